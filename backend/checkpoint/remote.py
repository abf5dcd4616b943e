"""Checkpoints and exports on fsspec URLs (``s3://``, ``gs://``, ``hf://``, ``memory://``, ...).

Latency, not bandwidth, is what a remote read costs, so reads are planned: a miss fetches the whole
item it falls in (when the reader told us the item boundaries), or a whole small file, or reads
ahead; neighbouring ranges are coalesced into one GET, batches go out concurrently, and the bytes
stay in a bounded LRU cache so the zip header, pickle, data and tail reads of one item cost one
request. Errors of the remote backend become one-line :class:`CheckpointError` (exit 2).
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..crc import crc32_b64, crc32_combine
from ..errors import Cancelled, CheckpointError
from ..format import human_bytes
from ..procs import orphaned, pid_alive

log = logging.getLogger(__name__)

URL_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")
BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "hf": "huggingface_hub",
            "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs", "http": "aiohttp", "https": "aiohttp",
            "hdfs": "pyarrow", "sftp": "paramiko", "ssh": "paramiko"}
# Object stores where one PUT (or a multipart upload) appears only when complete: a file goes there directly.
ATOMIC_PUT = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"}
# Errors raised by the network stacks under fsspec backends that mean "cannot reach / read it".
REMOTE_ERROR_MODULES = {"botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "google", "azure",
                        "huggingface_hub", "s3fs", "gcsfs", "adlfs", "fsspec", "paramiko"}

WHOLE_FILE = 8 << 20  # files up to this size are read whole on the first miss
READ_AHEAD = 2 << 20  # least bytes fetched on a miss without item boundaries
COALESCE = 16 << 20  # small items are merged into one request up to this size
MAX_GAP = 1 << 20  # neighbouring ranges closer than this are fetched as one
MAX_REQUEST = 64 << 20  # larger fetches are split into concurrent parts
CACHE_BUDGET = 96 << 20  # fetched bytes kept for later reads (LRU); items up to a quarter of it are read whole
SERVE_SLACK = 4096  # unread gaps this small do not keep a fetch in the cache


def is_url(path: str | os.PathLike) -> bool:
    """True for ``scheme://...`` other than ``file://``."""
    m = URL_RE.match(str(path))
    return bool(m) and m.group(1) != "file"


def default_options(protocol: str) -> dict[str, Any]:
    """Options that make an unreachable endpoint fail in about a second instead of retrying for minutes."""
    if protocol in ("s3", "s3a"):
        return {"config_kwargs": {"connect_timeout": 5, "read_timeout": 120,
                                  "retries": {"max_attempts": 2, "mode": "standard"}}}
    return {}


def merge_options(base: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    """``extra`` over ``base``, nested dicts merged key by key (the user's options win)."""
    out = dict(base)
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_options(out[key], value)
        else:
            out[key] = value
    return out


def is_remote_error(exc: BaseException) -> bool:
    """An error of the storage backend or the network (not a bug of ours)."""
    if isinstance(exc, (OSError, TimeoutError)):
        return True
    if any(c.__module__.split(".")[0] in REMOTE_ERROR_MODULES for c in type(exc).__mro__[:-2]):
        return True
    return isinstance(exc, ValueError | TypeError) and _raised_by_backend(exc)


def _raised_by_backend(exc: BaseException) -> bool:
    """True when the innermost frame of ``exc`` is in a storage backend's code: botocore refuses bad options
    (``endpoint_url=notaurl``) with a plain ValueError when it first makes its client, at the first request."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = str(tb.tb_frame.f_globals.get("__name__", "")) if tb is not None else ""
    return module.split(".")[0] in REMOTE_ERROR_MODULES


def remote_error(where: str, exc: BaseException, doing: str = "cannot read it") -> CheckpointError:
    """One line naming the URL and what the backend said."""
    if isinstance(exc, FileNotFoundError):
        return CheckpointError(f"{where}: no such file or folder.", path=where)
    if isinstance(exc, PermissionError):
        return CheckpointError(f"{where}: access denied ({_first_line(exc)}).", path=where,
                               hint="Check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
                                    "--storage-option key=... secret=...).")
    text = _first_line(exc)
    if isinstance(exc, ValueError | TypeError):
        return CheckpointError(f"{where}: bad storage options ({text}).", path=where,
                               hint="Check --storage-option values, e.g. client_kwargs.endpoint_url=http://host:9000")
    if "connect" in text.lower() or "endpoint" in text.lower() or isinstance(exc, TimeoutError):
        return CheckpointError(f"{where}: cannot reach the storage endpoint ({text}).", path=where,
                               hint="Check AWS_ENDPOINT_URL or --storage-option client_kwargs.endpoint_url=...")
    return CheckpointError(f"{where}: {doing} ({text}).", path=where)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def fs_for(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem and path for ``url``; a missing backend package is named."""
    try:
        import fsspec
    except ImportError:
        raise CheckpointError(f"{url}: opening URLs needs the fsspec package (pip install fsspec).",
                              path=url) from None
    protocol = URL_RE.match(url).group(1)  # type: ignore[union-attr]
    options = merge_options(default_options(protocol), storage_options)
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        pkg = BACKENDS.get(protocol, f"the fsspec backend for {protocol}://")
        raise CheckpointError(f"{url}: no fsspec backend for {protocol}:// is installed ({exc}).", path=url,
                              hint=f"Install it, e.g. `pip install {pkg}`.") from None
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{url}: bad storage options or URL ({_first_line(exc)}).", path=url) from None


def call(where: str, fn: Any, *args: Any, doing: str = "cannot read it", **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with backend errors turned into one-line :class:`CheckpointError`."""
    try:
        return fn(*args, **kwargs)
    except CheckpointError:
        raise
    except Exception as exc:
        if not is_remote_error(exc):
            raise
        log.info("%s: %r", where, exc)
        raise remote_error(where, exc, doing) from None


# ------------------------------------------------------------------ the read planner
def merge_ranges(ranges: Iterable[tuple[str, int, int]], max_gap: int = MAX_GAP,
                 max_request: int = MAX_REQUEST) -> list[tuple[str, int, int]]:
    """``(name, start, end)`` ranges with neighbours of one file merged when the gap between them is
    below ``max_gap`` and the merged range stays within ``max_request``."""
    out: list[tuple[str, int, int]] = []
    for name, start, end in sorted(r for r in ranges if r[2] > r[1]):
        if out and out[-1][0] == name and start - out[-1][2] <= max_gap and max(end, out[-1][2]) - out[-1][1] \
                <= max_request:
            out[-1] = (name, out[-1][1], max(end, out[-1][2]))
        else:
            out.append((name, start, end))
    return out


class _Fetch:
    """Bytes ``[start, end)`` of one file: being fetched (``done`` not set) or fetched."""

    __slots__ = ("cached", "data", "done", "end", "error", "item_starts", "served", "start", "sticky", "unread")

    def __init__(self, start: int, end: int, cached: bool, sticky: bool = False,
                 item_starts: np.ndarray | None = None) -> None:
        self.start, self.end, self.cached = start, end, cached
        self.sticky = sticky  # part of a small file read whole: its headers are read again, keep it
        self.data: bytes | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.served: list[list[int]] = []  # merged [a, b) ranges handed out so far
        # where the planned items inside the fetch start, and which of those no read has touched yet: a small
        # item nobody has read is not slack, however few its bytes
        self.item_starts = item_starts if item_starts is not None and len(item_starts) else None
        self.unread = None if self.item_starts is None else np.ones(len(self.item_starts), dtype=bool)

    def serve(self, a: int, b: int) -> bool:
        """Record that ``[a, b)`` was handed out; True once every byte of the fetch has been, but for
        gaps below ``SERVE_SLACK`` (zip records nobody reads: byte order, version, ...) that hold no
        planned item's start."""
        a, b = max(a, self.start), min(b, self.end)
        if b > a:
            if self.unread is not None:
                self.unread[np.searchsorted(self.item_starts, a):np.searchsorted(self.item_starts, b)] = False
            merged = []
            for r in self.served:
                if r[1] + SERVE_SLACK < a or r[0] > b + SERVE_SLACK:
                    merged.append(r)
                else:
                    a, b = min(a, r[0]), max(b, r[1])
            merged.append([a, b])
            self.served = sorted(merged)
        return (len(self.served) == 1 and self.served[0][0] <= self.start + SERVE_SLACK
                and self.served[0][1] >= self.end - SERVE_SLACK and (self.unread is None or not self.unread.any()))


@dataclass
class _File:
    """What the planner knows of one remote file: its fetched extents (sorted, disjoint) and item bounds."""

    size: int | None = None
    starts: list[int] = field(default_factory=list)
    fetches: list[_Fetch] = field(default_factory=list)
    item_start: np.ndarray | None = None  # item bounds, sorted by start
    item_end: np.ndarray | None = None
    next_seq: int = -1  # where the last read ended (sequential read-ahead)
    ahead: int = READ_AHEAD


@dataclass(frozen=True, slots=True)
class RequestStats:
    """Requests and bytes these handles asked the backend for."""

    requests: int
    bytes: int


class RemoteHandles:
    """Planned, cached byte-range reads from one folder on an fsspec filesystem; thread-safe."""

    local = False

    def __init__(self, fs: Any, root: str, url: str, sizes: dict[str, int] | None = None,
                 budget: int = CACHE_BUDGET) -> None:
        self.fs, self.root, self.url = fs, root.rstrip("/"), url.rstrip("/")
        self.budget = budget
        self._files: dict[str, _File] = {}
        self._sizes = dict(sizes or {})
        self._lru: OrderedDict[int, tuple[str, _Fetch]] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._requests = 0
        self._bytes = 0

    # -- public
    def where(self, name: str) -> str:
        """The file's full URL, for error messages."""
        return f"{self.url}/{name}"

    @property
    def stats(self) -> RequestStats:
        """Requests and bytes asked of the backend so far."""
        return RequestStats(self._requests, self._bytes)

    def size(self, name: str) -> int:
        """Size of file ``name`` in bytes, asked of the backend once and then cached."""
        size = self._file(name).size
        if size is None:
            size = int(call(self.where(name), self.fs.size, f"{self.root}/{name}"))
            with self._lock:
                self._file(name).size = size
        return size

    def plan_items(self, name: str, extents: Iterable[tuple[int, int]] | np.ndarray) -> None:
        """Item boundaries ``(offset, length)`` of ``name`` (pairs or an (n, 2) array): a miss then
        fetches the whole item it falls in, merged with small neighbours."""
        arr = np.asarray(extents if isinstance(extents, np.ndarray) else list(extents), dtype=np.int64)
        arr = arr.reshape(-1, 2)
        arr = arr[arr[:, 1] > 0]
        order = np.argsort(arr[:, 0], kind="stable")
        with self._lock:
            f = self._file(name)
            f.item_start = arr[order, 0]
            f.item_end = arr[order, 0] + arr[order, 1]

    def plan_table(self, names: Sequence[str], file: np.ndarray, offset: np.ndarray, length: np.ndarray) -> None:
        """:meth:`plan_items` for a whole chunk table: item ``i`` is in ``names[file[i]]`` (-1: none)."""
        file = np.asarray(file)
        pairs = np.stack([np.asarray(offset, dtype=np.int64), np.asarray(length, dtype=np.int64)], 1)
        for idx in np.unique(file[file >= 0]).tolist():
            if 0 <= idx < len(names):
                self.plan_items(names[idx], pairs[file == idx])

    def read(self, name: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes of file ``name`` from ``offset``, through the planned range cache."""
        if length <= 0:
            return b""
        pieces = self._acquire([(name, offset, offset + length)])[0]
        f = pieces[0] if len(pieces) == 1 else None
        if f is not None and f.start <= offset and f.end >= offset + length:
            self._served(name, pieces, offset, offset + length)
            if f.start == offset and f.end == offset + length:
                return f.data  # type: ignore[return-value]
            return f.data[offset - f.start:offset - f.start + length]  # type: ignore[index]
        buf = bytearray(length)
        self._copy_into(name, offset, memoryview(buf), pieces)
        return bytes(buf)

    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with the bytes of file ``name`` from ``offset``, through the planned range cache."""
        view = buf.cast("B") if buf.format != "B" else buf
        if len(view):
            self._copy_into(name, offset, view, self._acquire([(name, offset, offset + len(view))])[0])

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """The bytes of every ``(name, start, end)``, fetched as one batch: ranges of a file closer
        than ``MAX_GAP`` merged (up to ``MAX_REQUEST``), all requests in flight at once."""
        cap = min(MAX_REQUEST, self.budget // 4)  # what stays cached until the copies below
        self._acquire([r for r in merge_ranges(ranges, max_request=cap) if r[2] - r[1] <= cap])
        out = []
        for name, start, end in ranges:
            buf = bytearray(max(0, end - start))
            if buf:
                self.readinto(name, start, memoryview(buf))
            out.append(bytes(buf))
        return out

    def prefetch(self, ranges: Sequence[tuple[str, int, int]]) -> None:
        """Start fetching these ranges in the background (bounded by the cache budget)."""
        with self._lock:
            room = max(0, self.budget - self._used)
            todo = []
            for name, start, end in ranges:
                for f in self._plan(name, start, end, readahead=False):
                    if f.end - f.start > room:
                        self._forget(name, f)
                        continue
                    room -= f.end - f.start
                    todo.append((name, f))
            if not todo:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(2, thread_name_prefix="shardscope-prefetch")
            pool = self._pool
        pool.submit(self._run, todo)

    def fd(self, name: str) -> int:
        """Always raises OSError: remote files have no descriptor (kernel copies need a local file)."""
        raise OSError("remote files have no descriptor")

    def close(self) -> None:
        """Stop prefetching and drop the cache (the handles stay usable: the next read fetches again)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._lock:
            self._evict(0)

    def __enter__(self) -> RemoteHandles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- planning (under the lock)
    def _file(self, name: str) -> _File:
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = _File(size=self._sizes.get(name))
        return f

    def _acquire(self, ranges: list[tuple[str, int, int]]) -> list[list[_Fetch]]:
        """For each range, the fetches that cover it, after fetching the missing ones (one batch)."""
        todo: list[tuple[str, _Fetch]] = []
        covers = []
        with self._lock:
            for name, start, end in ranges:
                new = self._plan(name, start, end, readahead=True)
                todo.extend((name, f) for f in new)
                covers.append(self._covering(name, start, end))
                self._file(name).next_seq = end
        if todo:
            self._run(todo)
        for name, start, end in ranges:
            self._check_end(name, start, end)
        for pieces in covers:
            for f in pieces:
                f.done.wait()
                if f.error is not None:
                    raise f.error
        return covers

    def _check_end(self, name: str, start: int, end: int) -> None:
        size = self._file(name).size
        if size is not None and end > size:
            raise CheckpointError(f"{self.where(name)}: file ends before byte {end} (read at {start}, {end - start} "
                                  "bytes): the file is truncated.", path=self.where(name))

    def _covering(self, name: str, start: int, end: int) -> list[_Fetch]:
        f = self._file(name)
        i = max(0, bisect.bisect_right(f.starts, start) - 1)
        out = []
        while i < len(f.fetches) and f.fetches[i].start < end:
            if f.fetches[i].end > start:
                out.append(f.fetches[i])
                key = id(f.fetches[i])
                if key in self._lru:
                    self._lru.move_to_end(key)
            i += 1
        return out

    def _gaps(self, name: str, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """Uncovered parts of ``[start, end)`` as ``(gap_start, gap_end, lo, hi)``: lo/hi bound a fetch."""
        f = self._file(name)
        hi_file = f.size if f.size is not None else 1 << 62
        end = min(end, hi_file)
        out = []
        pos = start
        i = bisect.bisect_right(f.starts, pos) - 1
        lo = 0
        if i >= 0:
            lo = f.fetches[i].end
            if f.fetches[i].end > pos:
                pos = f.fetches[i].end
        i += 1
        while pos < end:
            nxt = f.fetches[i].start if i < len(f.fetches) else hi_file
            if nxt > pos:
                out.append((pos, min(end, nxt), max(lo, 0), nxt))
            if i >= len(f.fetches):
                break
            lo = pos = max(pos, f.fetches[i].end)
            i += 1
        return out

    def _plan(self, name: str, start: int, end: int, readahead: bool) -> list[_Fetch]:
        """Register the fetches that will cover ``[start, end)`` and return the new ones."""
        f = self._file(name)
        new = []
        for g0, g1, lo, hi in self._gaps(name, start, end):
            a, b = self._extent(f, g0, g1, lo, hi, readahead)
            step = MAX_REQUEST if b - a > MAX_REQUEST else b - a
            for s in range(a, b, step):
                e = min(b, s + step)
                inside = None
                if f.item_start is not None:
                    inside = f.item_start[np.searchsorted(f.item_start, s):np.searchsorted(f.item_start, e)]
                fetch = _Fetch(s, e, cached=(b - a) <= self.budget // 2,
                               sticky=f.size is not None and f.size <= WHOLE_FILE, item_starts=inside)
                k = bisect.bisect_left(f.starts, s)
                f.starts.insert(k, s)
                f.fetches.insert(k, fetch)
                new.append(fetch)
        return new

    def _extent(self, f: _File, g0: int, g1: int, lo: int, hi: int, readahead: bool) -> tuple[int, int]:
        """What to fetch for the gap ``[g0, g1)`` that must stay within ``[lo, hi)``."""
        if f.size is not None and f.size <= WHOLE_FILE:
            return lo, hi  # a small file: all of what is missing, in one request
        starts, ends = f.item_start, f.item_end
        if starts is not None and ends is not None and len(starts):
            k = int(np.searchsorted(starts, g0, side="right")) - 1
            if k >= 0 and starts[k] <= g0 < ends[k]:
                a, b = max(lo, int(starts[k])), int(ends[k])
                if b - a <= min(MAX_REQUEST, self.budget // 4):  # larger items: head, tail and data apart
                    k += 1  # merge following small items while they are close and the request stays small
                    while k < len(starts) and starts[k] - b <= MAX_GAP and ends[k] - a <= COALESCE:
                        b = max(b, int(ends[k]))
                        k += 1
                    return a, min(hi, max(b, g1))
        if not readahead:
            return g0, g1
        if g0 == f.next_seq:
            f.ahead = min(MAX_REQUEST, f.ahead * 2)
        else:
            f.ahead = READ_AHEAD
        return g0, min(hi, max(g1, g0 + f.ahead))

    def _forget(self, name: str, fetch: _Fetch) -> None:
        f = self._files.get(name)
        if f is None:
            return
        for i, other in enumerate(f.fetches):
            if other is fetch:
                del f.fetches[i]
                del f.starts[i]
                break

    # -- fetching
    def _run(self, todo: list[tuple[str, _Fetch]]) -> None:
        """Fetch all of ``todo`` concurrently, then publish (cache or drop) each result."""
        paths = [f"{self.root}/{name}" for name, _ in todo]
        results: list[Any] | None = None
        try:
            results = self.fs.cat_ranges(paths, [f.start for _, f in todo], [f.end for _, f in todo],
                                         on_error="return")
        except Exception as exc:  # the whole batch failed (e.g. the event loop could not run it)
            results = [exc] * len(todo)
        finally:
            if results is None:  # interrupted (Ctrl-C, SIGTERM): waiting threads must not wait forever
                results = [CheckpointError(f"{self.url}: reading was interrupted.", path=self.url)] * len(todo)
                self._publish(todo, results)
        self._publish(todo, results)

    def _publish(self, todo: list[tuple[str, _Fetch]], results: list[Any]) -> None:
        with self._lock:
            self._requests += len(todo)
            for (name, fetch), data in zip(todo, results, strict=True):
                if fetch.done.is_set():
                    continue
                if isinstance(data, BaseException):
                    fetch.error = self._error(name, data)
                    self._forget(name, fetch)
                else:
                    self._bytes += len(data)
                    fetch.data = data
                    self._settle(name, fetch)
                fetch.done.set()
            self._evict()

    def _error(self, name: str, exc: BaseException) -> BaseException:
        if isinstance(exc, CheckpointError) or not is_remote_error(exc):
            return exc
        log.info("%s: %r", self.where(name), exc)
        return remote_error(self.where(name), exc)

    def _settle(self, name: str, fetch: _Fetch) -> None:
        """A fetch shorter than asked means the file ends there; keep it if it fits the budget."""
        got = fetch.start + len(fetch.data)  # type: ignore[arg-type]
        if got < fetch.end:
            f = self._file(name)
            if f.size is None or f.size > got:
                f.size = got
            fetch.end = got
        if fetch.cached:
            self._lru[id(fetch)] = (name, fetch)
            self._used += fetch.end - fetch.start
        else:
            self._forget(name, fetch)

    def _evict(self, budget: int | None = None) -> None:
        while self._used > (self.budget if budget is None else budget) and self._lru:
            _, (name, fetch) = self._lru.popitem(last=False)
            self._used -= fetch.end - fetch.start
            self._forget(name, fetch)

    def _copy_into(self, name: str, offset: int, view: memoryview, pieces: list[_Fetch]) -> None:
        pos, end = offset, offset + len(view)
        for f in pieces:
            if f.start > pos:
                break
            a, b = pos, min(end, f.end)
            if b <= a:
                continue
            view[a - offset:b - offset] = memoryview(f.data)[a - f.start:b - f.start]  # type: ignore[arg-type]
            pos = b
        if pos < end:
            raise CheckpointError(f"{self.where(name)}: file ends before byte {end} (read at {offset}, "
                                  f"{len(view)} bytes): the file is truncated.", path=self.where(name))
        self._served(name, pieces, offset, end)

    def _served(self, name: str, pieces: list[_Fetch], start: int, end: int) -> None:
        """Drop fetches whose every byte has been handed out: a copy reads each item once, so
        keeping them would only hold memory (headers and small files stay until evicted)."""
        with self._lock:
            for f in pieces:
                if not f.sticky and f.serve(start, end) and f.cached and self._lru.pop(id(f), None) is not None:
                    self._used -= f.end - f.start
                    self._forget(name, f)


# ------------------------------------------------------------------ a whole object, copied to a local temporary
TMP_PREFIX = ".shardscope-tmp-"
OLD_PREFIX = ".shardscope-old-"  # the old files of a --force export over a folder, while it commits
DOWNLOAD_BLOCK = 16 << 20  # one ranged GET each
DOWNLOAD_IN_FLIGHT = 4  # blocks fetched at once: at most this many blocks are in memory
DOWNLOAD_SPARE = 256 << 20  # left free on the temp folder's disk after a copy
DOWNLOAD_RE = re.compile(r"^\.shardscope-tmp-(\d+)-dl-")


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


# ------------------------------------------------------------------ writing to a URL
LEFTOVER_RE = re.compile(r"^\.shardscope-tmp-(\d+)-([0-9a-f]{6})-(.+)$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


STALE_ENV = "SHARDSCOPE_STALE_UPLOAD_SECONDS"


def stale_seconds() -> float:
    """How long another machine's temporary upload (or any incomplete multipart upload) must have been
    left untouched before an export next to it removes it: a day, or ``$SHARDSCOPE_STALE_UPLOAD_SECONDS``."""
    try:
        return float(os.environ.get(STALE_ENV, 86400))
    except ValueError:
        return 86400.0


def _modified(info: dict[str, Any]) -> float | None:
    when = info.get("LastModified") or info.get("mtime") or info.get("last_modified")
    if when is None:
        return None
    return when.timestamp() if hasattr(when, "timestamp") else float(when)


def _uploads_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "shardscope-uploads")


def _remember_upload(upload_id: str) -> str:
    """A local record ``<pid>-<hash>`` of a multipart upload in flight; removed when it ends."""
    folder = _uploads_dir()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(upload_id)
    return path


def _forget_upload(record: str) -> None:
    try:
        os.unlink(record)
    except OSError:
        pass


def _upload_records() -> dict[str, tuple[str, bool]]:
    """Upload id -> (record path, whether its process is alive), for this machine's multipart uploads."""
    out: dict[str, tuple[str, bool]] = {}
    try:
        names = os.listdir(_uploads_dir())
    except OSError:
        return out
    for name in names:
        pid = name.split("-", 1)[0]
        if not pid.isdigit():
            continue
        alive = pid_alive(int(pid))
        path = os.path.join(_uploads_dir(), name)
        try:
            if not alive and time.time() - os.path.getmtime(path) > 2 * stale_seconds():
                _forget_upload(path)  # its upload is gone by now, or the age rule takes it
                continue
            with open(path, encoding="utf-8") as f:
                out[f.read(1024).strip()] = (path, alive)
        except OSError:
            continue
    return out


PART = 16 << 20  # multipart part size for S3 uploads (5 MiB..5 GiB, at most 10,000 parts)
MAX_PARTS = 10_000
PARTS_IN_FLIGHT = 4  # parts read and sent at once: at most this many parts in memory


@dataclass(frozen=True, slots=True)
class Sent:
    """One uploaded object: its size and, when sent with checksums, the CRC32 of the whole staged file
    and (multipart) S3's composite checksum (the CRC32 of the parts' CRC32s, ``-N``)."""

    size: int
    requests: int = 1
    crc32: str | None = None
    composite: str | None = None

    def matches(self, stored: str) -> bool:
        """True when a stored ``ChecksumCRC32`` (full-object, or composite with or without ``-N``) is ours."""
        value = stored.split("-", 1)[0]
        return value in (self.crc32, (self.composite or "").split("-", 1)[0])


@dataclass
class UploadCheck:
    """What a commit proved about the uploaded objects (the summary's ``uploaded:`` line)."""

    objects: int = 0
    requests: int = 0  # PUTs and parts
    by_crc32: int = 0  # final objects that report the staged file's CRC32 (sent with every PUT/part)
    checksummed: bool = False  # every PUT and part carried a CRC32 the server checks on receipt
    unreadable: int = 0  # final objects these credentials may write but not read back

    def add(self, sent: Sent, crc_confirmed: bool, readable: bool = True) -> None:
        """Count one final object."""
        self.objects += 1
        self.requests += sent.requests
        self.by_crc32 += crc_confirmed
        self.unreadable += not readable

    def describe(self) -> str:
        """Exactly what was checked, in one sentence."""
        n = f"{self.objects} object{'s' if self.objects != 1 else ''}"
        readable = self.objects - self.unreadable
        denied = (f"{self.unreadable} of {self.objects} final objects could not be read back with these credentials "
                  "(access denied), so nothing was checked after their upload") if self.unreadable else ""
        if not self.checksummed:
            sizes = (f"{n}; each final object's size equals the staged file's (the uploaded bytes themselves were "
                     "not checked)") if readable else n
            return "; ".join(p for p in (sizes, denied) if p)
        text = (f"{n} in {self.requests} PUT{'s' if self.requests != 1 else ''}/parts, each sent with the CRC32 of "
                "its bytes as read from the staged file, which the server checks on receipt (S3 refuses a mismatch)")
        if self.by_crc32 == readable:
            tail = "every final object reports the staged file's CRC32" if readable else ""
        else:
            tail = (f"{self.by_crc32} of {readable} final objects report the staged file's CRC32, the others were "
                    "checked by size only")
        return "; ".join(p for p in (text, tail, denied) if p)


def _go_on() -> None:
    """The ``stop`` of a commit nobody can interrupt."""


class RemoteTarget:
    """An export destination on an fsspec URL, committed only when the whole upload succeeded."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.fs, root = fs_for(self.url, storage_options)
        self.root = root.rstrip("/")
        self.protocol = URL_RE.match(self.url).group(1)  # type: ignore[union-attr]
        # S3: our own PUTs and parts, each with a CRC32 that the server checks (s3fs sends none of its own)
        self.s3 = self.protocol in ("s3", "s3a") and hasattr(self.fs, "call_s3")
        self.report = UploadCheck(checksummed=self.s3)
        self._stop: Callable[[], None] = _go_on
        self._keep_aside = False  # a failed --force export could not put every old file back
        self.kept: list[str] = []  # --force over a folder: what was there and is not the export's, kept

    def exists(self) -> bool:
        """True when something already exists at the destination URL."""
        return bool(call(self.url, self.fs.exists, self.root, doing="cannot check the destination"))

    def check(self, force: bool) -> None:
        """Refuse an existing destination unless ``force``; fails fast on an unreachable endpoint."""
        self.clean_leftovers()
        if self.exists() and not force:
            raise CheckpointError(f"{self.url}: already exists (use --force to replace it).", path=self.url)
        bucket = self.root.split("/", 1)[0]
        if self.protocol in ATOMIC_PUT - {"memory"} and not call(self.url, self.fs.exists, bucket,
                                                                  doing="cannot check the destination"):
            raise CheckpointError(f"{self.url}: the bucket {bucket} does not exist (or is not visible with these "
                                  "credentials).", path=self.url)

    def commit(self, local_path: str, kind: str, stop: Callable[[], None] | None = None,
               owned: Callable[[str], bool] | None = None) -> None:
        """Upload ``local_path`` (a file, or a folder when ``kind == "dir"``) to the URL. ``stop`` raises when
        the user asked to stop (a deferred Ctrl-C); it is called between requests, never during one, so what
        is at the destination is known when it raises, and removed. Over an existing folder (--force), its
        files the upload does not replace are removed when ``owned(name)`` says they are the writer's kind
        (an earlier export's other shards), and kept otherwise (listed in ``kept``); all, without ``owned``."""
        self._stop = stop or _go_on
        if kind == "file":
            if self.protocol in ATOMIC_PUT:  # one PUT or a multipart upload: visible only when complete
                self._stop()
                sent = self._put(local_path, self.root)
                try:
                    self._confirm(sent, self.root)
                    self._stop()  # a stop asked during the last request: the object goes again
                except BaseException:
                    self._quiet_rm(self.root)  # a damaged object must not stay at the destination
                    raise
                return
            tmp = self._temp_name()
            self._upload_then_move([(local_path, tmp, self.root)], tmp)
            return
        tmp = self._temp_name()
        names = sorted(os.listdir(local_path), key=lambda n: (n.endswith(".json"), n))  # the index last
        moves = [(os.path.join(local_path, n), f"{tmp}/{n}", f"{self.root}/{n}") for n in names
                 if os.path.isfile(os.path.join(local_path, n))]
        old = self._old_files()
        finals = {final for _, _, final in moves}
        # --force over a folder: the old files a move would overwrite are first copied aside (server side),
        # and put back if the export then fails, so a failure leaves the old folder as it was
        saved = self._set_aside(sorted(old & finals)) if old & finals else None
        try:
            self._upload_then_move(moves, tmp)
        except BaseException:
            if saved is not None:
                self._put_back(saved)  # raises, keeping the copies, when one could not be put back
            raise
        finally:
            if saved is not None and not self._keep_aside:
                self._quiet_rm(saved[0], recursive=True)
        for path in sorted(old - finals):  # an earlier export's other files, once the new one is in place
            name = path[len(self.root) + 1:]
            if "/" not in name and (owned is None or owned(name)):
                self._quiet_rm(path)
            else:
                self.kept.append(name)  # not written by an export (config.json, tokenizer files): kept

    def _set_aside(self, paths: list[str]) -> tuple[str, list[tuple[str, str]]]:
        """Copies of ``paths`` in a folder next to the destination, ``.shardscope-old-…``. NOTE: unlike the
        temporary uploads it is never removed by a later run: after a kill -9 during the moves it holds the
        only copy of the old files the moves had replaced."""
        parent, _, base = self.root.rpartition("/")
        aside = f"{parent}/{OLD_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}-{_host()}-{base}"
        copies = [(p, f"{aside}/{p.rpartition('/')[2]}") for p in paths]
        try:
            for path, copy in copies:
                self._stop()
                call(self.url, self.fs.copy, path, copy, doing="cannot set the old files aside")
        except BaseException:
            self._quiet_rm(aside, recursive=True)
            raise
        return aside, copies

    def _put_back(self, saved: tuple[str, list[tuple[str, str]]]) -> None:
        """After a failed --force export: every old file the new one may have replaced or removed, as it was.
        A file that cannot be put back is named in the log, with the copy that still holds it."""
        aside, copies = saved
        lost = []
        for path, copy in copies:
            try:
                self.fs.copy(copy, path)
            except Exception as exc:
                if not is_remote_error(exc):
                    raise
                lost.append(path)
                log.warning("could not put back %s from %s: %r", path, copy, exc)
        if lost:  # keep the copies: they are all that is left of these files
            self._keep_aside = True
            raise CheckpointError(f"{self.url}: the export failed and {len(lost)} of the old files could not be "
                                  f"put back; their copies are under {self.protocol}://{aside} (see the log).",
                                  path=self.url)

    def _old_files(self) -> set[str]:
        if not self.exists():
            return set()
        found = call(self.url, self.fs.find, self.root, doing="cannot list the destination")
        return {p.rstrip("/") for p in found}

    def _temp_name(self) -> str:
        parent, _, base = self.root.rpartition("/")
        return f"{parent}/{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}-{_host()}-{base}"

    def clean_leftovers(self) -> list[str]:
        """Remove what killed Shardscope exports left next to the destination: temporary uploads of this
        machine whose process is gone (host name and pid in the name), and anyone's (another machine's)
        untouched for longer than :func:`stale_seconds`; on S3 also incomplete multipart uploads to
        these keys, by the same two rules (this machine's are known from their local records)."""
        parent = self.root.rpartition("/")[0]
        try:
            entries = call(self.url, self.fs.ls, parent, detail=True, doing="cannot list the destination")
        except CheckpointError:
            return []
        removed = []
        for entry in entries:
            path = entry["name"].rstrip("/")
            m = LEFTOVER_RE.match(path.rpartition("/")[2])
            if not m:
                continue
            mine = m.group(3).startswith(f"{_host()}-")
            if (mine and not pid_alive(int(m.group(1)))) or (not mine and self._stale(path, entry)):
                self._quiet_rm(path, recursive=True)
                removed.append(path)
        if self.s3:
            removed += self._abort_dead_uploads(parent)
        return removed

    def _stale(self, path: str, entry: dict[str, Any]) -> bool:
        """True when nothing under ``path`` was written for :func:`stale_seconds`."""
        try:
            found = self.fs.find(path, detail=True) if entry.get("type") == "directory" else {path: entry}
        except Exception as exc:
            if not is_remote_error(exc):
                raise
            return False
        times = [_modified(info) for info in found.values()]
        if not times or None in times:
            return False  # no time to go by: never remove another machine's upload
        return time.time() - max(times) > stale_seconds()  # type: ignore[type-var]

    def _abort_dead_uploads(self, parent: str) -> list[str]:
        bucket, _, prefix = parent.partition("/")
        try:
            listed = self.fs.call_s3("list_multipart_uploads", Bucket=bucket,
                                     Prefix=f"{prefix}/" if prefix else "").get("Uploads") or []
        except Exception as exc:
            if not is_remote_error(exc):
                raise
            return []
        records = _upload_records()
        aborted = []
        for up in listed:
            key, upload_id = up.get("Key", ""), up.get("UploadId", "")
            path, alive = records.get(upload_id, ("", False))
            if alive:
                continue  # this machine's export still sending it
            started = up.get("Initiated")
            old = started is not None and time.time() - started.timestamp() > stale_seconds()
            if path or old:
                try:
                    self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
                    aborted.append(f"{bucket}/{key} (incomplete upload {upload_id[:12]})")
                except Exception as exc:
                    if not is_remote_error(exc):
                        raise
                    log.warning("could not abort the upload of %s/%s: %r", bucket, key, exc)
                    continue
            if path:
                _forget_upload(path)
        return aborted

    def _put(self, local: str, remote: str) -> Sent:
        if self.s3:
            return self._put_s3(local, remote)
        call(self.url, self.fs.put_file, local, remote, doing="upload failed")
        return Sent(os.path.getsize(local))

    def _s3_call(self, method: str, doing: str = "upload failed", **kwargs: Any) -> Any:
        return call(self.url, self.fs.call_s3, method, doing=doing, **kwargs)

    def _put_s3(self, local: str, remote: str) -> Sent:
        """One PUT (up to a part's size) or a multipart upload, every request with the CRC32 of its body."""
        bucket, _, key = remote.partition("/")
        size = os.path.getsize(local)
        part = max(PART, -(-size // MAX_PARTS))
        if size > part:
            return self._multipart(local, bucket, key, size, part)
        with open(local, "rb") as f:
            data = f.read(part + 1)
        if len(data) != size:
            raise CheckpointError(f"{self.url}: the staged file changed while it was uploaded.", path=self.url)
        crc = crc32_b64(zlib.crc32(data))
        self._s3_call("put_object", Bucket=bucket, Key=key, Body=data, ChecksumAlgorithm="CRC32", ChecksumCRC32=crc)
        return Sent(size, 1, crc)

    def _multipart(self, local: str, bucket: str, key: str, size: int, part: int) -> Sent:
        upload_id = self._s3_call("create_multipart_upload", Bucket=bucket, Key=key,
                                  ChecksumAlgorithm="CRC32")["UploadId"]
        record = _remember_upload(upload_id)  # a kill -9 from here on is cleaned by this machine's next run
        fd = os.open(local, os.O_RDONLY)

        def one(i: int) -> tuple[dict[str, Any], int, int]:
            self._stop()
            data = os.pread(fd, min(part, size - i * part), i * part)
            crc = zlib.crc32(data)
            out = self._s3_call("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=i + 1,
                                Body=data, ChecksumAlgorithm="CRC32", ChecksumCRC32=crc32_b64(crc))
            return {"PartNumber": i + 1, "ETag": out["ETag"], "ChecksumCRC32": crc32_b64(crc)}, crc, len(data)

        pool = ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="shardscope-upload")
        try:
            done = [f.result() for f in [pool.submit(one, i) for i in range(-(-size // part))]]
            self._stop()
            self._s3_call("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                          MultipartUpload={"Parts": [d[0] for d in done]})
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # no part goes out after this
            try:
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            except Exception as exc:  # the failure that brought us here is the one to report
                if not is_remote_error(exc):
                    raise
                log.warning("could not abort the upload of %s/%s: %r", bucket, key, exc)
            raise
        finally:
            pool.shutdown(wait=True)
            os.close(fd)
            _forget_upload(record)
        if sum(d[2] for d in done) != size:
            raise CheckpointError(f"{self.url}: the staged file changed while it was uploaded.", path=self.url)
        whole = done[0][1]
        for _, crc, length in done[1:]:
            whole = crc32_combine(whole, crc, length)
        composite = crc32_b64(zlib.crc32(b"".join(d[1].to_bytes(4, "big") for d in done)))
        return Sent(size, len(done), crc32_b64(whole), f"{composite}-{len(done)}")

    def _stored(self, remote: str) -> tuple[int, str | None] | None:
        """Size and stored CRC32 of an uploaded object; None when these credentials may write it but not
        read it (a write-only policy: the PUT succeeded, the HEAD is refused)."""
        try:
            if not self.s3:
                info = self.fs.info(remote)
                return int(info.get("size") or 0), None
            bucket, _, key = remote.partition("/")
            head = self.fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
            return int(head.get("ContentLength") or 0), head.get("ChecksumCRC32")
        except PermissionError:
            return None
        except Exception as exc:
            if not is_remote_error(exc):
                raise
            raise remote_error(self.url, exc, "cannot check the upload") from None

    def _confirm(self, sent: Sent, remote: str) -> None:
        """The final object has the staged file's size and (S3) reports its CRC32; else CheckpointError."""
        stored_info = self._stored(remote)
        if stored_info is None:
            self.report.add(sent, False, readable=False)
            return
        size, stored = stored_info
        where = f"{self.url}/{remote[len(self.root):].lstrip('/')}".rstrip("/")
        if size != sent.size:
            raise CheckpointError(f"{where}: the uploaded object has {size} bytes, the staged file {sent.size}.",
                                  path=where)
        if stored is not None and not sent.matches(stored):
            raise CheckpointError(f"{where}: the uploaded object's CRC32 is {stored}, the staged file's "
                                  f"{sent.crc32}: the upload is damaged.", path=where)
        self.report.add(sent, stored is not None)

    def _upload_then_move(self, moves: list[tuple[str, str, str]], tmp: str) -> None:
        done: list[str] = []
        try:
            sent = []
            for local, staged, _ in moves:
                self._stop()
                sent.append(self._put(local, staged))
            for one, (_, staged, final) in zip(sent, moves, strict=True):
                self._stop()
                done.append(final)  # before the request: a copy that lands after a failure is removed too
                if self.s3:  # a server-side copy that computes the copy's CRC32 itself (fsspec's mv drops options)
                    call(self.url, self.fs.copy, staged, final, on_error="raise", ChecksumAlgorithm="CRC32",
                         doing="cannot move the upload into place")  # the staged copies go below, in one bulk delete
                else:
                    call(self.url, self.fs.mv, staged, final, doing="cannot move the upload into place")
                self._confirm(one, final)
            self._stop()
        except BaseException:
            for final in done:  # a half-moved folder is worse than none
                self._quiet_rm(final)
            raise
        finally:
            self._quiet_rm(tmp, recursive=True)

    def _quiet_rm(self, path: str, recursive: bool = False) -> None:
        try:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=recursive)
        except Exception as exc:  # cleanup after a failure must not hide that failure
            if not is_remote_error(exc):
                raise
            log.warning("could not remove %s: %r", path, exc)


__all__ = ["RemoteHandles", "RemoteTarget", "RequestStats", "call", "fs_for", "is_remote_error", "is_url",
           "remote_error"]
