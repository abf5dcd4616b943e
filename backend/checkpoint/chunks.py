"""The one chunk reader: the bytes of a chunk, by file and byte range, for every storage variant.

Every consumer reads tensor bytes through :class:`ChunkReader`: the inspector's values, ``show``, deep
verify, export (``copy_range`` for the zero-copy path), diff, reshard and import's verification. It
dispatches once over the storage variants (a ``torch.save`` zip item in a ``.distcp``, a safetensors blob
in a ``.distcp``, the raw ranges of a ``HuggingFaceStorageWriter`` folder; local or remote files through
:mod:`.storage`), caches where each chunk's values are, checks every range against the file before
reading, and checks the stored CRC32 in the same pass as the read.
"""

from __future__ import annotations

import io
import logging
import math
import threading
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..crc import crc32
from ..errors import CheckpointError
from ..progress import Progress
from .items import (
    ZIP_LOCAL,
    ItemFormatError,
    RecordCrcError,
    StoredTensor,
    check_object_archive,
    parse_torch_item,
)
from .layout import coverage
from .model import ITEMSIZE, Checkpoint, Chunk, ObjectEntry, TensorEntry, contiguous_strides
from .safetensors_items import SafetensorsHeader, parse_safetensors_header
from .storage import LocalHandles, RemoteHandles, open_folder
from .unpickler import allow_torch_safe_globals

log = logging.getLogger(__name__)
# A damaged non-tensor entry can name any pickle protocol; torch.load then warns on stderr before it fails
# (or not). The entry's fate is reported once, as a problem or an error naming it: not as terminal noise.
warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)

COPY_BLOCK = 16 << 20
REMOTE_COPY_BLOCK = 4 << 20  # remote bytes are already in memory (a planned segment): a small block is one memcpy
MAX_OBJECT_BYTES = 1 << 30  # a non-tensor entry (an optimizer step, an lr) is small; refuse a 1 GiB pickle


class CorruptChunkError(CheckpointError):
    """The bytes read do not match the CRC32 stored with them: the file changed on disk."""


class SharedStorageError(CheckpointError):
    """Two chunks' metadata point at the same stored bytes: one of them would read the other's values."""


def torch_dtype(name: str) -> Any:
    """The ``torch.dtype`` for a short dtype name, or a CheckpointError when this torch lacks it."""
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"dtype {name} is not known to this torch ({torch.__version__}).")
    return dt


def safe_name(name: str) -> bool:
    """True for a plain file name inside the folder (what torch's writers produce): no separators, no ``..``."""
    return bool(name) and isinstance(name, str) and "/" not in name and "\\" not in name and "\0" not in name \
        and name not in (".", "..")


_local = threading.local()
# One kernel copy at a time: copies into one output serialise on its inode lock anyway, and several at once on
# 2 cores took 2-3x longer in all than one after the other (the other export threads meanwhile locate items,
# assemble tensors or verify).
_KERNEL_COPIES = threading.Lock()


def _thread_buffer() -> memoryview:
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(bytearray(COPY_BLOCK))
    return buf


def _small_buffer() -> memoryview:
    buf = getattr(_local, "small", None)
    if buf is None:
        buf = _local.small = memoryview(bytearray(REMOTE_COPY_BLOCK))
    return buf


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    import os

    pos = 0
    while pos < len(view):
        pos += os.pwrite(fd, view[pos:], offset + pos)


class ChunkReader:
    """Reads chunks and entries of one checkpoint; keeps files open and caches where values are.
    Thread-safe for reads (local reads use ``pread``)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        folder = ckpt.folder if ckpt.folder is not None else open_folder(ckpt.path)
        self.handles: LocalHandles | RemoteHandles = folder.handles()
        if not self.handles.local:  # remote: a read inside an item fetches the whole item (one request)
            t = ckpt.chunk_table
            self.handles.plan_table([f.name for f in ckpt.files], t.file, t.byte_offset, t.length)
        self._located: dict[tuple[str, int, str], StoredTensor] = {}
        self._blobs: dict[tuple[str, int], SafetensorsHeader] = {}
        self._sizes: dict[str, int] = {}
        self._owners: dict[tuple[str, int], tuple[str, tuple[int, ...]]] = {}
        self._verified: set[tuple[str, int]] = set()  # records whose whole CRC32 was checked (see _trimmed)
        self._verify_lock = threading.Lock()
        self._columns: tuple[list, ...] | None = None  # the chunk table as lists, for whole_values (made once)

    def close(self) -> None:
        """Close the files this reader opened."""
        self.handles.close()

    def plan_reads(self, chunks: Iterable[Chunk], objects: Iterable[ObjectEntry] = (),
                   files_at_once: int | None = None) -> int | None:
        """Tell remote handles every item this job will read, each once (an export's tensors and entries, a
        deep verify's chunks): their bytes then come in fixed segments, one GET each, the same on every run
        (see ``remote_reads.plan_segments``); ``files_at_once`` as ``RemoteHandles.plan_reads`` takes it. Returns the
        planned GETs (None for local files: nothing to plan)."""
        if self.handles.local:
            return None
        ranges = [(c.file, c.offset, c.offset + c.length) for c in chunks if c.file and c.length > 0]
        ranges += [(o.file, o.offset, o.offset + o.length) for o in objects if o.file and not o.inline and o.length > 0]
        return self.handles.plan_reads(ranges, files_at_once)

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ ranges
    def _size(self, name: str) -> int:
        size = self._sizes.get(name)
        if size is None:
            if not safe_name(name):
                raise CheckpointError(f"{self.ckpt.path}: refusing to open {name!r}: not a plain file name "
                                      "inside the checkpoint folder.", path=self.ckpt.path)
            size = self._sizes[name] = self.handles.size(name)
        return size

    def file_size(self, name: str) -> int:
        """Bytes in data file ``name``, opening it (once); CheckpointError when it cannot be opened."""
        return self._size(name)

    def _check_range(self, name: str, offset: int, length: int, what: str) -> None:
        size = self._size(name)
        if offset < 0 or length < 0 or offset + length > size:
            where = self.handles.where(name)
            raise CheckpointError(f"{where}: {what} needs bytes {offset}..{offset + length} but the file has "
                                  f"{size}: the file is truncated or the metadata is wrong.", path=where)

    def _where(self, fqn: str, chunk: Chunk) -> str:
        return f"{self.handles.where(chunk.file)} (tensor {fqn}, chunk at offsets {list(chunk.offsets)})"

    def _error(self, fqn: str, chunk: Chunk, text: str, cls: type[CheckpointError] = CheckpointError
               ) -> CheckpointError:
        return cls(f"{self._where(fqn, chunk)}: {text}", fqn=fqn, path=self.handles.where(chunk.file))

    # ------------------------------------------------------------ where values are
    def locate(self, fqn: str, chunk: Chunk) -> StoredTensor:
        """Where a chunk's values are, checked against the metadata and the file (cached per chunk)."""
        key = (chunk.file, chunk.offset, fqn)
        st = self._located.get(key)
        if st is None:
            try:
                st = self._locate(fqn, chunk)
            except CheckpointError as exc:
                if exc.fqn:
                    raise
                raise CheckpointError(f"{exc} (tensor {fqn}, chunk at offsets {list(chunk.offsets)})",
                                      path=exc.path, fqn=fqn) from None
            if self.ckpt.located is None:  # pre-located storages may be shared on purpose (tied weights)
                self._claim(fqn, chunk, st)
            self._located[key] = st
        return st

    def _claim(self, fqn: str, chunk: Chunk, st: StoredTensor) -> None:
        """Refuse a chunk whose stored bytes another chunk already read as its own (a metadata pointing
        two entries at one item would otherwise give one tensor's values to both)."""
        if not st.nbytes:
            return
        owner = self._owners.setdefault((chunk.file, st.data_offset), (fqn, chunk.offsets))
        if owner != (fqn, chunk.offsets):
            raise self._error(fqn, chunk, f"its stored bytes are those of {owner[0]} (chunk at offsets "
                                          f"{list(owner[1])}): the metadata points two entries at one item.",
                              SharedStorageError)

    def _locate(self, fqn: str, chunk: Chunk) -> StoredTensor:
        located = self.ckpt.located
        if located is not None:  # the format located every tensor (a torch file's records, which tied weights share)
            return self._prelocated(fqn, chunk, located)
        if not chunk.file:
            raise CheckpointError(f"{fqn}: chunk at offsets {list(chunk.offsets)} has no storage entry.", fqn=fqn)
        dtype = self.ckpt.tensor(fqn).dtype
        self._check_range(chunk.file, chunk.offset, chunk.length, "the item")
        try:
            st = self._stored(fqn, chunk, dtype)
        except RecordCrcError as exc:
            raise self._error(fqn, chunk, f"{exc}: the bytes changed on disk.", CorruptChunkError) from None
        except ItemFormatError as exc:
            raise self._error(fqn, chunk, f"item cannot be decoded ({exc}).") from None
        if st.dtype != dtype:
            raise self._error(fqn, chunk, f"item holds {st.dtype}, metadata says {dtype}.")
        if tuple(st.shape) != tuple(chunk.sizes):
            raise self._error(fqn, chunk, f"item has shape {list(st.shape)}, metadata says {list(chunk.sizes)}.")
        if (st.storage_offset + st.span()) * ITEMSIZE.get(dtype, 1) > st.nbytes:
            raise self._error(fqn, chunk, "item storage is shorter than its view.")
        self._check_range(chunk.file, st.data_offset, st.nbytes, f"tensor {fqn}'s storage")
        return st

    def _prelocated(self, fqn: str, chunk: Chunk, located: dict[tuple[str, str, int], StoredTensor]
                    ) -> StoredTensor:
        st = located.get((fqn, chunk.file, chunk.offset))
        if st is None:
            raise self._error(fqn, chunk, "its values were not located in the file (see the checkpoint's problems).")
        if st.nbytes:
            self._check_range(chunk.file, st.data_offset, st.nbytes, f"tensor {fqn}'s storage")
        if (st.storage_offset + st.span()) * ITEMSIZE.get(st.dtype, 1) > st.nbytes and st.numel:
            raise self._error(fqn, chunk, "item storage is shorter than its view.")
        return self._trimmed(fqn, chunk, st)

    def _trimmed(self, fqn: str, chunk: Chunk, st: StoredTensor) -> StoredTensor:
        """A contiguous view of part of a larger record (a parameter's slice of a DeepSpeed flat partition): the
        whole record's stored CRC32 is checked once for this reader (read in blocks), after which only the view's
        bytes are read, as bytes without a stored checksum (an export then proves its copy against the CRC32 of
        those bytes as they were read). Without this every slice would re-read its whole partition."""
        elem = ITEMSIZE.get(st.dtype, 1)
        start, count = st.storage_offset * elem, st.numel * elem
        if st.crc32 is None or not st.contiguous or count >= st.nbytes:
            return st
        key = (chunk.file, st.data_offset)
        with self._verify_lock:
            if key not in self._verified:
                self._stream(fqn, chunk, st, None, 0, 0, 0, None)  # raises CorruptChunkError naming the tensor
                self._verified.add(key)
        return StoredTensor(st.dtype, st.shape, contiguous_strides(st.shape), 0, st.data_offset + start, count, None)

    def _stored(self, fqn: str, chunk: Chunk, dtype: str) -> StoredTensor:
        """The one dispatch over storage variants."""
        if self.ckpt.raw_values:  # the chunk's byte range is the raw data itself
            need = math.prod(chunk.sizes) * max(1, ITEMSIZE.get(dtype, 1))
            if chunk.length != need:  # the safetensors library refuses such a header: never read a prefix
                raise ItemFormatError(f"{chunk.length} bytes stored for shape {list(chunk.sizes)} of {dtype}, "
                                      f"which needs {need}")
            return StoredTensor(dtype, tuple(chunk.sizes), contiguous_strides(chunk.sizes), 0, chunk.offset,
                                chunk.length, None)
        magic = self.handles.read(chunk.file, chunk.offset, 4) if chunk.length >= 4 else b""
        if magic == ZIP_LOCAL:
            return parse_torch_item(self.handles, chunk.file, chunk.offset, chunk.length)
        # SerializationFormat.SAFETENSORS: the item offset is where the file's safetensors blob starts.
        blob_key = (chunk.file, chunk.offset)
        blob = self._blobs.get(blob_key)
        if blob is None:
            blob = parse_safetensors_header(self.handles, chunk.file, chunk.offset, self._size(chunk.file))
            self._blobs[blob_key] = blob
        st = blob.tensors.get(fqn)
        if st is None:
            raise ItemFormatError(f"tensor {fqn} is not in the safetensors header")
        return st

    def direct_copy(self, fqn: str, chunk: Chunk, dtype: str) -> StoredTensor | None:
        """The chunk's StoredTensor when its values are stored as-is (``dtype``, contiguous), so
        :meth:`copy_range` can copy them byte for byte; None when they must be assembled."""
        st = self.locate(fqn, chunk)
        return st if st.dtype == dtype and st.contiguous else None

    # ------------------------------------------------------------ reading
    def _read_checked(self, fqn: str, chunk: Chunk, st: StoredTensor, buf: memoryview) -> None:
        self.handles.readinto(chunk.file, st.data_offset, buf)
        if st.crc32 is not None:
            crc = crc32(buf)
            if crc != st.crc32:
                raise self._corrupt(fqn, chunk, st, crc)

    def _corrupt(self, fqn: str, chunk: Chunk, st: StoredTensor, crc: int) -> CorruptChunkError:
        return self._error(fqn, chunk, f"fails its CRC32 check (stored {st.crc32:08x}, read {crc:08x}): the "
                                       "bytes changed on disk.", CorruptChunkError)  # type: ignore[return-value]

    def read_chunk(self, fqn: str, chunk: Chunk, dtype: str) -> Any:
        """The chunk as a torch tensor of ``chunk.sizes``; its CRC32 checked in the same pass as the read."""
        import torch

        st = self.locate(fqn, chunk)
        tdtype = torch_dtype(dtype)
        if st.nbytes % tdtype.itemsize:
            raise self._error(fqn, chunk, f"item storage of {st.nbytes} bytes is not a whole number of {dtype}.")
        if not st.nbytes:
            self._release(chunk)
            return torch.empty(st.shape, dtype=tdtype)
        raw = torch.empty(st.nbytes, dtype=torch.uint8)  # NOTE: not a bytearray, which is zero-filled first
        self._read_checked(fqn, chunk, st, memoryview(raw.numpy()))
        self._release(chunk)
        return raw.view(tdtype).as_strided(st.shape, st.stride, st.storage_offset)

    def read_tensor(self, entry: TensorEntry, progress: Progress | None = None) -> Any:
        """The whole tensor assembled from its chunks (reads only this tensor's items)."""
        import torch

        if not coverage(self.ckpt, entry).exact:  # also bounds the allocation by the bytes really stored
            raise CheckpointError(f"{self.ckpt.path}: the chunks of {entry.fqn} do not tile its shape "
                                  f"{list(entry.shape)} (see `shardscope verify`), so its values cannot be "
                                  "assembled.", path=self.ckpt.path, fqn=entry.fqn)
        chunks = entry.chunks
        for c in chunks:  # every chunk's bytes exist before the tensor is allocated
            self.locate(entry.fqn, c)
        if progress:
            progress.start(len(chunks), f"reading {entry.fqn}")
        if len(chunks) == 1:  # the whole tensor (coverage is exact): its stored values, copied only if strided
            t = self.read_chunk(entry.fqn, chunks[0], entry.dtype)
            if progress:
                progress.advance(1)
            return t if t.is_contiguous() and tuple(t.shape) == tuple(entry.shape) else t.contiguous().reshape(
                entry.shape)
        out = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
        for c in chunks:
            t = self.read_chunk(entry.fqn, c, entry.dtype)
            out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))].copy_(t)
            if progress:
                progress.advance(1)
        return out

    def whole_values(self, entries: list[TensorEntry], limit: int, block: int = 16 << 20
                     ) -> Iterator[tuple[TensorEntry, memoryview | None]]:
        """Each entry's values as C-contiguous bytes, in the given order, stored CRC32s checked: entries whose
        records lie near each other in a file are read together, one read per ``block`` bytes (a file of
        300,000 small tensors is a few dozen reads, not 300,000). None for an entry that is not one whole
        chunk stored contiguously in at most ``limit`` bytes (read it with :meth:`read_tensor`)."""
        cols = None
        if self.ckpt.raw_values or self.ckpt.located is not None:
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
        if not st.contiguous or st.nbytes > limit or st.dtype != e.dtype:
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
            if st.dtype != entry.dtype or not st.contiguous or st.nbytes % elem or st.numel != c.numel:
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
        buf = _thread_buffer()
        pos = 0
        while pos < length:
            view = buf[:min(len(buf), length - pos)]
            self.handles.readinto(name, offset + pos, view)
            crc = zlib.crc32(view, crc)
            pos += len(view)
        return crc

    def check_chunk(self, fqn: str, chunk: Chunk) -> StoredTensor:
        """Deep verification of one chunk: located, every stored byte read once and its CRC32 checked.
        Reads in blocks (memory bounded by the block, not the chunk)."""
        st = self.locate(fqn, chunk)
        self._stream(fqn, chunk, st, None, 0, 0, 0, None)
        self._release(chunk)
        return st

    def copy_range(self, fqn: str, chunk: Chunk, fd: int, dst_offset: int, progress: Progress | None = None,
                   check_crc: bool = True) -> tuple[int, int | None]:
        """Copy a directly copyable chunk's value bytes into ``fd`` at ``dst_offset``, in fixed-size blocks;
        returns the bytes copied and, for a chunk stored without a CRC32 (a safetensors shard), the CRC32 of
        those bytes as they were read (None otherwise).
        A stored record's CRC32 is computed over the whole record in the same pass; CorruptChunkError is
        raised after copying when it does not match, so the caller discards its (temporary) output.
        ``check_crc=False`` (local files, a record with a stored CRC32): the kernel copies the bytes
        (copy_file_range) without them passing through this process; the caller then proves the copy against
        ``locate().crc32`` itself (the exporter's verifier re-reads its output) and calls :meth:`check_chunk`
        to name a corrupt source."""
        st = self.locate(fqn, chunk)
        if not st.contiguous:
            raise self._error(fqn, chunk, "item is not stored contiguously; read it with read_chunk.")
        elem = ITEMSIZE.get(st.dtype, 1)
        start, count = st.storage_offset * elem, st.numel * elem
        if not check_crc and st.crc32 is not None and self.handles.local and \
                self._kernel_copy(chunk, st.data_offset + start, count, fd, dst_offset, progress):
            return count, None
        crc = self._stream(fqn, chunk, st, fd, dst_offset, start, count, progress)
        self._release(chunk)
        return count, crc

    def _release(self, chunk: Chunk) -> None:
        """This job has read the chunk's item for the last time (remote: its planned segment may go)."""
        self.handles.release(chunk.file, chunk.offset, chunk.offset + chunk.length)

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

    def _stream(self, fqn: str, chunk: Chunk, st: StoredTensor, fd: int | None, dst_offset: int, start: int,
                count: int, progress: Progress | None) -> int | None:
        """Read the storage record block by block: CRC over all of it, bytes [start, start+count) to fd.
        Returns the CRC32 of the bytes written when the record has no stored CRC32, else None."""
        buf = _thread_buffer() if self.handles.local else _small_buffer()
        crc = 0
        copied = 0
        pos = 0
        while pos < st.nbytes:
            n = min(len(buf), st.nbytes - pos)
            view = buf[:n]
            self.handles.readinto(chunk.file, st.data_offset + pos, view)
            if st.crc32 is not None:
                crc = crc32(view, crc)
            lo, hi = max(pos, start), min(pos + n, start + count)
            if st.crc32 is None and hi > lo:
                copied = crc32(view[lo - pos:hi - pos], copied)
            if fd is not None and hi > lo:
                _pwrite_all(fd, view[lo - pos:hi - pos], dst_offset + lo - start)
                if progress:
                    progress.advance(hi - lo)
            elif progress:
                progress.check()
            pos += n
        if st.crc32 is not None and crc != st.crc32:
            raise self._corrupt(fqn, chunk, st, crc)
        return copied if st.crc32 is None else None

    # ------------------------------------------------------------ non-tensor entries
    def read_object_bytes(self, obj: ObjectEntry) -> bytes:
        """The raw stored bytes of a non-tensor entry (a torch.save archive), range checked; an archive's
        records are checked against the zip directory and their stored CRC32 (torch.load checks neither)."""
        if obj.file is None:
            raise CheckpointError(f"{obj.fqn}: no storage entry in the metadata.", fqn=obj.fqn)
        try:
            if obj.length > MAX_OBJECT_BYTES:
                raise CheckpointError(f"{self.handles.where(obj.file)}: a {obj.length}-byte non-tensor entry is "
                                      "implausible.", path=self.handles.where(obj.file))
            self._check_range(obj.file, obj.offset, obj.length, "the entry")
            data = self.handles.read(obj.file, obj.offset, obj.length)
            self.handles.release(obj.file, obj.offset, obj.offset + obj.length)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} (entry {obj.fqn})", path=exc.path, fqn=obj.fqn) from None
        if data[:4] == ZIP_LOCAL:
            where = self.handles.where(obj.file)
            try:
                check_object_archive(data)
            except RecordCrcError as exc:
                raise CorruptChunkError(f"{where} (entry {obj.fqn}): {exc}: the bytes changed on disk.",
                                        path=where, fqn=obj.fqn) from None
            except ItemFormatError as exc:
                raise CheckpointError(f"{where} (entry {obj.fqn}): the stored archive cannot be decoded ({exc}).",
                                      path=where, fqn=obj.fqn) from None
        return data

    def read_file(self, name: str) -> bytes:
        """A whole small file of the folder (``meta.pt``), size checked."""
        size = self._size(name)
        if size > MAX_OBJECT_BYTES:
            raise CheckpointError(f"{self.handles.where(name)}: {size} bytes is implausible for this file.",
                                  path=self.handles.where(name))
        return self.handles.read(name, 0, size)

    def read_object(self, obj: ObjectEntry) -> Any:
        """A non-tensor entry, decoded with ``weights_only=True`` (refuses arbitrary objects); a consolidated
        file's entry is the value read with the file."""
        if obj.inline:
            return obj.value
        data = self.read_object_bytes(obj)
        where = self.handles.where(obj.file or "")
        return load_weights_only(data, f"{where} (entry {obj.fqn})", fqn=obj.fqn, path=where)


def load_weights_only(data: bytes, where: str, fqn: str | None = None, path: str | None = None) -> Any:
    """``torch.load(weights_only=True)`` of untrusted bytes; any failure is a CheckpointError."""
    import pickle
    import struct

    import torch

    allow_torch_safe_globals()
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, TypeError, AttributeError, EOFError, KeyError,
            IndexError, OverflowError, UnicodeDecodeError, RecursionError, MemoryError, NotImplementedError,
            AssertionError, ImportError, OSError, struct.error) as exc:
        # torch.load's zip reader and weights-only unpickler raise all of these on damaged input (struct.error:
        # an opcode's argument cut short by the end of data.pkl).
        log.debug("torch.load failed on %s", where, exc_info=True)
        lines = str(exc).splitlines() or [""]
        # torch's weights-only message starts with advice; the line that says what was refused is further down
        text = next((ln for ln in lines if "Unsupported global" in ln), lines[0]).strip()[:200]
        raise CheckpointError(f"{where}: cannot be decoded safely ({type(exc).__name__}: {text}).",
                              fqn=fqn, path=path) from None


__all__ = ["COPY_BLOCK", "ChunkReader", "CorruptChunkError", "SharedStorageError", "StoredTensor",
           "load_weights_only", "safe_name", "torch_dtype"]
