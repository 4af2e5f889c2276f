"""A process's random number generators as data: what a checkpoint keeps of each rank so that
a resumed run draws the same dropout masks and data order as the uninterrupted one.

Owns: reading the states (torch's CPU generator, this rank's CUDA device's, numpy's global,
Python ``random``'s) in types ``torch.load(weights_only=True)`` accepts (``rng_state``), and
setting them back, including from checkpoints written before the per-device CUDA format
(``set_rng_state``). Never: seeds a run (runtime.train.build does) or writes files
(runtime.train.checkpoint keeps the states in each rank's file).
"""
from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    """This process's RNG states in types ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                       float(cached)),
             "python": (version, tuple(internal), gauss_next)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This rank's own device only (dropout draws come from its generator): a resume where
        # each process sees fewer GPUs (one per task) must not need the others' indices.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):  # written before the per-device format: every
            cuda = cuda[torch.cuda.current_device()] if torch.cuda.current_device() < len(
                cuda) else cuda[0]               # visible GPU's; ours, or the first
        torch.cuda.set_rng_state(cuda)
