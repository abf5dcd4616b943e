"""CRC32 arithmetic the readers and writers share: the CRC32 of concatenated pieces from the pieces'
CRC32s (zlib's ``crc32_combine``, which Python's zlib lacks), and S3's text form of a CRC32."""

from __future__ import annotations

import base64
import threading


def _gf2_times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


_ZERO_BYTES_OPS: list[list[int]] = []  # operator k appends 2**k zero bytes to a CRC32
# NOTE: writer threads combine CRCs at once; two threads growing the table together appended the same operator
# twice, and every later CRC of the process was wrong (an upload refused as damaged), so it grows under a lock.
_ZERO_BYTES_LOCK = threading.Lock()


def _zero_bytes_op(k: int) -> list[int]:
    if len(_ZERO_BYTES_OPS) > k:
        return _ZERO_BYTES_OPS[k]
    with _ZERO_BYTES_LOCK:
        if not _ZERO_BYTES_OPS:
            op = [0xEDB88320] + [1 << n for n in range(31)]  # appends one zero bit
            for _ in range(3):
                op = _gf2_square(op)
            _ZERO_BYTES_OPS.append(op)
        while len(_ZERO_BYTES_OPS) <= k:
            _ZERO_BYTES_OPS.append(_gf2_square(_ZERO_BYTES_OPS[-1]))
        return _ZERO_BYTES_OPS[k]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of A+B from crc(A), crc(B) and len(B) (zlib's crc32_combine, which Python lacks)."""
    k = 0
    while len2 > 0:
        if len2 & 1:
            crc1 = _gf2_times(_zero_bytes_op(k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def crc32_b64(crc: int) -> str:
    """A CRC32 as S3 writes it (``x-amz-checksum-crc32``): the 4 big-endian bytes in base64."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


__all__ = ["crc32_b64", "crc32_combine"]
