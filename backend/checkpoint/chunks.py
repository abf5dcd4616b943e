"""The one chunk reader: the bytes of a chunk, by file and byte range, for every storage variant.

Every consumer reads tensor bytes through :class:`ChunkReader`: the inspector's values, ``show``, deep
verify, export (``copy_range`` for the zero-copy path), diff, reshard and import's verification. What is
shared lives here: ranges checked against the file before reading, handles (local or remote files through
:mod:`.storage`, remote read plans), the cache of where each chunk's values are, and the stored CRC32 checked
in the same pass as the read. How an item's bytes decode is the checkpoint's codec's (:mod:`.codecs`, attached
by its format's ``open``: a ``torch.save`` zip item or a safetensors blob in a ``.distcp``, compressed or not,
the raw ranges of a safetensors file); values a format located itself are the format's (``Checkpoint.located``).
The whole-tensor fast paths are :mod:`.chunk_runs`'.
"""

from __future__ import annotations

import io
import logging
import threading
import warnings
from collections.abc import Iterable
from typing import Any

from ..crc import crc32
from ..errors import CheckpointError
from ..progress import Progress
from .chunk_runs import COPY_BLOCK, RunReads, thread_buffer
from .codecs import MAX_OBJECT_BYTES, STORED_ITEMS, compressed_bound, decode
from .dtypes import torch_dtype
from .items import ZIP_LOCAL, ItemFormatError, RecordCrcError, StoredTensor, check_object_archive
from .layout import coverage
from .model import ITEMSIZE, Checkpoint, Chunk, ObjectEntry, TensorEntry, contiguous_strides
from .safetensors_items import SafetensorsHeader, parse_safetensors_header
from .storage import LocalHandles, RemoteHandles, open_folder
from .unpickler import allow_torch_safe_globals

log = logging.getLogger(__name__)
# A damaged non-tensor entry can name any pickle protocol; torch.load then warns on stderr before it fails
# (or not). The entry's fate is reported once, as a problem or an error naming it: not as terminal noise.
warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)

REMOTE_COPY_BLOCK = 4 << 20  # remote bytes are already in memory (a planned segment): a small block is one memcpy


class CorruptChunkError(CheckpointError):
    """The bytes read do not match the CRC32 stored with them: the file changed on disk."""


class SharedStorageError(CheckpointError):
    """Two chunks' metadata point at the same stored bytes: one of them would read the other's values."""


def safe_name(name: str) -> bool:
    """True for a plain file name inside the folder (what torch's writers produce): no separators, no ``..``."""
    return bool(name) and isinstance(name, str) and "/" not in name and "\\" not in name and "\0" not in name \
        and name not in (".", "..")


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    import os

    pos = 0
    while pos < len(view):
        pos += os.pwrite(fd, view[pos:], offset + pos)


class ChunkReader(RunReads):
    """Reads chunks and entries of one checkpoint; keeps files open and caches where values are.
    Thread-safe for reads (local reads use ``pread``)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        folder = ckpt.folder if ckpt.folder is not None else open_folder(ckpt.path)
        self.handles: LocalHandles | RemoteHandles = folder.handles()
        if not self.handles.local:  # remote: a read inside an item fetches the whole item (one request)
            t = ckpt.chunk_table
            self.handles.plan_table([f.name for f in ckpt.files], t.file, t.byte_offset, t.length)
        self.codec = ckpt.codec if ckpt.codec is not None else STORED_ITEMS
        self._located: dict[tuple[str, int, str], StoredTensor] = {}
        self._blobs: dict[tuple[str, int], SafetensorsHeader] = {}
        self._sizes: dict[str, int] = {}
        self._owners: dict[tuple[str, int], tuple[str, tuple[int, ...]]] = {}
        self._verified: set[tuple[str, int]] = set()  # records whose whole CRC32 was checked (see _trimmed)
        self._verify_lock = threading.Lock()
        self._columns: tuple[list, ...] | None = None  # the chunk table as lists, for whole_values (made once)
        self._decoded = threading.local()  # per thread: the last decoded item (see decoded_item)

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
        owner = self._owners.setdefault((chunk.file, chunk.offset if st.encoded else st.data_offset),
                                        (fqn, chunk.offsets))
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
        if not st.encoded:
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
        """Where the chunk's values are: the checkpoint's codec decides (:mod:`.codecs`)."""
        return self.codec.stored(self, fqn, chunk, dtype)

    def safetensors_blob(self, name: str, offset: int) -> SafetensorsHeader:
        """The header of the safetensors blob starting at ``offset`` of file ``name`` (parsed once per reader)."""
        blob = self._blobs.get((name, offset))
        if blob is None:
            blob = self._blobs[(name, offset)] = parse_safetensors_header(self.handles, name, offset, self._size(name))
        return blob

    def decoded_item(self, name: str, offset: int, length: int, transforms: tuple[str, ...], limit: int
                     ) -> bytes | bytearray:
        """The item's stored bytes with its stream transforms undone, at most ``limit`` bytes (its range already
        checked); this thread keeps the last one until the chunk is released (locating and reading decode once)."""
        slot = getattr(self._decoded, "item", None)
        if slot is not None and slot[0] == (name, offset):
            return slot[1]
        if length > compressed_bound(limit):
            raise ItemFormatError(f"{length} stored bytes are more than a compressed item of at most {limit} "
                                  "bytes needs")
        data = decode(self.handles.read(name, offset, length), transforms, limit)
        self._decoded.item = ((name, offset), data)
        return data

    def _encoded_record(self, fqn: str, chunk: Chunk, st: StoredTensor) -> memoryview:
        """An encoded item's storage record, from its decoded bytes."""
        try:
            data = self.decoded_item(chunk.file, chunk.offset, chunk.length,
                                     self.codec.transforms_of(chunk.file, chunk.offset),
                                     self.codec.item_limit(chunk, st.dtype))
        except RecordCrcError as exc:
            raise self._error(fqn, chunk, f"{exc}: the bytes changed on disk.", CorruptChunkError) from None
        except ItemFormatError as exc:
            raise self._error(fqn, chunk, f"item cannot be decoded ({exc}).") from None
        return memoryview(data)[st.data_offset:st.data_offset + st.nbytes]

    def direct_copy(self, fqn: str, chunk: Chunk, dtype: str) -> StoredTensor | None:
        """The chunk's StoredTensor when its values are stored as-is (``dtype``, contiguous), so
        :meth:`copy_range` can copy them byte for byte; None when they must be assembled."""
        st = self.locate(fqn, chunk)
        return st if st.dtype == dtype and st.contiguous and not st.encoded else None

    # ------------------------------------------------------------ reading
    def _read_checked(self, fqn: str, chunk: Chunk, st: StoredTensor, buf: memoryview) -> None:
        if st.encoded:
            buf[:] = self._encoded_record(fqn, chunk, st)
        else:
            self.handles.readinto(chunk.file, st.data_offset, buf)
        self._check_crc(fqn, chunk, st, buf)

    def _check_crc(self, fqn: str, chunk: Chunk, st: StoredTensor, buf: memoryview) -> None:
        if st.crc32 is not None:
            crc = crc32(buf)
            if crc != st.crc32:
                raise self._corrupt(fqn, chunk, st, crc)

    def _corrupt(self, fqn: str, chunk: Chunk, st: StoredTensor, crc: int) -> CorruptChunkError:
        return self._error(fqn, chunk, f"fails its CRC32 check (stored {st.crc32:08x}, read {crc:08x}): the "
                                       "bytes changed on disk.",
                           CorruptChunkError)  # type: ignore[return-value]  # _error makes the class it is given

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
        self._read_checked(fqn, chunk, st, memoryview(raw.numpy()))  # type: ignore[arg-type]  # an ndarray is a buffer
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

    def check_chunk(self, fqn: str, chunk: Chunk) -> StoredTensor:
        """Deep verification of one chunk: located, every stored byte read once and its CRC32 checked.
        Reads in blocks (memory bounded by the block, not the chunk)."""
        st = self.locate(fqn, chunk)
        if st.encoded:  # the stored bytes decoded (their checksum, if any, checked by the codec), then the record's
            self._check_crc(fqn, chunk, st, self._encoded_record(fqn, chunk, st))
        else:
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
        if st.encoded:  # a compressed item's stored bytes are not its values: they must be decoded
            raise self._error(fqn, chunk, "item is stored encoded (compressed): its bytes cannot be copied as "
                                          "they are; read it with read_chunk.")
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
        """This job has read the chunk's item for the last time (remote: its planned segment may go; a decoded
        item this thread keeps goes)."""
        slot = getattr(self._decoded, "item", None)
        if slot is not None and slot[0] == (chunk.file, chunk.offset):
            self._decoded.item = None
        self.handles.release(chunk.file, chunk.offset, chunk.offset + chunk.length)

    def _stream(self, fqn: str, chunk: Chunk, st: StoredTensor, fd: int | None, dst_offset: int, start: int,
                count: int, progress: Progress | None) -> int | None:
        """Read the storage record block by block: CRC over all of it, bytes [start, start+count) to fd.
        Returns the CRC32 of the bytes written when the record has no stored CRC32, else None."""
        buf = thread_buffer() if self.handles.local else thread_buffer(REMOTE_COPY_BLOCK)
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
        """The stored bytes of a non-tensor entry (a torch.save archive), range checked, its stream transforms undone
        (the codec's, at most MAX_OBJECT_BYTES decoded); an archive's
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
        transforms = self.codec.transforms_of(obj.file, obj.offset)
        if transforms:  # decoded first, never past what a non-tensor entry may hold
            try:
                data = bytes(decode(data, transforms, MAX_OBJECT_BYTES))
            except ItemFormatError as exc:
                where = self.handles.where(obj.file)
                if isinstance(exc, RecordCrcError):
                    raise CorruptChunkError(f"{where} (entry {obj.fqn}): {exc}: the bytes changed on disk.",
                                            path=where, fqn=obj.fqn) from None
                raise CheckpointError(f"{where} (entry {obj.fqn}): cannot be decoded ({exc}).", path=where,
                                      fqn=obj.fqn) from None
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
