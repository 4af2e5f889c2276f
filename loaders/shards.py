"""The on-disk data set: MLPerf BERT HDF5 schema (variable-length variant) and checksums.

Owns: the schema, writing and reading one shard, checking a shard's values against what the
model can take (``check_samples``: token ids, segment ids, masked positions, lengths), the
data-set layout on disk, and the checksum file. Never: tokenisation, example creation, batching (see prepare.py, dataset.py).

Layout of a prepared data set directory::

    <out>/train/part_00000_of_00008.hdf5 ...   sharded training samples
    <out>/eval/eval.hdf5                       fixed eval set (uniform stride, held-out docs)
    <out>/vocab.txt                            the WordPiece vocabulary the ids refer to
    <out>/stats.json                           counts, histogram, parameters used
    <out>/checksums.sha256                     `sha256sum -c` compatible, covers all of the above

Every sample stores only its real tokens: ``input_ids`` starts with [CLS] and its length is
the sequence length; the loader pads per batch and rebuilds the MLM labels from
``masked_lm_positions``/``masked_lm_ids`` (0 = no label, as in the MLPerf shards).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

VLEN_INT16 = ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids")
SCALAR_INT8 = ("next_sentence_labels",)
NARROW_READ = {"segment_ids": np.int8}
"""Also read (and widened to int16): NVIDIA's MLPerf shards store segment ids as vlen int8
(``convert_fixed2variable.py``, ``pick_eval_samples_varlength.py`` in
``NVIDIA/benchmarks/bert/implementations/pytorch/input_preprocessing``)."""
KEYS = VLEN_INT16 + SCALAR_INT8
CHECKSUM_FILE = "checksums.sha256"
TRAIN_DIR = "train"
EVAL_FILE = "eval/eval.hdf5"


class DataError(RuntimeError):
    """A data-set problem the user must fix; the message names the file and the remedy."""


@dataclass
class Samples:
    """Columns of a shard in memory: lists of int16 arrays and one int8 array."""

    input_ids: list
    segment_ids: list
    masked_lm_positions: list
    masked_lm_ids: list
    next_sentence_labels: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)

    def lengths(self) -> np.ndarray:
        return np.fromiter((len(x) for x in self.input_ids), dtype=np.int64, count=len(self))


def shard_name(index: int, count: int) -> str:
    return f"part_{index:05d}_of_{count:05d}.hdf5"


def write_shard(path: str | os.PathLike, samples: Samples) -> None:
    """Write one shard in the MLPerf vlen schema. Writes ``path`` directly (callers write
    into a temporary directory and rename the whole set at the end)."""
    vlen16 = h5py.vlen_dtype(np.dtype("int16"))
    with h5py.File(path, "w", track_order=True) as f:
        for key in VLEN_INT16:
            col = getattr(samples, key)
            ds = f.create_dataset(key, (len(col),), dtype=vlen16)
            # One write call for the whole column: ~50x faster than a write per row, and
            # the file bytes are identical. (Assigning an object array through ds[...]
            # would make numpy stack equal-length rows into 2-D, hence the low-level call.)
            column = np.empty(len(col), dtype=vlen16)
            for i, arr in enumerate(col):
                column[i] = np.asarray(arr, dtype=np.int16)
            if len(col):
                ds.id.write(h5py.h5s.ALL, h5py.h5s.ALL, column)
        f.create_dataset("next_sentence_labels",
                         data=np.asarray(samples.next_sentence_labels, dtype=np.int8))


def read_shard(path: str | os.PathLike) -> Samples:
    """Read a whole shard; a missing key, wrong dtype or ragged column is a DataError."""
    path = Path(path)
    try:
        f = h5py.File(path, "r")
    except OSError as e:  # truncated or not HDF5 at all
        raise DataError(f"{path}: cannot open as HDF5 ({e}); the shard is corrupt or "
                        "truncated - rebuild the data set with `python -m loaders.prepare`") from e
    with f:
        missing = [k for k in KEYS if k not in f]
        if missing:
            raise DataError(f"{path}: missing dataset(s) {missing}; expected the MLPerf BERT "
                            f"vlen schema {list(KEYS)}")
        n = len(f["next_sentence_labels"])
        cols = {}
        for key in VLEN_INT16:
            ds = f[key]
            base = h5py.check_vlen_dtype(ds.dtype)
            if base is None and ds.ndim == 2 and "input_mask" in f:
                raise DataError(f"{path}: the fixed-length (padded) MLPerf layout; this loader "
                                "reads the variable-length one - use the *_varlength shards "
                                "(NVIDIA's convert_fixed2variable.py output) or "
                                "`python -m loaders.prepare`")
            if base is None or base not in (np.int16, NARROW_READ.get(key, np.int16)):
                raise DataError(f"{path}: dataset '{key}' has dtype {ds.dtype}, expected vlen int16")
            if len(ds) != n:
                raise DataError(f"{path}: dataset '{key}' has {len(ds)} rows, "
                                f"next_sentence_labels has {n}")
            rows = list(ds[()])
            cols[key] = rows if base == np.int16 else [r.astype(np.int16) for r in rows]
        nsp = f["next_sentence_labels"]
        if nsp.dtype != np.int8:
            raise DataError(f"{path}: next_sentence_labels has dtype {nsp.dtype}, expected int8")
        cols["next_sentence_labels"] = nsp[()]
    return Samples(**cols)


@dataclass(frozen=True)
class Limits:
    """What a model can take from a shard: token ids in [0, vocab_size), segment ids in
    [0, type_vocab_size), 1 to max_seq_length tokens per sample. None: that bound is not
    checked (a checksum-only reader)."""

    vocab_size: int | None = None
    max_seq_length: int | None = None
    type_vocab_size: int = 2


_REBUILD = ("the file was written this way (a checksum cannot tell): rebuild the data set "
            "with `python -m loaders.prepare` (with the vocabulary and --seq-len/--max-pred "
            "the model uses), or point data.data_dir at the right one")


def check_samples(path: str | os.PathLike, s: Samples, limits: Limits | None = None) -> None:
    """Every value the model will index with is in range: a DataError naming the file, the
    row, the column and the value otherwise - before a bad id reaches an embedding, where it
    is a bare ``IndexError: index out of range in self`` naming nothing. Vectorised over the
    whole shard (a few milliseconds for 6,500 samples)."""
    limits = limits or Limits()
    n = len(s)
    if n == 0:
        return
    lengths = s.lengths()

    def fail(column: str, flat_index: int, row_ends: np.ndarray, value, rule: str, count: int):
        row = int(np.searchsorted(row_ends, flat_index, side="right"))
        raise DataError(f"{path}: row {row}: {column} holds {value} ({rule}); {count} value(s) "
                        f"of this shard are out of range - {_REBUILD}")

    def per_row(column: str) -> tuple[np.ndarray, np.ndarray]:
        col = getattr(s, column)
        sizes = np.fromiter((len(x) for x in col), dtype=np.int64, count=n)
        flat = np.concatenate(col).astype(np.int64) if sizes.sum() else np.zeros(0, np.int64)
        return flat, sizes

    ids, _ = per_row("input_ids")
    ends = np.cumsum(lengths)
    short = np.flatnonzero(lengths < 1)
    if short.size:
        raise DataError(f"{path}: row {int(short[0])}: input_ids is empty ({short.size} empty "
                        f"row(s)) - {_REBUILD}")
    if limits.max_seq_length is not None:
        long = np.flatnonzero(lengths > limits.max_seq_length)
        if long.size:
            raise DataError(f"{path}: row {int(long[0])}: {int(lengths[long[0]])} tokens, more "
                            f"than data.max_seq_length = {limits.max_seq_length} "
                            f"({long.size} such row(s)) - {_REBUILD}")
    top = limits.vocab_size
    rule = f"token ids must be in [0, {top}): model.vocab_size" if top else "token ids are >= 0"
    bad = np.flatnonzero((ids < 0) | (ids >= top)) if top else np.flatnonzero(ids < 0)
    if bad.size:
        fail("input_ids", int(bad[0]), ends, int(ids[bad[0]]), rule, int(bad.size))
    seg, seg_sizes = per_row("segment_ids")
    if not np.array_equal(seg_sizes, lengths):
        row = int(np.flatnonzero(seg_sizes != lengths)[0])
        raise DataError(f"{path}: row {row}: {int(seg_sizes[row])} segment_ids for "
                        f"{int(lengths[row])} input_ids - {_REBUILD}")
    bad = np.flatnonzero((seg < 0) | (seg >= limits.type_vocab_size))
    if bad.size:
        fail("segment_ids", int(bad[0]), ends, int(seg[bad[0]]),
             f"segment ids must be in [0, {limits.type_vocab_size})", int(bad.size))
    pos, pos_sizes = per_row("masked_lm_positions")
    lab, lab_sizes = per_row("masked_lm_ids")
    if not np.array_equal(pos_sizes, lab_sizes):
        row = int(np.flatnonzero(pos_sizes != lab_sizes)[0])
        raise DataError(f"{path}: row {row}: {int(pos_sizes[row])} masked_lm_positions but "
                        f"{int(lab_sizes[row])} masked_lm_ids - {_REBUILD}")
    pos_ends = np.cumsum(pos_sizes)
    row_len = np.repeat(lengths, pos_sizes)  # each position's sequence length
    bad = np.flatnonzero((pos < 0) | (pos >= row_len))
    if bad.size:
        i = int(bad[0])
        fail("masked_lm_positions", i, pos_ends, int(pos[i]),
             f"positions must be inside the sequence, [0, {int(row_len[i])})", int(bad.size))
    bad = np.flatnonzero((lab < 0) | (lab >= top)) if top else np.flatnonzero(lab < 0)
    if bad.size:
        fail("masked_lm_ids", int(bad[0]), pos_ends, int(lab[bad[0]]), rule, int(bad.size))
    nsp = np.asarray(s.next_sentence_labels)
    bad = np.flatnonzero((nsp != 0) & (nsp != 1))
    if bad.size:
        raise DataError(f"{path}: row {int(bad[0])}: next_sentence_labels holds "
                        f"{int(nsp[bad[0]])} (must be 0 or 1; {bad.size} such row(s)) - {_REBUILD}")


PUBLISHED_EVAL_MD5 = "611d8bae26646145e1c33338a27ba124"
"""``input_ids_md5`` of the official 10,000-sample eval set, as NVIDIA publishes it for their
``part_eval_10k.hdf5`` (``input_preprocessing/eval_varlength.chk``, training_results_v2.0)."""


def input_ids_md5(input_ids) -> str:
    """NVIDIA's content hash of a shard (``input_preprocessing/hdf5_md5.py``): the md5 of the
    list of each row's md5 of ``str(row.tolist())`` - it names the token ids and their order,
    whatever the file's bytes."""
    rows = [hashlib.md5(str(np.asarray(r).tolist()).encode("utf-8")).hexdigest()
            for r in input_ids]
    return hashlib.md5(str(rows).encode("utf-8")).hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_checksums(root: str | os.PathLike, relpaths: list[str]) -> None:
    """Write ``checksums.sha256`` (``sha256sum -c`` format) for ``relpaths`` under ``root``."""
    root = Path(root)
    lines = [f"{sha256_file(root / rel)}  {rel}\n" for rel in sorted(relpaths)]
    (root / CHECKSUM_FILE).write_text("".join(lines))


def read_checksums(root: str | os.PathLike) -> dict[str, str]:
    root = Path(root)
    path = root / CHECKSUM_FILE
    if not path.is_file():
        raise DataError(f"{path}: no checksum file; {root} is not a complete prepared data set "
                        f"- run `python -m loaders.prepare --out {root}`")
    table = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        digest, sep, rel = line.partition("  ")
        if not sep or len(digest) != 64:
            raise DataError(f"{path}:{n}: malformed line {line!r}")
        table[rel] = digest
    return table


def verify_checksums(root: str | os.PathLike, relpaths: list[str] | None = None) -> None:
    """Check files against ``checksums.sha256``; raise DataError naming the first bad file.

    ``relpaths`` limits the check (a rank verifies the shards it will read); default all."""
    root = Path(root)
    table = read_checksums(root)
    for rel in (sorted(table) if relpaths is None else relpaths):
        path = root / rel
        if rel not in table:
            raise DataError(f"{path}: not listed in {root / CHECKSUM_FILE}; the data set was "
                            "modified after preparation - rebuild it")
        if not path.is_file():
            raise DataError(f"{path}: listed in {CHECKSUM_FILE} but missing - rebuild the data set")
        if sha256_file(path) != table[rel]:
            raise DataError(f"{path}: checksum mismatch (corrupt or truncated shard) - rebuild "
                            f"the data set with `python -m loaders.prepare --out {root}`")
