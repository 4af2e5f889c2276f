"""The device-time model's arithmetic over counted steps (bench.device_cases' rows): each kernel
priced on a GPU row (runtime.calibrate.gpus.kernel_seconds), summed by part of the model and
by op, extrapolated in batch (each kernel's FLOPs and bytes, before pricing) and in depth
(the priced sums), the kernels that cost most.

Parts (``PARTS``; ``part_of``):
  encoder GEMMs          GEMMs inside the encoder's forward and backward
  attention              the attention kernels (flash varlen; the padded path's SDPA)
  compiled/elementwise   every other kernel inside the encoder: casts, dropout, LayerNorm,
                         GELU, bias sums, Inductor's generated kernels
  optimizer              the optimizer phase: the clip and loss scale, LAMB's passes, its
                         per-tensor norms
  gradient buffer        whatever reads or writes the gradient buffer outside the optimizer's
                         passes: the buckets' adds, its zeroing, the gradient norm's read
  embeddings and heads   the rest: embeddings, pooler, MLM and NSP heads and losses, the
                         step's edges (the batch's copy in, the values out)

Why extrapolate: a step at BERT-large's widths and 24 layers needs ~13 GB of host memory to
count; at 2 and 4 layers a few. Every encoder layer launches the same kernels on the same
shapes and everything outside the layers that grows with the model (the optimizer's passes,
the buffer) grows linearly in its parameters, so a priced total at 24 layers is the 2-layer
total plus 11 times the difference to 4 layers (``depth``); the only part that is not exactly
linear is the buckets' count (a few floor-sized kernels at most). A large batch cannot be
counted at all (116k tokens), but each kernel's FLOPs and bytes are affine in the batch when
every sequence has the same length: two small batches give each kernel's line, read at the
target batch before pricing (``batch``), then attention's FLOPs are set to the real lengths'
Σ L² and longest sequence (``retarget_attention``).

Owns: parts, pricing a counted step, the two extrapolations, the top-kernel list.
Never: counts (bench.device_cases), holds GPU numbers (runtime.calibrate.gpus), or reads a
record.
"""
from __future__ import annotations

from collections import defaultdict

from bench.op_cost import Cost
from runtime.calibrate.gpus import GpuRow, kernel_seconds

PARTS = ("encoder GEMMs", "attention", "compiled/elementwise", "optimizer", "gradient buffer",
         "embeddings and heads")


def part_of(phase: str, category: str, tag: str) -> str:
    """The part of the model a counted op belongs to (module docstring)."""
    if tag == "gradbuf":
        return "gradient buffer"
    if phase == "optimizer" or category == "optimizer":
        return "optimizer"
    if category == "attention":
        return "attention"
    if tag == "encoder":
        return "encoder GEMMs" if category == "gemm" else "compiled/elementwise"
    return "embeddings and heads"


def _costs(row: list) -> list[Cost]:
    return [c if isinstance(c, Cost) else Cost.from_list(c) for c in row[5]]


def price(rows: list, gpu: GpuRow, additive: bool = True) -> dict:
    """One counted step priced on ``gpu``: {"s", "kernels", "bytes", "flops", "by_part":
    {part: {...}}, "by_op": {"part|op": {...}}} (seconds, kernels, bytes, FLOPs each)."""
    out = _zero()
    parts: dict = defaultdict(_zero)
    ops: dict = defaultdict(_zero)
    for row in rows:
        phase, cat, name, _kernels, tag = row[:5]
        part = part_of(phase, cat, tag)
        for c in _costs(row):
            s = kernel_seconds(gpu, c.kind, c.bytes, c.flops, c.dtype, c.tiles, c.cta_flops,
                               additive=additive)
            for d in (out, parts[part], ops[f"{part}|{name}"]):
                d["s"] += s
                d["kernels"] += 1
                d["bytes"] += c.bytes
                d["flops"] += c.flops
    out["by_part"] = {p: dict(parts[p]) if p in parts else _zero() for p in PARTS}
    out["by_op"] = {k: dict(v) for k, v in ops.items()}
    return out


def _zero() -> dict:
    return {"s": 0.0, "kernels": 0.0, "bytes": 0.0, "flops": 0.0}


def combine(a: dict, b: dict, wa: float, wb: float) -> dict:
    """wa·a + wb·b over every number of two priced steps (a key one lacks counts as 0)."""
    out = {}
    for k in set(a) | set(b):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) or isinstance(y, dict):
            out[k] = combine(x or {}, y or {}, wa, wb)
        else:
            out[k] = wa * (x or 0.0) + wb * (y or 0.0)
    return out


def mean(priced: list[dict]) -> dict:
    """The mean of several priced steps (the profiled steps a record averages)."""
    out = priced[0]
    for i, p in enumerate(priced[1:], 2):
        out = combine(out, p, (i - 1) / i, 1 / i)
    return out


def depth(lo: dict, hi: dict, layers_lo: int, layers_hi: int, layers: int) -> dict:
    """A priced step at ``layers`` from the same step priced at two depths (module docstring)."""
    if layers_hi == layers_lo:
        raise ValueError("depth extrapolation needs two different depths")
    w = (layers - layers_lo) / (layers_hi - layers_lo)
    return combine(lo, hi, 1 - w, w)


def batch(rows_lo: list, rows_hi: list, x_lo: float, x_hi: float, x: float) -> list:
    """Each kernel's FLOPs, bytes and tiles read at ``x`` on the line through its values at
    ``x_lo`` and ``x_hi`` (two counts of the same step at two batches: the same ops in the same
    order, refused otherwise)."""
    if len(rows_lo) != len(rows_hi):
        raise ValueError(f"batch extrapolation: the two counts launch different ops "
                         f"({len(rows_lo)} vs {len(rows_hi)})")
    w = (x - x_lo) / (x_hi - x_lo)
    out = []
    for a, b in zip(rows_lo, rows_hi):
        if a[:5] != b[:5] or len(a[5]) != len(b[5]):
            raise ValueError(f"batch extrapolation: op {a[:5]} against {b[:5]}")
        costs = []
        for ca, cb in zip(_costs(a), _costs(b)):
            def line(u, v):
                return max(0.0, u + w * (v - u))
            costs.append(Cost(ca.kind, line(ca.bytes, cb.bytes), line(ca.flops, cb.flops),
                              ca.dtype, round(line(ca.tiles, cb.tiles)), cb.cta_flops))
        out.append([*a[:5], costs])
    return out


def retarget_attention(rows: list, counted_sq: float, real_sq: float,
                       real_max: int, head_dim: int = 64) -> list:
    """Attention kernels' FLOPs scaled from the counted sequences' Σ L² to the real batch's,
    and the longest CTA's from its longest sequence (bench.op_cost's formulas: a backward
    2.5 times its forward)."""
    f = real_sq / counted_sq if counted_sq else 1.0
    cta = 4.0 * head_dim * min(128, real_max) * real_max
    out = []
    for r in rows:
        k = 2.5 if r[2].endswith("_backward") else 1.0
        out.append([*r[:5], [Cost(c.kind, c.bytes, c.flops * f, c.dtype, c.tiles, cta * k)
                             if c.kind == "attention" else c for c in _costs(r)]])
    return out


def top(priced: dict, n: int = 12) -> list[dict]:
    """The ``n`` ops that cost most: part, op, ms, kernels, MB, GFLOP."""
    rows = sorted(priced["by_op"].items(), key=lambda kv: -kv[1]["s"])[:n]
    return [{"part": k.split("|")[0], "op": k.split("|")[1], "ms": round(v["s"] * 1e3, 3),
             "kernels": round(v["kernels"], 1), "MB": round(v["bytes"] / 1e6, 1),
             "GFLOP": round(v["flops"] / 1e9, 1)} for k, v in rows]


def summary(priced: dict) -> dict:
    """The priced step in ms by part, with the kernels, for a record."""
    return {"ms": round(priced["s"] * 1e3, 3), "kernels": round(priced["kernels"], 1),
            "GB": round(priced["bytes"] / 1e9, 3), "TFLOP": round(priced["flops"] / 1e12, 3),
            "by_part": {p: {"ms": round(v["s"] * 1e3, 3), "kernels": round(v["kernels"], 1),
                            "GB": round(v["bytes"] / 1e9, 3)}
                        for p, v in priced["by_part"].items()}}
