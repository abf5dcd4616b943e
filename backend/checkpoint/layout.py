"""Layout analysis: does each tensor's chunk set tile it exactly; per-rank and per-file balance."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..text import count
from .model import Checkpoint, Problem, TensorEntry, itemsize

MAX_GRID_CELLS = 4_000_000
MAX_REPORTED_REGIONS = 8


@dataclass(frozen=True, slots=True)
class Region:
    """A box of tensor indices: ``[start, stop)`` per dimension."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    def __str__(self) -> str:
        if not self.start:
            return "[scalar]"
        return "[" + ", ".join(f"{a}:{b}" for a, b in zip(self.start, self.stop, strict=True)) + "]"


@dataclass(slots=True)
class Coverage:
    """How a tensor's chunks cover it."""

    exact: bool
    gaps: list[Region] = field(default_factory=list)
    overlaps: list[Region] = field(default_factory=list)
    gap_elements: int = 0
    overlap_elements: int = 0
    out_of_bounds: list[int] = field(default_factory=list)  # chunk indices reaching past the shape


def _chunk_boxes(ckpt: Checkpoint, entry: TensorEntry) -> tuple[np.ndarray, np.ndarray]:
    t = ckpt.chunk_table
    nd = entry.ndim
    n = entry.chunk_count
    if n == 0:
        return np.zeros((0, nd), np.int64), np.zeros((0, nd), np.int64)
    starts = t.dim_start[entry.first_chunk:entry.first_chunk + n]
    idx = starts[:, None] + np.arange(2 * nd)[None, :]
    d = t.dims[idx] if nd else np.zeros((n, 0), np.int64)
    return d[:, :nd], d[:, :nd] + d[:, nd:]


def coverage(ckpt: Checkpoint, entry: TensorEntry) -> Coverage:
    """How the chunks of one tensor cover it: exact, or its gaps, overlaps and out-of-bounds chunks."""
    shape = np.asarray(entry.shape, np.int64)
    nd = entry.ndim
    lo, hi = _chunk_boxes(ckpt, entry)
    numel = math.prod(entry.shape)
    oob = [int(i) for i in np.nonzero(((lo < 0) | (hi > shape) | (hi < lo)).any(axis=1))[0]] if nd else []
    if nd == 0:
        n = entry.chunk_count
        if n == 1:
            return Coverage(True)
        if n == 0:
            return Coverage(False, gaps=[Region((), ())], gap_elements=1)
        return Coverage(False, overlaps=[Region((), ())], overlap_elements=n - 1)
    if numel == 0:
        return Coverage(not oob, out_of_bounds=oob)
    lo = np.clip(lo, 0, shape)
    hi = np.clip(hi, 0, shape)
    # Fast path: every chunk spans all trailing dims (row-wise sharding, FSDP/DDP): 1-D intervals.
    if (lo[:, 1:] == 0).all() and (hi[:, 1:] == shape[1:]).all():
        order = np.argsort(lo[:, 0], kind="stable")
        a, b = lo[order, 0], hi[order, 0]
        if len(a) and a[0] == 0 and b[-1] == shape[0] and (a[1:] == b[:-1]).all() and (b >= a).all():
            return Coverage(not oob, out_of_bounds=oob)
    return _grid_coverage(entry, lo, hi, shape, oob)


MAX_CORNER_DIMS = 10  # a difference array needs 2**ndim corner updates per chunk
MAX_CORNER_UPDATES = 1 << 26  # beyond this, only element totals are compared (no regions)


def _grid_coverage(entry: TensorEntry, lo: np.ndarray, hi: np.ndarray, shape: np.ndarray,
                   oob: list[int]) -> Coverage:
    """Coverage counted on the grid the chunk edges make: a difference array (one +-1 per chunk corner,
    then a prefix sum per axis), so the cost is O(chunks * 2**ndim + cells), not O(chunks * cells)."""
    # Dimensions every chunk spans fully do not change the grid: leave them out.
    keep = [d for d in range(entry.ndim) if not ((lo[:, d] == 0).all() and (hi[:, d] == shape[d]).all())]
    lo, hi, sub = lo[:, keep], hi[:, keep], shape[keep]
    full = math.prod(int(shape[d]) for d in range(entry.ndim) if d not in keep)
    bounds = [np.unique(np.concatenate(([0, sub[d]], lo[:, d], hi[:, d]))) for d in range(len(keep))]
    cells = math.prod(len(b) - 1 for b in bounds)
    if cells > MAX_GRID_CELLS or len(keep) > MAX_CORNER_DIMS or len(lo) << len(keep) > MAX_CORNER_UPDATES:
        vol = sum(math.prod(int(x) for x in row) for row in (hi - lo)) * full
        numel = math.prod(entry.shape)
        return Coverage(vol == numel and not oob, gap_elements=max(0, numel - vol),
                        overlap_elements=max(0, vol - numel), out_of_bounds=oob)
    count = _cell_counts(lo, hi, bounds)
    widths = [np.diff(b) for b in bounds]
    # Sums of cell volumes stay exact: int64 while they provably fit, Python ints beyond.
    big = math.prod(entry.shape) * max(1, len(lo)) >= 2**62
    cov = Coverage(True, out_of_bounds=oob)
    cov.gap_elements = _volume((count == 0).astype(np.int64), widths, big) * full
    cov.overlap_elements = _volume(np.maximum(count - 1, 0).astype(np.int64), widths, big) * full
    cov.gaps = _regions(np.argwhere(count == 0), bounds, keep, shape)
    cov.overlaps = _regions(np.argwhere(count > 1), bounds, keep, shape)
    cov.exact = not cov.gap_elements and not cov.overlap_elements and not oob
    return cov


def _cell_counts(lo: np.ndarray, hi: np.ndarray, bounds: list[np.ndarray]) -> np.ndarray:
    """How many chunks cover each grid cell."""
    nd = len(bounds)
    if nd == 0:
        return np.array(len(lo), np.int64)
    a = np.stack([np.searchsorted(bounds[d], lo[:, d]) for d in range(nd)])
    b = np.stack([np.searchsorted(bounds[d], hi[:, d]) for d in range(nd)])
    diff = np.zeros([len(x) for x in bounds], np.int64)
    for corner in range(1 << nd):
        idx = tuple(b[d] if corner >> d & 1 else a[d] for d in range(nd))
        np.add.at(diff, idx, -1 if bin(corner).count("1") % 2 else 1)
    for d in range(nd):
        np.cumsum(diff, axis=d, out=diff)
    return diff[tuple(slice(0, len(x) - 1) for x in bounds)]


def _volume(weights: np.ndarray, widths: list[np.ndarray], big: bool) -> int:
    """sum over cells of weight * cell volume, contracting one axis at a time."""
    m: Any = weights.astype(object) if big else weights
    for w in widths:
        m = np.tensordot(w.astype(object) if big else w, m, axes=([0], [0]))
    return int(m)


def _regions(cells: np.ndarray, bounds: list[np.ndarray], keep: list[int], shape: np.ndarray) -> list[Region]:
    """Merge runs of grid cells along the first dimension into boxes (a readable summary); dimensions
    left out of the grid span the whole tensor."""
    out: list[Region] = []
    for c in cells[: MAX_REPORTED_REGIONS * 16]:
        start_l, stop_l = [0] * len(shape), [int(x) for x in shape]
        for k, d in enumerate(keep):
            start_l[d], stop_l[d] = int(bounds[k][c[k]]), int(bounds[k][c[k] + 1])
        start, stop = tuple(start_l), tuple(stop_l)
        if out and out[-1].stop[0] == start[0] and out[-1].start[1:] == start[1:] and out[-1].stop[1:] == stop[1:]:
            out[-1] = Region(out[-1].start, (stop[0], *stop[1:]))
        else:
            out.append(Region(start, stop))
        if len(out) > MAX_REPORTED_REGIONS:
            break
    return out[:MAX_REPORTED_REGIONS]


def whole_single_chunks(ckpt: Checkpoint) -> np.ndarray:
    """Per tensor, True when it is one chunk at offset 0 of exactly its shape (a safetensors or torch file's
    every tensor): such a tensor is tiled exactly, which :func:`coverage` would find one tensor at a time (40 µs
    each: 12 s for a file of 300,000 tensors). Worked out for all tensors at once, grouped by rank."""
    tensors = ckpt.tensors
    n = len(tensors)
    out = np.zeros(n, bool)
    if not n:
        return out
    t = ckpt.chunk_table
    ndim = np.fromiter((len(e.shape) for e in tensors), np.int64, n)
    first = np.fromiter((e.first_chunk for e in tensors), np.int64, n)
    single = np.fromiter((e.chunk_count == 1 for e in tensors), bool, n)
    for nd in np.unique(ndim[single]).tolist():
        which = np.nonzero(single & (ndim == nd))[0]
        if nd == 0:
            out[which] = True
            continue
        starts = t.dim_start[first[which]]
        if starts.min() < 0 or starts.max() + 2 * nd > len(t.dims):
            continue  # a malformed table: the one-by-one check says what is wrong
        d = t.dims[starts[:, None] + np.arange(2 * nd)[None, :]]
        shapes = np.array([tensors[i].shape for i in which.tolist()], np.int64).reshape(len(which), nd)
        out[which] = (d[:, :nd] == 0).all(axis=1) & (d[:, nd:] == shapes).all(axis=1)
    return out


def coverage_problems(ckpt: Checkpoint) -> list[Problem]:
    """A gap, overlap or out-of-bounds problem for every tensor whose chunks do not tile it."""
    problems = []
    whole = whole_single_chunks(ckpt)
    for i, e in enumerate(ckpt.tensors):
        if whole[i]:
            continue
        cov = coverage(ckpt, e)
        if cov.exact:
            continue
        if cov.gap_elements:
            where = ", ".join(map(str, cov.gaps)) or "(too many chunks to list)"
            problems.append(Problem("gap", f"{e.fqn}: {cov.gap_elements} of {e.numel} elements are in no chunk: "
                                    f"{where}.", fqn=e.fqn))
        if cov.overlap_elements:
            where = ", ".join(map(str, cov.overlaps)) or "(too many chunks to list)"
            problems.append(Problem("overlap", f"{e.fqn}: chunks overlap on {cov.overlap_elements} elements: "
                                    f"{where}.", fqn=e.fqn))
        if cov.out_of_bounds:
            problems.append(Problem("out_of_bounds", f"{e.fqn}: {count(len(cov.out_of_bounds), 'chunk')} reach outside "
                                    f"the shape {list(e.shape)}.", fqn=e.fqn))
    return problems


@dataclass(frozen=True, slots=True)
class RankBalance:
    """Chunks and value bytes one writer rank holds."""
    rank: int  # -1: files whose name carries no rank
    chunks: int
    bytes: int  # tensor bytes written by this rank

    def to_json(self) -> dict:
        """This rank's chunk count and bytes as a JSON-ready dict."""
        return {"rank": self.rank, "chunks": self.chunks, "bytes": self.bytes}


def chunk_nbytes(ckpt: Checkpoint) -> np.ndarray:
    """Value bytes of every chunk (elements × item size), from the metadata: the product of its sizes, worked
    out for all chunks of a rank at once (one tensor at a time took 2 s for 300,000 tensors)."""
    t = ckpt.chunk_table
    out = np.zeros(len(t), np.int64)
    tensors = ckpt.tensors
    if not len(t) or not tensors:
        return out
    sizes = {d: itemsize(d) for d in {e.dtype for e in tensors}}
    ndim = np.fromiter((len(e.shape) for e in tensors), np.int64, len(tensors))
    item = np.fromiter((sizes[e.dtype] for e in tensors), np.int64, len(tensors))
    owner = t.tensor.astype(np.int64)
    ok = (owner >= 0) & (owner < len(tensors))
    chunk_nd = np.where(ok, ndim[np.clip(owner, 0, len(tensors) - 1)], -1)
    for nd in np.unique(chunk_nd[ok]).tolist():
        which = np.nonzero(chunk_nd == nd)[0]
        if nd == 0:
            out[which] = item[owner[which]]
            continue
        idx = t.dim_start[which][:, None] + nd + np.arange(nd)[None, :]
        out[which] = np.prod(t.dims[idx], axis=1) * item[owner[which]]
    return out


def rank_balance(ckpt: Checkpoint) -> list[RankBalance]:
    """Chunks and value bytes per writer rank (-1: files without a rank in their name)."""
    t = ckpt.chunk_table
    ranks = ckpt.file_ranks[t.file]  # file -1 maps to the trailing -1
    nbytes = chunk_nbytes(ckpt)
    # one pass over the chunks (a mask per rank is quadratic with 100,000 ranks)
    uniq, inverse = np.unique(np.concatenate([ranks, np.asarray(ckpt.ranks, ranks.dtype)]), return_inverse=True)
    inverse = inverse[:len(ranks)]
    chunks = np.bincount(inverse, minlength=len(uniq))
    sums = np.zeros(len(uniq), np.int64)
    np.add.at(sums, inverse, nbytes)
    return [RankBalance(int(r), int(c), int(b)) for r, c, b in zip(uniq.tolist(), chunks.tolist(), sums.tolist(),
                                                                    strict=True)]


def tensor_rank_bytes(ckpt: Checkpoint) -> tuple[list[int], np.ndarray]:
    """A tensors × ranks matrix of value bytes (the heat map)."""
    ranks = ckpt.ranks or [0]
    col = {r: i for i, r in enumerate(ranks)}
    t = ckpt.chunk_table
    nbytes = chunk_nbytes(ckpt)
    mat = np.zeros((len(ckpt.tensors), len(ranks)), np.int64)
    lookup = np.full(max(ranks) + 2, -1, np.int64)
    for r, i in col.items():
        lookup[r] = i
    chunk_cols = lookup[ckpt.file_ranks[t.file]]  # rank -1 indexes the trailing -1
    keep = chunk_cols >= 0
    np.add.at(mat, (t.tensor[keep], chunk_cols[keep]), nbytes[keep])
    return ranks, mat
