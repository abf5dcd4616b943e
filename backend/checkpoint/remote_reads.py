"""Planned, cached byte-range reads from a folder on an fsspec URL.

Latency, not bandwidth, is what a remote read costs, so reads are planned: a miss fetches the whole
item it falls in (when the reader told us the item boundaries), or a whole small file, or reads
ahead; neighbouring ranges are coalesced into one GET, batches go out concurrently, and the bytes
stay in a bounded LRU cache so the zip header, pickle, data and tail reads of one item cost one
request. Errors of the remote backend become one-line :class:`CheckpointError` (exit 2).

A job that knows every range it will read (an export, a deep verify) says so first
(:meth:`RemoteHandles.plan_reads`): each file's wanted ranges are then cut, once and before any read, into
fixed segments of at most ``SEGMENT`` bytes (neighbours closer than ``MAX_GAP`` share one), each fetched
by one ranged GET on its first read and dropped once the job has released (:meth:`RemoteHandles.release`)
every range it planned in it. Which segments exist and when one is dropped depend on the ranges and the
releases only, never on which thread reads first or how fast, so the same job makes the same requests on
every run: one per segment.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..errors import CheckpointError
from .remote import call, is_remote_error, remote_error
from .remote_plans import (
    CACHE_BUDGET,
    COALESCE,
    MAX_GAP,
    MAX_REQUEST,
    MIN_SEGMENT,
    PLAN_MEMORY,
    PLANNED_BUDGET,
    READ_AHEAD,
    SEGMENT,
    WHOLE_FILE,
    _Fetch,
    _File,
    _segment,
    merge_ranges,
    plan_segments,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RequestStats:
    """Requests and bytes these handles asked the backend for."""

    requests: int
    bytes: int


class RemoteHandles:
    """Planned, cached byte-range reads from one folder on an fsspec filesystem; thread-safe."""

    local: Literal[False] = False  # a tag: `if handles.local` tells the two kinds of handles apart

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
        self._planned: OrderedDict[int, tuple[str, _Fetch]] = OrderedDict()  # planned segments holding bytes
        self._planned_used = 0
        self._dropped_early = 0

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

    def plan_reads(self, ranges: Iterable[tuple[str, int, int]], files_at_once: int | None = None) -> int:
        """Every ``(name, start, end)`` range a job is about to read (each about once): from now on a read
        inside them is served from fixed segments (:func:`plan_segments`), each fetched by one GET on its
        first read and dropped once the job has released (:meth:`release`) every range it planned in it;
        replaces an earlier plan. Returns
        the number of segments: the GETs the job will make for these ranges. ``files_at_once``: how many files
        the job reads at the same time (None: all of them, as an export reading each tensor from every rank's
        file does; 1: a job that reads the files one after the other)."""
        by_file: dict[str, list[tuple[int, int]]] = {}
        for name, start, end in ranges:
            by_file.setdefault(name, []).append((start, end))
        # NOTE: a job holds about two segments per file it reads at once (a cast export's tensors in flight have a
        # chunk in every file), so with many such files the segments are smaller: memory stays bounded and nothing
        # is dropped before it is read (which would make the count depend on timing again), at the price of more
        # requests (see the benchmarks README). Jobs that read file after file keep 16 MiB segments.
        at_once = len(by_file) if files_at_once is None else min(len(by_file), files_at_once)
        segment = max(MIN_SEGMENT, min(SEGMENT, PLAN_MEMORY // max(1, at_once)))
        count = 0
        with self._lock:
            for f in self._files.values():
                f.seg_starts, f.segments = [], []
            for key in list(self._planned):
                self._drop_planned(key)
            for name, pairs in by_file.items():
                f = self._file(name)
                for s, e, wanted in plan_segments(pairs, segment):
                    f.seg_starts.append(s)
                    f.segments.append(_segment(s, e, wanted))
                count += len(f.segments)
        return count

    def release(self, name: str, start: int, end: int) -> None:
        """The job is done with the planned range ``[start, end)`` of ``name`` (as passed to :meth:`plan_reads`);
        a segment whose every planned range is released drops its bytes. Other ranges are ignored."""
        with self._lock:
            f = self._files.get(name)
            if f is None or not f.segments:
                return
            i = max(0, bisect.bisect_right(f.seg_starts, start) - 1)
            while i < len(f.segments) and f.segments[i].start < end:
                seg = f.segments[i]
                i += 1
                pending = seg.pending
                left = pending.get((start, end), 0) if pending is not None else 0
                if not left or pending is None:
                    continue
                if left == 1:
                    del pending[(start, end)]
                else:
                    pending[(start, end)] = left - 1
                if not seg.pending and id(seg) in self._planned:
                    self._drop_planned(id(seg))

    def read(self, name: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes of file ``name`` from ``offset``, through the planned range cache."""
        if length <= 0:
            return b""
        pieces = self._acquire([(name, offset, offset + length)])[0]
        f = pieces[0] if len(pieces) == 1 else None
        if f is not None and f.start <= offset and f.end >= offset + length:
            self._served(name, pieces, offset, offset + length)
            if f.start == offset and f.end == offset + length:
                return f.data
            return f.data[offset - f.start:offset - f.start + length]
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
            for key in list(self._planned):
                self._drop_planned(key)

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
                planned = self._planned_cover(name, start, end)
                if planned is not None:
                    for fetch in planned:
                        if not fetch.cached and id(fetch) not in self._planned and not fetch.done.is_set():
                            fetch.cached = True  # marks "asked for": its GET is in this batch
                            todo.append((name, fetch))
                    covers.append(planned)
                    continue
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

    def _planned_cover(self, name: str, start: int, end: int) -> list[_Fetch] | None:
        """The planned segments that together hold ``[start, end)``, or None when it is not all inside them."""
        f = self._files.get(name)
        if f is None or not f.segments:
            return None
        i = bisect.bisect_right(f.seg_starts, start) - 1
        if i < 0:
            return None
        out = []
        pos = start
        while pos < end:
            if i >= len(f.segments) or f.segments[i].start > pos or f.segments[i].end <= pos:
                return None
            out.append(f.segments[i])
            pos = f.segments[i].end
            i += 1
        return out

    def _drop_planned(self, key: int) -> None:
        """Forget a planned segment's bytes: a later read of it fetches it again (a fresh segment)."""
        name, fetch = self._planned.pop(key)
        self._planned_used -= fetch.end - fetch.start
        f = self._files[name]
        i = bisect.bisect_left(f.seg_starts, fetch.start)
        if i < len(f.segments) and f.segments[i] is fetch:
            f.segments[i] = _segment(fetch.start, fetch.end, fetch.wanted)

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

    def _plan(self, name: str, start: int, end: int, readahead: bool) -> list[_Fetch]:
        """Register the fetches that will cover ``[start, end)`` and return the new ones."""
        f = self._file(name)
        new = []
        for g0, g1, lo, hi in f.gaps(start, end):
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
                    if fetch.wanted is not None:  # the next read asks again
                        f = self._file(name)
                        i = bisect.bisect_left(f.seg_starts, fetch.start)
                        if i < len(f.segments) and f.segments[i] is fetch:
                            f.segments[i] = _segment(fetch.start, fetch.end, fetch.wanted)
                    else:
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
        got = fetch.start + len(fetch.data)
        if got < fetch.end:
            f = self._file(name)
            if f.size is None or f.size > got:
                f.size = got
            fetch.end = got
        if fetch.wanted is not None:  # a planned segment: held until its wanted ranges are released
            self._planned[id(fetch)] = (name, fetch)
            if not fetch.pending:  # every range released already (read again after its last release): not held
                self._drop_planned(id(fetch))
                return
            self._planned_used += fetch.end - fetch.start
            while self._planned_used > PLANNED_BUDGET and len(self._planned) > 1:  # reads far from the plan
                self._dropped_early += 1
                log.info("%s: planned segment dropped before it was read (%d so far)", self.url, self._dropped_early)
                self._drop_planned(next(iter(self._planned)))
            return
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
            view[a - offset:b - offset] = memoryview(f.data)[a - f.start:b - f.start]
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
                if f.wanted is not None:
                    continue  # a planned segment: dropped when released
                if not f.sticky and f.serve(start, end) and f.cached and self._lru.pop(id(f), None) is not None:
                    self._used -= f.end - f.start
                    self._forget(name, f)


__all__ = ["RemoteHandles", "RequestStats", "merge_ranges", "plan_segments"]
