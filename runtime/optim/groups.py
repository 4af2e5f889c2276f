"""BERT's parameter groups and norm blocks: which tensors an optimizer decays and adapts, and
which parameter stands for several of the reference model's tensors.

Owns:
  * the MLPerf parameter grouping (``param_groups_for_bert``): names containing ``bias``,
    ``LayerNorm``, ``layer_norm``, ``gamma`` or ``beta`` get no weight decay and no layer
    adaptation; every other tensor gets both;
  * norm blocks (``norm_blocks``): a parameter that stands for several of the reference
    model's tensors - fusion qkv's ``Wqkv.weight``, Q's, K's and V's rows - is that many
    tensors for LAMB's and LARS's per-tensor norms and trust ratios in every backend (the
    per-tensor ones step its row blocks as views, ``fused`` declares them in its layout), so
    fusing the projection changes no update but by the GEMMs' rounding (NVIDIA's MLPerf BERT
    keeps its Wqkv's row blocks as three parameters for the same reason: docs/REFERENCES.md
    §2).
Never: builds or steps an optimizer (runtime.optim.optimizers does, from these groups).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from runtime.choices import hparam_error

__all__ = ["NO_DECAY_NAME_PARTS", "NORM_BLOCKS", "excluded_from_decay", "norm_blocks",
           "param_groups_for_bert"]

#: MLPerf reference (TF BERT) exclusion: no weight decay and no layer adaptation.
NO_DECAY_NAME_PARTS = ("bias", "LayerNorm", "layer_norm", "gamma", "beta")

#: Parameters (by name ending) that are several equal row blocks of the reference model's
#: tensors, and how many: runtime.model.bert's fused QKV weight, [3H, H] = Q, K, V.
NORM_BLOCKS = ((".attention.self.Wqkv.weight", 3),)


def norm_blocks(name: str) -> int:
    """How many tensors parameter ``name`` is for per-tensor norms (``NORM_BLOCKS``; 1 for
    every other)."""
    return next((k for end, k in NORM_BLOCKS if name.endswith(end)), 1)


def excluded_from_decay(name: str) -> bool:
    """True for bias and LayerNorm tensors (MLPerf: no weight decay, no adaptation)."""
    return any(part in name for part in NO_DECAY_NAME_PARTS)


def param_groups_for_bert(named_parameters: Iterable[tuple[str, torch.Tensor]],
                          weight_decay: float) -> list[dict[str, Any]]:
    """Split (name, tensor) pairs into the MLPerf BERT groups.

    Returns up to two groups (empty ones are dropped), each with ``params``,
    ``param_names``, ``weight_decay`` and ``adapt``:
      * decay group: ``weight_decay=weight_decay, adapt=True``;
      * no-decay group (names with any of ``NO_DECAY_NAME_PARTS``): ``weight_decay=0.0,
        adapt=False``.
    Tensors with ``requires_grad=False`` are left out. Order within a group follows the input.
    """
    why = hparam_error("weight_decay", weight_decay)
    if why:
        raise ValueError(f"param_groups_for_bert: hyperparameter 'weight_decay' {why}")
    decay: dict[str, list] = {"params": [], "param_names": []}
    no_decay: dict[str, list] = {"params": [], "param_names": []}
    for name, p in named_parameters:
        if not isinstance(name, str) or not isinstance(p, torch.Tensor):
            raise TypeError("param_groups_for_bert expects (name, tensor) pairs, as from "
                            f"model.named_parameters(); got ({type(name).__name__}, "
                            f"{type(p).__name__})")
        if not p.requires_grad:
            continue
        target = no_decay if excluded_from_decay(name) else decay
        target["params"].append(p)
        target["param_names"].append(name)
    groups = []
    if decay["params"]:
        groups.append({**decay, "weight_decay": float(weight_decay), "adapt": True})
    if no_decay["params"]:
        groups.append({**no_decay, "weight_decay": 0.0, "adapt": False})
    return groups
