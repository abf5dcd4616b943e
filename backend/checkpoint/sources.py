"""One reading interface for diff and import over any opened checkpoint (every format opens to the one model,
see :mod:`..formats`): tensors are read one at a time through the chunk reader."""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .chunks import ChunkReader, torch_dtype
from .model import Checkpoint, Problem, TensorEntry
from .verify import overlap_problems


@dataclass(frozen=True)
class EntryInfo:
    """What a source says about one entry without reading its values."""

    kind: str  # "tensor" or "object"
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    layout: tuple | None = None  # (offsets, sizes, writer rank) of every chunk


class Source:
    """Something diff and import read entries from, one tensor at a time."""
    name: str
    kind: str  # the format's name

    def entries(self) -> dict[str, EntryInfo]:
        """Every entry by name, with its kind, dtype, shape (and chunk layout for DCP), without reading values."""
        raise NotImplementedError

    def tensor(self, fqn: str) -> Any:
        """The values of tensor ``fqn``, read in full."""
        raise NotImplementedError

    def object(self, fqn: str) -> Any:
        """The value of non-tensor entry ``fqn``."""
        raise NotImplementedError

    def nested_path(self, fqn: str) -> tuple | None:
        """The nested key path entry ``fqn`` was flattened from, or None when not known."""
        return None

    def close(self) -> None:
        """Release open files and readers; the source is not used afterwards."""
        pass

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: builtins.object) -> None:
        self.close()


class CheckpointSource(Source):
    """Any opened checkpoint (every format opens to the one model) read through the chunk reader: tensors
    assembled from their chunks with stored checksums checked, non-tensor entries decoded safely."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self.name = ckpt.path
        self.kind = ckpt.format
        self.reader = ChunkReader(ckpt)

    def entries(self) -> dict[str, EntryInfo]:
        """Every tensor (with its chunk layout when writer ranks sharded it) and non-tensor entry."""
        sharded = bool(self.ckpt.ranks)
        out = {t.fqn: EntryInfo("tensor", t.dtype, t.shape, tuple((c.offsets, c.sizes, c.rank) for c in t.chunks)
                                if sharded else None) for t in self.ckpt.tensors}
        out.update({o.fqn: EntryInfo("object") for o in self.ckpt.objects})
        return out

    def tensor(self, fqn: str) -> Any:
        """Tensor ``fqn`` assembled from its chunks, each checked against its stored checksum."""
        return self.reader.read_tensor(self.ckpt.tensor(fqn))

    def object(self, fqn: str) -> Any:
        """Non-tensor entry ``fqn``, decoded safely (or the value a single file's header or pickle held)."""
        return self.reader.read_object(self.ckpt.object(fqn))

    def small_values(self, entries: list[TensorEntry], limit: int) -> Iterator[tuple[TensorEntry, memoryview | None]]:
        """(entry, its values as C-contiguous bytes) in the given order, for tensors of at most ``limit`` bytes
        stored whole and contiguous, read many at a time with stored checksums checked; (entry, None) for the
        others (read them with :meth:`tensor`)."""
        return self.reader.whole_values(entries, limit)

    def nested_path(self, fqn: str) -> tuple | None:
        """The nested key path the entry was flattened from (DCP's planner data, a torch file's keys), or None."""
        return self.ckpt.planner_data.get(fqn)

    def close(self) -> None:
        """Close the chunk reader's files and let the model go (a model of 300,000 entries is most of an
        import's memory); the source is not used afterwards. Closing twice is harmless."""
        if self.reader is not None:
            self.reader.close()
        # let the model go: typed as never None, since nothing uses a closed source
        self.reader = self.ckpt = None  # type: ignore[assignment]


def tensor_windows(source: CheckpointSource, fqn: str, window_elems: int, take: Any, check: bool = True
                   ) -> Iterator[memoryview]:
    """The bytes of tensor ``fqn`` in windows of ``window_elems`` elements: read run by run into buffers from
    ``take(n)``, or, for a layout that must be assembled, views of the assembled tensor (``take`` not called)."""
    entry = source.ckpt.tensor(fqn)
    reader = source.reader
    runs = reader.flat_runs(entry)
    if runs is not None:
        window = window_elems * torch_dtype(entry.dtype).itemsize
        yield from reader.read_runs(entry, runs, window, take, check)
        return
    import torch

    t = reader.read_tensor(entry).reshape(-1)
    whole = memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
    window = window_elems * t.element_size()
    for s in range(0, len(whole), window):
        yield whole[s:s + window]


def header_problem(ckpt: Checkpoint) -> Problem | None:
    """The first entry of safetensors headers that the safetensors library would refuse: a byte length
    that does not fit its shape and dtype (found by the reader), or bytes overlapping another entry's.
    O(n log n): a header of 300,000 entries must not cost a full :func:`verify`."""
    bad = next((p for p in ckpt.problems if p.kind == "unreadable" and p.fqn), None)
    if bad is not None:
        return bad
    t = ckpt.chunk_table
    if not _may_overlap(t.file, t.byte_offset, t.length):
        return None
    names, fqns = [f.name for f in ckpt.files], [e.fqn for e in ckpt.tensors]  # the first one, named as before
    ranges = [(names[f], o, o + n, fqns[ti]) for f, o, n, ti in zip(
        t.file.tolist(), t.byte_offset.tolist(), t.length.tolist(), t.tensor.tolist(), strict=True) if n > 0]
    return next(iter(overlap_problems(ranges, same_start=False)), None)


def _may_overlap(file: np.ndarray, start: np.ndarray, length: np.ndarray) -> bool:
    """Whether :func:`overlap_problems` (``same_start`` False) finds any overlap among the non-empty ranges, in
    numpy: sorted by file, start and end, a range overlaps when it starts before the end of the range reaching
    furthest before it in its file, at another byte than that range starts."""
    keep = length > 0
    file, start = file[keep], start[keep]
    end = start + length[keep]
    order = np.lexsort((end, start, file))
    file, start, end = file[order], start[order], end[order]
    bounds = np.flatnonzero(np.r_[True, file[1:] != file[:-1], True])
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        s, e = start[lo:hi], end[lo:hi]
        if len(s) < 2:
            continue
        reach = np.maximum.accumulate(e)  # how far the ranges up to each one reach
        first = e > np.r_[-1, reach[:-1]]  # the first range to reach that far: the sweep's "far"
        far = np.maximum.accumulate(np.where(first, np.arange(len(e)), 0))
        if ((s[1:] < reach[:-1]) & (s[1:] != s[far[:-1]])).any():
            return True
    return False
