"""Plain dataclasses for what a distributed checkpoint holds and where its bytes are.

Chunks live in one columnar :class:`ChunkTable` (numpy arrays), so a checkpoint with a
million chunks costs a few arrays, not a million objects; :class:`Chunk` objects are
made on demand for one tensor at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .dtypes import (  # noqa: F401  (re-exported: the model is where readers look for them)
    DTYPE_NAMES,
    FLOAT_DTYPES,
    ITEMSIZE,
    MAX_INDEX,
    MAX_NDIM,
    SAFETENSORS_CODES,
    SAFETENSORS_DTYPES,
    contiguous_strides,
    itemsize,
)


@dataclass(frozen=True, slots=True)
class Problem:
    """Something wrong with a checkpoint, found by reading or verifying it."""

    kind: str  # gap, overlap, missing_file, short_file, unreadable, corrupt, incomplete, leftover_tmp, ...
    message: str
    fqn: str | None = None
    file: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The problem as a JSON-ready dict (kind, fqn, file, message)."""
        return {"kind": self.kind, "fqn": self.fqn, "file": self.file, "message": self.message}


@dataclass(frozen=True, slots=True)
class FileInfo:
    """One file of the checkpoint folder; ``rank`` is the writer rank parsed from ``__R_N.distcp`` (None for a
    non-empty data file the metadata does not reference: not a rank of this save)."""

    name: str
    rank: int | None
    bytes: int | None  # None: the file is referenced but missing
    kind: str = "data"  # data, metadata, meta.pt, other


@dataclass(frozen=True, slots=True)
class Chunk:
    """One stored piece of a tensor: where it sits in the tensor and where its bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int  # byte offset of the item in the file
    length: int  # byte length of the item
    rank: int | None  # the rank that wrote it (DCP writes a replicated tensor once)

    @property
    def numel(self) -> int:
        """Number of elements in this chunk (product of its sizes)."""
        return math.prod(self.sizes)

    def to_json(self) -> dict[str, Any]:
        """The chunk's place in the tensor and in its file, as a JSON-ready dict."""
        return {"offsets": list(self.offsets), "sizes": list(self.sizes), "rank": self.rank,
                "file": self.file, "offset": self.offset, "length": self.length}


@dataclass(slots=True)
class ChunkTable:
    """All chunks of a checkpoint, columnar. Chunk ``j`` of a tensor with ``ndim`` dims stores its
    offsets at ``dims[dim_start[j]:dim_start[j]+ndim]`` and sizes right after them."""

    tensor: np.ndarray  # int32: index of the tensor
    file: np.ndarray  # int32: index into Checkpoint.files, -1 when the metadata names no storage
    byte_offset: np.ndarray  # int64
    length: np.ndarray  # int64
    dim_start: np.ndarray  # int64
    dims: np.ndarray  # int64

    @classmethod
    def empty(cls) -> ChunkTable:
        """A table with no chunks (all columns zero-length), for checkpoints without tensors."""
        z32, z64 = np.zeros(0, np.int32), np.zeros(0, np.int64)
        return cls(z32, z32, z64, z64, z64, z64)

    def __len__(self) -> int:
        return len(self.tensor)


@dataclass(slots=True, eq=False)
class TensorEntry:
    """A tensor of the checkpoint by its flattened FQN (``model.blocks.0.fc1.weight``)."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    first_chunk: int
    chunk_count: int
    checkpoint: Checkpoint = field(repr=False)

    @property
    def ndim(self) -> int:
        """Number of dimensions of the full tensor."""
        return len(self.shape)

    @property
    def numel(self) -> int:
        """Number of elements of the full (unsharded) tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size of the full tensor in bytes at its stored dtype."""
        return self.numel * itemsize(self.dtype)

    @property
    def chunks(self) -> list[Chunk]:
        """The chunks (shards) this tensor is stored in, built from the checkpoint's chunk table."""
        return self.checkpoint.chunks_of(self)

    @property
    def ranks(self) -> list[int]:
        """Sorted ranks whose files hold a chunk of this tensor (unknown ranks left out)."""
        t = self.checkpoint.chunk_table
        sl = slice(self.first_chunk, self.first_chunk + self.chunk_count)
        ranks = self.checkpoint.file_ranks[t.file[sl]]
        return sorted({int(r) for r in ranks if r >= 0})

    def to_json(self) -> dict[str, Any]:
        """The tensor's name, dtype, shape, size and chunks as a JSON-ready dict."""
        return {"fqn": self.fqn, "dtype": self.dtype, "shape": list(self.shape), "nbytes": self.nbytes,
                "chunks": [c.to_json() for c in self.chunks]}


@dataclass(frozen=True, slots=True)
class ObjectEntry:
    """A non-tensor entry (``step``, ``optimizer.param_groups.0.lr``): pickled bytes in a file."""

    fqn: str
    file: str | None
    offset: int
    length: int
    rank: int | None
    # a consolidated file's entry read with the file's header or pickle (a safetensors file's
    # ``shardscope_objects``, a torch file's scalars): its value, stored nowhere else
    value: Any = None
    inline: bool = False

    def to_json(self) -> dict[str, Any]:
        """Where the entry's pickled bytes are (file, rank, offset, length) as a JSON-ready dict."""
        return {"fqn": self.fqn, "file": self.file, "rank": self.rank, "offset": self.offset,
                "length": self.length}


@dataclass(slots=True, eq=False)
class Checkpoint:
    """What a checkpoint folder holds: its files, tensors, chunks and non-tensor entries."""

    path: str
    format: str  # the name of its format (see backend/formats): set by the format that opened it
    version: str | None
    files: list[FileInfo]
    tensors: list[TensorEntry]
    objects: list[ObjectEntry]
    chunk_table: ChunkTable
    save_id: str | None = None
    planner_data: dict[str, tuple] = field(default_factory=dict)  # flattened FQN -> nested key path (validated)
    problems: list[Problem] = field(default_factory=list)  # found while reading (more come from verify)
    extra_files: dict[str, str] = field(default_factory=dict)  # e.g. {"meta.pt": "meta.pt"}
    metadata_files: list[str] = field(default_factory=list)
    folder: Any = field(default=None, repr=False)  # the storage.Folder it was opened from (set once)
    # tensors whose values the format already located (a torch file's storage records): fqn -> StoredTensor
    located: dict[tuple[str, str, int], Any] | None = field(default=None, repr=False)  # (fqn, file, offset) ->
    # how the chunk reader finds a chunk's values (a .codecs.ItemCodec the format's open attaches): DCP's stored
    # items (a torch.save archive or a safetensors blob at the chunk's byte range) with their stream transforms;
    # RAW_VALUES, the byte range is the raw values (a safetensors file's data); None: DCP's, untransformed
    codec: Any = field(default=None, repr=False)
    notes: list[str] = field(default_factory=list)  # what the format wants said (which tag of a save folder)
    format_data: Any = field(default=None, repr=False)  # what the format keeps for its own deep checks
    _by_fqn: dict[str, TensorEntry] = field(default_factory=dict, repr=False)
    file_ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32), repr=False)

    def __post_init__(self) -> None:
        self.reindex()

    def reindex(self) -> None:
        """Rebuild the name lookup and file-to-rank array; call after changing ``tensors`` or ``files``."""
        self._by_fqn = {t.fqn: t for t in self.tensors}
        self.file_ranks = np.array([-1 if f.rank is None else f.rank for f in self.files] + [-1], np.int32)

    def tensor(self, fqn: str) -> TensorEntry:
        """The tensor named ``fqn``; KeyError naming the checkpoint when there is none."""
        try:
            return self._by_fqn[fqn]
        except KeyError:
            raise KeyError(f"no tensor named {fqn!r} in {self.path}") from None

    def has_tensor(self, fqn: str) -> bool:
        """True when the checkpoint holds a tensor named ``fqn``."""
        return fqn in self._by_fqn

    def object(self, fqn: str) -> ObjectEntry:
        """The non-tensor entry named ``fqn``; KeyError naming the checkpoint when there is none."""
        for o in self.objects:
            if o.fqn == fqn:
                return o
        raise KeyError(f"no entry named {fqn!r} in {self.path}")

    def chunks_of(self, entry: TensorEntry) -> list[Chunk]:
        """The chunks of ``entry`` with their offsets, sizes, file, byte range and writer rank."""
        t = self.chunk_table
        nd = entry.ndim
        out = []
        for j in range(entry.first_chunk, entry.first_chunk + entry.chunk_count):
            s = int(t.dim_start[j])
            d = t.dims[s:s + 2 * nd].tolist()
            fi = int(t.file[j])
            info = self.files[fi] if fi >= 0 else None
            out.append(Chunk(tuple(d[:nd]), tuple(d[nd:]), info.name if info else "",
                             int(t.byte_offset[j]), int(t.length[j]), info.rank if info else None))
        return out

    def nesting_problem(self) -> Problem | None:
        """Why ``planner_data`` cannot rebuild the nested state dict (what a .pt export and reshard need), or None."""
        return next((p for p in self.problems if p.kind == "planner_data"), None)

    @property
    def ranks(self) -> list[int]:
        """Sorted ranks that wrote files into this checkpoint."""
        return sorted({f.rank for f in self.files if f.rank is not None})

    @property
    def total_bytes(self) -> int:
        """Total bytes of all tensors (full shapes at stored dtypes), not counting objects or files."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def data_files(self) -> list[FileInfo]:
        """The files that hold tensor and object bytes (not metadata or extra files)."""
        return [f for f in self.files if f.kind == "data"]
