"""Which varlen attention kernel runs, and what its cost grows with: the one rule that the
kernels (kernels.attention), the model's arithmetic and cost layout (runtime.model.arithmetic:
the balancer's length-cost model, the trainer's computed tokens, the memory check) all follow.

Owns: the kernel names (``KERNELS``), ``resolve`` (what ``auto`` means on a device) and each
kernel's cost layout (``COST_LAYOUT``: how a loaders.length_cost model prices it). Never:
imports torch (the pre-launch memory check reads it), runs a kernel.
"""
from __future__ import annotations

KERNELS = ("auto", "per_sequence", "repad", "block_diagonal", "jagged", "flash_varlen",
           "cuda_varlen")

COST_LAYOUT: dict[str, str | None] = {
    "per_sequence": "unpadded",   # attention on each sequence alone: Σ len²
    "jagged": "unpadded",
    "flash_varlen": "unpadded",
    "cuda_varlen": "unpadded",
    "repad": "repad",             # attention padded to the longest sequence: n · Lseq²
    "block_diagonal": None,       # T² scores over all tokens: a measured counter-example
}                                 # (docs/BENCHMARKS.md), no cost layout, not for training


def resolve(kernel: str, device_type: str, cuda_varlen_ok: bool = True) -> str:
    """The kernel that runs for ``kernel`` on a ``device_type`` device: 'auto' is
    ``cuda_varlen`` on CUDA (where torch has the varlen path: ``cuda_varlen_ok``) and
    ``repad`` elsewhere (the fastest CPU path measured, ``python -m bench.balance
    --attention``)."""
    if kernel == "auto":
        return "cuda_varlen" if device_type == "cuda" and cuda_varlen_ok else "repad"
    if kernel not in KERNELS:
        raise ValueError(f"unknown varlen attention kernel {kernel!r}; choose one of "
                         f"{', '.join(KERNELS)}")
    return kernel


def cost_layout(attention: str, device_type: str, kernel: str = "auto",
                cuda_varlen_ok: bool = True) -> str:
    """The length-cost layout (loaders.length_cost.LAYOUTS) of a model built with
    ``model.attention = attention`` running ``kernel`` on ``device_type``."""
    if attention == "padded":
        return "padded"
    if attention != "unpadded":
        raise ValueError(f"model.attention={attention!r}: expected padded | unpadded")
    name = resolve(kernel, device_type, cuda_varlen_ok)
    layout = COST_LAYOUT[name]
    if layout is None:
        raise ValueError(f"attention kernel {name!r} has no cost layout: it is a measured "
                         f"counter-example, not a training kernel")
    return layout
