"""The balancing modes' names and their specification: what the run config declares and checks.

Owns: ``BalanceMode`` (the modes ``random | global | local | pack | offline_pack``, declared
once here; the config imports it), ``PACKED_MODES`` and ``BalanceSpec`` (the ``data.*``
balancing keys of one run, their ranges checked on construction). Never: the plans, the cost
model's arithmetic or the description a checkpoint records (loaders/balance.py), numpy or
h5py - run_and_time.sh reads the config in processes of their own (``python -m
runtime.config``, ``python -m runtime.train.memory``), a few per run, and numpy with h5py
was ~0.15 s of each one's ~0.2 s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from loaders.length_cost import LengthCost

BalanceMode = Literal["random", "global", "local", "pack", "offline_pack"]
MODES: tuple[str, ...] = get_args(BalanceMode)
PACKED_MODES: tuple[str, ...] = ("pack", "offline_pack")
"""Modes whose rows may hold several sequences: the model must be built with packed=True."""


@dataclass(frozen=True)
class BalanceSpec:
    """How to balance; the field names are the ``data.*`` config keys (``cost`` is
    ``data.length_cost`` resolved by the trainer)."""

    mode: str = "random"
    bin_edges: tuple[int, ...] = ()  # upper edges of length bins; () = num_bins / strata
    num_bins: int = 0                # quantile bins; 0 = G·b strata of the sorted lengths
    group_size: int = 1              # G: ranks per node group (local, pack)
    pack_length: int = 128           # tokens per packed row (pack, offline_pack)
    cost: LengthCost | None = None   # what a rank's batch costs; None = real tokens
    max_seqs_per_row: int = 0        # offline_pack: sequences a row holds at most (0 = any)
    static_rows: int = -1            # offline_pack, static shapes: rows per rank and step
    #                                  (0 = from the data; -1 = not static: rows may vary)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"data.balance={self.mode!r}: choose one of {' | '.join(MODES)}")
        edges = list(self.bin_edges)
        if any(e < 1 for e in edges) or edges != sorted(set(edges)):
            raise ValueError(f"data.bin_edges={edges}: give strictly increasing positive upper "
                             "edges, e.g. [64, 96, 127, 128]")
        if self.num_bins < 0:
            raise ValueError(f"data.num_bins={self.num_bins} must be >= 0 (0 = strata from "
                             "the data)")
        for key in ("group_size", "pack_length"):
            if getattr(self, key) < 1:
                raise ValueError(f"data.{key}={getattr(self, key)} must be >= 1")
        if self.max_seqs_per_row < 0:
            raise ValueError(f"data.max_seqs_per_row={self.max_seqs_per_row} must be >= 0 "
                             "(0 = no limit)")
