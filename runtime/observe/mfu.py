"""Achieved TFLOP/s and model FLOP utilisation (MFU): the model FLOPs a step did (counted by
runtime.model.arithmetic on the real tokens) over its time, against the device's peak.

Owns: the dense peak table by GPU name and precision (``PEAKS``, from the vendors'
datasheets), ``peak_of`` (the table's entry for this device, ``system.peak_tflops`` when set,
or none - on a CPU, or a GPU the table does not know - said so), and ``figures`` (TFLOP/s per
device and MFU of a span of steps). Never: counts FLOPs, reads anything of the device but
its name, or times anything (the step log's host times are used).

MFU here is PaLM's (Chowdhery et al. 2022, appendix B; torchtitan and nanoGPT report the same):
useful model FLOPs per second over the dense peak. Padding, a graph's idle time and kernels'
overheads all lower it. A datasheet peak is not what a GEMM reaches (one H100's large bf16
GEMM: ~798 of 989 TFLOP/s, measured 2026-11-26): set ``system.peak_tflops`` to a measured
peak to read MFU against it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    # name contains -> dense TFLOP/s per precision (fp32: CUDA cores - PyTorch's default matmul
    # precision 'highest' does not use TF32). Sources: NVIDIA H100, H200, A100, L40S datasheets.
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),      # SXM5
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.05, "fp16": 362.05, "fp32": 91.6}),
)


@dataclass(frozen=True)
class Peak:
    """The peak MFU is read against: TFLOP/s (None: no MFU) and where it comes from."""

    tflops: Optional[float]
    source: str


def peak_of(device_name: Optional[str], precision: str, override: float = 0.0) -> Peak:
    """The dense peak for a device called ``device_name`` (None: a CPU) running
    ``precision``; ``override`` (system.peak_tflops) > 0 wins."""
    if override > 0:
        return Peak(float(override), "system.peak_tflops")
    if device_name is None:
        return Peak(None, "none: a CPU has no table entry (set system.peak_tflops to a "
                          "measured peak for MFU)")
    for key, table in PEAKS:
        if key.lower() in device_name.lower() and precision in table:
            return Peak(table[precision], f"{key} {precision} dense, datasheet")
    return Peak(None, f"none: {device_name} is not in the table (set system.peak_tflops)")


def figures(model_flops_all: float, world_size: int, seconds: float, peak: Peak) -> dict:
    """{"tflops": achieved TFLOP/s per device, "mfu": of the peak (None without one)} for
    ``model_flops_all`` FLOPs of every rank over ``seconds``."""
    if seconds <= 0 or world_size < 1:
        return {"tflops": None, "mfu": None}
    tflops = model_flops_all / world_size / seconds / 1e12
    return {"tflops": tflops, "mfu": tflops / peak.tflops if peak.tflops else None}
