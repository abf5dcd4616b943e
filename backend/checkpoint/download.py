"""A whole object on an fsspec URL, copied to a local temporary file for a reader that needs one."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
from typing import Any

from ..errors import Cancelled, CheckpointError
from ..filenames import DOWNLOAD_RE, TMP_PREFIX
from ..procs import orphaned
from ..text import human_bytes
from .remote import call, fs_for

log = logging.getLogger(__name__)

DOWNLOAD_BLOCK = 16 << 20  # one ranged GET each
DOWNLOAD_IN_FLIGHT = 4  # blocks fetched at once: at most this many blocks are in memory
DOWNLOAD_SPARE = 256 << 20  # left free on the temp folder's disk after a copy


def clean_downloads(folder: str) -> list[str]:
    """Remove copies in ``folder`` left by Shardscope processes that are gone (a kill -9 mid-copy)."""
    removed = []
    for name in orphaned(folder, TMP_PREFIX):
        if DOWNLOAD_RE.match(name):
            try:
                os.unlink(os.path.join(folder, name))
                removed.append(name)
            except OSError:
                pass
    return removed


class Download:
    """The object at ``url`` copied to a temporary file in the system temp folder, for a reader that
    needs a local file (``torch.load(mmap=True)`` of a ``.pt``). A context manager: the file is removed
    on exit (mapped pages stay readable on POSIX), on any exception, on SIGINT and, on the main thread,
    SIGTERM; one left by a ``kill -9`` is removed by the next download once its process is gone.
    The copy is checked against the object's size before anything reads it."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.fs, root = fs_for(url, storage_options)
        self.root = root.rstrip("/")
        self.path: str | None = None
        self.size = 0
        self.requests = 0
        self._old_term: Any = None

    def __enter__(self) -> Download:
        self._catch_sigterm()
        try:
            self._copy()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.remove()
        finally:
            if self._old_term is not None:
                signal.signal(signal.SIGTERM, self._old_term)
                self._old_term = None

    def remove(self) -> None:
        """Remove the copy now (a memory-mapped reader keeps its pages)."""
        path, self.path = self.path, None
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:  # Windows: a mapped file cannot be removed; the next download removes it
                log.warning("could not remove %s: %r", path, exc)

    def _catch_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # the window's workers cancel through Progress; signals reach the main thread only

        def on_term(signum: int, frame: Any) -> None:
            self.remove()
            raise Cancelled(f"interrupted by SIGTERM while copying {self.url}; the temporary copy was removed")

        self._old_term = signal.signal(signal.SIGTERM, on_term)

    def _copy(self) -> None:
        self.fs.invalidate_cache(self.root)
        info = call(self.url, self.fs.info, self.root)
        if info.get("type") != "file":
            raise CheckpointError(f"{self.url}: is a folder, not a file.", path=self.url)
        size = int(info.get("size") or 0)
        folder = tempfile.gettempdir()
        clean_downloads(folder)
        free = shutil.disk_usage(folder).free
        if size + DOWNLOAD_SPARE > free:
            raise CheckpointError(f"{self.url}: {human_bytes(size)} must be copied to {folder} to be read (torch.load "
                                  f"needs a local file), but only {human_bytes(free)} is free there.", path=self.url,
                                  hint="Set TMPDIR to a folder on a disk with room.")
        fd, self.path = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{os.getpid()}-dl-", dir=folder)
        with os.fdopen(fd, "wb") as out:
            starts = list(range(0, size, DOWNLOAD_BLOCK))
            for i in range(0, len(starts), DOWNLOAD_IN_FLIGHT):
                batch = starts[i:i + DOWNLOAD_IN_FLIGHT]
                ends = [min(size, s + DOWNLOAD_BLOCK) for s in batch]
                blocks = call(self.url, self.fs.cat_ranges, [self.root] * len(batch), batch, ends, on_error="raise")
                self.requests += len(batch)
                for start, end, data in zip(batch, ends, blocks, strict=True):
                    if len(data) != end - start:
                        raise CheckpointError(f"{self.url}: the object ended at byte {start + len(data)} while it "
                                              f"was copied, but its listing says {size} bytes (it changed?).",
                                              path=self.url)
                    out.write(data)
        self.size = size


__all__ = ["Download", "clean_downloads"]
