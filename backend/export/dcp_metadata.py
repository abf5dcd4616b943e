"""The ``.metadata`` of a DCP checkpoint Shardscope writes: kept as columns while the items are written, pickled
straight from them, and proven by reading the written file back with the checkpoint reader's own streaming parser.

torch's writer builds a ``TensorStorageMetadata``, a ``ChunkStorageMetadata`` per chunk, a ``MetadataIndex`` and a
``_StorageInfo`` per item, then ``pickle.dump``s the graph: for 300,000 entries that is 1.5 million objects kept
alive (and memoised by the pickler) at once, most of the time and memory of an import. Here each entry costs a few
array slots, and the pickle is emitted entry by entry with the opcodes ``pickle`` itself would use for those
objects (protocol 4, framed); the few shared objects (the classes, one ``TensorProperties`` per dtype, a
``torch.Size`` per distinct shape, ``StorageMeta``) go through the standard library's own pickler, which shares
the memo, so that every reference to them is the ordinary memo reference. The per-entry objects are not memoised:
nothing refers to them twice, and a reader's memo then stays small. ``pickle.load`` with torch's classes gives
the same ``Metadata`` as pickling torch's objects would (tested), and the file is read back as DCP's own layout by
:mod:`..checkpoint.streaming` (tensor chunks right before their tensor, each storage key right before its value)."""

from __future__ import annotations

import os
import pickle
import struct
from array import array
from typing import Any, Protocol, cast

from ..checkpoint.model import DTYPE_NAMES
from ..filenames import METADATA

DTYPE_CODE = {name: i for i, name in enumerate(DTYPE_NAMES)}
SHARED_SIZES = 1 << 16  # distinct shapes pickled once and referred to; past this many, each is written inline
BATCH = 1000  # items per SETITEMS / APPENDS, as pickle batches them
_P = pickle


class MetadataColumns:
    """What a written DCP checkpoint's ``.metadata`` says, as flat columns in the order it will be pickled:
    the non-tensor entries, then every tensor with its chunks (each chunk's item: file, offset, length)."""

    def __init__(self, files: list[str]) -> None:
        self.files = files  # the data files' names, by index
        self.objects: list[tuple[str, int, int, int]] = []  # (fqn, file, offset, length)
        self.fqns: list[str] = []  # tensors
        self.dtype = array("b")  # DTYPE_NAMES index per tensor
        self.ndim = array("b")  # per tensor
        self.shape = array("q")  # per tensor, ndim values each
        self.nchunks = array("i")  # per tensor
        self.chunk_dims = array("q")  # per chunk: offsets then sizes (ndim of its tensor each)
        self.item_file = array("i")  # per chunk
        self.item_offset = array("q")
        self.item_length = array("q")

    def add_object(self, fqn: str, file: int, offset: int, length: int) -> None:
        self.objects.append((fqn, file, offset, length))

    def add_tensor(self, fqn: str, dtype: str, shape: tuple[int, ...]) -> None:
        """A tensor whose chunks follow (:meth:`add_chunk`)."""
        code = DTYPE_CODE.get(dtype)
        if code is None:
            from .plan import ExportError

            raise ExportError(f"{fqn}: dtype {dtype!r} cannot be written to a DCP checkpoint here.")
        self.fqns.append(fqn)
        self.dtype.append(code)
        self.ndim.append(len(shape))
        self.shape.extend(shape)
        self.nchunks.append(0)

    def add_chunk(self, offsets: tuple[int, ...], sizes: tuple[int, ...], file: int, offset: int,
                  length: int) -> None:
        """A chunk of the tensor added last, and where its item was written."""
        self.nchunks[-1] += 1
        self.chunk_dims.extend(offsets)
        self.chunk_dims.extend(sizes)
        self.item_file.append(file)
        self.item_offset.append(offset)
        self.item_length.append(length)


# ------------------------------------------------------------------ writing
def _int(n: int) -> bytes:
    if 0 <= n < 256:
        return _P.BININT1 + bytes((n,))
    if 0 <= n < 65536:
        return _P.BININT2 + struct.pack("<H", n)
    if -(1 << 31) <= n < (1 << 31):
        return _P.BININT + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return _P.LONG1 + bytes((len(raw),)) + raw


def _str(s: str) -> bytes:
    raw = s.encode("utf-8", "surrogatepass")
    if len(raw) < 256:
        return _P.SHORT_BINUNICODE + bytes((len(raw),)) + raw
    return _P.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _tuple(parts: list[bytes]) -> bytes:
    n = len(parts)
    if n == 0:
        return _P.EMPTY_TUPLE
    if n <= 3:
        return b"".join(parts) + (_P.TUPLE1, _P.TUPLE2, _P.TUPLE3)[n - 1]
    return _P.MARK + b"".join(parts) + _P.TUPLE


def _path_part(p: Any) -> bytes:
    if type(p) is int:
        return _int(p)
    if type(p) is str:
        return _str(p)
    raise TypeError(f"a key path part of type {type(p).__name__}")


class _Framer(Protocol):
    def start_framing(self) -> None: ...
    def commit_frame(self) -> None: ...
    def end_framing(self) -> None: ...


class _PicklerInternals(Protocol):
    """What the emitter uses of the pure-Python ``pickle._Pickler``: its internals, which typeshed does not declare
    (``memo``: id -> (memo index, object))."""

    framer: _Framer
    memo: dict[int, tuple[int, Any]]

    def write(self, data: bytes) -> None: ...
    def save(self, obj: Any) -> None: ...
    def get(self, i: int) -> bytes: ...


class _Emitter:
    """The standard library's pure-Python pickler for the shared objects (memoised there), and raw opcodes for
    the per-entry ones, written through its framer so frames and memo references stay consistent."""

    def __init__(self, f: Any) -> None:
        import torch
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )

        self.torch = torch
        self.p = cast(_PicklerInternals, _P._Pickler(f, protocol=4))
        self.p.write(_P.PROTO + bytes((4,)))
        self.p.framer.start_framing()
        self.cls = {c.__name__: c for c in (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                             TensorStorageMetadata, _StorageInfo)}
        self.TensorProperties = TensorProperties
        self.props: dict[int, bytes] = {}  # dtype code -> memo reference
        self.sizes: dict[tuple, bytes] = {}
        self.keep: list[Any] = []  # objects the memo refers to by id: alive until the end

    def write(self, data: bytes) -> None:
        self.p.write(data)

    def commit(self) -> None:
        """End the current frame if it is big enough (between entries)."""
        self.p.framer.commit_frame()

    def save(self, obj: Any) -> None:
        """Write ``obj`` here: pickled the first time (and memoised), a memo reference afterwards."""
        self.p.save(obj)
        self.keep.append(obj)  # the memo is keyed by id: keep it alive

    def shared(self, obj: Any) -> bytes:
        """The bytes of a memo reference to ``obj``; the first time, ``obj`` is pickled now and popped from the
        stack (so call it between entries, never inside one that is being written)."""
        memo = self.p.memo.get(id(obj))
        if memo is None:
            self.save(obj)
            self.p.write(_P.POP)
            memo = self.p.memo[id(obj)]
        return self.p.get(memo[0])

    def prop(self, code: int) -> bytes:
        """Memo reference to the ``TensorProperties`` of a dtype (one per dtype)."""
        out = self.props.get(code)
        if out is None:
            obj = self.TensorProperties(dtype=getattr(self.torch, DTYPE_NAMES[code]))
            out = self.props[code] = self.shared(obj)
        return out

    def size(self, dims: tuple[int, ...]) -> bytes:
        """The bytes that push ``torch.Size(dims)``: a memo reference for the first SHARED_SIZES distinct values,
        else written inline as pickle writes it (torch.Size applied to the tuple of dims)."""
        out = self.sizes.get(dims)
        if out is None:
            if len(self.sizes) < SHARED_SIZES:
                out = self.sizes[dims] = self.shared(self.torch.Size(dims))
            else:
                out = self.shared(self.torch.Size) + _tuple([_tuple([_int(d) for d in dims])]) + _P.REDUCE
        return out

    def finish(self) -> None:
        self.p.write(_P.STOP)
        self.p.framer.end_framing()


def write_metadata(folder: str, cols: MetadataColumns, planner_data: dict[str, tuple] | None, checkpoint_id: str,
                   save_id: str, version: str) -> None:
    """Pickle ``cols`` as DCP's ``Metadata`` into ``folder/.metadata`` (fsynced). ``planner_data`` None: each
    entry's key path is its own name.

    NOTE: over 60 lines on purpose: the three dicts of the Metadata written in one pass each, entries gathered a
    batch at a time (per-entry Python is the whole cost for 300,000 entries)."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    with open(os.path.join(folder, METADATA), "wb") as f:
        e = _Emitter(f)
        new = {name: e.shared(cls) + _P.EMPTY_TUPLE + _P.NEWOBJ for name, cls in e.cls.items()}
        key = {k: e.shared(k) for k in ("state_dict_metadata", "planner_data", "storage_data", "storage_meta",
                                        "version", "properties", "size", "chunks", "offsets", "sizes", "fqn",
                                        "offset", "index", "relative_path", "length")}
        codes = cols.dtype.tolist()
        for code in sorted(set(codes)):
            e.prop(code)
        end_state = _P.SETITEMS + _P.BUILD
        tensor_head = new["TensorStorageMetadata"] + _P.EMPTY_DICT + _P.MARK + key["properties"]
        size_key, chunks_key = key["size"], key["chunks"] + _P.EMPTY_LIST
        chunk_head = new["ChunkStorageMetadata"] + _P.EMPTY_DICT + _P.MARK + key["offsets"]
        sizes_key = key["sizes"]
        index_head = new["MetadataIndex"] + _P.EMPTY_DICT + _P.MARK + key["fqn"]
        index_tail = key["index"] + _P.NONE + end_state
        offset_key, length_key = key["offset"], key["length"]
        info_head = [new["_StorageInfo"] + _P.EMPTY_DICT + _P.MARK + key["relative_path"] + e.shared(n) + offset_key
                     for n in cols.files]  # each file's name pickled once (as torch's pickler does)
        names = [_str(o[0]) for o in cols.objects] + [_str(f) for f in cols.fqns]
        nobj = len(cols.objects)
        ndims, nchunks, shape, dims = cols.ndim.tolist(), cols.nchunks.tolist(), cols.shape.tolist(), \
            cols.chunk_dims.tolist()
        item_file, item_offset, item_length = cols.item_file.tolist(), cols.item_offset.tolist(), \
            cols.item_length.tolist()
        size = e.size
        batch: list[bytes] = []

        def flush() -> None:
            e.write(_P.MARK + b"".join(batch) + _P.SETITEMS)
            batch.clear()
            e.commit()

        e.write(new["Metadata"] + _P.EMPTY_DICT + _P.MARK + key["state_dict_metadata"] + _P.EMPTY_DICT)
        for name in names[:nobj]:
            batch.append(name + new["BytesStorageMetadata"])
            if len(batch) == BATCH:
                flush()
        s = d = 0
        chunk_offsets: list[bytes] = []  # each chunk's offsets as pushed, for its storage key
        for i in range(len(cols.fqns)):
            nd, n = ndims[i], nchunks[i]
            parts = [names[nobj + i], tensor_head, e.props[codes[i]], size_key, size(tuple(shape[s:s + nd])),
                     chunks_key]
            s += nd
            if n > 1:
                parts.append(_P.MARK)
            for _ in range(n):
                off = size(tuple(dims[d:d + nd]))
                chunk_offsets.append(off)
                parts += (chunk_head, off, sizes_key, size(tuple(dims[d + nd:d + 2 * nd])), end_state)
                d += 2 * nd
            parts.append(_P.APPEND if n == 1 else _P.APPENDS if n else b"")
            parts.append(end_state)
            batch.append(b"".join(parts))
            if len(batch) == BATCH:
                flush()
        flush()
        # planner_data: fqn -> its nested key path
        e.write(key["planner_data"] + _P.EMPTY_DICT)
        if planner_data is None:
            for name in names:
                batch.append(name + name + _P.TUPLE1)
                if len(batch) == BATCH:
                    flush()
        else:
            for fqn, path in planner_data.items():
                batch.append(_str(fqn) + _tuple([_path_part(p) for p in path]))
                if len(batch) == BATCH:
                    flush()
        flush()
        # storage_data: MetadataIndex -> _StorageInfo, the objects' items first, then every chunk's
        e.write(key["storage_data"] + _P.EMPTY_DICT)
        for name, (_fqn, file, offset, length) in zip(names, cols.objects, strict=False):
            batch.append(b"".join((index_head, name, offset_key, _P.NONE, index_tail, info_head[file], _int(offset),
                                   length_key, _int(length), end_state)))
            if len(batch) == BATCH:
                flush()
        j = 0
        for i in range(len(cols.fqns)):
            name = names[nobj + i]
            for _ in range(nchunks[i]):
                batch.append(b"".join((index_head, name, offset_key, chunk_offsets[j], index_tail,
                                       info_head[item_file[j]], _int(item_offset[j]), length_key,
                                       _int(item_length[j]), end_state)))
                j += 1
                if len(batch) == BATCH:
                    flush()
        flush()
        e.write(key["storage_meta"])
        e.save(StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id))
        e.write(key["version"])
        e.save(version)
        e.write(_P.SETITEMS + _P.BUILD)
        e.finish()
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------------------ reading back
def check_metadata(folder: str, cols: MetadataColumns, planner_data: dict[str, tuple] | None,
                   version: str) -> str | None:
    """Read ``folder/.metadata`` back with the checkpoint reader's streaming parser (the allow-listed unpickler
    that every open uses) and compare what it says with ``cols``: every entry's name, kind, dtype and shape, every
    chunk's offsets and sizes, every storage key and where its item is, the key paths and the version. None when
    all agree, else what differs first."""
    import numpy as np

    from ..checkpoint.safe_pickle import NotStreamable
    from ..checkpoint.streaming import stream_metadata_compact
    from ..errors import ShardscopeError

    path = os.path.join(folder, METADATA)
    try:
        with open(path, "rb") as fh:
            md, ev = stream_metadata_compact(fh, path)
    except (NotStreamable, ShardscopeError, OSError) as exc:
        return f"{path} does not read back ({exc})"
    sdm = md.get("state_dict_metadata")
    if not isinstance(sdm, dict) or len(sdm) != len(cols.objects) + len(cols.fqns):
        return f"{path} does not hold the {len(cols.objects) + len(cols.fqns)} entries written"
    names = [o[0] for o in cols.objects] + cols.fqns
    if list(sdm) != names:
        return f"{path}: its entries are not the ones written"
    if any(getattr(v, "kind", "") != "BytesStorageMetadata" for v in list(sdm.values())[:len(cols.objects)]):
        return f"{path}: a non-tensor entry does not read back as one"
    codes = cols.dtype.tolist()
    shapes = _rows(cols.shape.tolist(), cols.ndim.tolist(), 1)
    tensors = ev.tensors or []
    if len(tensors) != len(cols.fqns):
        return f"{path} does not hold the {len(cols.fqns)} tensors written"
    for i, (props, size, n) in enumerate(tensors):
        if n != cols.nchunks[i] or tuple(size or ()) != shapes[i] or \
                getattr(props, "dtype", None) != DTYPE_NAMES[codes[i]]:
            return f"{path}: {cols.fqns[i]} does not read back as written (dtype, shape or chunk count)"
    if ev.chunk_ndim.tolist() != np.repeat(cols.ndim, cols.nchunks).tolist() or ev.chunk_dims != cols.chunk_dims:
        return f"{path}: the chunks' offsets or sizes do not read back as written"
    chunk_fqns = [f for f, n in zip(cols.fqns, cols.nchunks.tolist(), strict=True) for _ in range(n)]
    if ev.index_fqn != [o[0] for o in cols.objects] + chunk_fqns:
        return f"{path}: the storage keys do not read back as written"
    offsets = array("q")
    nd_of_chunk = np.repeat(cols.ndim, cols.nchunks).tolist()
    dims = cols.chunk_dims.tolist()
    d = 0
    for nd in nd_of_chunk:
        offsets.extend(dims[d:d + nd])
        d += 2 * nd
    if ev.index_ndim.tolist() != [-1] * len(cols.objects) + nd_of_chunk or ev.index_dims != offsets:
        return f"{path}: the storage keys' offsets do not read back as written"
    files = [cols.files[o[1]] for o in cols.objects] + [cols.files[i] for i in cols.item_file.tolist()]
    if ev.info_path != files or ev.info_offset.tolist() != [o[2] for o in cols.objects] + \
            cols.item_offset.tolist() or ev.info_length.tolist() != [o[3] for o in cols.objects] + \
            cols.item_length.tolist():
        return f"{path}: where the items are does not read back as written"
    read = md.get("planner_data")
    same = read == planner_data if planner_data is not None else isinstance(read, dict) and \
        len(read) == len(names) and all(read.get(k) == (k,) for k in names)
    if not same or md.get("version") != version:
        return f"{path}: the key paths or the version do not read back as written"
    return None


def _rows(values: list[int], counts: list[int], per: int) -> list[tuple[int, ...]]:
    out, p = [], 0
    for n in counts:
        out.append(tuple(values[p:p + n]))
        p += n * per
    return out
