"""SHA-256 digests of a checkpoint: of its files (hashed in parallel, each read once, front to back, with the
digests of the chunk ranges in them taken in the same pass) and of its tensors' logical bytes (the whole tensor
C-contiguous in its stored dtype, fed in row-major order: a tensor stored as runs of its row-major bytes, DCP's
dim-0 shards or one chunk per tensor, is streamed run after run straight from its files; any other layout is
assembled first, see :func:`.sources.tensor_windows`). hashlib, ``preadv`` and zlib release the GIL, so the
thread pool of :func:`readers` (files in parallel) and each file's lanes (:func:`hash_file`) keep several cores busy."""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError
from ..progress import Progress
from .manifest import checkpoint_files  # noqa: F401  (re-exported: hashing a checkpoint starts from its files)
from .model import Checkpoint, ObjectEntry, TensorEntry
from .sources import CheckpointSource, tensor_windows

BLOCK = 8 << 20  # bytes read (and hashed) at a time
BUFFERS = 3  # blocks of a file in flight in :func:`hash_file`: one being read while the lanes hash the others
WINDOW_ELEMS = 1 << 22  # elements of a tensor's bytes hashed at a time
SMALL_TENSOR = 1 << 20  # tensors of at most this many bytes are read many at a time


def readers() -> int:
    """Threads that read and hash at once: min(4, CPUs)."""
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True, slots=True)
class FileHash:
    bytes: int
    sha256: str
    ranges: dict[Any, str]  # range key -> SHA-256 of that byte range (only ranges asked for)


class RangeSink:
    """What a byte range of a file feeds in :func:`hash_file`'s pass, in place of a SHA-256 of its own: ``update``
    with each piece in order, ``close`` once its last byte has passed (never for a file that ends before it).
    ``lane``: which of :func:`hash_file`'s threads feeds it (0: the file's own SHA-256's, for cheap sinks)."""

    lane = 2

    def update(self, data: memoryview) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class TensorKey:
    """The range key of a tensor stored as one run of its row-major bytes: its logical digest is that range's
    SHA-256, hashed on lane 2 unless a chunk range is the very same bytes (one SHA-256 for both)."""

    fqn: str
    lane = 2


class _Lane:
    """Ranges of one file (and, for lane 0, the whole file's SHA-256) fed block after block, in file order: each
    a :class:`RangeSink`, or a list of keys whose range is the same bytes (one SHA-256 for them all)."""

    def __init__(self, ranges: list[tuple[Any, int, int]], whole: Any = None) -> None:
        self.results: dict[Any, Any] = {}  # key -> its hasher
        todo = []
        for target, off, length in ranges:
            if not isinstance(target, RangeSink):
                h = hashlib.sha256()
                self.results.update((key, h) for key in target)
                target = h
            todo.append((target, off, length))
        self.todo = sorted(todo, key=lambda r: r[1])
        self.whole = whole
        self.active: list[tuple[Any, int, int]] = []
        self.nxt = 0

    def feed(self, view: memoryview, pos: int) -> None:
        end = pos + len(view)
        if self.whole is not None:
            self.whole.update(view)
        todo, active = self.todo, self.active
        while self.nxt < len(todo) and todo[self.nxt][1] < end:
            active.append(todo[self.nxt])
            self.nxt += 1
        for target, off, length in active:
            lo, hi = max(off, pos), min(off + length, end)
            if lo < hi:
                target.update(view[lo - pos:hi - pos])
        for target, off, length in active:
            if off + length <= end and isinstance(target, RangeSink):
                target.close()
        self.active = [r for r in active if r[1] + r[2] > end]


def hash_file(full: str, ranges: Iterable[tuple[Any, int, int]] = (), progress: Progress | None = None) -> FileHash:
    """SHA-256 of the file at ``full`` and of each (key, offset, length) range in it, in one front-to-back read
    (keys of the same range share one SHA-256); a key that is a :class:`RangeSink` is fed the range's bytes instead
    (and left out of the result). The file's
    own SHA-256, the ranges' SHA-256s and the sinks are three lanes, each on a thread of its own while this one
    reads (hashlib and reads let go of the GIL), so the hashes of the same bytes run on several cores at once."""
    whole = hashlib.sha256()
    groups: dict[int, list[tuple[Any, int, int]]] = {0: [], 1: [], 2: []}
    same: dict[tuple[int, int], list[Any]] = {}  # plain keys by their byte range
    for key, off, length in ranges:
        if isinstance(key, RangeSink):
            groups[key.lane].append((key, off, length))
        else:
            same.setdefault((off, length), []).append(key)
    for (off, length), keys in same.items():  # a range alone keeps its key's lane; shared ones go to lane 1
        groups[getattr(keys[0], "lane", 1) if len(keys) == 1 else 1].append((keys, off, length))
    lanes = [_Lane(groups[0], whole)] + [_Lane(groups[k]) for k in (1, 2) if groups[k]]
    with open(full, "rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size <= BLOCK:  # one block: no threads
            buf = bytearray(BLOCK)
            pos = 0
            while n := f.readinto(buf):
                for lane in lanes:
                    lane.feed(memoryview(buf)[:n], pos)
                pos += n
                if progress:
                    progress.advance(n)
        else:
            pos = _pipeline(f, lanes, progress)
    return FileHash(pos, whole.hexdigest(), {k: h.hexdigest() for lane in lanes for k, h in lane.results.items()})


def _pipeline(f: Any, lanes: list[_Lane], progress: Progress | None) -> int:
    """Read ``f`` front to back into :data:`BUFFERS` blocks in turn while every lane, on a thread of its own,
    feeds each block in order; a block is read into again once every lane is done with it. Returns the bytes
    read; the first error (a lane's, the read's, a cancel) stops it and is raised."""
    bufs = [bytearray(BLOCK) for _ in range(BUFFERS)]
    free: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(BUFFERS):
        free.put(i)
    inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in lanes]
    pending = [0] * BUFFERS
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(lane: _Lane, inbox: queue.SimpleQueue) -> None:
        while (item := inbox.get()) is not None:
            i, pos, n = item
            try:
                if not errors:
                    lane.feed(memoryview(bufs[i])[:n], pos)
            except BaseException as exc:  # raised by the reading thread
                errors.append(exc)
            with lock:
                pending[i] -= 1
                if not pending[i]:
                    free.put(i)

    threads = [threading.Thread(target=work, args=(lane, inbox), name="digest-lane", daemon=True)
               for lane, inbox in zip(lanes, inboxes, strict=True)]
    for t in threads:
        t.start()
    pos = 0
    try:
        while not errors:
            i = free.get()
            n = f.readinto(bufs[i])
            if not n:
                break
            pending[i] = len(lanes)  # NOTE: set before the block is handed out; no lane holds block i now
            for inbox in inboxes:
                inbox.put((i, pos, n))
            pos += n
            if progress:
                progress.advance(n)
    finally:
        for inbox in inboxes:
            inbox.put(None)
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return pos


def hash_files(root: str, is_folder: bool, names: Iterable[str], ranges: dict[str, list[tuple[Any, int, int]]],
               progress: Progress | None = None) -> dict[str, FileHash]:
    """:func:`hash_file` of every name (relative to the checkpoint at ``root``), largest first, on
    :func:`readers` threads; ``ranges``: per name, the ranges to hash too."""
    folder = root if is_folder else os.path.dirname(root)

    def one(rel: str) -> FileHash:
        if progress:
            progress.check()
        return hash_file(os.path.join(folder, *rel.split("/")), ranges.get(rel, ()), progress)

    todo = sorted(names, key=lambda r: -_size(os.path.join(folder, *r.split("/"))))
    return dict(zip(todo, parallel(one, todo, progress), strict=True))


def _size(full: str) -> int:
    try:
        return os.stat(full).st_size
    except OSError:
        return 0


def parallel(fn: Callable[[Any], Any], items: list[Any], progress: Progress | None) -> list[Any]:
    """``fn`` of every item on :func:`readers` threads, in order; the first error cancels the rest."""
    with ThreadPoolExecutor(readers(), thread_name_prefix="digest") as pool:
        futures = [pool.submit(fn, x) for x in items]
        try:
            return [f.result() for f in futures]
        except BaseException:
            if progress:
                progress.cancel()
            for f in futures:
                f.cancel()
            raise


def chunk_ranges(ckpt: Checkpoint) -> dict[str, list[tuple[tuple[int, int], int, int]]]:
    """Per file name: ((tensor index, chunk index), offset, length) of every stored chunk in it."""
    t = ckpt.chunk_table
    names = [f.name for f in ckpt.files]
    out: dict[str, list] = {}
    for j, (ti, fi, off, ln) in enumerate(zip(t.tensor.tolist(), t.file.tolist(), t.byte_offset.tolist(),
                                              t.length.tolist(), strict=True)):
        if fi >= 0:
            out.setdefault(names[fi], []).append(((ti, j - ckpt.tensors[ti].first_chunk), off, ln))
    return out


def tensor_digests(source: CheckpointSource, entries: list[TensorEntry], progress: Progress | None = None,
                   errors: dict[str, CheckpointError] | None = None) -> dict[str, str]:
    """fqn -> SHA-256 of the tensor's logical bytes, stored CRC32s checked on the way (a chunk whose bytes
    changed raises CorruptChunkError naming it; with ``errors``, a tensor that cannot be read is put there
    instead and the others are still hashed). Small tensors are read many at a time."""
    out: dict[str, str] = {}
    small = [e for e in entries if e.nbytes <= SMALL_TENSOR]
    large = [e for e in entries if e.nbytes > SMALL_TENSOR]
    try:
        for e, raw in source.small_values(small, SMALL_TENSOR):
            if raw is None:
                large.append(e)
            else:
                out[e.fqn] = hashlib.sha256(raw).hexdigest()
                if progress:
                    progress.advance(len(raw))
    except CheckpointError:
        if errors is None:
            raise
        large += [e for e in small if e.fqn not in out and e not in large]  # one at a time: which one is bad

    def one(e: TensorEntry) -> str | None:
        try:
            return _tensor_digest(source, e, progress)
        except CheckpointError as exc:
            if errors is None:
                raise
            errors[e.fqn] = exc
            return None

    out.update((e.fqn, h) for e, h in zip(large, parallel(one, large, progress), strict=True) if h is not None)
    return out


def _tensor_digest(source: CheckpointSource, e: TensorEntry, progress: Progress | None) -> str:
    h = hashlib.sha256()
    buf = bytearray(0)

    def take(n: int) -> memoryview:  # one buffer, read into again: each window is hashed before the next
        nonlocal buf
        if len(buf) < n:
            buf = bytearray(n)
        return memoryview(buf)[:n]

    for window in tensor_windows(source, e.fqn, WINDOW_ELEMS, take):
        h.update(window)
        if progress:
            progress.advance(len(window))
    return h.hexdigest()


def object_digest(source: CheckpointSource, obj: ObjectEntry) -> str:
    """SHA-256 of a non-tensor entry's stored bytes (a value held in a file's header: of its ``repr``)."""
    if obj.inline or obj.file is None:
        return hashlib.sha256(repr(obj.value).encode()).hexdigest()
    return hashlib.sha256(source.reader.read_object_bytes(obj)).hexdigest()


def bytes_digest(data: Any) -> str:
    """SHA-256 of a buffer, hex."""
    return hashlib.sha256(data).hexdigest()
