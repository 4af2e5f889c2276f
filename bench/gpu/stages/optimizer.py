"""The ``optimizer`` stage: one optimizer step over BERT-large's parameters - Presto's fused
LAMB and AdamW, the reference and foreach LAMB, torch's fused and foreach AdamW - against the
bytes each must move over the device's copy bandwidth measured in the same run.

Owns: the optimizers compared, the step's timings (back to back, isolated, host) and kernel
table, the bandwidth limit and the goal against it.
Never: trains a model (random parameters and gradients of BERT-large's shapes).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

from bench.gpu.harness import Goal, Results, Run, _free_cuda, _profile, _synchronize


def _lamb_within(results: Results, goal: Goal) -> dict:
    opt = results("optimizer").get("goal_lamb_within_1_5x", {})
    return {"ratio": opt.get("ratio"), "met": opt.get("met")}


# Fused LAMB's step over the bytes it must move at the copy bandwidth, at most (the stage's
# own record says it too).
LAMB_WITHIN = Goal("fused_lamb_within_1_5x_bandwidth", 1.5, _lamb_within)


def _copy_bandwidth(device: str, elements: int) -> float:
    """GB/s of a device copy, bytes read + written, best of 5 (events on CUDA)."""
    import torch
    src = torch.randn(elements, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(6):
        _synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        _synchronize()
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
    out: dict[str, Any] = {"model": "tiny" if run.smoke else "bert-large", "copy_GBps": bw,
                           "elements": sum(math.prod(s) for _, s in shapes)}
    # foreach LAMB: its per-tensor trust ratios are 0-dim tensors, which foreach's fast path
    # refuses (one multiply kernel per tensor on CUDA) - its time here shows the cost.
    cases = [("lamb", "presto:fused"), ("adamw", "presto:fused"), ("lamb", "presto:reference"),
             ("lamb", "presto:foreach"), *([("adamw", "torch:fused")] if run.cuda else []),
             ("adamw", "torch:foreach")]
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
            out[key] = {"step_s": step, "limit_s": limit, "ratio_to_limit": step / limit,
                        "isolated_step_s": isolated, "host_s": host}
            if impl == "presto:fused":
                out[key]["compiled"] = opt.flat_binding.compiled
                out[key]["compile_s"] = round(opt.compile_seconds, 2)
            if impl in ("presto:fused", "torch:fused"):
                table = _kernel_table(run, lambda: opt.step(**kwargs))
                out[key]["kernels"] = table
                out[key]["device_s"] = sum(r["us"] for r in table) / 1e6
            del opt, named
        except Exception as e:  # noqa: BLE001
            out[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        _free_cuda()
    lamb = out.get("lamb_presto:fused", {}).get("ratio_to_limit")
    out["goal_lamb_within_1_5x"] = {"goal": LAMB_WITHIN.threshold, "ratio": lamb,
                                    "met": lamb is not None and lamb <= LAMB_WITHIN.threshold}
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
        _synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        _synchronize()
        chained.append((time.perf_counter() - t0) / n)
        for _ in range(2):
            _synchronize()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            _synchronize()
            host.append(t1 - t0)
            isolated.append(time.perf_counter() - t0)
    return statistics.median(chained), statistics.median(isolated), statistics.median(host)


def _kernel_table(run: Run, fn: Callable[[], Any], top: int = 8) -> list[dict]:
    """One call of ``fn`` under the profiler: its ``top`` device kernels (CPU ops on CPU) by
    total time - name, calls, microseconds - and the rest summed, so a step's gap to its
    bandwidth limit can be read as kernels (passes, small per-tensor ops, launches)."""
    _, _, rows = _profile(run, fn, 1)
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])
    table = [{"kernel": k, "calls": c, "us": round(t, 1)} for k, (c, t) in ranked[:top]]
    rest = ranked[top:]
    if rest:
        table.append({"kernel": f"({len(rest)} others)", "calls": sum(c for _, (c, _) in rest),
                      "us": round(sum(t for _, (_, t) in rest), 1)})
    return table
