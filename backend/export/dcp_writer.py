"""Write a DCP checkpoint as if saved by M ranks with even row-wise chunks (FSDP2's ``torch.chunk``
along dim 0), one tensor in memory at a time. The items are ``torch.save`` archives and the
``.metadata`` pickle uses torch's own classes, so ``dcp.load`` reads the result at any world size.
Written into a temporary folder and renamed at the end; ``.metadata`` last, as DCP does."""

from __future__ import annotations

import copyreg
import io
import math
import os
import pickle
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..checkpoint.chunks import ChunkReader
from ..checkpoint.reader import open_checkpoint
from ..filenames import METADATA
from ..formats import open_checkpoint as open_any
from ..formats import open_source
from ..progress import Progress
from .atomic import AtomicOutput
from .lineage import lineage_for
from .plan import ExportError
from .planner import require_nesting
from .result import ExportResult
from .source import tensor_bytes
from .verify import WHAT, Expectation, check_written

DCP_VERSION = "1.0.0"


@dataclass
class TensorIn:
    """A tensor to write: ``load`` returns the whole tensor (memory: this one tensor)."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    load: Callable[[], Any]
    raw: memoryview | None = None  # a small tensor's C-contiguous bytes, already read (see SMALL_TENSOR)


@dataclass
class ObjectIn:
    """A non-tensor entry: a torch.save archive, as DCP stores them."""

    fqn: str
    data: bytes


def row_chunks(rows: int, ranks: int) -> list[tuple[int, int]]:
    """(start, stop) per rank, as torch.chunk splits dim 0 (later ranks may get nothing)."""
    per = math.ceil(rows / ranks) if rows else 0
    return [(min(rows, r * per), min(rows, (r + 1) * per)) for r in range(ranks)]


@dataclass(slots=True)
class _Written:
    """What was written for one piece: where the verifier will find it and the CRC of its bytes."""

    fqn: str
    offsets: tuple[int, ...]
    crc32: int
    # a templated item (see _Template): (file, item offset, item length, its template), else None
    item: tuple[str, int, int, _Template] | None = None


# Tensors of at most this many bytes are written from their bytes through a per-shape template of torch.save's
# archive (a file of 300,000 small tensors made 300,000 torch.save calls, 0.1 ms each, and the verifier parsed
# 300,000 archives back); larger ones through torch.save, whose fixed cost is then negligible.
SMALL_TENSOR = 1 << 20


class _Template:
    """The ``torch.save`` archive of one tensor of a dtype and shape, made once by torch.save itself: an item for
    other values of that dtype and shape is the same bytes with the values and their CRC32 (in the record's
    local header and in the central directory) put in place."""

    def __init__(self, dtype: Any, shape: tuple[int, ...]) -> None:
        import torch

        from ..checkpoint.items import InMemory, StoredTensor, parse_torch_item

        self.bytes = _saved(torch.zeros(shape, dtype=dtype))
        st: StoredTensor = parse_torch_item(InMemory(self.bytes, "a torch.save archive"), "", 0,
                                                     len(self.bytes))  # what the reader finds
        self.stored = st
        self.data_start, self.nbytes = st.data_offset, st.nbytes
        self.local_crc, self.central_crc = _crc_fields(self.bytes, st.data_offset, st.nbytes, st.crc32)

    def item(self, data: memoryview) -> tuple[bytearray, int]:
        """(the archive of these values, their CRC32)."""
        crc = zlib.crc32(data)
        out = bytearray(self.bytes)
        out[self.data_start:self.data_start + self.nbytes] = data
        packed = crc.to_bytes(4, "little")
        out[self.local_crc:self.local_crc + 4] = packed
        out[self.central_crc:self.central_crc + 4] = packed
        return out, crc


def _crc_fields(data: bytes, data_start: int, nbytes: int, crc: int) -> tuple[int, int]:
    """Offsets of the two copies of the CRC32 of the storage record whose bytes start at ``data_start``: in its
    local header, or in the data descriptor after its bytes (torch.save's writer streams: flag 8), and in its
    central directory entry (found by the local header's offset, which the entry names)."""
    import struct

    packed = struct.pack("<I", crc)
    local = data.rfind(b"PK\x03\x04", 0, data_start)  # the record's local header: the last one before its bytes
    if local < 0:
        raise ExportError("torch.save wrote an archive this writer does not know (no local header).")
    (flags,) = struct.unpack_from("<H", data, local + 6)
    first = local + 14
    if flags & 8:  # a data descriptor follows the bytes, its signature optional
        first = data_start + nbytes + (4 if data[data_start + nbytes:data_start + nbytes + 4] == b"PK\x07\x08" else 0)
    if data[first:first + 4] != packed:
        raise ExportError("torch.save wrote an archive this writer does not know (CRC32 not found).")
    end = data.rfind(b"PK\x05\x06")
    cd_size, cd_offset = struct.unpack_from("<II", data, end + 12)
    p = cd_offset
    while p < cd_offset + cd_size:
        nlen, xlen, clen = struct.unpack_from("<HHH", data, p + 28)
        if struct.unpack_from("<I", data, p + 42)[0] == local and data[p + 16:p + 20] == packed:
            return first, p + 16
        p += 46 + nlen + xlen + clen
    raise ExportError("torch.save wrote an archive this writer does not know (no directory entry).")


RUN_BYTES = 8 << 20  # templated items written back to back are verified as one range of at most this


class _Runs:
    """Ranges of templated items written back to back in each file, with the CRC32 of their bytes as written:
    the verifier re-reads each range once (every byte of the items, headers and pickles too)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.open: dict[str, list] = {}  # file -> [start, end, crc32, first fqn, last fqn]
        self.done: list[Expectation] = []

    def add(self, file: str, offset: int, item: bytes | bytearray, fqn: str) -> None:
        run = self.open.get(file)
        if run is not None and (run[1] != offset or run[1] - run[0] + len(item) > RUN_BYTES):
            self.close(file)
            run = None
        if run is None:
            self.open[file] = [offset, offset + len(item), zlib.crc32(item), fqn, fqn]
        else:
            run[1] += len(item)
            run[2] = zlib.crc32(item, run[2])
            run[4] = fqn

    def close(self, file: str | None = None) -> None:
        """End the run of ``file`` (every file's when None)."""
        for f in [file] if file is not None else list(self.open):
            run = self.open.pop(f, None)
            if run is not None:
                start, end, crc, first, last = run
                self.done.append(Expectation(os.path.join(self.folder, f), start, end - start, crc,
                                             first if first == last else f"{first} … {last}"))


def _save_small(t: TensorIn, files: list[Any], names: list[str], storage: dict, ranks: int, written: list[_Written],
                templates: dict, sizes: dict, runs: _Runs, torch: Any) -> tuple[Any, list]:
    """Write a small tensor from its bytes as row-wise pieces, one templated torch.save item per rank; returns
    (its torch dtype, chunk metas). No torch tensor is made."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    from ..checkpoint.chunks import torch_dtype

    dtype = torch_dtype(t.dtype)
    shape = t.shape
    raw = t.raw
    assert raw is not None
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise ExportError(f"{t.fqn}: read {len(raw)} bytes for shape {list(shape)} of {t.dtype}.")
    if not shape or shape[0] == 0 or ranks == 1:
        pieces = [(0, (0,) * len(shape), shape, raw)]
    else:
        row = len(raw) // shape[0]
        pieces = [(r, (a, *([0] * (len(shape) - 1))), (b - a, *shape[1:]), raw[a * row:b * row])
                  for r, (a, b) in enumerate(row_chunks(shape[0], ranks)) if b > a]
    chunks = []
    for r, offsets, piece_shape, data in pieces:
        key = (dtype, piece_shape)
        tpl = templates.get(key)
        if tpl is None:
            tpl = templates[key] = _Template(dtype, piece_shape)
        item, crc = tpl.item(data)
        f = files[r]
        off = f.tell()
        f.write(item)
        runs.add(names[r], off, item, t.fqn)
        written.append(_Written(t.fqn, offsets, crc, (names[r], off, len(item), tpl)))
        meta = ChunkStorageMetadata(_size(sizes, offsets, torch), _size(sizes, piece_shape, torch))
        chunks.append(meta)
        index = MetadataIndex(t.fqn)
        object.__setattr__(index, "offset", meta.offsets)  # the shared Size (its __init__ makes a new one)
        storage[index] = _StorageInfo(names[r], off, len(item))
    return dtype, chunks


def _size(cache: dict, dims: tuple[int, ...], torch: Any) -> Any:
    """One torch.Size per distinct value (the .metadata pickle then stores it once and refers to it)."""
    size = cache.get(dims)
    if size is None:
        size = cache[dims] = torch.Size(dims)
    return size


def _save_pieces(t: TensorIn, files: list[Any], names: list[str], storage: dict, ranks: int,
                 written: list[_Written]) -> tuple[Any, list]:
    """Write one tensor as row-wise pieces, one ``torch.save`` item per rank; returns (value, chunk metas)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    value = t.load()
    if tuple(value.shape) != tuple(t.shape):
        raise ExportError(f"{t.fqn}: read a tensor of shape {list(value.shape)}, expected {list(t.shape)}.")
    if value.dim() == 0 or value.shape[0] == 0:
        pieces = [(0, (0,) * value.dim(), value)]
    else:
        pieces = [(r, (a, *([0] * (value.dim() - 1))), value[a:b])
                  for r, (a, b) in enumerate(row_chunks(value.shape[0], ranks)) if b > a]
    chunks = []
    for r, offsets, piece in pieces:
        f = files[r]
        off = f.tell()
        piece = piece.contiguous().clone()
        written.append(_Written(t.fqn, offsets, zlib.crc32(tensor_bytes(piece))))
        # NOTE: serialised in memory, then written by Python: a failing write (disk full) inside torch's zip
        # writer ended in a C++ terminate for .pt exports (issue 10); here it stays an OSError.
        f.write(_saved(piece))
        meta = ChunkStorageMetadata(torch.Size(offsets), torch.Size(piece.shape))
        chunks.append(meta)
        storage[MetadataIndex(t.fqn, meta.offsets)] = _StorageInfo(names[r], off, f.tell() - off)
    return value, chunks


def _write_metadata(folder: str, sdm: dict, storage: dict, planner_data: dict, dst: str) -> None:
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    md = Metadata(sdm, planner_data=planner_data or {k: (k,) for k in sdm}, storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id=os.path.basename(dst), save_id=str(uuid.uuid4())),
                  version=DCP_VERSION)
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf)  # writing with torch's classes; Shardscope itself never unpickles this way
    pickler.dispatch_table = _reducers()
    pickler.dump(md)
    with open(os.path.join(folder, METADATA), "wb") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())


def _newobj(obj: Any) -> tuple:
    """What ``object.__reduce_ex__(2+)`` returns for an object of a plain class, without its failed lookups of
    ``__getnewargs_ex__`` and friends (each an exception raised and cleared: most of the time of pickling a
    .metadata of 300,000 entries): the same pickle bytes, 30% sooner."""
    return copyreg.__newobj__, (type(obj),), obj.__getstate__()


def _reducers() -> dict:
    """The pickler's dispatch table: copyreg's, plus :func:`_newobj` for the DCP metadata classes that reduce
    the default way (a class that defines its own reduction keeps it)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    table = dict(copyreg.dispatch_table)
    for cls in (TensorStorageMetadata, ChunkStorageMetadata, MetadataIndex, _StorageInfo, TensorProperties):
        if cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__ and \
                not hasattr(cls, "__getnewargs_ex__") and not hasattr(cls, "__getnewargs__"):
            table[cls] = _newobj
    return table


def write_dcp(tensors: Iterable[TensorIn], objects: list[ObjectIn], dst: str, ranks: int,
              planner_data: dict[str, tuple] | None = None, force: bool = False, verify: bool = True,
              progress: Progress | None = None, total_bytes: int = 0,
              storage_options: dict | None = None, sources: list[str] | None = None,
              source_format: str = "") -> ExportResult:
    """Write a DCP checkpoint of ``ranks`` ranks into an atomic output folder; ``.metadata`` last.
    ``sources``: what the tensors are read from (the destination may not overlap them; the first is recorded
    in the output's lineage sidecar, opened as ``source_format``)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    if ranks < 1:
        raise ExportError("the number of ranks must be at least 1.")
    t0 = time.monotonic()
    progress = progress or Progress()  # its cancel flag is how a signal stops the writing
    names = [f"__{r}_0.distcp" for r in range(ranks)]
    need = total_bytes + sum(len(o.data) for o in objects) + 4096 * ranks + (1 << 20)
    lineage = lineage_for(sources[0], "dcp", source_format) if sources else None
    with AtomicOutput(dst, kind="dir", force=force, need_bytes=need, storage_options=storage_options,
                      sources=sources or [], progress=progress, lineage=lineage) as out:
        sdm: dict[str, Any] = {}
        storage: dict[Any, Any] = {}
        written: list[_Written] = []
        count = nbytes = 0
        progress.start(total_bytes * (2 if verify else 1) or 1, "writing")
        files = [open(os.path.join(out.path, n), "wb") for n in names]
        try:
            for obj in objects:
                progress.check()
                off = files[0].tell()
                files[0].write(obj.data)
                sdm[obj.fqn] = BytesStorageMetadata()
                storage[MetadataIndex(obj.fqn)] = _StorageInfo(names[0], off, len(obj.data))
            templates: dict = {}
            runs = _Runs(out.path)
            sizes: dict = {}
            props: dict = {}  # one TensorProperties per dtype, one torch.Size per value: pickled once each
            for t in tensors:
                if t.raw is not None:
                    dtype, chunks = _save_small(t, files, names, storage, ranks, written, templates, sizes, runs,
                                                torch)
                    shape, size = t.shape, len(t.raw)
                else:
                    runs.close()  # torch.save's items come between
                    value, chunks = _save_pieces(t, files, names, storage, ranks, written)
                    dtype, shape, size = value.dtype, tuple(value.shape), value.numel() * value.element_size()
                    del value
                prop = props.get(dtype)
                if prop is None:
                    prop = props[dtype] = TensorProperties(dtype=dtype)
                sdm[t.fqn] = TensorStorageMetadata(prop, _size(sizes, shape, torch), chunks)
                count += 1
                nbytes += size
                progress.advance(size, t.fqn)
                if count == 1:
                    out.hold_for_tests("written")
            runs.close()
            for f in files:
                f.flush()
                os.fsync(f.fileno())
        finally:
            for f in files:
                f.close()
        progress.check()
        _write_metadata(out.path, sdm, storage, planner_data or {}, dst)
        progress.check()
        mismatches = check_written(_expectations(out.path, written) + runs.done, progress) if verify else []
        if mismatches:
            return ExportResult(out.dst, [], count, nbytes, time.monotonic() - t0, "dcp", ranks=ranks,
                                verified=False, mismatches=mismatches)
        out.commit()
    return ExportResult(out.dst, [os.path.join(out.dst, n) for n in [*names, METADATA]], count, nbytes,
                        time.monotonic() - t0, "dcp", ranks=ranks, verified=True if verify else None,
                        verified_what=WHAT + "; the folder reads back as a DCP checkpoint" if verify else "",
                        uploaded=out.uploaded, kept=out.kept)


def _expectations(folder: str, written: list[_Written]) -> list[Expectation]:
    """Open the written folder with the checkpoint reader and locate every piece's bytes in it, so the
    metadata and the items are proven along with the values. A templated item is found where the metadata
    says it was written, and the reader parses one item of each template (the others differ from it only in
    their values and CRC32, and their bytes are proven by :class:`_Runs`' ranges)."""
    ckpt = open_checkpoint(folder, use_cache=False)
    expect = []
    parsed: set[int] = set()
    t = ckpt.chunk_table
    names = [f.name for f in ckpt.files]
    files, offsets, lengths = [names[i] if i >= 0 else "" for i in t.file.tolist()], t.byte_offset.tolist(), \
        t.length.tolist()
    dim_start, dims = t.dim_start.tolist(), t.dims.tolist()
    with ChunkReader(ckpt) as reader:
        for w in written:
            entry = ckpt.tensor(w.fqn) if ckpt.has_tensor(w.fqn) else None
            nd = len(w.offsets)
            j = next((j for j in range(entry.first_chunk, entry.first_chunk + entry.chunk_count)
                      if tuple(dims[dim_start[j]:dim_start[j] + nd]) == w.offsets), None) if entry else None
            if j is None:
                raise ExportError(f"{folder}: the written metadata lacks {w.fqn} at {list(w.offsets)}.")
            if w.item is not None:
                file, offset, length, tpl = w.item
                if (files[j], offsets[j], lengths[j]) != (file, offset, length):
                    raise ExportError(f"{folder}: the written metadata puts {w.fqn} at {files[j]}:{offsets[j]} "
                                      f"({lengths[j]} bytes), not where it was written.")
                if id(tpl) in parsed:
                    continue
                parsed.add(id(tpl))
            chunk = ckpt.chunks_of(entry)[j - entry.first_chunk]
            st = reader.locate(w.fqn, chunk)
            if w.item is not None and (st.data_offset, st.nbytes, st.dtype, tuple(st.shape)) != (
                    w.item[1] + w.item[3].data_start, w.item[3].nbytes, w.item[3].stored.dtype,
                    tuple(w.item[3].stored.shape)):
                raise ExportError(f"{folder}: {w.fqn}'s item does not read back as written.")
            expect.append(Expectation(os.path.join(folder, chunk.file), st.data_offset, st.nbytes, w.crc32, w.fqn))
    return expect


# ------------------------------------------------------------------ sources
def import_file(src: str, dst: str, ranks: int = 1, prefix: str | None = None, force: bool = False,
                verify: bool = True, progress: Progress | None = None,
                storage_options: dict | None = None) -> ExportResult:
    """Any checkpoint the window opens (a ``.pt``, a ``.safetensors`` file or an HF folder, typically) becomes a
    DCP checkpoint. ``prefix`` nests every key (``model``), so ``dcp.load({"model": model.state_dict()})`` finds
    them."""
    import torch

    from ..checkpoint.safe_pickle import gc_paused

    # NOTE: the cyclic GC paused: a file of 300,000 tensors makes millions of acyclic objects (the model, the
    # .metadata's torch objects), which it would rescan over and over (3x the time of the whole import)
    with gc_paused(), open_source(src, storage_options) as source:
        pre = prefix.strip(".") if prefix else ""

        def key(fqn: str) -> str:
            return f"{pre}.{fqn}" if pre else fqn

        entries = source.entries()
        names = [k for k, e in entries.items() if e.kind == "tensor"]
        objects = [ObjectIn(key(k), _saved(source.object(k))) for k, e in entries.items() if e.kind == "object"]
        planner = {}
        for k in entries:
            path = source.nested_path(k) or (k,)
            planner[key(k)] = ((pre, *map(_key_part, path)) if pre else tuple(map(_key_part, path)))
        sizes: dict[str, int] = {}
        total = 0
        for k in names:
            e = entries[k]
            dtype = e.dtype or ""
            if dtype not in sizes:
                sizes[dtype] = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            total += math.prod(e.shape or ()) * sizes[dtype]

        def tensors() -> Iterator[TensorIn]:
            # small tensors come with their bytes, read many at a time (memory: one block); others load one by one
            for k, raw in source.small_values(names, SMALL_TENSOR):
                e = entries[k]
                yield TensorIn(key(k), e.dtype or "", tuple(e.shape or ()), lambda k=k: source.tensor(k), raw)

        return write_dcp(tensors(), objects, dst, ranks, planner, force, verify, progress, total, storage_options,
                         sources=[src], source_format=source.kind)


def _key_part(p: Any) -> Any:
    return p if isinstance(p, int) else str(p)


def _saved(value: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def reshard(src: str, dst: str, ranks: int, force: bool = False, verify: bool = True,
            progress: Progress | None = None, storage_options: dict | None = None) -> ExportResult:
    """Rewrite a DCP checkpoint as if saved by ``ranks`` ranks; non-tensor entries are copied byte for
    byte (never decoded), tensors one at a time."""
    ckpt = open_any(src, storage_options)
    missing = [f.name for f in ckpt.files if f.kind == "data" and f.bytes is None]
    if missing:
        raise ExportError(f"{ckpt.path}: missing {', '.join(missing)}; cannot reshard an incomplete checkpoint.")
    require_nesting(ckpt)  # its planner_data would be copied, or lost, into the new .metadata
    reader = ChunkReader(ckpt)
    try:
        tensors = [TensorIn(t.fqn, t.dtype, t.shape, lambda t=t: reader.read_tensor(t)) for t in ckpt.tensors]
        objects = [ObjectIn(o.fqn, _saved(o.value) if o.inline else reader.read_object_bytes(o))
                   for o in ckpt.objects if o.file or o.inline]
        return write_dcp(tensors, objects, dst, ranks, dict(ckpt.planner_data), force, verify, progress,
                         ckpt.total_bytes, storage_options, sources=[ckpt.path], source_format=ckpt.format)
    finally:
        reader.close()
