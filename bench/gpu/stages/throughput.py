"""The ``throughput``, ``throughput_paths`` and ``fusions`` stages: Presto's step on BERT-large at
sequence 512, each path and precision at its largest local batch, the fused and compiled
models beside it: sequences/s, real tokens/s, TFLOP/s, MFU, busy time and peak memory.
``throughput`` (the verdicts) is unpadded bf16 at the largest batch and FP8 (model.fp8 =
'tensorwise', torchao) beside it at that batch and at 2 sequences (``seqs2``: about 256
tokens a step, where FP8's casts and scale kernels cost more than its GEMMs save) - each FP8
case with the mean loss of its measured steps beside its bf16 sibling's, trained from the
same weights on the same batches (the sibling's probes replayed first);
``throughput_paths`` the padded and packed paths and fp16; ``fusions`` unpadded bf16 with every
fusion (``unpadded_bf16_fused``), each fusion alone (``unpadded_bf16_fused_<name>``) and with
whole layers compiled (``unpadded_bf16_compiled``, model.compile = 'layers'), beside unfused.
Time is the wall clock's between two device synchronisations, the steps enqueued back to back
in between: TFLOP/s and MFU count any idle device time inside that window too
(``time_source`` in the record); the device's own busy time (the profiler's kernel sum) is
recorded beside it. Each case says whether its GEMMs ran in FP8 (``fp8``) and at which batch
(``batch``: ``largest``, or the fixed one), so that no goal on bf16 reads an FP8 case (or one
at 2 sequences); a fused kernel that fell back to its reference says so
(``fusion_fallbacks``, kernels.fused).

A fused, compiled or FP8 case runs at the batch its unfused sibling found (no probes of its own):
Inductor tunes its kernels for the token count of the first call, which a probe's small batch
would otherwise set (the fusions' 8.5 % loss of 2026-11-28 was compiled at the batch-8 probe).

Owns: the cases measured, the GEMM peak they are compared with, the record of each case
(written as it finishes), the goals on them (against the plain recipe's figures too).
Never: measures the plain recipe (plain.py) or the optimizer alone (optimizer.py).
"""
from __future__ import annotations

import time
from typing import Optional

from bench.gpu.harness import (CPU_CONFIG, DGX_CONFIG, LARGE_SHAPE, PATHS, TINY, Goal, Results,
                               Run, free_cuda, fusion_fallbacks, largest_that_runs,
                               max_predictions, profile_kernels, seq_length, stage_config,
                               synchronize, timed, top_kernels, world_of_one)
from kernels.fusions import FUSIONS


def _toml_list(names) -> str:
    return "[" + ",".join(f'"{n}"' for n in names) + "]"


FUSED = _toml_list(FUSIONS)
"""model.fusions of the all-fusions cases (kernels/fused.py, runtime/model/bert.py)."""
PLAIN = "model.fusions=[]"
"""The runs beside them: no fusion, whatever the base config sets (the DGX configs: qkv)."""


def _gemm_peak(run: Run) -> Optional[float]:
    """TFLOP/s of a large square GEMM in the device's training precision (bf16 on CUDA,
    fp32 on CPU): what a step's matmuls could reach at best on this device."""
    import torch
    n = 8192 if run.cuda else 512
    dtype = torch.bfloat16 if run.cuda else torch.float32
    a = torch.randn(n, n, device=run.device, dtype=dtype)
    b = torch.randn(n, n, device=run.device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize()
    reps = 20 if run.cuda else 3
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12


def _busy(run: Run, trainer, cfg, spec, batch: int) -> dict:
    """The device's busy time, kernel count and longest kernels of one step at ``batch``
    (the profiler)."""
    from loaders.dataset import TrainLoader
    loader = TrainLoader(cfg.data.data_dir, 0, 1, batch, 7, verify=False, balance=spec)
    it = iter(loader)
    try:
        trainer.train_step(it)
        busy, kernels, names = profile_kernels(run, lambda: trainer.train_step(it), 1)
    finally:
        loader.close()
        trainer.step_log.flush()
    return {"busy_s": busy, "kernels": kernels, "top_kernels": top_kernels(names)}


FP8 = "model.fp8=tensorwise"
"""The FP8 cases' key (runtime/model/fp8.py: the encoder's four GEMM roles, torchao's
tensorwise recipe; emulated on a CPU in --smoke)."""
SEQS2 = 2
"""The small case's local batch: 2 sequences (dynamic unpadded: about 256 real tokens, not 2
full rows as the graphs stages' ``rows2``), where FP8's casts and scale kernels cost more than
its GEMMs save (docs/GPU.md)."""


def stage_throughput(run: Run) -> dict:
    """Unpadded bf16 (fp32 in --smoke) at its largest local batch (the throughput goals'
    figures), FP8 beside it at that batch, then both at 2 sequences, with their losses."""
    prec = run.precisions()[0]
    base = f"unpadded_{prec}"
    return _throughput(run, [
        (base, [*PATHS["unpadded"], PLAIN], prec),
        (f"{base}_fp8", [*PATHS["unpadded"], PLAIN, FP8], prec),
        (f"{base}_seqs{SEQS2}", [*PATHS["unpadded"], PLAIN], prec, SEQS2),
        (f"{base}_fp8_seqs{SEQS2}", [*PATHS["unpadded"], PLAIN, FP8], prec, SEQS2)])


def stage_fusions(run: Run) -> dict:
    """Unpadded bf16 (fp32 in --smoke) at the unfused model's largest local batch with every
    fusion, each fusion alone and whole layers compiled: which fusion gains or loses, and
    what a compiled layer does instead (--smoke: the harness, with one compiled fusion;
    tests/integration/test_fused.py holds the fusions to their references)."""
    prec = run.precisions()[0]
    base = [*PATHS["unpadded"], "model.fusions=[]"]  # whatever fusions the base config sets
    names = FUSIONS if not run.smoke else ("pad_vocab", "bias_gelu")
    cases = [(f"unpadded_{prec}", base, prec)]
    if not run.smoke:
        cases.append((f"unpadded_{prec}_fused", [*PATHS["unpadded"], f"model.fusions={FUSED}"],
                      prec))
    cases += [(f"unpadded_{prec}_fused_{n}", [*base, f"model.fusions={_toml_list([n])}"], prec)
              for n in names]
    if not run.smoke:
        cases.append((f"unpadded_{prec}_compiled", [*base, "model.compile=layers"], prec))
    return _throughput(run, cases)


def stage_throughput_paths(run: Run) -> dict:
    """The other paths and precisions at their largest batch: padded and packed in each
    precision, unpadded in the second, and padded and packed fused in the first."""
    first = run.precisions()[0]
    cases = [(f"{name}_{prec}", [*extra, PLAIN], prec) for name, extra in PATHS.items()
             for prec in run.precisions() if (name, prec) != ("unpadded", first)]
    cases += [(f"{name}_{first}_fused", [*extra, f"model.fusions={FUSED}"], first)
              for name, extra in PATHS.items() if name != "unpadded" and not run.smoke]
    return _throughput(run, cases)


def _sibling(key: str) -> str:
    """The unfused case a fused, compiled or FP8 case is measured beside (its batch; an FP8
    case's loss too)."""
    return key.split("_fused")[0].split("_compiled")[0].replace("_fp8", "")


def _loss_beside(out: dict, key: str, losses: list) -> dict:
    """The case's mean loss over its measured steps and, for an FP8 case, its sibling's and
    the difference."""
    mine = sum(losses) / len(losses) if losses else None
    got = {"loss": mine}
    sibling = out.get(_sibling(key)) if "_fp8" in key else None
    if isinstance(sibling, dict) and sibling.get("loss") is not None and mine is not None:
        got.update(loss_of_sibling=sibling["loss"], loss_minus_sibling=mine - sibling["loss"])
    return got


def _throughput(run: Run, cases: list) -> dict:
    """Presto's step (Trainer.train_step: the bucket engine, the fused optimizer, loss
    scaling) on BERT-large at sequence 512 for each (key, overrides, precision) case at its
    largest local batch - a fused or compiled case at its unfused sibling's, when that ran
    (the module docstring) -: sequences/s and real tokens/s after warm-up, achieved TFLOP/s
    and MFU (runtime.observe.mfu) over the device-synchronised time, the busy time and
    kernels of a step, peak memory; each case written as it finishes."""
    import torch
    from loaders.dataset import TrainLoader
    from runtime.train.trainer import Trainer

    ctx = world_of_one(run.device)
    total = torch.cuda.get_device_properties(0).total_memory if run.cuda else 0
    shape = [] if run.smoke else [f"model.{k}={v}" for k, v in LARGE_SHAPE.items()]
    out = run.result({"model": "tiny" if run.smoke else "bert-large", "seq": seq_length(run),
                      "fusions": FUSED, "gemm_peak_tflops": _gemm_peak(run),
                      "time_source": "wall between device synchronisations"})
    from runtime.observe.mfu import peak_of
    device_name = torch.cuda.get_device_name(0) if run.cuda else None
    for key, extra, prec, *fixed in cases:
        try:
            cfg = stage_config(run, DGX_CONFIG if not run.smoke else CPU_CONFIG,
                               f"data.data_dir={run.data('seq512')}", "model.init=scratch",
                               *(TINY if run.smoke else shape), "train.global_batch_size=8",
                               "system.nodes=1", "system.ranks_per_node=1",
                               f"system.device={run.device}", f"train.precision={prec}",
                               "data.balance=random", "model.attention=padded",
                               f"data.max_seq_length={seq_length(run)}",
                               f"data.max_predictions_per_seq={max_predictions(run)}",
                               "train.log_every_steps=100000", *extra)
            trainer = Trainer(cfg, ctx)
            trainer.setup()
            spec = cfg.data.balance_spec(1, cost=trainer.batch_cost)

            losses: list = []  # the last measure's steps: read after its timing

            def measure(batch: int, steps: int = 3, warmup: int = 2) -> dict:
                loader = TrainLoader(cfg.data.data_dir, 0, 1, batch, 7, verify=False,
                                     balance=spec)
                it = iter(loader)
                step_losses: list = []

                def one() -> tuple:
                    rec = trainer.train_step(it)
                    step_losses.append(rec.losses[0])  # on the device, read after timing
                    return rec.host["real_tokens"], rec.host["model_flops"]
                try:
                    r = timed(run, one, warmup, steps)
                finally:
                    loader.close()
                    trainer.step_log.flush()
                losses[:] = [float(v) for v in step_losses[warmup:]]
                r["batch"] = batch
                return r

            sibling = out.get(_sibling(key)) if _sibling(key) != key else None
            sibling = sibling if isinstance(sibling, dict) else {}
            if "_fp8" in key:  # the sibling's probes first: the same weights and batches
                for p in sibling.get("probes", []):
                    measure(p["batch"])
            known = fixed[0] if fixed else sibling.get("local_batch")
            batch, r, probes = largest_that_runs(
                measure, 8, 8, total, run.smoke, steps=10 if not run.smoke else 3,
                warmup=3 if not run.smoke else 1, known=known)
            peak = peak_of(device_name, trainer.body.numerics.peak_dtypes,
                           trainer.cfg.system.peak_tflops)
            tflops = r["flops"] / r["seconds"] / 1e12
            busy = _busy(run, trainer, cfg, spec, batch) if not run.smoke or not any(
                "busy_s" in v for v in out.values() if isinstance(v, dict)) else {}
            gemm = out["gemm_peak_tflops"]
            out[key] = {"local_batch": batch, "batch": "fixed" if fixed else "largest",
                        "fp8": FP8 in extra,
                        "sequences_per_s": batch * r["steps"] / r["seconds"],
                        "tokens_per_s": r["tokens"] / r["seconds"],
                        "step_s": r["seconds"] / r["steps"],
                        "tflops": tflops, "mfu": tflops / peak.tflops if peak.tflops else None,
                        **{f"mfu_{d}": tflops / v for d, v in peak.others},  # (FP8 cases)
                        "of_gemm_peak": tflops / gemm if gemm else None,
                        "peak_tflops": peak.tflops, **busy,
                        "peak_memory_GiB": round(r["peak_bytes"] / 2**30, 2),
                        **_loss_beside(out, key, losses),
                        "probes": [{k: p[k] for k in ("batch", "peak_bytes")} for p in probes],
                        **fusion_fallbacks()}
            trainer.close()
            trainer = None
        except Exception as e:  # noqa: BLE001 - one combination failing keeps the others
            out[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        free_cuda()
    return dict(out)


# ------------------------------------------------------------------------------ goals

def _over_plain(results: Results, goal: Goal) -> dict:
    """Each case's sequences/s over the plain recipe's in the same precision; met by the best."""
    thr, plain = {**results("throughput_paths"), **results("throughput")}, results("plain")
    ratios = {}
    for key, v in thr.items():
        if not isinstance(v, dict) or "sequences_per_s" not in v:
            continue
        prec = next((p for p in ("bf16", "fp16", "fp32") if f"_{p}" in key), "")
        base = plain.get(f"padded_{prec}", {}).get("sequences_per_s")
        if base:
            ratios[key] = v["sequences_per_s"] / base
    return {"ratios": ratios, "met": max(ratios.values()) >= goal.threshold if ratios else None}


def _best_unpadded_bf16(results: Results) -> Optional[dict]:
    """The fused-kernels issue's case: unpadded bf16 at its largest batch, fused or not (the
    ``fusions`` stage's too) - never an FP8 case, one at a fixed batch or one whose fused
    kernels fell back to their references."""
    cases = {**results("fusions"), **results("throughput")}
    return max((v for k, v in cases.items() if k.startswith("unpadded_bf16") and
                isinstance(v, dict) and "tokens_per_s" in v and v.get("fp8") is False and
                v.get("batch") == "largest" and not v.get("fusion_fallbacks")),
               key=lambda v: v["tokens_per_s"], default=None)


def _tokens_per_s(results: Results, goal: Goal) -> dict:
    best = _best_unpadded_bf16(results)
    return {"tokens_per_s": best and best["tokens_per_s"],
            "met": None if best is None else best["tokens_per_s"] >= goal.threshold}


def _of_gemm_peak(results: Results, goal: Goal) -> dict:
    best = _best_unpadded_bf16(results)
    return {"of_gemm_peak": best and best.get("of_gemm_peak"),
            "met": None if best is None or best.get("of_gemm_peak") is None
            else best["of_gemm_peak"] >= goal.threshold}


# At least: unpadded bf16's real tokens/s and its share of the GEMM peak measured in the stage;
# the best path's sequences/s over the plain recipe's.
GOALS = (Goal("unpadded_bf16_200k_tokens_per_s", 200_000, _tokens_per_s),
         Goal("unpadded_bf16_half_of_gemm_peak", 0.5, _of_gemm_peak))
PATH_GOALS = (Goal("throughput_1_5x_plain", 1.5, _over_plain),)
