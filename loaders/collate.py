"""Samples → one padded batch of torch tensors.

Owns: the ``Batch`` the model consumes and ``collate``, which pads a batch only to its own
longest sequence and rebuilds the masked-LM labels from the stored positions. Never: choosing
which samples form a batch (see dataset.py's ``ShardPlan``), file I/O, or device placement
policy (``Batch.to`` moves tensors where the caller says).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from loaders.shards import DataError, Samples

IGNORE_INDEX = -100
"""Label of every position that is not masked: the default ``ignore_index`` of
``torch.nn.functional.cross_entropy``."""


@dataclass
class Batch:
    """One local batch, padded to ``L`` = the longest sequence in this batch (not ``seq_len``).

    ``masked_lm_labels`` holds the original token at each masked position and ``IGNORE_INDEX``
    everywhere else, so the MLM loss and accuracy need no separate mask."""

    input_ids: torch.Tensor           # [b, L] int64, 0-padded
    token_type_ids: torch.Tensor      # [b, L] int64, 0-padded (segment A = 0, B = 1)
    attention_mask: torch.Tensor      # [b, L] int64, 1 = real token, 0 = padding
    masked_lm_labels: torch.Tensor    # [b, L] int64, IGNORE_INDEX except at masked positions
    next_sentence_labels: torch.Tensor  # [b] int64, 1 = B is a random sentence (MLPerf)
    num_real_tokens: int              # Σ sequence lengths
    num_padded_tokens: int            # b · L, what the model computes on

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_masked(self) -> int:
        """Number of masked-LM labels; a CPU-GPU sync point if the batch is on a GPU."""
        return int((self.masked_lm_labels != IGNORE_INDEX).sum())

    def to(self, device, non_blocking: bool = False) -> "Batch":
        """A copy with every tensor on ``device``. ``non_blocking`` only overlaps the copy
        when the source tensors are in pinned memory (``pin_memory()``)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Batch":
        return self._map(lambda t: t.pin_memory())

    def _map(self, fn) -> "Batch":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Batch(**{k: fn(v) if isinstance(v, torch.Tensor) else v
                        for k, v in values.items()})


def collate(samples: Samples) -> Batch:
    """Pad ``samples`` to their longest sequence and rebuild the masked-LM labels.

    Stored positions/ids are unpadded (vlen), so every stored pair is a real label. A pair
    at position 0 is the padding of a fixed-length MLPerf shard converted as-is (position 0 is
    always [CLS], never masked) and is ignored."""
    b = len(samples)
    if b == 0:
        raise ValueError("collate: empty batch")
    lengths = samples.lengths()
    width = int(lengths.max())
    real = np.arange(width)[None, :] < lengths[:, None]  # [b, L] True on real tokens

    input_ids = np.zeros((b, width), dtype=np.int64)
    input_ids[real] = np.concatenate(samples.input_ids)
    token_type_ids = np.zeros((b, width), dtype=np.int64)
    token_type_ids[real] = np.concatenate(samples.segment_ids)
    labels = _masked_lm_labels(samples, lengths, width)

    return Batch(
        input_ids=torch.from_numpy(input_ids),
        token_type_ids=torch.from_numpy(token_type_ids),
        attention_mask=torch.from_numpy(real.astype(np.int64)),
        masked_lm_labels=torch.from_numpy(labels),
        next_sentence_labels=torch.from_numpy(
            np.asarray(samples.next_sentence_labels, dtype=np.int64).reshape(b)),
        num_real_tokens=int(lengths.sum()),
        num_padded_tokens=b * width,
    )


def _masked_lm_labels(samples: Samples, lengths: np.ndarray, width: int) -> np.ndarray:
    counts = np.fromiter((len(p) for p in samples.masked_lm_positions), dtype=np.int64,
                         count=len(samples))
    rows = np.repeat(np.arange(len(samples)), counts)
    positions = _concat(samples.masked_lm_positions)
    ids = _concat(samples.masked_lm_ids)
    if len(ids) != len(positions):
        raise DataError("masked_lm_ids and masked_lm_positions differ in length in this batch")
    keep = positions > 0
    rows, positions, ids = rows[keep], positions[keep], ids[keep]
    beyond = positions >= lengths[rows]
    if beyond.any():
        i = int(np.flatnonzero(beyond)[0])
        raise DataError(f"sample {int(rows[i])} of a batch: masked position {int(positions[i])} "
                        f"is beyond its length {int(lengths[rows[i]])}; the shard is malformed")
    labels = np.full((len(samples), width), IGNORE_INDEX, dtype=np.int64)
    labels[rows, positions] = ids
    return labels


def _concat(arrays: list) -> np.ndarray:
    if not arrays:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(arrays).astype(np.int64)
