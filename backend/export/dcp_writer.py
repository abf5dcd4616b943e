"""Write a DCP checkpoint as if saved by M ranks with even row-wise chunks (FSDP2's ``torch.chunk``
along dim 0), one tensor in memory at a time. The items are ``torch.save`` archives and the
``.metadata`` pickle uses torch's own classes, so ``dcp.load`` reads the result at any world size.
Written into a temporary folder and renamed at the end; ``.metadata`` last, as DCP does."""

from __future__ import annotations

import gc
import io
import math
import os
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..checkpoint.chunks import ChunkReader
from ..crc import crc32
from ..filenames import METADATA, dcp_data_file
from ..formats import open_checkpoint as open_any
from ..formats import open_source
from ..progress import Progress
from .atomic import AtomicOutput
from .dcp_metadata import MetadataColumns, check_metadata, write_metadata
from .lineage import lineage_for
from .output_seal import Origin
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
        if st.crc32 is None:  # torch.save's zip writer stores one for every record
            raise ExportError("a torch.save archive written here has no CRC32 for its storage record.")
        self.local_crc, self.central_crc = _crc_fields(self.bytes, st.data_offset, st.nbytes, st.crc32)
        self.first: tuple[int, int] | None = None  # (file, offset) of the first item written from it

    def item(self, data: memoryview) -> bytearray:
        """The archive of these values."""
        packed = zlib.crc32(data).to_bytes(4, "little")
        out = bytearray(self.bytes)
        out[self.data_start:self.data_start + self.nbytes] = data
        out[self.local_crc:self.local_crc + 4] = packed
        out[self.central_crc:self.central_crc + 4] = packed
        return out


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


RUN_BYTES = 8 << 20  # templated items are gathered (over all files) and written, later re-read, this much at a time


class _DataFiles:
    """The ``.distcp`` files being written. Templated items are gathered in memory and written ``RUN_BYTES`` at a
    time, the CRC32 of each such range taken as written (:attr:`runs`: the verifier re-reads each range once,
    every byte of the items, headers and pickles too); torch.save's items are written as they come."""

    def __init__(self, folder: str, names: list[str]) -> None:
        self.folder, self.names = folder, names
        self.files = [open(os.path.join(folder, n), "wb") for n in names]
        self.pos = [0] * len(names)  # where the next item of each file goes
        self.pending: list[list] = [[bytearray(), "", ""] for _ in names]  # per file: bytes, first, last name
        self.held = 0  # bytes pending in all files
        self.runs: list[Expectation] = []

    def add(self, r: int, item: bytes | bytearray, name: str, gather: bool = True) -> int:
        """Write ``item`` at the end of file ``r`` (gathered with its neighbours when ``gather``); its offset."""
        off = self.pos[r]
        self.pos[r] += len(item)
        if not gather:
            self.flush(r)
            self.files[r].write(item)
            return off
        buf = self.pending[r]
        if not buf[0]:
            buf[1] = name
        buf[0] += item
        buf[2] = name
        self.held += len(item)
        if self.held >= RUN_BYTES:  # across every file: memory stays RUN_BYTES at any number of ranks
            for f in range(len(self.files)):
                self.flush(f)
        return off

    def flush(self, r: int) -> None:
        data, first, last = self.pending[r]
        if data:
            start = self.files[r].tell()
            self.files[r].write(data)
            self.runs.append(Expectation(os.path.join(self.folder, self.names[r]), start, len(data),
                                         crc32(data), first if first == last else f"{first} … {last}"))
            self.held -= len(data)
            self.pending[r] = [bytearray(), "", ""]

    def close(self, sync: bool) -> None:
        try:
            for r, f in enumerate(self.files):
                if sync:
                    self.flush(r)
                    f.flush()
                    os.fsync(f.fileno())
        finally:
            for f in self.files:
                f.close()


def _pieces(shape: tuple[int, ...], ranks: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...], int, int]]:
    """(rank, offsets, sizes, first row, stop row) of each row-wise piece (one piece for 0-d or empty tensors)."""
    if not shape or shape[0] == 0 or ranks == 1:
        return [(0, (0,) * len(shape), shape, 0, shape[0] if shape else 1)]
    rest = (0,) * (len(shape) - 1)
    return [(r, (a, *rest), (b - a, *shape[1:]), a, b) for r, (a, b) in enumerate(row_chunks(shape[0], ranks))
            if b > a]


def _save_small(t: TensorIn, out: _DataFiles, cols: MetadataColumns, ranks: int, plans: dict) -> None:
    """Write a small tensor from its bytes as row-wise pieces, one templated torch.save item per rank. No torch
    tensor is made; what depends only on the dtype and shape (the pieces, their templates) is worked out once."""
    plan = plans.get((t.dtype, t.shape))
    if plan is None:
        plan = plans[(t.dtype, t.shape)] = _small_plan(t.dtype, t.shape, ranks, plans)
    nbytes, pieces = plan
    raw = t.raw
    assert raw is not None
    if len(raw) != nbytes:
        raise ExportError(f"{t.fqn}: read {len(raw)} bytes for shape {list(t.shape)} of {t.dtype}.")
    cols.add_tensor(t.fqn, t.dtype, t.shape)
    for r, offsets, sizes, lo, hi, tpl in pieces:
        item = tpl.item(raw[lo:hi])
        off = out.add(r, item, t.fqn)
        if tpl.first is None:
            tpl.first = (r, off)
        cols.add_chunk(offsets, sizes, r, off, len(item))


def _small_plan(dtype_name: str, shape: tuple[int, ...], ranks: int, plans: dict) -> tuple[int, list]:
    """(bytes of the values, [(rank, offsets, sizes, first byte, end byte, template)]) for a small tensor."""
    from ..checkpoint.chunks import torch_dtype

    dtype = torch_dtype(dtype_name)
    nbytes = math.prod(shape) * dtype.itemsize
    row = nbytes // shape[0] if shape and shape[0] else nbytes
    templates = plans.setdefault("templates", {})
    pieces = []
    for r, offsets, sizes, a, b in _pieces(shape, ranks):
        tpl = templates.get((dtype, sizes))
        if tpl is None:
            tpl = templates[(dtype, sizes)] = _Template(dtype, sizes)
        pieces.append((r, offsets, sizes, a * row, b * row, tpl))
    return nbytes, pieces


def _save_pieces(t: TensorIn, out: _DataFiles, cols: MetadataColumns, ranks: int,
                 expect: list[tuple[int, int, int, int, str]]) -> Any:
    """Write one tensor as row-wise pieces, one ``torch.save`` item per rank; returns its value. ``expect`` gets
    (file, item offset, item length, CRC32 of the values, name) per piece, for the verifier."""
    value = t.load()
    if tuple(value.shape) != tuple(t.shape) or str(value.dtype).removeprefix("torch.") != t.dtype:
        raise ExportError(f"{t.fqn}: read a tensor of shape {list(value.shape)} and {value.dtype}, expected "
                          f"{list(t.shape)} of {t.dtype}.")
    for r, offsets, sizes, a, b in _pieces(tuple(value.shape), ranks):
        piece = (value[a:b] if value.dim() and value.shape[0] else value).contiguous().clone()
        crc = zlib.crc32(tensor_bytes(piece))
        # NOTE: serialised in memory, then written by Python: a failing write (disk full) inside torch's zip
        # writer ended in a C++ terminate for .pt exports (issue 10); here it stays an OSError.
        item = _saved(piece)
        off = out.add(r, item, t.fqn, gather=False)
        expect.append((r, off, len(item), crc, t.fqn))
        cols.add_chunk(offsets, sizes, r, off, len(item))
    return value


def write_dcp(tensors: Iterable[TensorIn], objects: list[ObjectIn], dst: str, ranks: int,
              planner_data: dict[str, tuple] | None = None, force: bool = False, verify: bool = True,
              progress: Progress | None = None, total_bytes: int = 0,
              storage_options: dict | None = None, sources: list[str] | None = None,
              source_format: str = "", release: Callable[[], None] | None = None,
              lineage: dict[str, Any] | None = None, origins: dict[str, Origin] | None = None) -> ExportResult:
    """Write a DCP checkpoint of ``ranks`` ranks into an atomic output folder; ``.metadata`` last.
    ``sources``: what the tensors are read from (the destination may not overlap them; the first is recorded
    in the output's lineage sidecar, opened as ``source_format``). ``planner_data`` None: every entry's key path
    is its own name. ``release`` is called once every tensor is written (the source can go). ``lineage``: the
    sidecar's document, when not the first source's (an average lists every input). ``origins``: each written
    tensor's entry in the first source (its digest there, when it is sealed, must be the written one's)."""
    if ranks < 1:
        raise ExportError("the number of ranks must be at least 1.")
    t0 = time.monotonic()
    progress = progress or Progress()  # its cancel flag is how a signal stops the writing
    names = [dcp_data_file(r) for r in range(ranks)]
    need = total_bytes + sum(len(o.data) for o in objects) + 4096 * ranks + (1 << 20)
    if lineage is None and sources:
        lineage = lineage_for(sources[0], "dcp", source_format)
    with AtomicOutput(dst, kind="dir", force=force, need_bytes=need, storage_options=storage_options,
                      sources=sources or [], progress=progress, lineage=lineage) as out:
        cols = MetadataColumns(names)
        expect: list[tuple[int, int, int, int, str]] = []  # torch.save's items (see _save_pieces)
        plans: dict = {}  # per (dtype, shape) of small tensors: their pieces and templates
        progress.start(total_bytes * (2 if verify else 1) or 1, "read+verified" if verify else "read")
        files = _DataFiles(out.path, names)
        done = False
        try:
            for obj in objects:
                progress.check()
                cols.add_object(obj.fqn, 0, files.add(0, obj.data, obj.fqn, gather=False), len(obj.data))
            count, nbytes = _write_tensors(tensors, files, cols, ranks, plans, expect, progress, out)
            done = True
        finally:
            files.close(sync=done)
        if release is not None:
            release()
        progress.check()
        planner = planner_data or None
        write_metadata(out.path, cols, planner, os.path.basename(dst), str(uuid.uuid4()), DCP_VERSION)
        progress.check()
        mismatches = _check_output(out, cols, planner, verify, lambda: _expectations(
            out.path, names, expect, plans.get("templates", {})) + files.runs, progress) or \
            out.seal(sources[0] if sources else None, origins or {})  # its manifest, checked against a sealed source
        if mismatches:
            return ExportResult(out.dst, [], count, nbytes, time.monotonic() - t0, "dcp", ranks=ranks,
                                verified=False, mismatches=mismatches)
        out.commit()
    return ExportResult(out.dst, [os.path.join(out.dst, n) for n in [*names, METADATA]], count, nbytes,
                        time.monotonic() - t0, "dcp", ranks=ranks, verified=True if verify else None,
                        verified_what=WHAT + "; the folder reads back as a DCP checkpoint" if verify else "",
                        uploaded=out.uploaded, kept=out.kept)


def _write_tensors(tensors: Iterable[TensorIn], files: _DataFiles, cols: MetadataColumns, ranks: int, plans: dict,
                   expect: list, progress: Progress, out: AtomicOutput) -> tuple[int, int]:
    """Every tensor into the rank files and the metadata's columns; (tensors, bytes) written."""
    count = nbytes = shown = 0
    for t in tensors:
        if t.raw is not None:
            _save_small(t, files, cols, ranks, plans)
            size = len(t.raw)
        else:
            cols.add_tensor(t.fqn, t.dtype, t.shape)
            value = _save_pieces(t, files, cols, ranks, expect)
            size = value.numel() * value.element_size()
            del value
        count += 1
        nbytes += size
        if size > (1 << 20) or count & 255 == 1:  # small ones reported a few hundred at a time
            progress.advance(nbytes - shown, t.fqn)
            shown = nbytes
        if count == 1:
            out.hold_for_tests("written")
    progress.advance(nbytes - shown)
    return count, nbytes


def _check_output(out: AtomicOutput, cols: MetadataColumns, planner: dict | None, verify: bool,
                  expectations: Callable[[], list[Expectation]], progress: Progress) -> list[str]:
    """With ``verify``: what differs in the written folder (its ``.metadata`` read back, then every range of
    ``expectations()`` re-read against its CRC32); empty when all agree, or without ``verify``."""
    if not verify:
        return []
    problem = check_metadata(out.path, cols, planner, DCP_VERSION)
    return [problem] if problem else check_written(expectations(), progress)


def _expectations(folder: str, names: list[str], expect: list[tuple[int, int, int, int, str]],
                  templates: dict) -> list[Expectation]:
    """Each torch.save item parsed where the metadata (already proven to say what was written) puts it, its
    values' range to re-read against the CRC32 of the values; and one item of each template parsed, to prove the
    reader finds the dtype, shape and values where the template has them (the other items differ from it only
    in their values and CRC32, and every byte of them is proven by the runs' CRC32)."""
    from ..checkpoint.items import ItemFormatError, parse_torch_item
    from ..checkpoint.storage import LocalHandles

    out = []
    handles = LocalHandles(folder)
    try:
        for tpl in templates.values():
            if tpl.first is None:
                continue
            r, off = tpl.first
            try:
                st = parse_torch_item(handles, names[r], off, len(tpl.bytes))
            except ItemFormatError as exc:
                raise ExportError(f"{folder}: a written item does not parse ({exc}).") from None
            if (st.data_offset, st.nbytes, st.dtype, tuple(st.shape)) != (
                    off + tpl.data_start, tpl.nbytes, tpl.stored.dtype, tuple(tpl.stored.shape)):
                raise ExportError(f"{folder}: {names[r]}:{off}: a written item does not read back as written.")
        for r, off, length, crc, name in expect:
            try:
                st = parse_torch_item(handles, names[r], off, length)
            except ItemFormatError as exc:
                raise ExportError(f"{folder}: {name}'s item does not parse ({exc}).") from None
            out.append(Expectation(os.path.join(folder, names[r]), st.data_offset, st.nbytes, crc, name))
    finally:
        handles.close()
    return out


# ------------------------------------------------------------------ sources
def import_file(src: str, dst: str, ranks: int = 1, prefix: str | None = None, force: bool = False,
                verify: bool = True, progress: Progress | None = None,
                storage_options: dict | None = None) -> ExportResult:
    """Any checkpoint the window opens (a ``.pt``, a ``.safetensors`` file or an HF folder, typically) becomes a
    DCP checkpoint. ``prefix`` nests every key (``model``), so ``dcp.load({"model": model.state_dict()})`` finds
    them."""
    from ..checkpoint.model import itemsize
    from ..checkpoint.safe_pickle import gc_paused

    # NOTE: the cyclic GC paused: a file of 300,000 tensors makes millions of acyclic objects (the model, the
    # .metadata's columns), which it would rescan over and over (3x the time of the whole import)
    with gc_paused():
        source = open_source(src, storage_options)
        try:
            ckpt = source.ckpt
            pre = prefix.strip(".") if prefix else ""

            def key(fqn: str) -> str:
                return f"{pre}.{fqn}" if pre else fqn

            objects = [ObjectIn(key(o.fqn), _saved(source.object(o.fqn))) for o in ckpt.objects]
            planner: dict[str, tuple] | None = None  # None: every entry's path is its own name (a flat file)
            if pre or ckpt.planner_data:
                planner = {}
                for k in [o.fqn for o in ckpt.objects] + [t.fqn for t in ckpt.tensors]:
                    path = source.nested_path(k) or (k,)
                    planner[key(k)] = ((pre, *map(_key_part, path)) if pre else tuple(map(_key_part, path)))
            total = sum(t.numel * itemsize(t.dtype) for t in ckpt.tensors)
            kind = source.kind

            def tensors() -> Iterator[TensorIn]:
                # small tensors come with their bytes, read many at a time (memory: one block); others one by one
                for e, raw in source.small_values(ckpt.tensors, SMALL_TENSOR):
                    yield TensorIn(key(e.fqn), e.dtype, e.shape, partial(source.tensor, e.fqn), raw)

            def release() -> None:
                """The source is read: free its model before the verification (whose peak would add to it)."""
                nonlocal ckpt
                source.close()
                ckpt = None  # type: ignore[assignment]  # let the model go: nothing reads it after this
                gc.collect()  # the model's entries refer back to it: a cycle

            origins = {key(e.fqn): Origin(e.fqn) for e in ckpt.tensors}
            return write_dcp(tensors(), objects, dst, ranks, planner, force, verify, progress, total,
                             storage_options, sources=[src], source_format=kind, release=release, origins=origins)
        finally:
            source.close()


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
        tensors = [TensorIn(t.fqn, t.dtype, t.shape, partial(reader.read_tensor, t)) for t in ckpt.tensors]
        objects = [ObjectIn(o.fqn, _saved(o.value) if o.inline else reader.read_object_bytes(o))
                   for o in ckpt.objects if o.file or o.inline]
        return write_dcp(tensors, objects, dst, ranks, dict(ckpt.planner_data), force, verify, progress,
                         ckpt.total_bytes, storage_options, sources=[ckpt.path], source_format=ckpt.format,
                         origins={t.fqn: Origin(t.fqn) for t in ckpt.tensors})
    finally:
        reader.close()
