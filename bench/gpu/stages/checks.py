"""The ``checks`` stage: what reading could not settle - host syncs per ordinary step, the
attention kernel that ran, the fused optimizer compiled once.

Owns: the cases checked (each attention path and precision), the kernel names that say
which SDPA implementation ran, the goal of no host sync in a step.
Never: times anything (the throughput stages do).
"""
from __future__ import annotations


from bench.gpu.harness import (CPU_CONFIG, PATHS, TINY, Goal, Results, Run, stage_config,
                               synchronize, world_of_one)


def _no_host_sync(results: Results, goal: Goal) -> dict:
    chk = results("checks").get("goal_no_host_sync", {})
    return {"worst_per_step": chk.get("worst_per_step"), "met": chk.get("met")}


# Host syncs in an ordinary step, at most (the stage's own record says it too).
NO_HOST_SYNC = Goal("no_host_sync_in_a_step", 0, _no_host_sync)


def stage_checks(run: Run) -> dict:
    """What reading could not settle: host syncs per ordinary step (torch's sync debug mode
    on CUDA; the simulated device on CPU), which attention kernel ran (the profiler), and
    the fused optimizer compiled once (no recompile after the first-step re-cut)."""
    from runtime.launch import dist
    from runtime.observe.hostsync import simulated

    ctx = own = world_of_one(run.device)
    if not run.cuda:  # the CPU stand-in for a GPU (the stage's own: --smoke runs the next
        ctx = simulated(ctx)  # stages in this process)
        dist._CTX = ctx
    try:
        return _checks(run, ctx)
    finally:
        dist._CTX = own


def _checks(run: Run, ctx) -> dict:
    from runtime.observe.hostsync import HostSyncs
    from runtime.train.trainer import Trainer
    precision = "bf16" if run.cuda else "fp32"
    out = run.result({"precision": precision, "host_syncs": {}})
    cases = [(name, precision, extra) for name, extra in PATHS.items()]
    if run.cuda:
        cases.append(("unpadded", "fp16", PATHS["unpadded"]))
    for name, prec, extra in cases:
        cfg = stage_config(run, CPU_CONFIG, f"data.data_dir={run.data('small')}", *TINY,
                           "train.global_batch_size=16", "system.ranks_per_node=1",
                           f"train.precision={prec}",
                           f"system.device={'cuda' if run.cuda else 'cpu'}",
                           "train.log_every_steps=1000", *extra)
        with HostSyncs(ctx.device) as syncs:
            trainer = Trainer(cfg, ctx)
            trainer.setup()
            it = trainer.balance_meter.wrap(iter(trainer.train_loader))
            graphs = _unique_graphs()
            for _ in range(2):  # the first step re-cuts the buckets (and re-binds the optimizer)
                trainer.train_step(it)
            start, steps = len(syncs.events), 4
            for _ in range(steps):
                trainer.train_step(it)
            events = syncs.events[start:]
            synchronize()
        key = f"{name}_{prec}"
        out["host_syncs"][key] = {
            "per_step": len(events) / steps, "events": sorted({str(e) for e in events}),
            "optimizer_compiled": trainer.optimizer.flat_binding.compiled,
            "recompiles_after_setup": _unique_graphs() - graphs}
        out.save()
        trainer.close()
    out["attention"] = _attention_kernels(run)
    worst = max(v["per_step"] for v in out["host_syncs"].values())
    out["goal_no_host_sync"] = {"goal": NO_HOST_SYNC.threshold, "worst_per_step": worst,
                                "met": worst <= NO_HOST_SYNC.threshold}
    return dict(out)


def _unique_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - counters are private; report what we can
        return -1


def _attention_kernels(run: Run) -> dict:
    """One forward and backward of a BERT-large layer's attention shapes (64-wide heads) per
    path under the profiler: the kernels whose names say which SDPA implementation ran."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from loaders.dataset import TrainLoader
    from runtime.model.bert import BertForPreTraining
    from runtime.model.config import BertConfig

    device = run.device
    dtype = torch.bfloat16 if run.cuda else None
    out = {}
    activities = [ProfilerActivity.CUDA] if run.cuda else [ProfilerActivity.CPU]
    for name, attention, packed in (("padded", "padded", False), ("unpadded", "unpadded", False),
                                    ("packed", "padded", True)):
        cfg = BertConfig(vocab_size=30522, hidden_size=128, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=256,
                         max_position_embeddings=512)
        model = BertForPreTraining(cfg, attention=attention, packed=packed).to(device)
        from loaders.balance import BalanceSpec
        spec = BalanceSpec(mode="pack", pack_length=128) if packed else None
        loader = TrainLoader(run.data("small"), 0, 1, 16, 1, verify=False, balance=spec)
        batch = next(iter(loader)).to(device)
        loader.close()
        with profile(activities=activities) as prof:
            with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype is not None):
                o = model(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                          masked_lm_labels=batch.masked_lm_labels,
                          next_sentence_labels=batch.next_sentence_labels, layout=batch.layout)
            o.loss.backward()
            synchronize()
        names = sorted({e.name for e in prof.events()
                        if any(k in e.name.lower() for k in ("flash", "fmha", "efficient",
                                                             "scaled_dot_product", "attention"))})
        lower = " ".join(names).lower()
        kind = ("flash" if "flash" in lower else "efficient" if ("efficient" in lower or
                "fmha" in lower or "cutlass" in lower) else "math" if names else "unknown")
        out[name] = {"kernel": kind, "names": names[:12]}
    return out
