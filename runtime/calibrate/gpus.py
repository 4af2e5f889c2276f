"""GPUs as rows of a few numbers, and the price of one kernel on them: the arithmetic of the
step's device-time model (``python -m bench.device_time``) and of the tuner's predicted
profiles (``python -m runtime.calibrate.tune --simulate ... --profile model:h100``).

A row (``GpuRow``) holds what a kernel's time depends on in this model: the SM count, the
dense GEMM rate per input dtype, the rate FlashAttention reaches, the bandwidth a copy
reaches, the duration of a kernel that does (almost) nothing, and the memory. Every number
has its source beside it (``GpuRow.sources``): a datasheet (through runtime.observe.mfu's
table of dense peaks), or a measurement one of the GPU records holds (bench/results/gpu_*);
none is fitted to the busy times the model is validated on. The one number no datasheet
gives, the floor, is fitted on the H100's records (its optimizer stage's small kernels) and
the model is validated on the H200's busy times only (docs/benchmarks/device_time.md).

The price of a kernel (``kernel_seconds``) is a latency plus the larger of its two works,

    t = floor + max(FLOPs / (rate · waves), bytes / bandwidth)

the latency-bandwidth form (Hockney) that the tuner also uses for a collective
(runtime.calibrate.tune.costmodel: α + n/β), with the roofline's max between compute and
memory. ``max(floor, FLOPs/rate, bytes/bandwidth)`` - the plain roofline with a floor - is
``kernel_seconds(..., additive=False)``; the bench prints both. A GEMM's rate is the measured
large-GEMM rate times its wave efficiency: the output is cut into 128×128 tiles, one tile an
SM at a time, and a last partial wave runs at the share of SMs it fills (NVIDIA's "Matrix
Multiplication Background" guide, wave quantization; cuBLAS picks among several tile shapes,
this takes one). FlashAttention's rate is a fraction of the dense peak its papers report; a
forward CTA holds 128 queries of one head and sequence, so the longest sequence's CTA is a
lower bound on the kernel (its FLOPs at one SM's share of the rate).

Why here and not in bench: the tuner (runtime) projects a cluster from a predicted profile and
must not import bench (tests/unit/test_layering.py); the bench tool that counts the step
imports this module, so both price with one copy of the rows and the formula. The counting
itself - which kernels a step launches and their FLOPs and bytes - needs bench's CUDA dispatch
emulation and stays there: it writes the predicted profiles the tuner reads
(runtime/calibrate/tune/systems/model_profiles.json).

Owns: the rows (``GPUS``), their sources, ``kernel_seconds`` and ``gemm_waves``.
Never: counts kernels, reads a record at run time (the numbers are copied here with their
source; a unit test holds each to its record), or measures anything.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from runtime.observe.mfu import PEAKS

TILE = 128
"""A GEMM's output tile edge (elements): 128×128 tiles, one per SM per wave."""

H100_RECORD = "bench/results/gpu_nvidia-h100-80gb-hbm3_2026-11-24.json"
H200_RECORD = "bench/results/gpu_nvidia-h200_2026-11-28.json"
H200_ENV_RECORD = "bench/results/gpu_nvidia-h200_2026-11-27.json"

H200_GEMM_TFLOPS = 794.4514190517672
"""bf16 8192×8192×8192 GEMMs on the H200 (H200_RECORD stages.throughput.result.
gemm_peak_tflops, 20 back to back)."""
H200_COPY_GBPS = 3861.1653669183315
"""A 1 GiB device copy on the H200, bytes read + written (H200_RECORD stages.optimizer.result.
copy_GBps, best of 5)."""
H100_COPY_GBPS = 2929.7184828461295
"""The same copy on the H100 (H100_RECORD stages.optimizer.result.copy_GBps)."""
H100_FLOOR_US = 87.0 / 48
"""µs a kernel that moves (almost) nothing: the mean duration of the H100's optimizer-stage
kernels other than the two fused passes and the index_add (H100_RECORD stages.optimizer.result,
lamb_presto:fused and adamw_presto:fused kernel lists: 48 calls, 87.0 µs; per-tensor vectors
and row sums of at most 4 MB). Fitted on the H100's record; validated on the H200's."""
H100_DATASHEET_GBPS = 3350.0
"""H100 SXM5's HBM3 bandwidth, NVIDIA H100 datasheet (3.35 TB/s)."""
A100_DATASHEET_GBPS = 2039.0
"""A100 80GB SXM's HBM2e bandwidth, NVIDIA A100 datasheet (2,039 GB/s)."""
FA2_H100_FRACTION = 0.35
"""FlashAttention-2 on an H100: "only 35% utilization" of the dense peak (Shah et al.,
FlashAttention-3, arXiv 2407.08608, abstract)."""
FA2_A100_FRACTION = 0.50
"""FlashAttention-2 on an A100: "50-73% of the theoretical maximum FLOPs/s" (Dao,
FlashAttention-2, arXiv 2307.08691, abstract); the low end: head dim 64, short sequences."""
FP8_DENSE = {"H100": 1978.9, "H200": 1978.9}
"""Dense FP8 tensor-core TFLOP/s (NVIDIA H100 and H200 datasheets: 3,958 with sparsity); the
A100 has no FP8 tensor cores."""


def _peak(gpu: str, dtype: str) -> float:
    for key, table in PEAKS:
        if key == gpu:
            return table[dtype]
    raise KeyError(gpu)


@dataclass(frozen=True)
class GpuRow:
    """One GPU: what a kernel's time depends on in this model."""

    name: str
    """the GPU, as its vendor names it"""
    sms: int
    """streaming multiprocessors (a wave of GEMM tiles or attention CTAs)"""
    gemm_tflops: dict
    """dense GEMM TFLOP/s by input dtype ('bf16', 'fp16', 'fp8', 'fp32'): large GEMMs"""
    attention_tflops: float
    """FlashAttention-2's TFLOP/s (forward and backward alike)"""
    bandwidth_GBps: float
    """GB/s a device copy reaches, bytes read + written"""
    floor_us: float
    """µs a kernel takes that moves and computes almost nothing"""
    memory_GiB: float
    """device memory"""
    sources: dict = field(default_factory=dict)
    """field (``gemm_tflops.<dtype>`` for a rate) -> where its number comes from"""

    def gemm_rate(self, dtype: str) -> float:
        """FLOP/s of a large GEMM with ``dtype`` inputs; refused where the GPU has none."""
        if dtype not in self.gemm_tflops:
            raise ValueError(f"{self.name}: no {dtype} GEMMs (rates for "
                             f"{', '.join(self.gemm_tflops)}); model.fp8 needs compute "
                             f"capability 8.9 or higher")
        return self.gemm_tflops[dtype] * 1e12


def _hopper(name: str, peak_key: str, sms: int, memory: float, bandwidth: float,
            sources: dict) -> GpuRow:
    frac = H200_GEMM_TFLOPS / _peak("H200", "bf16")  # measured / datasheet, same GH100 compute
    rates = {"bf16": H200_GEMM_TFLOPS, "fp16": H200_GEMM_TFLOPS,
             "fp8": FP8_DENSE[peak_key] * frac, "fp32": _peak(peak_key, "fp32") * frac}
    common = {
        "gemm_tflops.bf16": f"measured on the H200 ({H200_RECORD}: throughput gemm_peak_tflops, "
                            f"bf16 8192^3); the H100 SXM and H200 share the GH100's 132 SMs "
                            f"and datasheet peaks (989.4 TFLOP/s bf16 dense)",
        "gemm_tflops.fp16": "the bf16 rate: equal datasheet peaks (not measured)",
        "gemm_tflops.fp8": f"datasheet FP8 dense 1,978.9 TFLOP/s x the measured bf16 fraction "
                           f"({frac:.3f} = 794.5 / 989.4)",
        "gemm_tflops.fp32": f"datasheet fp32 66.9 TFLOP/s x the measured bf16 fraction ({frac:.3f})",
        "attention_tflops": f"FlashAttention-2 at 35 % of 989.4 TFLOP/s (FlashAttention-3 paper, "
                            f"arXiv 2407.08608)",
        "floor_us": f"fitted on the H100's optimizer-stage small kernels ({H100_RECORD}: 48 "
                    f"calls, 87.0 µs); validated on the H200's busy times only",
    }
    return GpuRow(name, sms, rates, FA2_H100_FRACTION * _peak(peak_key, "bf16"), bandwidth,
                  H100_FLOOR_US, memory, {**common, **sources})


def _a100() -> GpuRow:
    frac = H200_GEMM_TFLOPS / _peak("H200", "bf16")
    bw_frac = H100_COPY_GBPS / H100_DATASHEET_GBPS
    rates = {"bf16": _peak("A100", "bf16") * frac, "fp16": _peak("A100", "fp16") * frac,
             "fp32": _peak("A100", "fp32") * frac}
    return GpuRow("NVIDIA A100 80GB SXM", 108, rates, FA2_A100_FRACTION * _peak("A100", "bf16"),
                  A100_DATASHEET_GBPS * bw_frac, H100_FLOOR_US, 80.0, {
                      "sms": "NVIDIA A100 datasheet / whitepaper: 108 SMs",
                      "gemm_tflops.bf16": f"datasheet 312 TFLOP/s dense x the bf16 fraction the "
                                          f"H200 measured ({frac:.3f}); no A100 record",
                      "gemm_tflops.fp16": "datasheet 312 TFLOP/s dense x the same fraction",
                      "gemm_tflops.fp32": f"datasheet 19.5 TFLOP/s x the same fraction",
                      "attention_tflops": "FlashAttention-2 at 50 % of 312 TFLOP/s (the low end "
                                          "of its paper's 50-73 %, arXiv 2307.08691)",
                      "bandwidth_GBps": f"datasheet 2,039 GB/s x the H100's measured copy over "
                                        f"its datasheet ({bw_frac:.3f} = 2,929.7 / 3,350)",
                      "floor_us": "the H100's (fitted there): no A100 record",
                      "memory_GiB": "NVIDIA A100 80GB datasheet (81,920 MiB)"})


GPUS: dict[str, GpuRow] = {
    "h100": _hopper("NVIDIA H100 80GB HBM3 (SXM5)", "H100", 132, 79.2, H100_COPY_GBPS, {
        "sms": f"{H100_RECORD}: env multiprocessors",
        "memory_GiB": f"{H100_RECORD}: env gpu_memory_GiB",
        "bandwidth_GBps": f"measured: {H100_RECORD}, optimizer copy_GBps (1 GiB copy)"}),
    "h200": _hopper("NVIDIA H200 (SXM, 141 GB HBM3e)", "H200", 132, 139.8, H200_COPY_GBPS, {
        "sms": f"{H200_ENV_RECORD}: env multiprocessors",
        "memory_GiB": f"{H200_ENV_RECORD}: env gpu_memory_GiB",
        "bandwidth_GBps": f"measured: {H200_RECORD}, optimizer copy_GBps (1 GiB copy)"}),
    "a100": _a100(),
}
"""The rows by short name (``--gpus``, ``--profile model:<name>``)."""


def gpu(name: str) -> GpuRow:
    """The row called ``name`` (h100, h200, a100); the error lists the rows."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"no GPU row {name!r}; the rows are {', '.join(GPUS)} "
                         f"(runtime/calibrate/gpus.py)") from None


def gemm_waves(row: GpuRow, tiles: int) -> float:
    """The share of the SMs a GEMM of ``tiles`` output tiles keeps busy over its waves."""
    if tiles <= 0:
        return 1.0
    return tiles / (math.ceil(tiles / row.sms) * row.sms)


def kernel_seconds(row: GpuRow, kind: str, nbytes: float, flops: float = 0.0,
                   dtype: str = "", tiles: int = 0, cta_flops: float = 0.0,
                   additive: bool = True) -> float:
    """Seconds one kernel takes on ``row`` (module docstring): ``kind`` 'gemm' (``tiles``:
    its 128×128 output tiles, batch included), 'attention' (``cta_flops``: its longest CTA's
    FLOPs) or 'memory'. ``additive=False``: max(floor, compute, memory) instead."""
    memory = nbytes / (row.bandwidth_GBps * 1e9)
    compute = 0.0
    if kind == "gemm" and flops:
        compute = flops / (row.gemm_rate(dtype) * gemm_waves(row, tiles))
    elif kind == "attention" and flops:
        rate = row.attention_tflops * 1e12
        compute = max(flops / rate, cta_flops / (rate / row.sms))
    floor = row.floor_us * 1e-6
    if additive:
        return floor + max(compute, memory)
    return max(floor, compute, memory)
