"""The ``plain`` stage: the plain recipe on the same GPU and data (Hugging Face
BertForPreTraining, torch's fused AdamW, autocast, every batch padded), the baseline the
throughput goal is measured against. bench/baseline_ddp.py is its CPU sibling: the plain
recipe's time to accuracy on 2 ranks, where this one is a GPU's throughput.

Owns: the plain recipe's step and its largest batch.
Never: uses Presto's runtime for the step (only its data loader).
"""
from __future__ import annotations


from bench.gpu.harness import (LARGE_SHAPE, Run, free_cuda, largest_that_runs, seq_length,
                               timed)


def stage_plain(run: Run) -> dict:
    """The plain recipe on the same GPU and data: Hugging Face BertForPreTraining, torch's
    fused AdamW, autocast (fp16 with a GradScaler), the global norm clipped to 1, every batch
    padded to the sequence length, at its largest batch."""
    import torch
    import torch.nn.functional as F
    try:
        from transformers import BertConfig as HFConfig, BertForPreTraining as HFBert
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"transformers does not import: {type(e).__name__}: {e}"}
    from loaders.dataset import TrainLoader

    device, seq = run.device, seq_length(run)
    shape = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2,
                 intermediate_size=256, vocab_size=30522) if run.smoke else LARGE_SHAPE
    total = torch.cuda.get_device_properties(0).total_memory if run.cuda else 0
    out = run.result({"model": "tiny" if run.smoke else "bert-large", "seq": seq})
    for prec in run.precisions():
        try:
            torch.manual_seed(0)
            model = HFBert(HFConfig(max_position_embeddings=512, type_vocab_size=2,
                                    **shape)).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                    fused=run.cuda)
            scaler = torch.amp.GradScaler(device.split(":")[0], enabled=prec == "fp16")
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(prec)

            def measure(batch: int, steps: int = 3, warmup: int = 2) -> dict:
                loader = TrainLoader(run.data("seq512"), 0, 1, batch, 7, verify=False)
                it = iter(loader)

                def one() -> int:
                    b = next(it)
                    pad = seq - b.input_ids.shape[1]

                    def to512(t, fill=0):
                        return F.pad(t, (0, pad), value=fill).to(device, non_blocking=True)
                    with torch.autocast(device.split(":")[0], dtype=dtype,
                                        enabled=dtype is not None):
                        o = model(input_ids=to512(b.input_ids),
                                  token_type_ids=to512(b.token_type_ids),
                                  attention_mask=to512((b.attention_mask > 0).long()),
                                  labels=to512(b.masked_lm_labels, -100),
                                  next_sentence_label=b.next_sentence_labels.to(device))
                    scaler.scale(o.loss).backward()
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad(set_to_none=True)
                    return b.num_real_tokens
                try:
                    r = timed(run, one, warmup, steps)
                finally:
                    loader.close()
                r["batch"] = batch
                return r

            batch, r, probes = largest_that_runs(measure, 8, 8, total, run.smoke,
                                                 steps=10 if not run.smoke else 3,
                                                 warmup=3 if not run.smoke else 1)
            out[f"padded_{prec}"] = {
                "local_batch": batch, "sequences_per_s": batch * r["steps"] / r["seconds"],
                "tokens_per_s": r["tokens"] / r["seconds"], "step_s": r["seconds"] / r["steps"],
                "peak_memory_GiB": round(r["peak_bytes"] / 2**30, 2)}
        except Exception as e:  # noqa: BLE001
            out[f"padded_{prec}"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        finally:
            model = opt = None
            free_cuda()
    import transformers
    out["transformers"] = transformers.__version__
    return dict(out)
