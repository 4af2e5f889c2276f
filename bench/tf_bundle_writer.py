"""Writing TensorFlow checkpoints (tensor bundles, V2) without TensorFlow: the inverse of
runtime.model.tf_bundle, from the same public definitions (``tensor_bundle.proto``,
``leveldb/doc/table_format.md``).

Owns: ``write_bundle`` (tensors -> ``P.index`` + ``P.data-NNNNN-of-NNNNN``, streamed: one
tensor in memory at a time, so a multi-GB checkpoint costs its largest tensor) and
``write_index`` (an index from ``Entry`` values as they are - the tests craft corrupt ones
with it). What it writes equals what TensorFlow writes entry for entry (header and
BundleEntryProto bytes: tests/unit/test_tf_checkpoint.py holds it to the fixture TensorFlow
wrote); the table's blocking (4 KiB blocks, a restart every 16 keys: LevelDB's defaults) may
differ, which no reader depends on. Never: used by the converter (which only reads), or
writes what the reader does not take (strings, slices, big-endian).

For ``bench.convert_crc`` (a BERT-large-sized checkpoint) and the tests.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import numpy as np

from runtime.model.crc32c import crc32c
from runtime.model.tf_bundle import (DTYPES, TABLE_MAGIC, Entry, data_path, mask_crc)

_DTYPE_OF = {np.dtype(v[1]).str: k for k, v in DTYPES.items() if k != 14}
"""numpy dtype -> TF DataType (uint16 for "<u2": bfloat16 bits need ``dtype=14`` given)."""
BLOCK_SIZE = 4096
RESTART_INTERVAL = 16


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1                                 # int64 fields: two's complement
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, wire: int, value) -> bytes:
    key = _varint(number << 3 | wire)
    if wire == 0:
        return key + _varint(value)
    if wire == 5:
        return key + int(value).to_bytes(4, "little")
    return key + _varint(len(value)) + value            # wire 2: bytes


def header_proto(num_shards: int) -> bytes:
    """BundleHeaderProto as TensorFlow writes it: num_shards, (LITTLE endianness is the
    default 0, omitted), version {producer: 1}."""
    return _field(1, 0, num_shards) + _field(3, 2, _field(1, 0, 1))


def entry_proto(e: Entry) -> bytes:
    """BundleEntryProto, proto3: zero fields omitted, the shape always present."""
    shape = b"".join(_field(2, 2, _field(1, 0, d) if d else b"") for d in e.shape)
    out = _field(1, 0, e.dtype) if e.dtype else b""
    out += _field(2, 2, shape)
    for number, value in ((3, e.shard_id), (4, e.offset), (5, e.size)):
        if value:
            out += _field(number, 0, value)
    return out + _field(6, 5, e.crc32c)


def _block(items: list[tuple[bytes, bytes]]) -> bytes:
    """A table block: prefix-compressed entries, a restart point every RESTART_INTERVAL."""
    out, restarts, last = bytearray(), [], b""
    for i, (key, value) in enumerate(items):
        if i % RESTART_INTERVAL == 0:
            restarts.append(len(out))
            shared = 0
        else:
            shared = next((j for j, (a, b) in enumerate(zip(last, key)) if a != b),
                          min(len(last), len(key)))
        out += _varint(shared) + _varint(len(key) - shared) + _varint(len(value))
        out += key[shared:] + value
        last = key
    restarts = restarts or [0]
    out += b"".join(r.to_bytes(4, "little") for r in restarts) + len(restarts).to_bytes(4, "little")
    return bytes(out)


def write_table(path: Path, items: list[tuple[bytes, bytes]]) -> None:
    """A LevelDB table of ``items`` (sorted by key): data blocks, an empty metaindex block,
    the index block (each data block's last key -> its handle), the 48-byte footer."""
    raw = bytearray()

    def put(block: bytes) -> bytes:                    # -> its BlockHandle
        handle = _varint(len(raw)) + _varint(len(block))
        trailer = b"\0"                                 # uncompressed
        raw.extend(block + trailer + mask_crc(crc32c(block + trailer)).to_bytes(4, "little"))
        return handle

    index, pending, size = [], [], 0
    for key, value in items:
        pending.append((key, value))
        size += len(key) + len(value) + 8
        if size >= BLOCK_SIZE:
            index.append((key, put(_block(pending))))
            pending, size = [], 0
    if pending:
        index.append((pending[-1][0], put(_block(pending))))
    meta = put(_block([]))
    footer = meta + put(_block(index))
    raw.extend(footer.ljust(40, b"\0") + TABLE_MAGIC.to_bytes(8, "little"))
    Path(path).write_bytes(bytes(raw))


def write_index(path: Path, num_shards: int, entries: dict[str, Entry]) -> None:
    """``path``: the index of a bundle of ``num_shards`` data shards holding ``entries`` (their
    fields written as they are, however wrong)."""
    items = [(b"", header_proto(num_shards))]
    items += [(name.encode(), entry_proto(e)) for name, e in sorted(entries.items())]
    write_table(path, items)


def write_bundle(prefix: str | os.PathLike, tensors: Iterable[tuple[str, np.ndarray]],
                 num_shards: int = 1, shard_of=None) -> dict[str, Entry]:
    """Write ``tensors`` (name, array; consumed one at a time) as the checkpoint ``prefix``:
    each into shard ``shard_of(name)`` (default 0), densely, then the index. Returns the
    entries."""
    prefix = Path(prefix)
    files = [open(data_path(prefix, i, num_shards), "wb") for i in range(num_shards)]
    entries = {}
    try:
        for name, array in tensors:
            array = np.asarray(array)           # (ascontiguousarray makes a scalar 1-d)
            dtype = _DTYPE_OF[array.dtype.newbyteorder("<").str]
            shard = shard_of(name) if shard_of else 0
            f = files[shard]
            raw = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
            entries[name] = Entry(name, dtype, tuple(array.shape), shard, f.tell(), len(raw),
                                  mask_crc(crc32c(raw)))
            f.write(raw)
    finally:
        for f in files:
            f.close()
    write_index(Path(f"{prefix}.index"), num_shards, entries)
    return entries
