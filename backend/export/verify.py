"""The one verifier of written outputs: every tensor's byte range is re-read from the output in a
streaming pass (fixed-size blocks, no whole-file maps) and its CRC32 compared with the CRC32 of the
source bytes: the one stored in the checkpoint for records the kernel copied, else the one taken as the
bytes were read. Format writers add a cheap structural check (the header
or archive read back by its ordinary reader, without touching tensor data)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..crc import crc32
from ..progress import Progress
from .source import run_parallel

BLOCK = 8 << 20
SMALL_CHECK = 1 << 20  # ranges of at most this many bytes are checked many at a time (Verifier.check)
SMALL_RUN = 4096
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
        crc = crc32(buf[:n], crc)
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


class Verifier:
    """Re-reads written ranges while the export goes on writing (its own threads): a tensor's range is checked
    as soon as its last byte is written, so the re-read of one tensor overlaps the writing of the next ones
    instead of being a second pass after all of them. Same check as :func:`check_written`: the bytes read back
    from the written file (``pread``, its own read-only descriptor) against the CRC32 of the source bytes.
    ``want`` picks the ranges to check (``--no-verify``: only those the kernel copied)."""

    def __init__(self, progress: Progress | None = None, threads: int = 2,
                 want: Callable[[Expectation], bool] | None = None) -> None:
        self.progress = progress
        self.want = want
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="export-verify")
        self._futures: list[Future] = []
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.submitted: set[tuple[str, int]] = set()  # (file, offset) of every range handed in
        self._small: list[Expectation] = []  # small ranges waiting to be checked together
        self.failed: list[Expectation] = []  # the ranges whose bytes differ (list.append is atomic)

    def submit(self, file: str, offset: int, length: int, crc32: int, name: str, holds: Iterable[int] = ()) -> None:
        """Check that ``length`` bytes of ``file`` at ``offset`` have this CRC32, soon (returns at once); ``holds``
        as :meth:`check` takes it."""
        self.check(Expectation(file, offset, length, crc32, name), holds)

    def check(self, e: Expectation, holds: Iterable[int] = ()) -> None:
        """Check ``e`` soon (returns at once). ``holds``: the offsets of the items ``e``'s range is made of (small
        tensors written and checked as one range), each then counted as submitted. Small ranges are checked
        SMALL_RUN at a time by one job (one job per tensor cost more than its check: 300,000 tensors)."""
        with self._lock:
            self.submitted.add((e.file, e.offset))
            self.submitted.update((e.file, o) for o in holds)
        if self.want is not None and not self.want(e):
            return
        if e.length > SMALL_CHECK:
            self._futures.append(self._pool.submit(self._many, [e]))
            return
        with self._lock:
            self._small.append(e)
            if len(self._small) < SMALL_RUN:
                return
            batch, self._small = self._small, []
        self._futures.append(self._pool.submit(self._many, batch))

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def _many(self, batch: list[Expectation]) -> list[str]:
        """The names of the ranges of ``batch`` whose bytes differ. Ranges of a file lying within BLOCK bytes of
        each other are read with one ``pread`` and checked slice by slice; a large one is streamed."""
        bad: list[str] = []
        batch = sorted(batch, key=lambda e: (e.file, e.offset))
        i = 0
        while i < len(batch):
            if self.progress is not None and self.progress.cancelled:
                return []
            e = batch[i]
            if e.length > SMALL_CHECK:
                if _crc_of_range(self._fd(e.file), e.offset, e.length, self.progress) != e.crc32:
                    bad.append(e.name)
                    self.failed.append(e)
                i += 1
                continue
            j, end = i, e.offset + e.length
            while j + 1 < len(batch) and batch[j + 1].file == e.file and batch[j + 1].length <= SMALL_CHECK and \
                    batch[j + 1].offset >= e.offset and batch[j + 1].offset + batch[j + 1].length - e.offset <= BLOCK:
                j += 1
                end = max(end, batch[j].offset + batch[j].length)
            data = os.pread(self._fd(e.file), end - e.offset, e.offset)
            view = memoryview(data)
            for x in batch[i:j + 1]:
                part = view[x.offset - e.offset:x.offset - e.offset + x.length]
                if len(part) != x.length or crc32(part) != x.crc32:
                    bad.append(x.name)
                    self.failed.append(x)
            if self.progress:
                self.progress.advance(sum(x.length for x in batch[i:j + 1]))
            i = j + 1
        return bad

    def finish(self) -> list[str]:
        """Wait for every check; the names whose bytes differ (empty: all proven equal)."""
        try:
            with self._lock:
                batch, self._small = self._small, []
            if batch:
                self._futures.append(self._pool.submit(self._many, batch))
            return [name for f in self._futures for name in f.result()]
        finally:
            self.close()

    def close(self) -> None:
        """Stop (queued checks are dropped) and close the descriptors."""
        for f in self._futures:
            f.cancel()
        self._pool.shutdown(wait=True)
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


__all__ = ["WHAT", "Expectation", "Verifier", "check_written"]
