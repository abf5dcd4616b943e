"""Bytes of one output tensor, written at a file offset: copied straight from the shards through
the chunk reader when the layout allows, else assembled (and cast) in memory. Every write returns
the CRC32 of the bytes written, which the verifier later compares with a re-read of the output."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

from ..checkpoint.chunks import ChunkReader, StoredTensor, torch_dtype
from ..checkpoint.model import Chunk, itemsize
from ..crc import crc32, crc32_combine
from ..errors import CheckpointError
from ..progress import Progress
from .atomic import start_writeback
from .hf_transforms import Transform
from .plan import ExportItem
from .stacked_reads import StackedReads, stacked_index

SMALL_ITEM = 1 << 20  # tensors of at most this many bytes are written many at a time (TensorSource._small_runs)
SMALL_RUN = 8 << 20
SMALL_RUN_ITEMS = 4096
BUDGET_FLOOR = 128 << 20  # bytes of assembled tensors in flight, or the largest tensor if bigger


def io_threads() -> int:
    """Worker threads for writing tensors (file I/O and CRC32 release the GIL)."""
    return max(1, min(4, 2 * (os.cpu_count() or 1)))


def pwrite_all(fd: int, buf: Any, offset: int) -> None:
    """Write all of ``buf`` at ``offset`` (os.pwrite may write less than asked)."""
    view = memoryview(buf).cast("B")
    pos = 0
    while pos < len(view):
        pos += os.pwrite(fd, view[pos:], offset + pos)


# ------------------------------------------------------------------ budget for assembled tensors
class ByteBudget:
    """Bounds the bytes of assembled tensors in flight across threads (at least one always fits)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        """Wait until ``n`` more bytes fit under the limit (or nothing is in flight), then take them."""
        with self._cond:
            while self.used and self.used + n > self.limit:
                self._cond.wait()
            self.used += n

    def release(self, n: int) -> None:
        """Give back ``n`` bytes and wake the threads waiting in ``acquire``."""
        with self._cond:
            self.used -= n
            self._cond.notify_all()

    def open_up(self) -> None:
        """Let every waiting thread through (used when the export is being torn down)."""
        with self._cond:
            self.limit = 1 << 62
            self._cond.notify_all()


class TensorSource:
    """Writes output tensors of one checkpoint; the reader checks stored CRC32s on the way in."""

    def __init__(self, reader: ChunkReader, items: list[ExportItem], kernel_copy: bool = False) -> None:
        self.reader = reader
        self.items = items
        self.budget = ByteBudget(max(BUDGET_FLOOR, max((i.nbytes for i in items), default=0)))
        # kernel_copy: whole records are copied by the kernel and proven afterwards, when the verifier
        # re-reads the output and compares with the CRC32 stored in the checkpoint (one pass instead of two).
        self.kernel_copy = kernel_copy
        self.kernel_copied: set[str] = set()  # keys whose bytes only the verifier's re-read has checked
        self.verifier: Any = None  # a verify.Verifier: each tensor written to a named file is checked at once
        self.stacked = StackedReads(reader, items)  # one expert/layer of a stacked tensor: its chunks read once

    def _copyable(self, fqn: str, chunk: Chunk, dtype: str) -> StoredTensor | None:
        """The chunk's stored tensor when it can be copied byte for byte in blocks: the whole storage record
        (whose zip CRC the reader checks), or raw bytes stored without a CRC32 (a safetensors shard: the
        copy computes their CRC32 as it reads them). NOTE: without the second case a safetensors source
        was read whole into memory and copied once more, 2.2x its largest tensor (2.3 GB for 1 GiB)."""
        st = self.reader.direct_copy(fqn, chunk, dtype)
        if st is None or st.storage_offset != 0 or st.numel * itemsize(dtype) != st.nbytes:
            return None
        return st

    def _direct_ranges(self, item: ExportItem) -> list[tuple[Chunk, int, int | None]] | None:
        """(chunk, offset in the output tensor) for chunks that are contiguous row bands stored as-is,
        tiling the tensor exactly; None when the tensor must be assembled."""
        bands = row_bands(item)  # a gap or an overlap: None, the reader assembles (and reports) it
        if bands is None:
            return None
        out = []
        for c, dst in bands:
            st = self._copyable(item.entry.fqn, c, item.entry.dtype)
            if st is None:
                return None
            out.append((c, dst, st.crc32))
        return out

    def write(self, item: ExportItem, fd: int, base: int, progress: Progress | None) -> int:
        """Write the item's bytes at ``base``; returns their CRC32. Their writeback to disk starts at once."""
        crc = self._write(item, fd, base, progress)
        start_writeback(fd, base, item.nbytes)
        return crc

    def _write(self, item: ExportItem, fd: int, base: int, progress: Progress | None) -> int:
        try:
            ranges = self._direct_ranges(item)
            if ranges is not None:
                crc = 0
                for c, dst, part in ranges:
                    if progress:
                        progress.check()
                    n, read = self.reader.copy_range(item.entry.fqn, c, fd, base + dst, progress,
                                                     check_crc=not self.kernel_copy)
                    # part: the CRC32 stored with the record; read: taken as the bytes were read (none stored)
                    crc = crc32_combine(crc, _copied_crc(item.entry.fqn, part, read), n)
                if self.kernel_copy and all(part is not None for _, _, part in ranges):
                    self.kernel_copied.add(item.key)  # set.add is atomic under the GIL
                return crc
            self.budget.acquire(item.nbytes)
            try:
                return write_buffer(fd, base, self.tensor_bytes(item), progress)
            finally:
                self.budget.release(item.nbytes)
        except CheckpointError as exc:
            if exc.fqn:
                raise
            raise CheckpointError(f"{exc} (while exporting tensor {item.entry.fqn})", path=exc.path,
                                  fqn=item.entry.fqn) from None

    def check_source(self, item: ExportItem) -> None:
        """Re-read the item's chunks with their CRC32 checked: raises CorruptChunkError (naming file and
        tensor) when the source, not the output, holds bad bytes."""
        for c in item.entry.chunks:
            self.reader.check_chunk(item.entry.fqn, c)

    def tensor(self, item: ExportItem) -> Any:
        """The whole output tensor in memory (transformed and cast when the plan says so), contiguous: the source
        tensor's stored CRC32s are checked as it is read. One index of a stacked tensor is read from the chunks
        that hold it (``StackedReads``), not the whole stacked tensor."""
        i = stacked_index(item)
        if i is not None and item.transform is not None:
            t = Transform(item.transform.steps[1:]).apply(self.stacked.row(item.entry, i))
        else:
            t = self.reader.read_tensor(item.entry)
            if item.transform is not None:
                t = item.transform.apply(t)
        if item.dtype != item.entry.dtype:
            t = t.to(torch_dtype(item.dtype))
        return t.contiguous()

    def tensor_bytes(self, item: ExportItem) -> memoryview:
        """The raw bytes of output tensor ``item``, ready to write."""
        return tensor_bytes(self.tensor(item))

    def write_all(self, jobs: list[tuple[ExportItem, int, int]], progress: Progress | None,
                  path: str | None = None) -> list[int]:
        """Write (item, fd, offset) jobs on a thread pool; each item has its own byte range. Returns CRCs
        (in the order of ``jobs``). With ``path`` (the file ``fd`` writes) and a verifier, each item's range is
        handed to the verifier as soon as it is written. A remote source is read file after file (see
        :meth:`_copy_by_file`); what is left is read front to back: the jobs start in the order of their items'
        places in the source files, so each planned segment is released soon after it came."""
        out = [0] * len(jobs)
        order = list(range(len(jobs)))
        if not self.reader.handles.local:
            order = self._copy_by_file(jobs, progress, path, out)
            sizes = {f.name: max(1, f.bytes or 0) for f in self.reader.ckpt.files}
            order.sort(key=lambda i: min((c.offset / sizes.get(c.file, 1) for c in jobs[i][0].entry.chunks),
                                         default=0.0))
        verifier = self.verifier if path is not None else None

        def job(item: ExportItem, fd: int, offset: int) -> int:
            crc = self.write(item, fd, offset, progress)
            if verifier is not None:
                verifier.submit(path, offset, item.nbytes, crc, item.key)
            return crc

        # a remote source's leftovers go one by one (whole_values would read outside the planned segments)
        groups = list(self._small_runs(order, jobs)) if self.reader.handles.local else [[i] for i in order]
        calls: list[tuple[Callable, tuple]] = []
        for group in groups:
            if len(group) == 1:
                calls.append((lambda i: [job(*jobs[i])], (group[0],)))
            else:
                calls.append((self._write_small, (group, jobs, progress, path)))
        results = run_parallel(calls, progress, self.budget)
        for group, crcs in zip(groups, results, strict=True):
            for i, crc in zip(group, crcs, strict=True):
                out[i] = crc
        return out

    def _small_runs(self, order: list[int], jobs: list[tuple[ExportItem, int, int]]) -> Iterator[list[int]]:
        """``order`` cut into groups: runs of small tensors (at most SMALL_ITEM bytes, no cast) written back to back
        in one file, up to SMALL_RUN bytes or SMALL_RUN_ITEMS each, and every other job alone. One thread-pool job
        and one write per tensor cost 100 µs: 40 s for a file of 300,000 tensors."""
        group: list[int] = []
        size = end = 0
        fd = -1
        for i in order:
            item, f, offset = jobs[i]
            small = item.nbytes <= SMALL_ITEM and item.dtype == item.entry.dtype and item.transform is None
            if group and (not small or f != fd or offset != end or size + item.nbytes > SMALL_RUN or
                          len(group) >= SMALL_RUN_ITEMS):
                yield group
                group, size = [], 0
            if not small:
                yield [i]
                continue
            group.append(i)
            fd, size, end = f, size + item.nbytes, offset + item.nbytes
        if group:
            yield group

    def _write_small(self, group: list[int], jobs: list[tuple[ExportItem, int, int]], progress: Progress | None,
                     path: str | None) -> list[int]:
        """Small tensors written back to back from ``jobs[group[0]]``'s offset with one write: their values read
        many at a time (stored CRC32s checked, :meth:`ChunkReader.whole_values`), or assembled the general way
        where they are not stored whole; one verifier check for the whole range. Returns each one's CRC32."""
        items = [jobs[i][0] for i in group]
        _, fd, base = jobs[group[0]]
        total = sum(it.nbytes for it in items)
        self.budget.acquire(total)
        try:
            return self._write_run(items, group, jobs, fd, base, total, progress, path)
        finally:
            self.budget.release(total)

    def _write_run(self, items: list[ExportItem], group: list[int], jobs: list[tuple[ExportItem, int, int]], fd: int,
                   base: int, total: int, progress: Progress | None, path: str | None) -> list[int]:
        buf = bytearray(total)
        crcs = []
        pos = 0
        try:
            for item, (_, raw) in zip(items, self.reader.whole_values([it.entry for it in items], SMALL_ITEM),
                                      strict=True):
                data = raw if raw is not None else self.tensor_bytes(item)
                if len(data) != item.nbytes:
                    raise CheckpointError(f"{item.entry.fqn}: read {len(data)} bytes, expected {item.nbytes}.",
                                          fqn=item.entry.fqn)
                buf[pos:pos + len(data)] = data
                crcs.append(crc32(data))
                pos += len(data)
        except CheckpointError as exc:
            if exc.fqn:
                raise
            raise CheckpointError(f"{exc} (while exporting tensors {items[0].key} … {items[-1].key})",
                                  path=exc.path) from None
        pwrite_all(fd, buf, base)
        start_writeback(fd, base, len(buf))
        if progress:
            progress.advance(len(buf))
        if path is not None and self.verifier is not None:
            self.verifier.submit(path, base, len(buf), crc32(buf), f"{items[0].key} … {items[-1].key}",
                                 holds=[jobs[i][2] for i in group])
        return crcs

    def files_at_once(self) -> int | None:
        """How many source files an export of these items reads at the same time: one per thread when every
        item is a set of row bands (copied file after file) or in one file, else all of them (tensor after
        tensor)."""
        return io_threads() if all(row_bands(it) is not None or len({c.file for c in it.entry.chunks}) <= 1
                                   for it in self.items) else None

    def _copy_by_file(self, jobs: list[tuple[ExportItem, int, int]], progress: Progress | None, path: str | None,
                      out: list[int]) -> list[int]:
        """Remote sources: copy every row-band chunk (what the metadata says is one) in the order of the source
        files and of its place in its file, whatever tensor it belongs to, so the threads move through one file
        at a time and hold one or two planned segments each, however many files there are; an item's CRC32 is
        combined from its chunks' once they are all copied. An item of another layout is written whole in the
        same order, where its first chunk lies. Returns the jobs left to write item by item (a row-band item
        with a chunk whose stored bytes cannot be copied as they are)."""
        bands = [row_bands(item) or [] for item, _, _ in jobs]
        parts: list[list[tuple[int, int] | None]] = [[None] * len(b) if b else [] for b in bands]
        failed: set[int] = set()

        def copy(i: int, k: int) -> None:
            item, fd, base = jobs[i]
            chunk, dst = bands[i][k]
            try:
                st = self._copyable(item.entry.fqn, chunk, item.dtype)
                if st is None:
                    failed.add(i)  # set.add is atomic under the GIL; the item is assembled below
                    return
                n, read = self.reader.copy_range(item.entry.fqn, chunk, fd, base + dst, progress)
            except CheckpointError as exc:
                if exc.fqn:
                    raise
                raise CheckpointError(f"{exc} (while exporting tensor {item.entry.fqn})", path=exc.path,
                                      fqn=item.entry.fqn) from None
            parts[i][k] = (_copied_crc(item.entry.fqn, st.crc32, read), n)

        def whole(i: int) -> None:  # an item of another layout, written at once where its first chunk lies
            item, fd, base = jobs[i]
            out[i] = self.write(item, fd, base, progress)
            if path is not None and self.verifier is not None:
                self.verifier.submit(path, base, item.nbytes, out[i], item.key)

        todo: list[tuple[tuple[str, int, int, int], Callable, tuple]] = []
        for i, b in enumerate(bands):
            if b:
                todo += [((c.file, c.offset, i, k), copy, (i, k)) for k, (c, _) in enumerate(b)]
            else:
                first = min(((c.file, c.offset) for c in jobs[i][0].entry.chunks), default=("", 0))
                todo.append(((*first, i, -1), whole, (i,)))
        todo.sort(key=lambda t: t[0])
        run_parallel([(fn, args) for _, fn, args in todo], progress, self.budget)
        left = []
        for i, b in enumerate(bands):
            if not b:
                continue  # written by whole()
            if i in failed:
                left.append(i)
                continue
            item, fd, base = jobs[i]
            crc = 0
            # every band copied: a failed copy raised in run_parallel, an uncopyable one is in `failed`
            for part_crc, n in cast(list[tuple[int, int]], parts[i]):
                crc = crc32_combine(crc, part_crc, n)
            out[i] = crc
            start_writeback(fd, base, item.nbytes)
            if path is not None and self.verifier is not None:
                self.verifier.submit(path, base, item.nbytes, crc, item.key)
        return left


def _copied_crc(fqn: str, stored: int | None, read: int | None) -> int:
    """The CRC32 of a copied range: the one stored with its record, else the one taken as it was read (copy_range
    gives one whenever none is stored)."""
    crc = stored if stored is not None else read
    if crc is None:
        raise CheckpointError(f"tensor {fqn}: no CRC32 stored or read for its copied bytes.", fqn=fqn)
    return crc


def row_bands(item: ExportItem) -> list[tuple[Chunk, int]] | None:
    """From the metadata alone: ``(chunk, offset in the output tensor)`` when the item's chunks are whole rows
    (every dimension but the first complete) that tile it exactly and no cast or transform is asked, sorted by
    offset; else
    None. Whether each chunk's stored bytes can be copied as they are is known only once it is located."""
    e = item.entry
    if item.transform is not None or item.dtype != e.dtype or e.ndim == 0 or not e.numel or not e.chunks:
        return None
    row_bytes = math.prod(e.shape[1:]) * (item.nbytes // e.numel)
    out = []
    for c in e.chunks:
        if any(o != 0 for o in c.offsets[1:]) or tuple(c.sizes[1:]) != tuple(e.shape[1:]):
            return None
        out.append((c, c.offsets[0] * row_bytes))
    out.sort(key=lambda x: x[1])
    pos = 0
    for c, dst in out:
        if dst != pos:
            return None
        pos += c.sizes[0] * row_bytes
    return out if pos == item.nbytes else None


def tensor_bytes(t: Any) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    import torch

    if not t.numel():
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_buffer(fd: int, offset: int, buf: memoryview, progress: Progress | None) -> int:
    """pwrite a buffer; returns its CRC32 (computed before the write, from the source bytes)."""
    crc = crc32(buf)
    pwrite_all(fd, buf, offset)
    if progress:
        progress.advance(len(buf))
    return crc


def run_parallel(calls: list[tuple[Callable, tuple]], progress: Progress | None,
                 budget: ByteBudget | None = None) -> list[Any]:
    """Run calls on the export thread pool; the first error cancels the rest and is raised."""
    with ThreadPoolExecutor(io_threads(), thread_name_prefix="export") as pool:
        futures: list[Future[Any]] = []
        try:  # NOTE: submitting is inside: stopped half-way (Ctrl-C), what was queued is cancelled, not run
            futures.extend(pool.submit(fn, *args) for fn, args in calls)
            return [f.result() for f in futures]
        except BaseException:
            if progress:
                progress.cancel()  # the other workers stop at their next check
            for f in futures:
                f.cancel()
            if budget is not None:
                budget.open_up()
            raise


__all__ = ["ByteBudget", "TensorSource", "crc32_combine", "io_threads", "pwrite_all", "run_parallel",
           "tensor_bytes", "write_buffer"]
