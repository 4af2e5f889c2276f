"""The shapes of a run's batches (``data.shapes``): what each mode makes, and the sizes that
can mean something.

Owns: ``ShapeMode`` (declared once here; the config imports it), the bucketed width
(``bucket_width``), the static shape every micro-batch of a static run has (``StaticShape``)
with its masked-LM slots per row (``masked_slots_per_row``), the static packing default
(``STATIC_SEQS_PER_ROW``) and the bounds a static or bucketed size must keep
(``shape_size_problem``, the config's check). Never: imports torch or numpy - the config and
the memory estimate read it before any rank starts; the padding itself is
``loaders.collate`` (``pad_rows`` to a width, ``pad_rows_static`` to a ``StaticShape``), which
dataset.py calls per batch by the mode.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

ShapeMode = Literal["dynamic", "bucketed", "static"]
"""``data.shapes``: what shapes the batches of a run have: 'dynamic' (each padded to its own
longest row), 'bucketed' (the width rounded up to a multiple of data.shape_bucket: few
distinct shapes, ``bucket_width``), 'static' (every micro-batch the same shapes, on every
rank: ``StaticShape``)."""
STATIC_SEQS_PER_ROW = 3
"""Sequences a packed row holds at most under static shapes unless data.max_seqs_per_row says
otherwise: NVIDIA's MLPerf packing (``--max_pack_factor 3``), which packs the seq-512 data set
to 99.75 % (Graphcore's NNLSHP) and bounds a row's sequence slots."""
MIN_SEQUENCE_TOKENS = 5
"""The shortest sequence a BERT pre-training data set holds: [CLS] A [SEP] B [SEP] with one
token in each segment (loaders.pretraining asserts both segments non-empty). A row of L
tokens therefore holds at most L // 5 sequences."""


def shape_size_problem(*, static_rows: int, max_seqs_per_row: int, shape_bucket: int,
                       local_batch: int, seq_len: int, pack_length: int) -> str | None:
    """Why a static or bucketed shape size cannot mean anything, with the largest value that
    does (None: every size is within what the data and the sequence length allow). Each
    bound is a fact, not a taste: a rank's micro-batch of b sequences fills at most b rows
    (each row holds at least one sequence: more rows are only padding, and the planner would
    try them all); a row of ``pack_length`` tokens holds at most pack_length //
    MIN_SEQUENCE_TOKENS sequences (more slots are only padding - every slot costs memory in
    the attention's segments and the slot tables); a bucket wider than the sequence length
    is the sequence length."""
    if static_rows > local_batch:
        return (f"data.static_rows={static_rows}: a rank's micro-batch of {local_batch} "
                f"sequences fills at most {local_batch} rows (every row holds at least one "
                f"sequence; more rows would be padding only) - set data.static_rows to at most "
                f"{local_batch}, or 0 to derive it from the data")
    most = max(1, pack_length // MIN_SEQUENCE_TOKENS)
    if max_seqs_per_row > most:
        return (f"data.max_seqs_per_row={max_seqs_per_row}: a row of {pack_length} tokens "
                f"holds at most {most} sequences (the shortest is {MIN_SEQUENCE_TOKENS} tokens, "
                f"[CLS] A [SEP] B [SEP]; more slots would be padding only) - set "
                f"data.max_seqs_per_row to at most {most} (0 = no limit, or "
                f"{STATIC_SEQS_PER_ROW} with static shapes)")
    if shape_bucket > seq_len:
        return (f"data.shape_bucket={shape_bucket} is wider than a row (data.max_seq_length = "
                f"{seq_len}; a batch is never padded past it) - set data.shape_bucket to at "
                f"most {seq_len}")
    return None


def bucket_width(longest: int, bucket: int, limit: int) -> int:
    """``data.shapes = 'bucketed'``: the padded width, ``longest`` rounded up to a multiple of
    ``bucket`` and capped at ``limit`` (the sequence length). A kernel that prepares a plan
    per shape (cuDNN's attention) then meets at most limit/bucket widths a run, not one per
    batch; the price is at most bucket - 1 padded columns."""
    if bucket < 1:
        raise ValueError(f"data.shape_bucket must be >= 1, got {bucket}")
    return min(limit, -(-longest // bucket) * bucket) if longest <= limit else longest


@dataclass(frozen=True)
class StaticShape:
    """The shapes every micro-batch of a ``data.shapes = 'static'`` run has, on every rank:
    ``rows`` rows of ``width`` tokens, each holding 1 to ``seqs_per_row`` sequences, and
    ``masked`` masked-LM label slots - what a CUDA graph captured once can replay on any
    batch (NVIDIA's MLPerf packing: rows of 512 with at most 3 sequences, cu_seqlens padded
    by repeating the last offset, NSP labels padded with an ignored value).

    Tensors of a static ``Batch``: input_ids, token_type_ids, attention_mask,
    masked_lm_labels [rows, width]; next_sentence_labels [rows·seqs_per_row] (a slot per
    possible sequence, IGNORE_INDEX where unused); its ``Layout``: all rows·width token slots
    in row order (token_index = arange), cu_seqlens [segments + 1] with ``seqs_per_row + 1``
    segments per row - its sequences, zero-length slots, and the row's padding tail as a
    segment of its own (it attends only to itself: every token slot is covered, nothing is
    uninitialised, and no real token sees it) -, max_len = width, cls_tokens [rows ·
    seqs_per_row] (unused slots point at token 0), masked_positions [masked] (unused slots
    point at token 0, a [CLS], whose label is always ignored)."""

    rows: int
    width: int
    seqs_per_row: int
    masked: int

    def __post_init__(self):
        for key in ("rows", "width", "seqs_per_row", "masked"):
            if getattr(self, key) < 1:
                raise ValueError(f"StaticShape.{key} must be >= 1, got {getattr(self, key)}")

    @property
    def sequence_slots(self) -> int:
        return self.rows * self.seqs_per_row

    @property
    def segments(self) -> int:
        return self.rows * (self.seqs_per_row + 1)

    @property
    def tokens(self) -> int:
        return self.rows * self.width


def masked_slots_per_row(width: int, seqs_per_row: int, max_predictions_per_seq: int,
                         masked_lm_prob: float | None) -> int:
    """At most how many masked-LM labels a row of ``width`` tokens holding up to
    ``seqs_per_row`` sequences can carry. A sequence of n tokens gets
    min(max_pred, max(1, round(n·p))) ≤ n·p + 1 labels (loaders.pretraining, the MLPerf
    reference's rule), so a row gets at most floor(width·p) + seqs_per_row; without p (a data
    set that does not record it) seqs_per_row · max_pred, which always holds."""
    bound = seqs_per_row * max_predictions_per_seq
    if masked_lm_prob is not None:
        bound = min(bound, math.floor(width * masked_lm_prob + 1e-9) + seqs_per_row)
    return bound
