"""Achieved TFLOP/s and model FLOP utilisation (MFU): the model FLOPs a step did (counted by
runtime.model.arithmetic on the real tokens) over its time, against the device's peak.

Owns: the dense peak table by GPU name and GEMM dtype (``PEAKS``, from the vendors'
datasheets), ``peak_of`` (the table's entry for this device and the run's GEMM dtypes - its
numerics' ``peak_dtypes`` -, ``system.peak_tflops`` when set, or none - on a CPU, or a GPU the
table does not know - said so), and ``figures`` (TFLOP/s per device and MFU of a span of
steps). Never: counts FLOPs, reads anything of the device but
its name, or times anything (the step log's host times are used).

MFU here is PaLM's (Chowdhery et al. 2022, appendix B; torchtitan and nanoGPT report the same):
useful model FLOPs per second over the dense peak. Padding, a graph's idle time and kernels'
overheads all lower it. A datasheet peak is not what a GEMM reaches (one H100's large bf16
GEMM: ~798 of 989 TFLOP/s, measured 2026-11-26): set ``system.peak_tflops`` to a measured
peak to read MFU against it.

Under model.fp8 only the encoder's converted Linears run in FP8 (attention, embeddings and
heads stay in the precision's dtype), so ``mfu`` stays against the precision's peak - as
torchtitan's MFU is (its ``get_peak_flops`` is the bf16 peak whatever float8 does) - and
``mfu_fp8`` beside it reads the same FLOPs against the FP8 peak (twice the bf16 one on
Hopper): the first comparable with a bf16 run's, the second the share of the FP8 tensor cores'
peak the step used. The peak's source says both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    # name contains -> dense TFLOP/s per GEMM dtype (fp32: CUDA cores - PyTorch's default matmul
    # precision 'highest' does not use TF32; fp8: half the datasheets' "with sparsity" figure,
    # as for the others). Sources: NVIDIA H100, H200, A100, L40S datasheets. An A100 has no
    # FP8 tensor cores (model.fp8 is emulated there): no fp8 entry.
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2, "fp8": 1513.0}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0, "fp8": 1670.5}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9, "fp8": 1978.9}),      # SXM5
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9, "fp8": 1978.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.05, "fp16": 362.05, "fp32": 91.6, "fp8": 733.0}),
)


@dataclass(frozen=True)
class Peak:
    """The peak MFU is read against: TFLOP/s (None: no MFU) and where it comes from; with
    GEMMs of other dtypes in the step (model.fp8's Linears), each one's peak beside it
    (``others``: (dtype, TFLOP/s) - ``mfu_<dtype>`` reads the same FLOPs against it)."""

    tflops: Optional[float]
    source: str
    others: tuple[tuple[str, float], ...] = ()


def _table(device_name: Optional[str]) -> Optional[tuple[str, dict[str, float]]]:
    for key, table in PEAKS:
        if device_name is not None and key.lower() in device_name.lower():
            return key, table
    return None


def peak_of(device_name: Optional[str], dtypes, override: float = 0.0) -> Peak:
    """The dense peak for a device called ``device_name`` (None: a CPU) running GEMMs of
    ``dtypes`` (a dtype name, or the run's numerics' ``peak_dtypes``: the first is MFU's -
    the precision's GEMMs -, the others' peaks go beside it); ``override``
    (system.peak_tflops) > 0 wins for the first. Under model.fp8 the source says which peak
    MFU is against and where FP8's is."""
    dtypes = (dtypes,) if isinstance(dtypes, str) else tuple(dtypes)
    main, rest = dtypes[0], dtypes[1:]
    row = _table(device_name)
    others = tuple((d, row[1][d]) for d in rest if row is not None and d in row[1])
    note = "".join(_beside(main, d, row, device_name) for d in rest)
    if override > 0:
        return Peak(float(override), "system.peak_tflops" + note, others)
    if device_name is None:
        return Peak(None, "none: a CPU has no table entry (set system.peak_tflops to a "
                          "measured peak for MFU)" + note, others)
    if row is not None and main in row[1]:
        return Peak(row[1][main], f"{row[0]} {main} dense, datasheet" + note, others)
    return Peak(None, f"none: {device_name} is not in the table (set system.peak_tflops)"
                + note, others)


def _beside(main: str, dtype: str, row, device_name: Optional[str]) -> str:
    """What the peak's source says of the step's ``dtype`` GEMMs beside its ``main`` ones."""
    if row is not None and dtype in row[1]:
        return (f"; the {dtype} GEMMs' peak beside it: mfu_{dtype} against {row[0]} {dtype} "
                f"dense, {row[1][dtype]:g} TFLOP/s")
    where = f"for {device_name}" if device_name else "on a CPU"
    return (f"; the {dtype} GEMMs run beside the {main} ones, MFU counts them against the "
            f"{main} peak (no {dtype} peak {where})")


def figures(model_flops_all: float, world_size: int, seconds: float, peak: Peak) -> dict:
    """{"tflops": achieved TFLOP/s per device, "mfu": of the peak (None without one), and
    "mfu_<dtype>" of each of the peak's ``others``} for ``model_flops_all`` FLOPs of every
    rank over ``seconds``."""
    if seconds <= 0 or world_size < 1:
        return {"tflops": None, "mfu": None}
    tflops = model_flops_all / world_size / seconds / 1e12
    return {"tflops": tflops, "mfu": tflops / peak.tflops if peak.tflops else None,
            **{f"mfu_{d}": tflops / v for d, v in peak.others}}
