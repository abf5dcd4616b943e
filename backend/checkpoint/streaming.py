"""Read a big ``.metadata`` as a stream of events instead of an object graph.

pickle's memo keeps every object it made alive until the load ends, so a million chunks cost a
million record objects. Here the per-chunk classes (ChunkStorageMetadata, MetadataIndex, _StorageInfo)
are stand-ins: empty 16-byte objects whose ``__setstate__`` appends the object's state, and its
identity, to flat arrays, in file order. A tensor claims its chunks by identity, and ``storage_data``
pairs keys and values as the dict is actually built (SETITEMS), so a pickle that builds its objects
somewhere else first (an extra attribute placed before the others) cannot re-pair them; any file whose
pairs are not in the order DCP writes them (each key right before its value, a tensor's chunks right
before it) is read again the ordinary way.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from .reader_process import must_isolate, run_isolated
from .safe_pickle import NotStreamable, Record, TensorStorageRecord, stream_size
from .unpickler import unpickle_metadata


class Events:
    """Flat arrays the streaming load fills in file order: chunk dims, storage keys and where each item is."""

    def __init__(self) -> None:
        self.chunk_ndim = array("i")
        self.chunk_dims = array("q")  # offsets then sizes, per chunk
        self.claimed = 0  # chunks already given to a tensor
        self.index_fqn: list[str] = []
        self.index_ndim = array("i")  # -1: no offset (a non-tensor entry)
        self.index_dims = array("q")
        self.info_path: list[str] = []
        self.info_offset = array("q")
        self.info_length = array("q")
        # id() of each stand-in object, per row above: pickle's memo keeps them all alive, so ids are unique
        self.chunk_ids, self.index_ids, self.info_ids = array("Q"), array("Q"), array("Q")
        self.transforms: dict[int, Any] = {}  # storage row -> its transform_descriptors as unpickled
        self.broken: str | None = None
        self.max_dims = 1 << 62  # chunk offsets+sizes a file of this size can plausibly hold
        self.tensors: list[tuple] | None = None  # compact loads: (properties, size, chunk count) per tensor


def _hooks(ev: Events) -> dict[str, Any]:
    """The stand-in classes, sharing ``ev`` through this closure.

    NOTE: longer than 60 lines on purpose: four small classes that only make sense together. Each stand-in
    object is a distinct empty object (made and hashed in C), so ``storage_data`` is a real dict whose pairs
    say which key got which value."""
    def fail(why: str) -> None:
        if ev.broken is None:
            ev.broken = why

    class Chunk:
        __slots__ = ()
        kind = "ChunkStorageMetadata"

        def __setstate__(self, state: Any) -> None:
            try:
                off, size = state["offsets"], state["sizes"]
                if len(off) != len(size):
                    raise TypeError("ragged chunk")
                if len(ev.chunk_dims) > ev.max_dims:
                    raise TypeError("more chunk dimensions than the file can hold (pickle memo references)")
                ev.chunk_ids.append(id(self))
                ev.chunk_ndim.append(len(off))
                ev.chunk_dims.extend(off)
                ev.chunk_dims.extend(size)
                state.clear()
            except (TypeError, KeyError, AttributeError, OverflowError):
                fail("chunk state")

    class Index:
        __slots__ = ()
        kind = "MetadataIndex"

        def __setstate__(self, state: Any) -> None:
            try:
                if not isinstance(state["fqn"], str):
                    raise TypeError("fqn")
                ev.index_ids.append(id(self))
                ev.index_fqn.append(state["fqn"])
                off = state.get("offset")
                if off is None:
                    ev.index_ndim.append(-1)
                else:
                    ev.index_ndim.append(len(off))
                    ev.index_dims.extend(off)
                state.clear()
            except (TypeError, KeyError, AttributeError, OverflowError):
                fail("index state")

    class Info:
        __slots__ = ()
        kind = "_StorageInfo"

        def __setstate__(self, state: Any) -> None:
            try:
                if not isinstance(state["relative_path"], str):
                    raise TypeError("relative_path")
                ev.info_ids.append(id(self))
                ev.info_path.append(state["relative_path"])
                ev.info_offset.append(state["offset"])
                ev.info_length.append(state["length"])
                if state.get("transform_descriptors"):  # torch's stream transforms (ZStandard), checked in _build
                    ev.transforms[len(ev.info_path) - 1] = state["transform_descriptors"]
                state.clear()
            except (TypeError, KeyError, AttributeError, OverflowError):
                fail("storage info state")

    class Tensor(TensorStorageRecord):
        """Claims the chunks made since the previous tensor, which must be the ones its list names, in order."""

        def __setstate__(self, state: Any) -> None:
            chunks = state.get("chunks") if isinstance(state, dict) else None
            if not isinstance(chunks, list):
                fail("tensor chunks")
                return
            n = len(chunks)
            if ev.claimed + n != len(ev.chunk_ndim) or array("Q", map(id, chunks)) != ev.chunk_ids[ev.claimed:]:
                fail("chunk order")
                return
            if ev.tensors is not None:  # compact: one shared record, what it says kept in a list
                ev.tensors.append((state.get("properties"), state.get("size"), n))
            else:
                self.__dict__.update(properties=state.get("properties"), size=state.get("size"),
                                     first=ev.claimed, count=n)
            ev.claimed += n

    if ev.tensors is not None:
        shared = object.__new__(Tensor)
        # every record of the class is the one shared object: a patch of __new__ that typing does not describe
        Tensor.__new__ = lambda cls, *args: shared  # type: ignore[method-assign,assignment]
    return {"ChunkStorageMetadata": Chunk, "MetadataIndex": Index, "_StorageInfo": Info,
            "TensorStorageMetadata": Tensor}


def stream_metadata(fh: Any, source: str) -> tuple[Any, Events]:
    """Load with the streaming hooks; raise :class:`NotStreamable` when the file's layout differs."""
    if must_isolate():  # the hooks live in this process: the whole streaming load moves to the helper
        return run_isolated(stream_metadata, fh, source)
    return _stream(fh, source, Events())


def stream_metadata_compact(fh: Any, source: str) -> tuple[Any, Events]:
    """:func:`stream_metadata` keeping no record per tensor: every ``state_dict_metadata`` value of a tensor is
    one shared record and ``Events.tensors`` holds (properties, size, chunk count) per tensor, in order (a writer
    reading back the ``.metadata`` of 300,000 tensors it wrote)."""
    if must_isolate():
        return run_isolated(stream_metadata_compact, fh, source)
    ev = Events()
    ev.tensors = []
    return _stream(fh, source, ev)


def _stream(fh: Any, source: str, ev: Events) -> tuple[Any, Events]:
    ev.max_dims = max_dims(stream_size(fh))
    md = unpickle_metadata(fh, source, overrides=_hooks(ev))
    if ev.broken:
        raise NotStreamable(ev.broken)
    if len(ev.index_fqn) != len(ev.info_path) or ev.claimed != len(ev.chunk_ndim):
        raise NotStreamable("storage keys and values do not pair up")
    _check_pairs(md, ev)
    return md, ev


def _check_pairs(md: Any, ev: Events) -> None:
    """``storage_data`` must pair the n-th key made with the n-th value made, every one once, in that order
    (as DCP writes it); then the events' arrays are the pairs, and the dict of stand-ins is dropped (it is not
    what the file's ``storage_data`` holds). A missing ``storage_data`` is refused by the ordinary reader."""
    storage = md.get("storage_data") if isinstance(md, Record) else None
    n = len(ev.index_ids)
    if not isinstance(storage, dict) or len(storage) != n:
        raise NotStreamable("storage_data missing, or not one entry per storage key")
    if not (np.array_equal(np.fromiter(map(id, storage.keys()), np.uint64, n), np.frombuffer(ev.index_ids, np.uint64))
            and np.array_equal(np.fromiter(map(id, storage.values()), np.uint64, n),
                               np.frombuffer(ev.info_ids, np.uint64))):
        raise NotStreamable("storage_data pairs keys and values other than in the order they were made")
    md.__dict__["storage_data"] = {}  # NOTE: the pairs are in the events' arrays
    ev.chunk_ids, ev.index_ids, ev.info_ids = array("Q"), array("Q"), array("Q")


def max_dims(file_bytes: int) -> int:
    """Chunk offsets and sizes a metadata file of this size can hold: each chunk record takes tens of
    bytes of its own, so more means memo references repeat chunks to amplify memory."""
    return 4 * file_bytes + (1 << 20)


def _padded(ndim: np.ndarray, dims: np.ndarray, stride_mult: int) -> np.ndarray:
    """Per row, its first ``ndim`` values of ``dims`` (rows stored back to back with
    ``stride_mult * ndim`` values each), padded with zeros to the widest row."""
    n = len(ndim)
    width = np.maximum(ndim, 0).astype(np.int64)
    starts = np.zeros(n, np.int64)
    if n:
        np.cumsum(width[:-1] * stride_mult, out=starts[1:])
    maxnd = int(width.max()) if n else 0
    out = np.zeros((n, maxnd), np.int64)
    for d in range(maxnd):
        has = width > d
        out[has, d] = dims[starts[has] + d]
    return out


def join_storage(tensor_of_chunk: np.ndarray, ev: Events, tensor_index: dict[str, int]
                 ) -> tuple[np.ndarray, list[int]]:
    """For every chunk, the position of its storage entry (-1: none); and the entries with no
    offset (non-tensor entries), by position."""
    c_ndim = np.frombuffer(ev.chunk_ndim, np.int32)
    c_dims = np.frombuffer(ev.chunk_dims, np.int64)
    c_off = _padded(c_ndim, c_dims, 2)
    i_ndim = np.frombuffer(ev.index_ndim, np.int32)
    i_dims = np.frombuffer(ev.index_dims, np.int64)
    i_off = _padded(i_ndim, i_dims, 1)
    i_tensor = np.fromiter((tensor_index.get(f, -1) for f in ev.index_fqn), np.int64, len(ev.index_fqn))
    objects = [int(i) for i in np.nonzero(i_ndim < 0)[0]]
    width = max(c_off.shape[1], i_off.shape[1])
    c_key = np.zeros((len(c_ndim), width + 2), np.int64)
    i_key = np.zeros((len(i_ndim), width + 2), np.int64)
    c_key[:, 0], c_key[:, 1], c_key[:, 2:2 + c_off.shape[1]] = tensor_of_chunk, c_ndim, c_off
    i_key[:, 0], i_key[:, 1], i_key[:, 2:2 + i_off.shape[1]] = i_tensor, i_ndim, i_off
    keep = (i_tensor >= 0) & (i_ndim >= 0)
    i_pos = np.nonzero(keep)[0]
    i_key = i_key[keep]
    c_order = np.lexsort(c_key.T[::-1])
    i_order = np.lexsort(i_key.T[::-1])
    result = np.full(len(c_ndim), -1, np.int64)
    cs, is_ = c_key[c_order], i_key[i_order]
    if len(cs) == len(is_) and np.array_equal(cs, is_):
        result[c_order] = i_pos[i_order]
        return result, objects
    # Not a one-to-one match (missing or extra storage entries): join row by row.
    lookup = {tuple(row): int(p) for row, p in zip(i_key.tolist(), i_pos.tolist(), strict=True)}
    for j, row in enumerate(c_key.tolist()):
        result[j] = lookup.get(tuple(row), -1)
    return result, objects
