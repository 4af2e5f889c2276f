"""Samples → one padded batch of torch tensors, one sample per row or several packed.

Owns: the ``Batch`` the model consumes, the unpadded per-row form ``Rows`` (what the torch
path and the DALI pipeline both pad), best-fit packing of one batch's samples into rows
(``best_fit_rows``, on packing.py's best-fit decreasing), padding a batch only to its own
longest row, to a bucketed width or to a static shape (what each ``data.shapes`` mode makes:
loaders.shapes, re-exported here), rebuilding the masked-LM labels from the stored positions,
and the batch's ``Layout`` (real tokens, sequences, masked positions - found here on the host,
so a GPU step never reads them back). Never: choosing which samples form a batch (see
dataset.py's plans and balance.py), file I/O, or device placement policy (``Batch.to`` moves
tensors where the caller says).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from loaders.packing import best_fit_decreasing
from loaders.shapes import (ShapeMode, StaticShape, bucket_width,  # noqa: F401 (re-exported)
                            masked_slots_per_row)
from loaders.shards import DataError, Samples

IGNORE_INDEX = -100
"""Label of every position that is not masked: the default ``ignore_index`` of
``torch.nn.functional.cross_entropy``."""


@dataclass
class Batch:
    """One local batch of rows, padded to ``L`` = the longest row in this batch (not
    ``seq_len``).

    ``masked_lm_labels`` holds the original token at each masked position and ``IGNORE_INDEX``
    everywhere else, so the MLM loss and accuracy need no separate mask.

    Packing (Graphcore's convention): a row may hold several sequences back to back; then
    ``attention_mask`` is the 1-based index of the sequence each token belongs to (1, 1, …,
    2, 2, …, 0 on padding), each sequence starts with its [CLS], and
    ``next_sentence_labels`` has one entry per *sequence*, in row-major order. Unpacked rows
    are the special case of one sequence per row (mask 1/0). The model derives position ids
    (restarting per sequence) and the [CLS] positions from the mask."""

    input_ids: torch.Tensor           # [b, L] int64, 0-padded
    token_type_ids: torch.Tensor      # [b, L] int64, 0-padded (segment A = 0, B = 1)
    attention_mask: torch.Tensor      # [b, L] int64, 1 = real token, 0 = padding
    masked_lm_labels: torch.Tensor    # [b, L] int64, IGNORE_INDEX except at masked positions
    next_sentence_labels: torch.Tensor  # [sequences] int64, 1 = B is a random sentence (MLPerf)
    num_real_tokens: int              # Σ sequence lengths
    num_padded_tokens: int            # rows · L, what a padded model computes on
    sequence_lengths: tuple | None = None
    """Per row, the lengths of its sequences (what loaders.length_cost prices); None where a
    pipeline did not record them (then they are read from ``attention_mask``)."""
    layout: "Layout | None" = None
    """Where the real tokens and the masked-LM labels are, computed on the host (``Layout``):
    the model needs no device-to-host read to find them. None: the model derives them from
    ``attention_mask`` and ``masked_lm_labels`` on the device (host syncs)."""
    num_masked_labels: int | None = None
    """The masked-LM labels, counted by collation on the host (a static batch's slots hold
    more); None where a pipeline did not count them."""

    @property
    def size(self) -> int:
        """Rows (= sequences unless packed)."""
        return self.input_ids.shape[0]

    @property
    def num_sequences(self) -> int:
        return self.next_sentence_labels.shape[0]

    @property
    def packed(self) -> bool:
        return self.num_sequences != self.size

    @property
    def num_masked(self) -> int:
        """Number of masked-LM labels; a CPU-GPU sync point if the batch is on a GPU."""
        return int((self.masked_lm_labels != IGNORE_INDEX).sum())

    def host_work(self) -> tuple[list[list[int]], int]:
        """(each row's sequence lengths, masked labels) of a host batch: collation's counts,
        else read from its tensors (a host read, no device involved)."""
        lengths = self.sequence_lengths
        if lengths is None:  # a pipeline that did not record them: from the mask
            lengths = [[int(c) for c in torch.bincount(row)[1:].tolist() if c]
                       for row in self.attention_mask]
        masked = self.num_masked_labels
        return [list(r) for r in lengths], self.num_masked if masked is None else masked

    def to(self, device, non_blocking: bool = False) -> "Batch":
        """A copy with every tensor on ``device``. ``non_blocking`` only overlaps the copy
        when the source tensors are in pinned memory (``pin_memory()``)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Batch":
        return self._map(lambda t: t.pin_memory())

    def _map(self, fn) -> "Batch":
        return _map_fields(self, fn)


@dataclass
class Layout:
    """Where the real tokens of a padded batch are, and its masked-LM labels, computed on the
    host by collation (NVIDIA's unpad indices and cu_seqlens, plus the masked positions): with
    these the model has no data-dependent shape and no device-to-host read (finding them on
    the device takes ``nonzero`` and reading lengths back, each a CPU-GPU sync).

    A row's real tokens are a prefix of the row; sequences are runs of one ``attention_mask``
    value; everything is in row-major order. T real tokens, n sequences, M masked labels."""

    token_index: torch.Tensor      # int64 [T] flat (row·L + column) positions of the real tokens
    cu_seqlens: torch.Tensor       # int32 [n+1] sequence offsets among the T tokens
    token_in_seq: torch.Tensor     # int64 [T] each token's position within its sequence
    seq_of_token: torch.Tensor     # int64 [T] each token's sequence
    masked_positions: torch.Tensor  # int64 [M] flat positions of the masked-LM labels
    masked_tokens: torch.Tensor    # int64 [M] the same labels' positions among the T tokens
    lengths: tuple                 # host: the n sequence lengths
    max_len: int
    min_len: int
    cls_tokens: torch.Tensor | None = None
    """int64 [sequences]: each sequence's [CLS] among the T tokens, in the order of
    ``next_sentence_labels`` (None: the starts of cu_seqlens). Static batches: one entry per
    sequence *slot*, unused slots 0 (a valid token; their NSP label is ignored)."""

    @property
    def num_tokens(self) -> int:
        """T: the tokens the unpadded model computes on (host metadata, no device read)."""
        return int(self.token_index.shape[0])

    def to(self, device, non_blocking: bool = False) -> "Layout":
        return _map_fields(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Layout":
        return _map_fields(self, lambda t: t.pin_memory())


def _map_fields(obj, fn):
    """A copy of dataclass ``obj`` with ``fn`` applied to its tensors (and its Layout's)."""
    values = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            v = fn(v)
        elif isinstance(v, Layout):
            v = _map_fields(v, fn)
        values[f.name] = v
    return type(obj)(**values)


def host_layout(row_lengths: np.ndarray, width: int, attention_mask: list,
                masked_lm_labels: list) -> Layout:
    """The ``Layout`` of rows of ``row_lengths`` real tokens padded to ``width``, from the
    rows' unpadded ``attention_mask`` (1-based sequence index per token) and labels."""
    row_lengths = np.asarray(row_lengths, dtype=np.int64)
    starts = np.arange(len(row_lengths), dtype=np.int64) * width
    token_index = np.repeat(starts - np.concatenate([[0], np.cumsum(row_lengths)[:-1]]),
                            row_lengths) + np.arange(int(row_lengths.sum()), dtype=np.int64)
    seq_lengths = np.concatenate([np.bincount(m)[1:] for m in attention_mask]).astype(np.int64)
    cu = np.concatenate([[0], np.cumsum(seq_lengths)])
    seq_of_token = np.repeat(np.arange(len(seq_lengths), dtype=np.int64), seq_lengths)
    token_in_seq = np.arange(int(cu[-1]), dtype=np.int64) - cu[seq_of_token]
    masked_tokens = np.flatnonzero(np.concatenate(masked_lm_labels) != IGNORE_INDEX)
    return Layout(
        token_index=torch.from_numpy(token_index),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        token_in_seq=torch.from_numpy(token_in_seq),
        seq_of_token=torch.from_numpy(seq_of_token),
        masked_positions=torch.from_numpy(token_index[masked_tokens]),
        masked_tokens=torch.from_numpy(masked_tokens.astype(np.int64)),
        lengths=tuple(seq_lengths.tolist()),
        max_len=int(seq_lengths.max()) if len(seq_lengths) else 0,
        min_len=int(seq_lengths.min()) if len(seq_lengths) else 0,
        cls_tokens=torch.from_numpy(cu[:-1].astype(np.int64)))


def collate(samples: Samples) -> Batch:
    """Pad ``samples`` to their longest sequence (one sample per row) and rebuild the
    masked-LM labels."""
    return pad_rows(sample_rows(samples))


def collate_packed(samples: Samples, pack_length: int) -> Batch:
    """Pack ``samples`` best-fit into rows of at most ``pack_length`` tokens, then pad the
    rows to the longest row (see ``best_fit_rows`` and the ``Batch`` packing convention)."""
    return pad_rows(sample_rows(samples, best_fit_rows(samples.lengths(), pack_length)))


@dataclass
class Rows:
    """A batch before padding: per row, the concatenated real tokens of its sequences.

    What both padding paths consume: ``pad_rows`` here (torch path) and the DALI pipeline
    (loaders/dali_pipeline.py), so the two cannot disagree on content, only on padding."""

    input_ids: list            # per row: int64 [n_row]
    token_type_ids: list       # per row: int64 [n_row]
    attention_mask: list       # per row: int64 [n_row], k = the row's k-th sequence (1-based)
    masked_lm_labels: list     # per row: int64 [n_row], IGNORE_INDEX where not masked
    next_sentence_labels: list  # per row: int64 [k], one per sequence in the row

    def __len__(self) -> int:
        return len(self.input_ids)


def best_fit_rows(lengths: np.ndarray, pack_length: int) -> list[list[int]]:
    """Best-fit decreasing (packing.py): sequences longest first (ties by index), each into
    the open row with the least room that still fits it (ties: the earliest row), else into
    a new row. Deterministic.

    Returns, per row, the sample indices in the order they sit in the row."""
    lengths = np.asarray(lengths)
    if len(lengths) and lengths.max() > pack_length:
        n = int(lengths.max())
        raise DataError(f"a sample of length {n} does not fit a packed row of "
                        f"pack_length={pack_length}; raise data.pack_length to at least {n}")
    return best_fit_decreasing(lengths, pack_length)


def sample_rows(samples: Samples, rows: list[list[int]] | None = None) -> Rows:
    """Per-row token arrays; ``rows`` lists the samples of each row (default: one each)."""
    if len(samples) == 0:
        raise ValueError("collate: empty batch")
    rows = [[i] for i in range(len(samples))] if rows is None else rows
    labels = _masked_lm_labels(samples)
    out = Rows([], [], [], [], [])
    for members in rows:
        out.input_ids.append(_cat(samples.input_ids, members))
        out.token_type_ids.append(_cat(samples.segment_ids, members))
        out.attention_mask.append(np.concatenate(
            [np.full(len(samples.input_ids[i]), k, dtype=np.int64)
             for k, i in enumerate(members, 1)]))
        out.masked_lm_labels.append(_cat(labels, members))
        out.next_sentence_labels.append(
            np.asarray(samples.next_sentence_labels, dtype=np.int64)[members])
    return out


def pad_rows(rows: Rows, width: int | None = None) -> Batch:
    """Stack ``rows`` into a ``Batch`` padded to the longest row, or to ``width`` (at least
    the longest row: ``bucket_width``'s rounding, or a static batch's full width)."""
    lengths = np.fromiter((len(r) for r in rows.input_ids), dtype=np.int64, count=len(rows))
    longest = int(lengths.max())
    if width is None:
        width = longest
    elif width < longest:
        raise ValueError(f"pad_rows: width {width} is shorter than the longest row ({longest})")
    real = np.arange(width)[None, :] < lengths[:, None]  # [rows, L] True on real tokens

    def padded(column: list, fill: int) -> torch.Tensor:
        out = np.full((len(rows), width), fill, dtype=np.int64)
        out[real] = np.concatenate(column)
        return torch.from_numpy(out)

    return Batch(
        input_ids=padded(rows.input_ids, 0),
        token_type_ids=padded(rows.token_type_ids, 0),
        attention_mask=padded(rows.attention_mask, 0),
        masked_lm_labels=padded(rows.masked_lm_labels, IGNORE_INDEX),
        next_sentence_labels=torch.from_numpy(np.concatenate(rows.next_sentence_labels)),
        num_real_tokens=int(lengths.sum()),
        num_padded_tokens=len(rows) * width,
        sequence_lengths=row_sequence_lengths(rows),
        layout=(layout := host_layout(lengths, width, rows.attention_mask,
                                      rows.masked_lm_labels)),
        num_masked_labels=int(layout.masked_tokens.shape[0]),
    )


def row_sequence_lengths(rows: Rows) -> tuple:
    """Per row, the lengths of its sequences (``Batch.sequence_lengths``)."""
    return tuple(tuple(np.bincount(m)[1:].tolist()) for m in rows.attention_mask)


def _cat(column: list, members: list[int]) -> np.ndarray:
    return np.concatenate([column[i] for i in members]).astype(np.int64)


def _masked_lm_labels(samples: Samples) -> list[np.ndarray]:
    """Per sample: the original token at each masked position, IGNORE_INDEX elsewhere.

    Stored positions/ids are unpadded (vlen), so every stored pair is a real label. A pair
    at position 0 is the padding of a fixed-length MLPerf shard converted as-is (position 0 is
    always [CLS], never masked) and is ignored."""
    out = []
    for i, (ids, positions, targets) in enumerate(zip(
            samples.input_ids, samples.masked_lm_positions, samples.masked_lm_ids)):
        if len(positions) != len(targets):
            raise DataError("masked_lm_ids and masked_lm_positions differ in length in this batch")
        positions = positions.astype(np.int64)
        keep = positions > 0
        positions, targets = positions[keep], targets[keep]
        if len(positions) and positions.max() >= len(ids):
            raise DataError(f"sample {i} of a batch: masked position {int(positions.max())} "
                            f"is beyond its length {len(ids)}; the shard is malformed")
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
        labels[positions] = targets
        out.append(labels)
    return out


# ---------------------------------------------------------------------------- shapes per step

def pad_rows_static(rows: Rows, shape: StaticShape) -> Batch:
    """``rows`` as a batch of ``shape`` (``StaticShape``); fewer rows than the shape's are
    completed with empty rows (all padding: a step whose sequences the plan packed into fewer
    rows). More rows, a row longer than its width or with more sequences than a row may
    hold, or more masked labels than the slots are refused (DataError, naming what to
    change): nothing is ever dropped; the balancing plan (loaders.balance) forms rows that
    fit."""
    R, L, k = shape.rows, shape.width, shape.seqs_per_row
    if not 0 < len(rows) <= R:
        raise DataError(f"a static batch (data.shapes = 'static') has at most {R} rows "
                        f"(data.static_rows); the plan gave {len(rows)}")
    empty = np.zeros(0, dtype=np.int64)
    rows = Rows(*(column + [empty] * (R - len(rows)) for column in (
        rows.input_ids, rows.token_type_ids, rows.attention_mask, rows.masked_lm_labels,
        rows.next_sentence_labels)))  # rows the plan left empty: all padding
    seqs = [np.bincount(m)[1:] for m in rows.attention_mask]
    for r, lens in enumerate(seqs):
        if len(lens) > k or int(lens.sum()) > L:
            raise DataError(f"row {r} of a static batch holds {len(lens)} sequences and "
                            f"{int(lens.sum())} tokens; a row takes at most {k} "
                            f"(data.max_seqs_per_row) and {L} tokens")
    batch = pad_rows(rows, width=L)
    table = np.zeros((R, k + 1), dtype=np.int64)   # per row: its sequences, 0s, padding tail
    for r, lens in enumerate(seqs):
        table[r, :len(lens)] = lens
        table[r, k] = L - int(lens.sum())
    cu = np.concatenate([[0], np.cumsum(table.ravel())])
    segment_of = np.repeat(np.arange(shape.segments, dtype=np.int64), table.ravel())
    token_in_seq = np.arange(R * L, dtype=np.int64) - cu[segment_of]
    used = np.arange(k)[None, :] < np.array([len(x) for x in seqs])[:, None]  # [R, k]
    cls = np.where(used, cu[:-1].reshape(R, k + 1)[:, :k], 0).ravel()
    nsp = np.full(shape.sequence_slots, IGNORE_INDEX, dtype=np.int64)
    nsp[used.ravel()] = np.concatenate(rows.next_sentence_labels)
    positions = np.flatnonzero(batch.masked_lm_labels.numpy().ravel() != IGNORE_INDEX)
    if len(positions) > shape.masked:
        raise DataError(f"a static batch carries {len(positions)} masked-LM labels, more than "
                        f"its {shape.masked} slots: the data set masks more than it records "
                        f"(masked_lm_prob / max_pred in stats.json) - use data.shapes = "
                        f"'dynamic', or rebuild the data set")
    slots = np.zeros(shape.masked, dtype=np.int64)  # unused slots: token 0, a [CLS] (ignored)
    slots[:len(positions)] = positions
    index = torch.arange(R * L, dtype=torch.int64)
    batch.next_sentence_labels = torch.from_numpy(nsp)
    batch.layout = Layout(
        token_index=index, cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        token_in_seq=torch.from_numpy(token_in_seq), seq_of_token=torch.from_numpy(segment_of),
        masked_positions=torch.from_numpy(slots), masked_tokens=torch.from_numpy(slots.copy()),
        lengths=tuple(table.ravel().tolist()), max_len=L, min_len=0,
        cls_tokens=torch.from_numpy(cls.astype(np.int64)))
    return batch
