"""Health check: files present and long enough, chunks tiling their tensors, stored byte ranges that do
not overlap, and with ``deep`` every item located, read once and its CRC32 checked in the same pass (bit
rot that ``torch.load`` would never notice)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import numpy as np

from ..errors import CheckpointError
from ..progress import Progress
from ..text import count
from .chunks import ChunkReader, CorruptChunkError, SharedStorageError, StoredTensor
from .layout import coverage_problems
from .model import Checkpoint, Chunk, Problem
from .storage import why_absent

log = logging.getLogger(__name__)
MAX_OVERLAP_REPORTS = 20


def verify(ckpt: Checkpoint, deep: bool = False, progress: Progress | None = None) -> list[Problem]:
    """All problems of a checkpoint: those found while reading, plus layout, files, byte ranges and (deep)
    the content of every item."""
    problems = list(ckpt.problems)
    problems += coverage_problems(ckpt)
    problems += _file_problems(ckpt)
    problems += overlap_problems(_metadata_ranges(ckpt), same_start=False)
    if deep:
        problems += _deep_problems(ckpt, progress)
    return problems


def _metadata_ranges(ckpt: Checkpoint) -> list[tuple[str, int, int, str]]:
    """(file, start, end, entry) of every stored item, as the metadata gives them."""
    t = ckpt.chunk_table
    out = []
    has = np.nonzero((t.file >= 0) & (t.length > 0))[0]
    names = [f.name for f in ckpt.files]
    fqns = [e.fqn for e in ckpt.tensors]
    for fi, off, ln, ti in zip(t.file[has].tolist(), t.byte_offset[has].tolist(), t.length[has].tolist(),
                               t.tensor[has].tolist(), strict=True):
        out.append((names[fi], off, off + ln, fqns[ti]))
    out += [(o.file, o.offset, o.offset + o.length, o.fqn) for o in ckpt.objects if o.file and o.length]
    return out


def overlap_problems(ranges: list[tuple[str, int, int, str]], same_start: bool) -> list[Problem]:
    """Entries whose stored bytes overlap, in O(n log n). With ``same_start`` False, ranges that begin at
    the same byte are one item (a safetensors-serialised ``.distcp`` gives every tensor the blob's start)."""
    problems: list[Problem] = []
    ranges = sorted(ranges)
    far: tuple[str, int, int, str] | None = None  # the range reaching furthest so far, in this file
    for r in ranges:
        if far is not None and far[0] == r[0] and r[1] < far[2] and (same_start or r[1] != far[1]):
            problems.append(Problem(
                "storage_overlap", f"{r[0]}: the stored bytes of {far[3]} ({far[1]}..{far[2]}) and {r[3]} "
                f"({r[1]}..{r[2]}) overlap: one of them is read from another entry's bytes.", fqn=r[3], file=r[0]))
            if len(problems) >= MAX_OVERLAP_REPORTS:
                break
        if far is None or far[0] != r[0] or r[2] > far[2]:
            far = r
    return problems


def _chunks_by_file(ckpt: Checkpoint) -> dict[int, np.ndarray]:
    """Chunk indices grouped by file, in O(chunks log chunks) (a per-file scan of every chunk is quadratic
    on a metadata that names 100,000 files)."""
    t = ckpt.chunk_table
    order = np.argsort(t.file, kind="stable")
    files, starts = np.unique(t.file[order], return_index=True)
    bounds = np.append(starts, len(order))
    return {int(f): order[bounds[i]:bounds[i + 1]] for i, f in enumerate(files.tolist())}


def _file_problems(ckpt: Checkpoint) -> list[Problem]:
    problems = []
    t = ckpt.chunk_table
    ends = t.byte_offset + t.length
    by_file = _chunks_by_file(ckpt)
    objects_of: dict[str | None, list] = {}
    for o in ckpt.objects:
        objects_of.setdefault(o.file, []).append(o)
    none = np.zeros(0, np.int64)
    for fi, f in enumerate(ckpt.files):
        if f.kind != "data":
            continue
        used = by_file.get(fi, none)
        tids = np.unique(t.tensor[used])
        users = [ckpt.tensors[int(i)].fqn for i in tids[:3]]
        objects = objects_of.get(f.name, [])
        if f.bytes is None:
            names = ", ".join(users or [o.fqn for o in objects[:3]])
            entries = count(len(tids) + len(objects), "entry", "entries")
            problems.append(Problem("missing_file", f"{f.name} {why_absent(ckpt.path, f.name)}; {entries} with data "
                                    f"in it (e.g. {names}).", fqn=users[0] if users else None, file=f.name))
            continue
        need = max([int(ends[used].max()) if len(used) else 0] + [o.offset + o.length for o in objects])
        if need > f.bytes:
            bad = used[ends[used] > f.bytes]
            fqn = ckpt.tensors[int(t.tensor[bad[0]])].fqn if len(bad) else next(
                (o.fqn for o in objects if o.offset + o.length > f.bytes), None)
            problems.append(Problem("short_file", f"{f.name} has {f.bytes} bytes but its items need {need}: the file "
                                    f"is truncated ({count(len(bad), 'chunk')} cut off, first {fqn}).", fqn=fqn,
                                    file=f.name))
        # NOTE: a rank left with nothing to write (its replicated entries deduplicated to other ranks) still
        # writes its file, empty: that is torch's normal output, not a stray file
        if not len(used) and not objects and ckpt.metadata_files and f.bytes:
            problems.append(Problem("unused_file", f"{f.name} is not referenced by the metadata (left from "
                                    "another save?).", file=f.name))
    return problems


def _deep_problems(ckpt: Checkpoint, progress: Progress | None) -> list[Problem]:
    problems: list[Problem] = []
    missing = {f.name for f in ckpt.files if f.bytes is None}
    if progress:
        progress.start(len(ckpt.chunk_table) + len(ckpt.objects), "reading every item")
    located: list[tuple[str, int, int, str]] = []
    with ChunkReader(ckpt) as reader:
        chunks = [(e, c) for e in ckpt.tensors for c in e.chunks]
        if ckpt.located is not None:  # tied weights share one located record: read and report it once
            seen: set[tuple[str, int]] = set()
            kept = []
            for e, c in chunks:
                if not c.length or (c.file, c.offset) not in seen:
                    kept.append((e, c))
                    if c.length:
                        seen.add((c.file, c.offset))
            chunks = kept
        # remote: every item read once, in fixed segments planned before the first read (the same GETs every run)
        reader.plan_reads((c for _, c in chunks if c.file not in missing),
                          (o for o in ckpt.objects if o.file not in missing), files_at_once=1)
        items: list[tuple[str, str | None, Callable[[], object], Chunk | None]] = [
            (e.fqn, c.file, partial(reader.check_chunk, e.fqn, c), c) for e, c in chunks]
        items += [(o.fqn, o.file, partial(reader.read_object, o), None) for o in ckpt.objects]
        if not reader.handles.local:  # one file after the other, front to back: one planned segment held at a time
            where = [c.offset for _, c in chunks] + [o.offset for o in ckpt.objects]
            order = sorted(range(len(items)), key=lambda i: (items[i][1] or "", where[i], i))
            items = [items[i] for i in order]
        unopenable: dict[str, list] = {}  # file -> [the error, entries not checked]: one problem per file
        for fqn, file, check, chunk in items:
            if progress:
                progress.advance(1, fqn)
            if not file or file in missing:
                continue
            if file not in unopenable:
                try:
                    reader.file_size(file)
                except CheckpointError as exc:
                    unopenable[file] = [str(exc), 0]
            if file in unopenable:
                unopenable[file][1] += 1
                continue
            try:
                st = check()
            except CorruptChunkError as exc:
                problems.append(Problem("corrupt", str(exc), fqn=fqn, file=file))
            except SharedStorageError as exc:
                problems.append(Problem("storage_overlap", str(exc), fqn=fqn, file=file))
            except CheckpointError as exc:
                problems.append(Problem("unreadable", str(exc), fqn=fqn, file=file))
            else:
                if isinstance(st, StoredTensor) and st.nbytes:  # an encoded item's values lie in its decoded bytes
                    lo, n = (chunk.offset, chunk.length) if st.encoded and chunk else (st.data_offset, st.nbytes)
                    located.append((file, lo, lo + n, fqn))
    problems += [Problem("unreadable", f"{why}; {count(n, 'entry', 'entries')} stored in it not checked", file=f)
                 for f, (why, n) in unopenable.items()]
    if ckpt.located is None:  # a format that located the values itself shares records on purpose (tied weights)
        problems += overlap_problems(located, same_start=True)
    return problems
