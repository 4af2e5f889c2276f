"""The step's memory-traffic cuts, measured by the device-time model before and after: on the
best mode (bf16_master, qkv, pad_vocab, compiled layers) at 2 full rows of 512 on each GPU.

  * a cut that landed, by its commit: the step counted in the tree before it and in this tree
    (the gradient buffer's zero-then-add -> copy, commit 3a22c0e after 3f8dd61);
  * a cut that landed as an option: the step counted in this tree with and without it
    (``optim.lamb_update = "stored"``: LAMB's pass 1 writes u over the bf16 gradient, pass 2
    reads it instead of m and v - the passes' bytes as Inductor's kernels read and write
    them, beside the what-if below);
  * a cut asked for, before it is made: the counted step with its kernels' bytes changed as
    the cut would change them, priced the same way (``what_if``):
      - LAMB's second pass reading an update u stored by the first instead of m and v: pass 1
        writes u (+4 B a parameter in fp32, +2 B in bf16), pass 2 reads x and u instead of x, m
        and v (8 or 6 B instead of 12) - fp32 keeps every result bitwise and moves no byte
        less; bf16 moves 4 B a parameter less and rounds every update;
      - the gradient norm folded into pass 1 (which reads every gradient anyway): the norm's
        own read of the buffer gone.

Owns: the cuts' before/after table. Never: changes the step (the cuts themselves are the
runtime's), counts (bench.device_time, whose case and pricing it is handed), or imports
bench.device_time (it sits below it).
"""
from __future__ import annotations

from runtime.calibrate.gpus import GpuRow, kernel_seconds

BEFORE_F8 = "3f8dd61"
"""The tree before the gradient buffer's copy (3a22c0e, issue 63): the review's commit."""
BEST = "bf16_master_layers"
STORED = "optim.lamb_update=stored"
"""The option that stores LAMB's update (kernels.optim_flat.FusedLambStoredUpdate)."""


def _passes(priced: dict) -> tuple[tuple[str, dict], tuple[str, dict]]:
    """LAMB's two passes among the optimizer's ops: the two single kernels that move most;
    pass 1 the reduction (its generated name has ``sum``)."""
    ops = sorted(((k, v) for k, v in priced["by_op"].items()
                  if k.startswith("optimizer|") and round(v["kernels"]) == 1),
                 key=lambda kv: -kv[1]["bytes"])[:2]
    one = next(kv for kv in ops if "sum" in kv[0])
    two = next(kv for kv in ops if kv is not one)
    return one, two


def what_if(priced: dict, gpu: GpuRow, master: bool = True) -> dict:
    """ms saved (negative: slower) by each asked-for cut on a priced step (module docstring)."""
    (_, p1), (_, p2) = _passes(priced)
    params = p2["bytes"] / (18 if master else 16)  # pass 2: x, m, v read; x (and p) written

    def delta(d1: float, d2: float) -> float:
        def t(b):
            return kernel_seconds(gpu, "memory", b)
        return (t(p1["bytes"] + d1 * params) - t(p1["bytes"])
                + t(p2["bytes"] + d2 * params) - t(p2["bytes"])) * 1e3
    norm = priced["by_op"].get("gradient buffer|linalg_vector_norm", {"s": 0.0})
    return {"lamb_stored_update_fp32_ms": delta(4, -4),
            "lamb_stored_update_bf16_ms": delta(2, -6),
            "grad_norm_folded_into_pass1_ms": -norm["s"] * 1e3,
            "parameters": params}


def cuts(gpus: list[str], depths, case_of, predict) -> dict:
    """Each GPU: the best mode's busy before and after the landed cut, and the asked-for ones'
    what-if (module docstring). ``case_of(gpu)`` is the best mode's rows2 case and ``predict``
    prices a case (both bench.device_time's, passed in: this module sits below it)."""
    from runtime.calibrate.gpus import GPUS
    out = {}
    for g in gpus:
        case = case_of(g)
        after = predict(case, GPUS[g], depths)
        stored = case_of(g)
        stored.spec["overrides"] = [*stored.spec["overrides"], STORED]
        with_stored = predict(stored, GPUS[g], depths)
        case.tree = BEFORE_F8
        before = predict(case, GPUS[g], depths)
        out[g] = {"mode": BEST, "config": "rows2",
                  "gradient_buffer_copy": {
                      "commit": "3a22c0e", "before_tree": BEFORE_F8,
                      "before_ms": before["s"] * 1e3, "after_ms": after["s"] * 1e3,
                      "buffer_before_ms": before["by_part"]["gradient buffer"]["s"] * 1e3,
                      "buffer_after_ms": after["by_part"]["gradient buffer"]["s"] * 1e3,
                      "buffer_before_GB": before["by_part"]["gradient buffer"]["bytes"] / 1e9,
                      "buffer_after_GB": after["by_part"]["gradient buffer"]["bytes"] / 1e9},
                  "lamb_stored_update": {
                      "option": STORED, "before_ms": after["s"] * 1e3,
                      "after_ms": with_stored["s"] * 1e3,
                      "optimizer_before_ms": after["by_part"]["optimizer"]["s"] * 1e3,
                      "optimizer_after_ms": with_stored["by_part"]["optimizer"]["s"] * 1e3,
                      "optimizer_before_GB": after["by_part"]["optimizer"]["bytes"] / 1e9,
                      "optimizer_after_GB": with_stored["by_part"]["optimizer"]["bytes"] / 1e9,
                      "kernels_before": after["kernels"], "kernels_after": with_stored["kernels"]},
                  "what_if": what_if(after, GPUS[g]),
                  "non_gemm_bytes": _ranked(after)}
    return out


def _ranked(priced: dict, n: int = 8) -> list[dict]:
    """The ops that move most bytes outside the GEMMs and attention, with their ms."""
    rows = sorted(((k, v) for k, v in priced["by_op"].items()
                   if not k.startswith(("encoder GEMMs|", "attention|"))
                   and v["flops"] == 0), key=lambda kv: -kv[1]["bytes"])[:n]
    return [{"part": k.split("|")[0], "op": k.split("|")[1], "GB": round(v["bytes"] / 1e9, 3),
             "ms": round(v["s"] * 1e3, 3), "kernels": round(v["kernels"], 1)} for k, v in rows]
