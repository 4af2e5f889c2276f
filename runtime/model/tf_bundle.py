"""Reading TensorFlow checkpoints (the "tensor bundle" format, V2) without TensorFlow.

Owns: the format, written from its public definition - ``tensorflow/core/protobuf/
tensor_bundle.proto`` (``BundleHeaderProto``, ``BundleEntryProto``),
``tensorflow/core/util/tensor_bundle/tensor_bundle.h`` (the files and what the index holds),
the LevelDB table format that TensorFlow's ``table::Table`` implements
(``leveldb/doc/table_format.md``: blocks with a 5-byte trailer, restart points, an index block,
the 48-byte footer and its magic number) and CRC-32C as TensorFlow masks it (``crc32c::Mask``).
A small protobuf wire decoder is here too (it needs no package); the CRC-32C itself is
runtime.model.crc32c's. Never: maps variable names to a model (runtime.model.convert), writes
anything, or imports torch.

A bundle with prefix ``P`` is::

    P.index                         a table: "" -> BundleHeaderProto (num_shards, endianness,
                                    version), then tensor name -> BundleEntryProto (dtype,
                                    shape, shard_id, offset, size, crc32c masked), sorted
    P.data-00000-of-0000N ...       the tensors' bytes, little-endian, back to back

Every failure is a ``BundleError`` naming the file (and the variable) and saying what is
wrong: a truncated or foreign .index (footer, magic, block checksums), a missing or short
data shard, a tensor whose bytes fail their CRC-32C, a dtype or layout this reader does not
take (string tensors, partitioned variables, big-endian bundles).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.model.crc32c import crc32c

TABLE_MAGIC = 0xDB4775248B80FB57   # leveldb/TensorFlow table footer, little-endian fixed64
FOOTER_SIZE = 48                   # two BlockHandles padded to 40 bytes + the magic
BLOCK_TRAILER = 5                  # compression type byte + masked crc32c of block + type
BUNDLE_VERSION = 1                 # kTensorBundleVersion: what this reader implements
HEADER_KEY = b""                   # kHeaderEntryKey: the first key of every bundle index

# tensorflow/core/framework/types.proto DataType -> (name, numpy dtype). bfloat16 has no numpy
# type: its bits are read as uint16 and the caller (which has torch) reinterprets them.
DTYPES = {1: ("float32", "<f4"), 2: ("float64", "<f8"), 3: ("int32", "<i4"),
          4: ("uint8", "u1"), 5: ("int16", "<i2"), 6: ("int8", "i1"), 9: ("int64", "<i8"),
          10: ("bool", "?"), 14: ("bfloat16", "<u2"), 17: ("uint16", "<u2"),
          19: ("float16", "<f2"), 22: ("uint32", "<u4"), 23: ("uint64", "<u8")}
DTYPE_NAMES = {7: "string", 8: "complex64", 18: "complex128", 20: "resource", 21: "variant"}


class BundleError(ValueError):
    """A checkpoint that cannot be read; the message names the file and what to do."""


# --------------------------------------------------------------------------------- CRC-32C

_MASK_DELTA = 0xA282EAD8


def unmask_crc(masked: int) -> int:
    """TensorFlow/leveldb store ``((crc >> 15) | (crc << 17)) + 0xa282ead8``; undo it."""
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def mask_crc(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


# ------------------------------------------------------------------------- protobuf wire

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("varint runs past the end")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _fields(buf: bytes):
    """(field number, wire type, value) of each field of a serialized message; value is an
    int (varint, fixed32, fixed64) or bytes (length-delimited)."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = int.from_bytes(buf[pos:pos + 8], "little"), pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 5:
            value, pos = int.from_bytes(buf[pos:pos + 4], "little"), pos + 4
        else:
            raise ValueError(f"wire type {wire} (groups) is not used by these messages")
        if pos > len(buf):
            raise ValueError("field runs past the end")
        yield number, wire, value


def _int64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


@dataclass(frozen=True)
class Entry:
    """One BundleEntryProto: where a tensor's bytes are and what they are."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    shard_id: int
    offset: int
    size: int
    crc32c: int          # masked, as stored
    sliced: bool = False

    @property
    def dtype_name(self) -> str:
        return DTYPES.get(self.dtype, (DTYPE_NAMES.get(self.dtype, f"DataType {self.dtype}"),))[0]


def parse_entry(name: str, buf: bytes) -> Entry:
    dtype = shard_id = offset = size = crc = 0
    shape: list[int] = []
    sliced = False
    for number, _, value in _fields(buf):
        if number == 1:
            dtype = value
        elif number == 2:                                   # TensorShapeProto
            for n2, _, v2 in _fields(value):
                if n2 == 2:                                 # Dim {int64 size = 1; name = 2}
                    dim = next((v3 for n3, _, v3 in _fields(v2) if n3 == 1), 0)
                    shape.append(_int64(dim))
                elif n2 == 3 and v2:
                    raise ValueError("unknown rank")
        elif number == 3:
            shard_id = value
        elif number == 4:
            offset = _int64(value)
        elif number == 5:
            size = _int64(value)
        elif number == 6:
            crc = value
        elif number == 7:
            sliced = True
    return Entry(name, dtype, tuple(shape), shard_id, offset, size, crc, sliced)


# ------------------------------------------------------------------------------ the table

def _read_block(raw: bytes, offset: int, size: int, path: Path, what: str) -> bytes:
    end = offset + size + BLOCK_TRAILER
    if offset < 0 or size < 0 or end > len(raw):
        raise BundleError(f"{path}: the {what} block ({offset}+{size} bytes) lies beyond the "
                          f"end of the file ({len(raw)} bytes): the index is truncated - copy "
                          "it again from the source")
    block, kind = raw[offset:offset + size], raw[offset + size]
    stored = int.from_bytes(raw[offset + size + 1:end], "little")
    if crc32c(raw[offset:offset + size + 1]) != unmask_crc(stored):
        raise BundleError(f"{path}: the {what} block at byte {offset} fails its CRC-32C: the "
                          "index is corrupt - copy it again from the source")
    if kind != 0:
        raise BundleError(f"{path}: the {what} block is compressed (type {kind}); TensorFlow "
                          "writes bundle indexes uncompressed, so this is not a checkpoint index")
    return block


def _block_entries(block: bytes, path: Path, what: str):
    """(key, value) of every entry of a table block, in order (prefix-compressed keys)."""
    if len(block) < 4:
        raise BundleError(f"{path}: the {what} block is shorter than its restart count")
    restarts = int.from_bytes(block[-4:], "little")
    limit = len(block) - 4 - 4 * restarts
    if limit < 0:
        raise BundleError(f"{path}: the {what} block's restart array does not fit in it")
    pos, key = 0, b""
    while pos < limit:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        vlen, pos = _varint(block, pos)
        if shared > len(key) or pos + unshared + vlen > limit:
            raise BundleError(f"{path}: a malformed entry in the {what} block at byte {pos}")
        key = key[:shared] + block[pos:pos + unshared]
        pos += unshared
        yield key, block[pos:pos + vlen]
        pos += vlen


def read_table(path: Path) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of a TensorFlow/leveldb table file, in key order."""
    raw = Path(path).read_bytes()
    if len(raw) < FOOTER_SIZE:
        raise BundleError(f"{path}: {len(raw)} bytes, shorter than a table footer "
                          f"({FOOTER_SIZE}): truncated - copy it again from the source")
    footer = raw[-FOOTER_SIZE:]
    if int.from_bytes(footer[-8:], "little") != TABLE_MAGIC:
        raise BundleError(f"{path}: no table magic number at its end: not a TensorFlow "
                          "checkpoint index, or truncated - copy it again from the source")
    try:
        _, pos = _varint(footer, 0)                      # metaindex handle (unused)
        _, pos = _varint(footer, pos)
        index_offset, pos = _varint(footer, pos)
        index_size, pos = _varint(footer, pos)
    except ValueError as e:
        raise BundleError(f"{path}: unreadable table footer ({e})") from None
    out = []
    try:
        index = _read_block(raw, index_offset, index_size, path, "index")
        for _, handle in _block_entries(index, path, "index"):
            offset, p = _varint(handle, 0)
            size, _ = _varint(handle, p)
            out.extend(_block_entries(_read_block(raw, offset, size, path, "data"), path, "data"))
    except ValueError as e:
        if isinstance(e, BundleError):
            raise
        raise BundleError(f"{path}: malformed table ({e}): the index is corrupt") from None
    return out


# ------------------------------------------------------------------------------ the bundle

def data_path(prefix: Path, shard: int, num_shards: int) -> Path:
    return Path(f"{prefix}.data-{shard:05d}-of-{num_shards:05d}")


class Bundle:
    """The index of a checkpoint ``prefix`` (parsed on construction) and its tensors."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = Path(prefix)
        self.index_path = Path(f"{self.prefix}.index")
        if not self.index_path.is_file():
            hint = ""
            if self.prefix.is_file() or self.prefix.suffix in (".index", ".meta") or \
                    ".data-" in self.prefix.name:
                hint = (" - name the checkpoint by its prefix (e.g. model.ckpt-28252, without "
                        ".index/.data-*/.meta)")
            raise BundleError(f"{self.index_path}: no such file; {self.prefix} is not the prefix "
                              f"of a TensorFlow checkpoint{hint}")
        items = read_table(self.index_path)
        if not items or items[0][0] != HEADER_KEY:
            raise BundleError(f"{self.index_path}: no bundle header (the empty key): a table, "
                              "but not a TensorFlow tensor bundle index")
        self.num_shards, endianness, version = 1, 0, {}
        try:
            for number, _, value in _fields(items[0][1]):
                if number == 1:
                    self.num_shards = value
                elif number == 2:
                    endianness = value
                elif number == 3:
                    version = {n: v for n, _, v in _fields(value)}
            self.entries = {k.decode("utf-8"): parse_entry(k.decode("utf-8"), v)
                            for k, v in items[1:]}
        except (ValueError, UnicodeDecodeError) as e:
            raise BundleError(f"{self.index_path}: malformed entry ({e}): the index is "
                              "corrupt - copy it again from the source") from None
        if endianness != 0:
            raise BundleError(f"{self.index_path}: a big-endian bundle; only little-endian "
                              "checkpoints (every x86/ARM TensorFlow) are read here")
        if version.get(2, 0) > BUNDLE_VERSION:   # VersionDef.min_consumer
            raise BundleError(f"{self.index_path}: needs a bundle reader of version "
                              f"{version[2]}; this one implements version {BUNDLE_VERSION}")
        if self.num_shards < 1:
            raise BundleError(f"{self.index_path}: header says {self.num_shards} data shards")

    def shard_paths(self) -> list[Path]:
        return [data_path(self.prefix, i, self.num_shards) for i in range(self.num_shards)]

    def check_layout(self, names) -> None:
        """Before any data is read: every shard file the ``names`` need exists and is long
        enough, each entry's size agrees with its dtype and shape."""
        sizes: dict[int, int] = {}
        for name in names:
            e = self.entries[name]
            if e.sliced:
                raise BundleError(f"{self.index_path}: {name} is a partitioned variable (saved "
                                  "as slices); this reader takes whole tensors only")
            if e.dtype not in DTYPES:
                raise BundleError(f"{self.index_path}: {name} has dtype {e.dtype_name}, which "
                                  "is not a numeric tensor")
            if not 0 <= e.shard_id < self.num_shards:
                raise BundleError(f"{self.index_path}: {name} names data shard {e.shard_id} of "
                                  f"{self.num_shards}: the index is corrupt")
            # Python ints: numpy's int64 product wraps ([2**32, 2**32] is 0 elements), and a
            # wrapped count let a corrupt entry pass here and fail in reshape as a traceback.
            want = math.prod(e.shape) * np.dtype(DTYPES[e.dtype][1]).itemsize
            if any(d < 0 for d in e.shape) or e.size != want:
                raise BundleError(f"{self.index_path}: {name} holds {e.size} bytes for a "
                                  f"{e.dtype_name} tensor of shape {list(e.shape)} ({want} "
                                  "bytes): the index is corrupt")
            path = data_path(self.prefix, e.shard_id, self.num_shards)
            if e.shard_id not in sizes:
                if not path.is_file():
                    raise BundleError(f"{path}: missing - data shard {e.shard_id + 1} of "
                                      f"{self.num_shards} of {self.prefix} (it holds {name}); "
                                      "copy every .data-* file of the checkpoint")
                sizes[e.shard_id] = path.stat().st_size
            if e.offset < 0 or e.offset + e.size > sizes[e.shard_id]:
                raise BundleError(f"{path}: {sizes[e.shard_id]} bytes, but {name} lies at bytes "
                                  f"{e.offset}..{e.offset + e.size}: the data file is truncated "
                                  "- copy it again from the source")

    def read(self, name: str) -> np.ndarray:
        """The tensor ``name`` (its CRC-32C checked), as a numpy array in the stored dtype
        (bfloat16 as its uint16 bits)."""
        e = self.entries[name]
        self.check_layout([name])
        path = data_path(self.prefix, e.shard_id, self.num_shards)
        with open(path, "rb") as f:
            f.seek(e.offset)
            raw = f.read(e.size)
        if len(raw) != e.size:
            raise BundleError(f"{path}: short read of {name}: the data file is truncated")
        if crc32c(raw) != unmask_crc(e.crc32c):
            raise BundleError(f"{path}: the bytes of {name} (offset {e.offset}, {e.size} "
                              "bytes) fail their CRC-32C: the data file is corrupt - copy it "
                              "again from the source")
        return np.frombuffer(raw, dtype=DTYPES[e.dtype][1]).reshape(e.shape)


__all__ = ["Bundle", "BundleError", "Entry", "crc32c", "mask_crc", "unmask_crc", "read_table",
           "data_path", "DTYPES"]
