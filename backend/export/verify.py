"""The one verifier of written outputs: every tensor's byte range is re-read from the output in a
streaming pass (fixed-size blocks, no whole-file maps) and its CRC32 compared with the CRC32 of the
source bytes: the one stored in the checkpoint for records the kernel copied, else the one taken as the
bytes were read. Format writers add a cheap structural check (the header
or archive read back by its ordinary reader, without touching tensor data)."""

from __future__ import annotations

import os
import threading
import zlib
from dataclasses import dataclass

from ..progress import Progress
from .source import run_parallel

BLOCK = 8 << 20
_local = threading.local()

WHAT = ("every tensor's bytes, re-read from the written files, match the CRC32 of the source bytes (stored in "
        "the checkpoint, or taken as they were read)")


@dataclass(frozen=True, slots=True)
class Expectation:
    """A byte range of a written file and the CRC32 it must have."""

    file: str
    offset: int
    length: int
    crc32: int
    name: str  # the tensor's key, for messages


def _buffer() -> memoryview:
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(bytearray(BLOCK))
    return buf


def _crc_of_range(fd: int, offset: int, length: int, progress: Progress | None) -> int | None:
    buf = _buffer()
    crc = 0
    done = 0
    while done < length:
        n = os.preadv(fd, [buf[:min(len(buf), length - done)]], offset + done)
        if n <= 0:
            return None  # the file is shorter than it should be
        crc = zlib.crc32(buf[:n], crc)
        done += n
        if progress:
            progress.advance(n)
    return crc


def check_written(expectations: list[Expectation], progress: Progress | None = None) -> list[str]:
    """Names whose bytes in the output differ from the source (empty: all proven equal)."""
    fds: dict[str, int] = {}
    try:
        for e in expectations:
            if e.file not in fds:
                fds[e.file] = os.open(e.file, os.O_RDONLY)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fds[e.file], 0, 0, os.POSIX_FADV_SEQUENTIAL)

        def one(e: Expectation) -> str | None:
            return None if _crc_of_range(fds[e.file], e.offset, e.length, progress) == e.crc32 else e.name

        bad = run_parallel([(one, (e,)) for e in expectations], progress)
    finally:
        for fd in fds.values():
            os.close(fd)
    return [name for name in bad if name is not None]


__all__ = ["WHAT", "Expectation", "check_written"]
