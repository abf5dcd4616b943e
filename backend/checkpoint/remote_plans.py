"""The plan of remote byte-range reads, apart from the reads themselves (:mod:`.remote_reads`): the sizes that
shape requests, ranges merged into requests, a planned job's fixed segments, and the record of one fetch and of
one file's fetched extents. Functions of the ranges alone: which requests a job makes is known before it starts."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

WHOLE_FILE = 8 << 20  # files up to this size are read whole on the first miss
READ_AHEAD = 2 << 20  # least bytes fetched on a miss without item boundaries
COALESCE = 16 << 20  # small items are merged into one request up to this size
MAX_GAP = 1 << 20  # neighbouring ranges closer than this are fetched as one
MAX_REQUEST = 64 << 20  # larger fetches are split into concurrent parts
CACHE_BUDGET = 96 << 20  # fetched bytes kept for later reads (LRU); items up to a quarter of it are read whole
SERVE_SLACK = 4096  # unread gaps this small do not keep a fetch in the cache
SEGMENT = 16 << 20  # planned reads (plan_reads): the most bytes one segment, one GET, holds
PLAN_MEMORY = 128 << 20  # planned segments of a job that reads many files at once shrink to this / files ...
MIN_SEGMENT = 256 << 10  # ... but not below this (16 MiB up to 8 files at once)
PLANNED_BUDGET = 512 << 20  # planned segments held at once before the oldest unfinished one is dropped


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


def plan_segments(ranges: Iterable[tuple[int, int]], segment: int = SEGMENT, max_gap: int = MAX_GAP
                  ) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Fixed segments ``(start, end, wanted)`` for the wanted ``[start, end)`` ranges (items) of one file:
    ranges closer than ``max_gap`` form one run, and a run is cut into the fewest equal parts of at most
    ``segment`` bytes; ``wanted`` are the ranges that meet each segment (a range planned twice is listed
    twice). A function of the ranges alone: the request count of a planned job is known before it starts."""
    runs: list[list[Any]] = []  # [start, end, wanted ranges]
    for a, b in sorted((int(a), int(b)) for a, b in ranges if b > a):
        if runs and a - runs[-1][1] <= max_gap:
            runs[-1][1] = max(runs[-1][1], b)
            runs[-1][2].append((a, b))
        else:
            runs.append([a, b, [(a, b)]])
    out = []
    for start, end, wanted in runs:
        parts = -(-(end - start) // segment)
        step = -(-(end - start) // parts)
        for s in range(start, end, step):
            e = min(end, s + step)
            out.append((s, e, [(a, b) for a, b in wanted if a < e and b > s]))
    return out


class _Fetch:
    """Bytes ``[start, end)`` of one file: being fetched (``done`` not set) or fetched."""

    __slots__ = ("cached", "data", "done", "end", "error", "item_starts", "pending", "served", "start", "sticky",
                 "unread", "wanted")

    def __init__(self, start: int, end: int, cached: bool, sticky: bool = False,
                 item_starts: np.ndarray | None = None, wanted: list[tuple[int, int]] | None = None) -> None:
        self.start, self.end, self.cached = start, end, cached
        self.wanted = wanted  # a planned segment: the ranges some read will want (None: an unplanned fetch)
        self.pending: dict[tuple[int, int], int] | None = None  # planned ranges not released yet (and how often)
        if wanted is not None:
            self.pending = {}
            for r in wanted:
                self.pending[r] = self.pending.get(r, 0) + 1
        self.sticky = sticky  # part of a small file read whole: its headers are read again, keep it
        self.data = b""  # the bytes fetched, once ``done`` is set without an error
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
            if self.unread is not None and self.item_starts is not None:  # set together
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


def _segment(start: int, end: int, wanted: list[tuple[int, int]] | None) -> _Fetch:
    """A planned segment, not fetched yet, held once fetched until each of its wanted ranges is released."""
    return _Fetch(start, end, cached=False, wanted=wanted)


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
    seg_starts: list[int] = field(default_factory=list)  # planned segments (plan_reads), sorted, disjoint
    segments: list[_Fetch] = field(default_factory=list)

    def gaps(self, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """Uncovered parts of ``[start, end)`` as ``(gap_start, gap_end, lo, hi)``: lo/hi bound a fetch."""
        f = self
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
