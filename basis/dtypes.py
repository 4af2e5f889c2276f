"""The names the config and the rows give dtypes - ``fp32``, ``bf16``, ``fp16`` - and the torch
dtype each stands for (by its attribute name, so this room needs no torch), stated once.

Owns: ``TORCH_NAMES`` and ``torch_dtypes``, with which the precision rows' torch side
(runtime.model.precision.DTYPES) builds its table, and ``BYTES``, each name's width (the run's
runtime.numerics.Numerics counts its bytes with it) - one list, so no reader can disagree on
what a name means. Never: imports torch (the caller hands its
module in) or anything of the project (basis/: the room below loaders and runtime), or
decides which dtype a run uses (runtime.choices' rows, the config).
"""
from __future__ import annotations

from typing import Any

TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""A dtype's name in the config and the rows -> its attribute of the ``torch`` module."""

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
"""Bytes per element of each dtype name (tests/unit/test_numerics.py holds them to the torch
dtypes' own): what the memory estimate and the tuner count (runtime.numerics). ``fp8`` is
the operands of model.fp8's GEMMs (e4m3/e5m2, one byte either way) - a GEMM dtype and a peak's
key, no tensor a run keeps, so no entry of ``TORCH_NAMES``."""


def torch_dtypes(torch: Any) -> dict[str, Any]:
    """Each name of ``TORCH_NAMES`` -> its ``torch.dtype`` (``torch``: the torch module)."""
    return {name: getattr(torch, attr) for name, attr in TORCH_NAMES.items()}
