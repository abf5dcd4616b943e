"""CRC32 arithmetic the readers and writers share: the CRC32 of bytes (:func:`crc32`), of concatenated pieces
from the pieces' CRC32s (zlib's ``crc32_combine``, which Python's zlib lacks), and S3's text form of a CRC32."""

from __future__ import annotations

import base64
import zlib
from collections.abc import Callable, Sequence
from typing import Any

_fast_crc32: Callable[[Any, int], int] | None
try:  # ISA-L's CRC32 (carry-less multiply folding): the same CRC-32 as zlib's, 3-4x as fast on large buffers
    from isal.isal_zlib import crc32 as _fast_crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values, slower
    _fast_crc32 = None

FAST_BELOW = 1 << 16  # smaller buffers: zlib's (the call costs more than the bytes)


def _crc32(data: Any, value: int = 0) -> int:
    """CRC-32 (the zip and gzip one) of ``data`` continuing from ``value``, as ``zlib.crc32``; ISA-L's for large
    buffers. NOTE: ISA-L holds the GIL while it runs (zlib's lets go above 5 KiB), at about 7 GB/s: 0.15 s per
    GiB, against zlib's 0.4-0.5 s per GiB of one core."""
    if len(data) < FAST_BELOW or _fast_crc32 is None:
        return zlib.crc32(data, value)
    return _fast_crc32(data, value)


crc32: Callable[..., int] = _crc32 if _fast_crc32 is not None else zlib.crc32


def _gf2_times(mat: Sequence[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: Sequence[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def _zero_bytes_ops() -> tuple[tuple[int, ...], ...]:
    """Operator k appends 2**k zero bytes to a CRC32, for k < 64 (any length a file can have)."""
    op = [0xEDB88320] + [1 << n for n in range(31)]  # appends one zero bit
    for _ in range(3):
        op = _gf2_square(op)
    ops = [op]
    while len(ops) < 64:
        ops.append(_gf2_square(ops[-1]))
    return tuple(tuple(o) for o in ops)


# NOTE: built whole at import (3 ms), never grown: a table grown lazily by writer threads at once once held an
# operator twice, and every later CRC of the process was wrong (an upload refused as damaged).
_ZERO_BYTES_OPS = _zero_bytes_ops()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of A+B from crc(A), crc(B) and len(B) (zlib's crc32_combine, which Python lacks)."""
    k = 0
    while len2 > 0:
        if len2 & 1:
            crc1 = _gf2_times(_ZERO_BYTES_OPS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def crc32_b64(crc: int) -> str:
    """A CRC32 as S3 writes it (``x-amz-checksum-crc32``): the 4 big-endian bytes in base64."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


__all__ = ["crc32", "crc32_b64", "crc32_combine"]
