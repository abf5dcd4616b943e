"""The whole-tensor fast paths of the one chunk reader: many small tensors' values from a few reads
(``whole_values``), and a tensor's row-major bytes read straight from its chunks' runs (``flat_runs`` and
``read_runs``: what export, diff, digests and reshard stream), and the kernel's copy of stored bytes into an output
(``copy_range``'s zero-copy path). Each reads stored bytes as they lie in the file, so
an item whose values must be decoded first (``StoredTensor.encoded``: a compressed item) takes none of them: the
reader's ``read_tensor`` decodes and assembles it. :class:`RunReads` is a part of :class:`.chunks.ChunkReader`.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..crc import crc32
from ..errors import CheckpointError
from ..progress import Progress
from .dtypes import torch_dtype
from .items import StoredTensor
from .layout import coverage
from .model import ITEMSIZE, Chunk, TensorEntry, contiguous_strides

if TYPE_CHECKING:
    from .codecs import ItemCodec
    from .model import Checkpoint

COPY_BLOCK = 16 << 20
_local = threading.local()
# One kernel copy at a time: copies into one output serialise on its inode lock anyway, and several at once on
# 2 cores took 2-3x longer in all than one after the other (the other export threads meanwhile locate items,
# assemble tensors or verify).
_KERNEL_COPIES = threading.Lock()


def thread_buffer(size: int = COPY_BLOCK) -> memoryview:
    """This thread's block buffer of ``size`` bytes (made once per thread and size)."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    buf = buffers.get(size)
    if buf is None:
        buf = buffers[size] = memoryview(bytearray(size))
    return buf


class RunReads:
    """The fast paths over whole tensors; the reader's ranges, handles, locating and CRC32 errors are its own."""

    ckpt: Checkpoint
    codec: ItemCodec
    handles: Any
    _columns: tuple[list, ...] | None
    _owners: dict[tuple[str, int], tuple[str, tuple[int, ...]]]
    # the reader's own, declared for the type checker (``ChunkReader`` defines them)
    _size: Callable[[str], int]
    locate: Callable[[str, Chunk], StoredTensor]
    _corrupt: Callable[[str, Chunk, StoredTensor, int], CheckpointError]  # a CorruptChunkError

    def whole_values(self, entries: list[TensorEntry], limit: int, block: int = 16 << 20
                     ) -> Iterator[tuple[TensorEntry, memoryview | None]]:
        """Each entry's values as C-contiguous bytes, in the given order, stored CRC32s checked: entries whose
        records lie near each other in a file are read together, one read per ``block`` bytes (a file of
        300,000 small tensors is a few dozen reads, not 300,000). None for an entry that is not one whole
        chunk stored contiguously in at most ``limit`` bytes (read it with :meth:`read_tensor`)."""
        cols = None
        if self.codec.raw_values or self.ckpt.located is not None:
            cols = self._columns
            if cols is None:  # once per reader: an export asks for a few tensors at a time, thousands of times
                cols = self._columns = self._raw_columns()
        pending: list[tuple] = []
        start = end = 0
        for e in entries:
            run = self._whole_run(e, limit) if cols is None else self._raw_run(e, limit, cols) \
                if self.ckpt.located is None else self._located_run(e, limit, cols)
            if run is None:
                yield from self._gathered(pending, start, end)
                pending = []
                yield e, None
                continue
            lo, hi = run[3], run[3] + run[4]
            if pending and (run[1] != pending[0][1] or lo < start or hi - start > block):
                yield from self._gathered(pending, start, end)
                pending = []
            if not pending:
                start = end = lo
            pending.append(run)
            end = max(end, hi)
        yield from self._gathered(pending, start, end)

    def _raw_columns(self) -> tuple[list, ...]:
        """The chunk table as lists (file name, byte offset, length, dims start, dims) for :meth:`_raw_run`."""
        t = self.ckpt.chunk_table
        names = [f.name for f in self.ckpt.files]
        return ([names[i] if i >= 0 else "" for i in t.file.tolist()], t.byte_offset.tolist(), t.length.tolist(),
                t.dim_start.tolist(), t.dims.tolist())

    def _raw_run(self, e: TensorEntry, limit: int, cols: tuple[list, ...]) -> tuple | None:
        """:meth:`_whole_run` of a checkpoint whose chunks' byte ranges are the values (safetensors), from the
        chunk table's columns: the checks :meth:`locate` makes, without a Chunk or StoredTensor per entry."""
        files, offsets, lengths, dim_start, dims = cols
        j = e.first_chunk
        nd = len(e.shape)
        need = e.numel * ITEMSIZE.get(e.dtype, 1)
        file, off, length = files[j], offsets[j], lengths[j]
        d = dims[dim_start[j]:dim_start[j] + 2 * nd]
        if e.chunk_count != 1 or not 0 < need <= limit or length != need or not file or any(d[:nd]) or \
                tuple(d[nd:]) != tuple(e.shape) or off < 0 or off + length > self._size(file):
            return None
        offsets_key = tuple(d[:nd])
        if self._owners.setdefault((file, off), (e.fqn, offsets_key)) != (e.fqn, offsets_key):
            return None  # another entry's bytes: read_tensor says so
        return e, file, None, off, length, None, 0, length

    def _located_run(self, e: TensorEntry, limit: int, cols: tuple[list, ...]) -> tuple | None:
        """:meth:`_whole_run` of a checkpoint whose format located every tensor (a torch file's records) for a
        tensor whose view is its whole record: the checks :meth:`locate` makes, without a Chunk per entry."""
        files, offsets, _, dim_start, dims = cols
        j = e.first_chunk
        nd = len(e.shape)
        need = e.numel * ITEMSIZE.get(e.dtype, 1)
        file = files[j]
        d = dims[dim_start[j]:dim_start[j] + 2 * nd]
        st = self.ckpt.located.get((e.fqn, file, offsets[j])) if self.ckpt.located is not None else None
        if st is None or e.chunk_count != 1 or not 0 < need <= limit or any(d[:nd]) or \
                tuple(d[nd:]) != tuple(e.shape) or st.storage_offset or st.nbytes != need or st.dtype != e.dtype \
                or tuple(st.shape) != tuple(e.shape) or not st.contiguous or \
                st.data_offset + st.nbytes > self._size(file):
            return self._whole_run(e, limit)  # the general way (a view into a larger record, a damaged file, ...)
        return e, file, None, st.data_offset, st.nbytes, st.crc32, 0, st.nbytes

    def _whole_run(self, e: TensorEntry, limit: int) -> tuple | None:
        """(entry, file, chunk, record offset, record bytes, stored CRC32, values start, values bytes) for a
        tensor stored as one whole chunk, contiguous, 1..limit bytes; None for any other."""
        if e.chunk_count != 1 or not 0 < e.numel * ITEMSIZE.get(e.dtype, 1) <= limit:
            return None
        chunk = e.chunks[0]
        if any(chunk.offsets) or tuple(chunk.sizes) != tuple(e.shape):
            return None
        st = self.locate(e.fqn, chunk)
        if st.encoded or not st.contiguous or st.nbytes > limit or st.dtype != e.dtype:
            return None
        elem = ITEMSIZE.get(st.dtype, 1)
        return e, chunk.file, chunk, st.data_offset, st.nbytes, st.crc32, st.storage_offset * elem, st.numel * elem

    def _gathered(self, pending: list[tuple], start: int, end: int) -> Iterator[tuple[TensorEntry, memoryview]]:
        """The values of ``pending`` (records of one file within ``start``..``end``) from one read."""
        if not pending:
            return
        data = memoryview(self.handles.read(pending[0][1], start, end - start))
        for e, _, chunk, lo, nbytes, stored, vstart, vlen in pending:
            record = data[lo - start:lo - start + nbytes]
            if stored is not None:
                crc = crc32(record)
                if crc != stored:
                    chunk = chunk or e.chunks[0]
                    raise self._corrupt(e.fqn, chunk, self.locate(e.fqn, chunk), crc)
            yield e, record[vstart:vstart + vlen]

    def flat_runs(self, entry: TensorEntry) -> list[tuple[int, Chunk, StoredTensor]] | None:
        """The tensor's chunks as runs of its row-major bytes: (first byte in the whole tensor, chunk, where its
        values are), in order, when every chunk is one contiguous run of the whole tensor (a dim-0 shard, what
        FSDP writes, or one chunk per tensor) stored contiguously and the runs tile the tensor; None otherwise
        (:meth:`read_tensor` assembles those). Locates every chunk, so bad metadata raises as a read would."""
        if not coverage(self.ckpt, entry).exact:
            return None
        elem = torch_dtype(entry.dtype).itemsize
        shape = entry.shape
        full = contiguous_strides(shape)
        runs = []
        for c in entry.chunks:
            if not c.numel:
                return None
            k = next((d for d, s in enumerate(c.sizes) if s != 1), len(shape) - 1)
            if any(c.offsets[d] or c.sizes[d] != shape[d] for d in range(k + 1, len(shape))):
                return None
            st = self.locate(entry.fqn, c)
            if st.encoded or st.dtype != entry.dtype or not st.contiguous or st.nbytes % elem or \
                    st.numel != c.numel:
                return None
            runs.append((sum(o * s for o, s in zip(c.offsets, full, strict=True)) * elem, c, st))
        runs.sort(key=lambda r: r[0])
        pos = 0
        for start, c, _ in runs:
            if start != pos:
                return None
            pos += c.numel * elem
        return runs if pos == entry.numel * elem else None

    def read_runs(self, entry: TensorEntry, runs: list[tuple[int, Chunk, StoredTensor]], window: int,
                  take: Callable[[int], memoryview], check: bool = True) -> Iterator[memoryview]:
        """The whole tensor's row-major bytes in windows of ``window`` bytes (the last one shorter), each read
        into a buffer from ``take(n)`` straight from the runs of :meth:`flat_runs`: large sequential reads, no
        assembled tensor. A record's stored CRC32 is computed over the bytes as they are read (and over any of
        its bytes outside the view), so nothing is read twice; CorruptChunkError as soon as a record ends with a
        CRC32 that does not match. ``check=False`` skips the CRC32s (a second read of bytes already checked)."""
        elem = torch_dtype(entry.dtype).itemsize
        total = entry.numel * elem
        todo = iter(runs)
        chunk: Chunk | None = None
        st: StoredTensor | None = None
        vstart = count = done = crc = 0
        for w0 in range(0, total, window):
            buf = take(min(window, total - w0))
            filled = 0
            while filled < len(buf):
                if chunk is None or done == count:
                    _, chunk, st = next(todo)
                    vstart, count, done = st.storage_offset * elem, st.numel * elem, 0
                    crc = self._crc_range(chunk.file, st.data_offset, vstart, 0) if check and st.crc32 is not None \
                        else 0
                assert st is not None
                n = min(len(buf) - filled, count - done)
                view = buf[filled:filled + n]
                self.handles.readinto(chunk.file, st.data_offset + vstart + done, view)
                if check and st.crc32 is not None:
                    crc = zlib.crc32(view, crc)
                done += n
                filled += n
                if done == count and check and st.crc32 is not None:
                    end = vstart + count
                    crc = self._crc_range(chunk.file, st.data_offset + end, st.nbytes - end, crc)
                    if crc != st.crc32:
                        raise self._corrupt(entry.fqn, chunk, st, crc)
            yield buf

    def _crc_range(self, name: str, offset: int, length: int, crc: int) -> int:
        """``crc`` continued over ``length`` bytes of file ``name`` from ``offset``, read in blocks."""
        if length <= 0:
            return crc
        buf = thread_buffer()
        pos = 0
        while pos < length:
            view = buf[:min(len(buf), length - pos)]
            self.handles.readinto(name, offset + pos, view)
            crc = zlib.crc32(view, crc)
            pos += len(view)
        return crc

    def _kernel_copy(self, chunk: Chunk, src_offset: int, count: int, fd: int, dst_offset: int,
                     progress: Progress | None) -> bool:
        """os.copy_file_range in blocks; False when the file systems cannot (the caller streams instead)."""
        src = self.handles.fd(chunk.file)
        with _KERNEL_COPIES:
            return self._kernel_copy_locked(src, chunk, src_offset, count, fd, dst_offset, progress)

    def _kernel_copy_locked(self, src: int, chunk: Chunk, src_offset: int, count: int, fd: int, dst_offset: int,
                            progress: Progress | None) -> bool:
        import errno
        import os

        done = 0
        while done < count:
            try:
                n = os.copy_file_range(src, fd, min(COPY_BLOCK * 4, count - done), src_offset + done,
                                       dst_offset + done)
            except OSError as exc:
                if done == 0 and exc.errno in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    return False
                raise
            if n <= 0:
                raise CheckpointError(f"{self.handles.where(chunk.file)}: file ends early (truncated shard).",
                                      path=chunk.file)
            done += n
            if progress:
                progress.advance(n)
        return True
