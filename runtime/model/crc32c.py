"""CRC-32C (Castagnoli), the checksum of TensorFlow checkpoints and of the LevelDB tables their
indexes are.

Owns: ``crc32c`` - Google's CRC32C library through the ``google-crc32c`` package (its C
extension uses the CPU's CRC32 instructions, SSE4.2 on x86 and the CRC extension on ARM:
gigabytes per second) when it is installed with that extension, else ``crc32c_numpy``, a
numpy implementation (~150 MB/s on a 2-core machine) kept as the fallback and as the tests'
reference; ``IMPLEMENTATION`` says which one runs (the converter reports it once, in its last
line and its manifest). Never: knows the checkpoint format (runtime.model.tf_bundle masks
and compares), reads files, or imports torch.

The package's own fallback is pure Python (~1 MB/s, hours for a 4 GB checkpoint): when only
that is there, the numpy implementation runs instead.
"""
from __future__ import annotations

import warnings

import numpy as np

try:
    with warnings.catch_warnings():      # its pure-Python fallback warns on import; we say it
        warnings.simplefilter("ignore", RuntimeWarning)
        import google_crc32c as _lib
    if _lib.implementation != "c":
        raise ImportError("only its pure-Python build")
    from importlib.metadata import version as _version
    IMPLEMENTATION = f"google-crc32c {_version('google-crc32c')}"
except ImportError as _e:
    _lib = None
    IMPLEMENTATION = ("numpy (google-crc32c has " + str(_e) + ")" if "pure-Python" in str(_e)
                      else "numpy (google-crc32c is not installed)")
"""Which implementation ``crc32c`` is: "google-crc32c X.Y.Z" or "numpy (why)"."""


def crc32c(data, crc: int = 0) -> int:
    """CRC-32C of ``data`` (bytes-like), continuing from ``crc`` (a previous result)."""
    if _lib is None:
        return crc32c_numpy(data, crc)
    if not isinstance(data, bytes):      # the extension takes read-only buffers only
        data = bytes(data)
    return _lib.extend(crc, data)


# ------------------------------------------------------------------- the numpy implementation

_POLY = 0x82F63B78   # Castagnoli, reflected


def _table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(_POLY), t >> 1).astype(np.uint32)
    return t


_T = _table()
_T_LIST = _T.tolist()
_MAX_LANES = 1 << 18          # a large buffer is hashed in up to this many independent lanes
_BYTEWISE_BELOW = 1 << 14     # smaller buffers: the plain byte loop is as fast


def _bytewise(crc: int, data) -> int:
    t = _T_LIST
    for b in data:
        crc = t[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc


class _Linear:
    """A GF(2)-linear map of the 32-bit CRC register, as 4 byte tables (apply: 4 gathers)."""

    def __init__(self, tables: np.ndarray):
        self.t = tables                                   # (4, 256) uint32

    @classmethod
    def zero_bytes(cls, n: int) -> "_Linear":
        """The register after ``n`` zero bytes (without pre/post conditioning)."""
        basis = np.array([[v << (8 * k) for v in range(256)] for k in range(4)], np.uint32)
        step = cls(_apply_zero_byte_table(basis))         # one zero byte
        out = None
        while n:                                          # square and multiply
            if n & 1:
                out = step if out is None else out.then(step)
            n >>= 1
            if n:
                step = step.then(step)
        return out if out is not None else cls(basis)

    def __call__(self, reg: np.ndarray) -> np.ndarray:
        t = self.t
        return (t[0][reg & 0xFF] ^ t[1][(reg >> 8) & 0xFF] ^ t[2][(reg >> 16) & 0xFF]
                ^ t[3][reg >> 24])

    def then(self, other: "_Linear") -> "_Linear":
        """``other`` applied after ``self``."""
        return _Linear(other(self.t.reshape(-1)).reshape(4, 256))


def _apply_zero_byte_table(reg: np.ndarray) -> np.ndarray:
    return (_T[reg & 0xFF] ^ (reg >> 8)).astype(np.uint32)


_SHIFTS: dict[int, _Linear] = {}


def _shift(n: int) -> _Linear:
    if n not in _SHIFTS:
        _SHIFTS[n] = _Linear.zero_bytes(n)
    return _SHIFTS[n]


def crc32c_numpy(data, crc: int = 0) -> int:
    """CRC-32C of ``data`` (bytes-like), continuing from ``crc``, without the package.

    Large buffers run as up to ``_MAX_LANES`` independent lanes updated together by numpy,
    then folded pairwise with the linear map "shift by k zero bytes" (the register of A||B is
    the register of A shifted by len(B), xor the register of B from zero): ~150 MB/s on a
    2-core machine where a byte loop in Python does ~10 MB/s."""
    buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    reg = crc ^ 0xFFFFFFFF
    if len(buf) < _BYTEWISE_BELOW:
        return _bytewise(reg, buf.tobytes()) ^ 0xFFFFFFFF
    lanes = min(_MAX_LANES, 1 << ((len(buf) // 256).bit_length() - 1))   # lanes of >= 256 B
    lane = len(buf) // lanes
    body = buf[:lane * lanes].reshape(lanes, lane).T.copy()     # row t: byte t of each lane
    regs = np.zeros(lanes, np.uint32)
    for row in body:
        regs = _T[(regs ^ row) & 0xFF] ^ (regs >> 8)
    width = lane
    while len(regs) > 1:                                       # fold neighbours pairwise
        regs = _shift(width)(regs[0::2]) ^ regs[1::2]
        width *= 2
    reg = int(_shift(width)(np.array([reg], np.uint32))[0]) ^ int(regs[0])
    return _bytewise(reg, buf[lane * lanes:].tobytes()) ^ 0xFFFFFFFF


__all__ = ["IMPLEMENTATION", "crc32c", "crc32c_numpy"]
