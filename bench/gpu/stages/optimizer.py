"""The ``optimizer`` stage: one optimizer step over BERT-large's parameters - Presto's fused
LAMB and AdamW, torch's fused AdamW (foreach on CPU) - against the bytes each must move over
the device's copy bandwidth measured in the same run; and the trainer's whole optimizer phase
(the reduced gradient's norm, the clip multiplier, the step, the loss scale, zeroing; for the
sharded optimizer its partial norms' sum and the parameters' gather: bench.shard's phase) with
``optim.shard = world`` on a group of one against ``none``: what the sharded code path costs
before any communication. (The reference and foreach LAMB, slow by design, were measured on
2026-11-24 and are not repeated.)

Owns: the optimizers compared, the step's timings (back to back, isolated, host) and kernel
table, the bandwidth limit and the goal against it, the sharded-phase comparison.
Never: trains a model (random parameters and gradients of BERT-large's shapes).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

from bench.gpu.harness import Goal, Results, Run, free_cuda, profile_kernels, synchronize


def _lamb_within(results: Results, goal: Goal) -> dict:
    opt = results("optimizer").get("goal_lamb_within_1_5x", {})
    return {"ratio": opt.get("ratio"), "met": opt.get("met")}


def _sharded_within(results: Results, goal: Goal) -> dict:
    phase = results("optimizer").get("phase_sharded_vs_unsharded", {})
    ratio = phase.get("sharded_over_unsharded")
    return {"ratio": ratio, "met": None if ratio is None else ratio <= goal.threshold}


# Fused LAMB's step over the bytes it must move at the copy bandwidth, at most (the stage's
# own record says it too); the sharded phase on a group of one over the unsharded, at most.
LAMB_WITHIN = Goal("fused_lamb_within_1_5x_bandwidth", 1.5, _lamb_within)
SHARDED_WITHIN = Goal("sharded_phase_group1_within_1_1x", 1.1, _sharded_within)
GOALS = (LAMB_WITHIN, SHARDED_WITHIN)


def _copy_bandwidth(device: str, elements: int) -> float:
    """GB/s of a device copy, bytes read + written, best of 5 (events on CUDA)."""
    import torch
    src = torch.randn(elements, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(6):
        synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * 4 * elements / best / 1e9


def stage_optimizer(run: Run) -> dict:
    """One optimizer step over BERT-large's parameters (fp32): Presto's fused LAMB and AdamW
    (and the reference LAMB), torch's fused and foreach AdamW, against the bytes each must
    move over the device's copy bandwidth measured here."""
    import torch
    from bench.optim import ADAMW_HP, LAMB_HP, bert_named_shapes
    from kernels.optim_flat import BYTES_PER_ELEMENT
    from runtime.optim.optimizers import build_optimizer

    device = run.device
    shapes = bert_named_shapes("tiny" if run.smoke else "large")
    bw = _copy_bandwidth(device, (1 << 22) if run.smoke else (1 << 28))
    out = run.result({"model": "tiny" if run.smoke else "bert-large", "copy_GBps": bw,
                      "elements": sum(math.prod(s) for _, s in shapes)})
    cases = [("lamb", "presto:fused"), ("adamw", "presto:fused"),
             ("adamw", "torch:fused" if run.cuda else "torch:foreach")]
    for optimizer, impl in cases:
        key = f"{optimizer}_{impl}"
        try:
            torch.manual_seed(0)
            named = [(n, (torch.randn(s, device=device) * 0.02).requires_grad_())
                     for n, s in shapes]
            if impl.startswith("presto:"):
                hp = LAMB_HP if optimizer == "lamb" else ADAMW_HP
                opt = build_optimizer(optimizer, named, backend=impl.split(":")[1], **hp)
                kwargs = {"grad_scale": 0.5}
            else:
                opt = torch.optim.AdamW([p for _, p in named], lr=1e-3, weight_decay=0.01,
                                        fused=impl == "torch:fused",
                                        foreach=impl == "torch:foreach")
                kwargs = {}
            for _, p in named:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.normal_()
            opt.step(**kwargs)
            step, isolated, host = _optimizer_times(lambda: opt.step(**kwargs), run.smoke)
            limit = out["elements"] * BYTES_PER_ELEMENT[optimizer] / (bw * 1e9)
            rec = {"step_s": step, "limit_s": limit, "ratio_to_limit": step / limit,
                   "isolated_step_s": isolated, "host_s": host}
            if impl == "presto:fused":
                rec["compiled"] = opt.flat_binding.compiled
                rec["compile_s"] = round(opt.compile_seconds, 2)
            if impl in ("presto:fused", "torch:fused"):
                table = _kernel_table(run, lambda: opt.step(**kwargs))
                rec["kernels"] = table
                rec["device_s"] = sum(r["us"] for r in table) / 1e6
            out[key] = rec
            del opt, named
        except Exception as e:  # noqa: BLE001
            out[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        free_cuda()
    lamb = out.get("lamb_presto:fused", {}).get("ratio_to_limit")
    out["goal_lamb_within_1_5x"] = {"goal": LAMB_WITHIN.threshold, "ratio": lamb,
                                    "met": lamb is not None and lamb <= LAMB_WITHIN.threshold}
    try:
        out["phase_sharded_vs_unsharded"] = _sharded_phase(run)
    except Exception as e:  # noqa: BLE001
        out["phase_sharded_vs_unsharded"] = {"error": f"{type(e).__name__}: "
                                                      f"{str(e).splitlines()[0][:300]}"}
    free_cuda()
    return dict(out)


def _sharded_phase(run: Run) -> dict:
    """The trainer's optimizer phase (bench.shard.optimizer_phase) on BERT-large's parts (the
    tiny model in --smoke), the fused LAMB, with optim.shard none and world on a group of one
    rank, each timed as ``_optimizer_times`` times a step."""
    import torch
    from bench.gpu.harness import (DGX_CONFIG, CPU_CONFIG, LARGE_SHAPE, TINY, stage_config,
                                   world_of_one)
    from bench.shard import optimizer_phase
    from runtime.optim.grad_scale import DynamicLossScale
    from runtime.train.build import build_parts
    ctx = world_of_one(run.device)
    shape = TINY if run.smoke else [f"model.{k}={v}" for k, v in LARGE_SHAPE.items()]
    out: dict[str, Any] = {}
    for mode in ("none", "world"):
        cfg = stage_config(run, CPU_CONFIG if run.smoke else DGX_CONFIG, *shape,
                           "model.init=scratch", "system.nodes=1", "system.ranks_per_node=1",
                           "train.global_batch_size=8", f"system.device={run.device}",
                           "optim.name=lamb", "optim.backend=fused", f"optim.shard={mode}")
        parts = build_parts(cfg, ctx, train_loader=False, eval_batches=False)
        scale = DynamicLossScale(1.0, enabled=False)
        torch.manual_seed(0)
        parts.grad_sync.flat.normal_()
        optimizer_phase(parts, cfg, scale)  # compiles, first touch

        def phase(parts=parts, cfg=cfg):
            return optimizer_phase(parts, cfg, scale)
        step, isolated, host = _optimizer_times(phase, run.smoke)
        out[mode] = {"step_s": step, "isolated_step_s": isolated, "host_s": host}
        parts.grad_sync.close()
        del parts
        free_cuda()
    out["sharded_over_unsharded"] = out["world"]["step_s"] / out["none"]["step_s"]
    return out


def _optimizer_times(step: Callable[[], Any], smoke: bool) -> tuple[float, float, float]:
    """(back-to-back, isolated, host) seconds per step, each the median of repeats.

    Back-to-back: 10 steps enqueued with one synchronisation at the end, as training runs
    them (the host enqueues the next kernels while the device works): the device-bound time
    the bandwidth goal is about. Isolated: a synchronisation before and after each step, so
    the host's enqueue time adds to the device's. Host: the time ``step()`` takes to return
    after a synchronisation - what the host spends per step, hidden when the device is busier."""
    n, reps = (3, 3) if smoke else (10, 5)
    chained, isolated, host = [], [], []
    for _ in range(reps):
        synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        synchronize()
        chained.append((time.perf_counter() - t0) / n)
        for _ in range(2):
            synchronize()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            synchronize()
            host.append(t1 - t0)
            isolated.append(time.perf_counter() - t0)
    return statistics.median(chained), statistics.median(isolated), statistics.median(host)


def _kernel_table(run: Run, fn: Callable[[], Any], top: int = 8) -> list[dict]:
    """One call of ``fn`` under the profiler: its ``top`` device kernels (CPU ops on CPU) by
    total time - name, calls, microseconds - and the rest summed, so a step's gap to its
    bandwidth limit can be read as kernels (passes, small per-tensor ops, launches)."""
    _, _, rows = profile_kernels(run, fn, 1)
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])
    table = [{"kernel": k, "calls": c, "us": round(t, 1)} for k, (c, t) in ranked[:top]]
    rest = ranked[top:]
    if rest:
        table.append({"kernel": f"({len(rest)} others)", "calls": sum(c for _, (c, _) in rest),
                      "us": round(sum(t for _, (_, t) in rest), 1)})
    return table
