"""Read a big ``.metadata`` as a stream of events instead of an object graph.

pickle's memo keeps every object it made alive until the load ends, so a million chunks cost a
million record objects plus a million-entry ``storage_data`` dict. Here the per-chunk classes
(ChunkStorageMetadata, MetadataIndex, _StorageInfo) are stand-ins whose one shared instance
receives each object's state in ``__setstate__`` and appends it to flat arrays, in file order.
DCP pickles a tensor's chunks right before the tensor, and each storage key right before its
value, so order alone ties them together; any file where that does not hold (a shared object,
an unexpected state) is read again the ordinary way.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from .reader_process import must_isolate, run_isolated
from .safe_pickle import NotStreamable, TensorStorageRecord, stream_size
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
        self.transformed = False
        self.broken: str | None = None
        self.max_dims = 1 << 62  # chunk offsets+sizes a file of this size can plausibly hold
        self.tensors: list[tuple] | None = None  # compact loads: (properties, size, chunk count) per tensor


def _hooks(ev: Events) -> dict[str, Any]:
    """The stand-in classes, sharing ``ev`` through this closure.

    NOTE: longer than 60 lines on purpose: four small classes that only make sense together."""
    def fail(why: str) -> None:
        if ev.broken is None:
            ev.broken = why

    class Chunk:
        __slots__ = ()
        kind = "ChunkStorageMetadata"

        def __new__(cls, *args: Any) -> Any:
            return chunk

        def __setstate__(self, state: Any) -> None:
            try:
                off, size = state["offsets"], state["sizes"]
                if len(off) != len(size):
                    raise TypeError("ragged chunk")
                if len(ev.chunk_dims) > ev.max_dims:
                    raise TypeError("more chunk dimensions than the file can hold (pickle memo references)")
                ev.chunk_ndim.append(len(off))
                ev.chunk_dims.extend(off)
                ev.chunk_dims.extend(size)
                state.clear()
            except (TypeError, KeyError, AttributeError, OverflowError):
                fail("chunk state")

    class Index:
        __slots__ = ()
        kind = "MetadataIndex"

        def __new__(cls, *args: Any) -> Any:
            return index

        def __setstate__(self, state: Any) -> None:
            try:
                if not isinstance(state["fqn"], str):
                    raise TypeError("fqn")
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

        def __hash__(self) -> int:
            return 0

    class Info:
        __slots__ = ()
        kind = "_StorageInfo"

        def __new__(cls, *args: Any) -> Any:
            return info

        def __setstate__(self, state: Any) -> None:
            try:
                if not isinstance(state["relative_path"], str):
                    raise TypeError("relative_path")
                ev.info_path.append(state["relative_path"])
                ev.info_offset.append(state["offset"])
                ev.info_length.append(state["length"])
                if state.get("transform_descriptors"):
                    ev.transformed = True
                state.clear()
            except (TypeError, KeyError, AttributeError, OverflowError):
                fail("storage info state")

    class Tensor(TensorStorageRecord):
        """Claims the chunks pushed since the previous tensor."""

        def __setstate__(self, state: Any) -> None:
            chunks = state.get("chunks") if isinstance(state, dict) else None
            if not isinstance(chunks, list) or chunks.count(chunk) != len(chunks):
                fail("tensor chunks")
                return
            n = len(chunks)
            if ev.claimed + n != len(ev.chunk_ndim):
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
        Tensor.__new__ = lambda cls, *args: shared  # type: ignore[method-assign,assignment]
    chunk, index, info = object.__new__(Chunk), object.__new__(Index), object.__new__(Info)
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
    return md, ev


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
