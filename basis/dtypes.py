"""The names the config and the rows give dtypes - ``fp32``, ``bf16``, ``fp16`` - and the torch
dtype each stands for (by its attribute name, so this room needs no torch), stated once.

Owns: ``TORCH_NAMES`` and ``torch_dtypes``, with which the precision rows' torch side
(runtime.model.precision.DTYPES) and the gradient sync's reduce dtypes
(runtime.grad_sync.REDUCE_DTYPES, ``train.allreduce_dtype``) build their tables - one list, so
the two cannot disagree on what a name means. Never: imports torch (the caller hands its
module in) or anything of the project (basis/: the room below loaders and runtime), or
decides which dtype a run uses (runtime.choices' rows, the config).
"""
from __future__ import annotations

from typing import Any

TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""A dtype's name in the config and the rows -> its attribute of the ``torch`` module."""


def torch_dtypes(torch: Any) -> dict[str, Any]:
    """Each name of ``TORCH_NAMES`` -> its ``torch.dtype`` (``torch``: the torch module)."""
    return {name: getattr(torch, attr) for name, attr in TORCH_NAMES.items()}
