"""Where each parameter of a DeepSpeed ZeRO checkpoint lies in the ranks' flat partitions, by the rules of
DeepSpeed's ``zero_to_fp32.py`` (0.19):

* ZeRO-1/2: each param group is one flat vector (parameters in ``param_shapes`` order, each followed by its
  ``param_alignment_paddings``; the whole padded to a multiple of ``2 * world``), cut into ``world`` equal
  partitions; rank r saves its partition without the padding it holds (``group_paddings``). A parameter is a
  flat range of the vector, which may straddle ranks.
* ZeRO-3: every parameter is cut on its own into ``ceil(numel / world)``-element partitions (the last padded);
  rank r's flat groups hold its partition of each parameter in ``param_shapes`` order. Frozen parameters are
  cut the same way, one fragment per rank in the rank's model file.

An optimizer state of a flat group (``exp_avg``, ...) is laid out like the group's fp32 partition."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

from .deepspeed_model import DeepSpeedTensor, Piece, covers
from .whole_archive import StoredArray, TorchArchive, describe

Report = Callable[..., None]  # problem(kind, message, fqn=None, file=None)


@dataclass(slots=True)
class Part:
    """One rank's optimizer partition: its file, flat fp32 groups, each group's optimizer states, and the padding
    each group had (``group_paddings``, ZeRO-1/2) and each parameter after it (``param_alignment_paddings``)."""

    rank: int
    archive: TorchArchive
    groups: list[StoredArray]
    states: list[dict[str, StoredArray]]
    paddings: list[int] | None
    aligns: list[list[int]] | None


@dataclass(slots=True)
class ZeroLayout:
    """The tensors the partitions hold (trainable, and ZeRO-3's frozen ones), the master weights' dtype and the
    optimizer states found."""

    tensors: dict[str, DeepSpeedTensor]
    master_dtype: str | None
    optimizer_states: tuple[str, ...]


def _cut(rank: int, archive: TorchArchive, array: StoredArray, element: int, start: int, numel: int) -> Piece:
    rec = archive.record_of(array)
    return Piece(rank, archive.file, f"data/{array.key}", archive.byte_offset(array, element), start, numel,
                 array.dtype, rec.crc32)


class _Collector:
    """Pieces of one tensor: master weights and each optimizer state."""

    def __init__(self, states: tuple[str, ...]) -> None:
        self.pieces: list[Piece] = []
        self.states: dict[str, list[Piece]] = {k: [] for k in states}

    def add(self, part: Part, group: int, element: int, start: int, numel: int) -> None:
        self.pieces.append(_cut(part.rank, part.archive, part.groups[group], element, start, numel))
        for key, array in part.states[group].items() if group < len(part.states) else ():
            if key in self.states and element + numel <= array.numel:
                self.states[key].append(_cut(part.rank, part.archive, array, element, start, numel))

    def tensor(self, name: str, kind: str, shape: tuple[int, ...], dtype: str, group: int | None) -> DeepSpeedTensor:
        return DeepSpeedTensor(name, kind, shape, dtype, tuple(self.pieces),
                               {k: tuple(v) for k, v in self.states.items()}, group)


def _state_names(parts: dict[int, Part], report: Report) -> tuple[str, ...]:
    """The optimizer states every group of every rank has, in the order found; a state a group lacks or holds
    too short for its partition is reported (and left unmapped there)."""
    names: dict[str, None] = {}
    for part in parts.values():
        for states in part.states:
            names.update(dict.fromkeys(states))
    for part in parts.values():
        for g, array in enumerate(part.groups):
            states = part.states[g] if g < len(part.states) else {}
            for key in names:
                if key not in states or states[key].numel < array.numel:
                    report("size", f"optimizer state {describe(key)} of group {g} is missing or shorter than the "
                           f"{array.numel}-element partition", None, part.archive.file)
    return tuple(names)


def _master_dtype(parts: dict[int, Part], report: Report) -> str | None:
    dtypes = {a.dtype for p in parts.values() for a in p.groups}
    if len(dtypes) > 1:
        report("mixed", f"the flat partitions have several dtypes ({sorted(dtypes)})")
    return min(dtypes) if dtypes else None


def _flat_ranges(world: int, g: int, parts: dict[int, Part], report: Report) -> dict[int, tuple[int, int]]:
    """Rank -> (first element, elements) of group ``g``'s flat vector that the rank's saved partition holds:
    partitions lie end to end (DeepSpeed concatenates them); with ``group_paddings``, every rank's partition
    plus its padding is one size, which places a rank even when an earlier rank's file is missing."""
    lengths = {r: p.groups[g].numel for r, p in parts.items() if g < len(p.groups)}
    sizes = {lengths[r] + p.paddings[g] for r, p in parts.items()
             if r in lengths and p.paddings and g < len(p.paddings)}
    concat, at = {}, 0
    for r in range(world):
        if r not in lengths:
            break
        concat[r] = (at, lengths[r])
        at += lengths[r]
    if len(sizes) == 1:
        size = sizes.pop()
        placed = {r: (r * size, n) for r, n in lengths.items()}
        if all(placed[r] == concat[r] for r in concat):
            return placed
    elif len(sizes) > 1:
        report("size", f"group {g}: the ranks' partitions and paddings add up to different sizes {sorted(sizes)}")
    if len(concat) < len(lengths):
        report("size", f"group {g}: the partitions after a missing rank cannot be placed")
    return concat


def flat_layout(world: int, param_shapes: list[dict[str, tuple[int, ...]]], parts: dict[int, Part],
                report: Report) -> ZeroLayout:
    """ZeRO-1/2: each trainable parameter's pieces in its group's flat vector."""
    for part in parts.values():
        if len(part.groups) != len(param_shapes):
            report("size", f"rank {part.rank} holds {len(part.groups)} flat groups; param_shapes names "
                   f"{len(param_shapes)}", None, part.archive.file)
    states, dtype = _state_names(parts, report), _master_dtype(parts, report)
    tensors: dict[str, DeepSpeedTensor] = {}
    for g, shapes in enumerate(param_shapes):
        ranges = _flat_ranges(world, g, parts, report)
        first = parts[min(parts)] if parts else None
        aligns = first.aligns[g] if first and first.aligns and g < len(first.aligns) else None
        if aligns is not None and len(aligns) != len(shapes):
            report("size", f"group {g}: {len(aligns)} alignment paddings for {len(shapes)} parameters; ignored")
            aligns = None
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            n = math.prod(shape)
            got = _Collector(states)
            for r, (start, length) in ranges.items():
                lo, hi = max(offset, start), min(offset + n, start + length)
                if lo < hi:
                    got.add(parts[r], g, lo - start, lo - offset, hi - lo)
            tensors[name] = got.tensor(name, "trainable", shape, dtype or "float32", g)
            offset += n + (aligns[i] if aligns else 0)
        if len(ranges) == world:
            held = sum(length for _, length in ranges.values())
            align = 2 * world  # DeepSpeed's own check: both ends aligned to 2 * world agree. With the paddings
            exact = all(p.paddings is not None for p in parts.values())  # saved, the ends agree exactly
            if offset != held if exact else -(-offset // align) != -(-held // align):
                report("size", f"group {g}: the parameters take {offset} elements; the partitions hold {held}")
    return ZeroLayout(_report_incomplete(tensors, report), dtype, states)


def _report_incomplete(tensors: dict[str, DeepSpeedTensor], report: Report) -> dict[str, DeepSpeedTensor]:
    for t in tensors.values():
        if not t.complete:
            held = sum(p.numel for p in t.pieces)
            report("incomplete", f"{describe(t.name)}: the files hold {held} of its {t.numel} elements", t.name)
    return tensors


def zero3_layout(world: int, param_shapes: list[dict[str, tuple[int, ...]]], parts: dict[int, Part],
                 frozen_shapes: dict[str, tuple[int, ...]] | None,
                 fragments: dict[int, dict[str, tuple[TorchArchive, StoredArray]]], report: Report) -> ZeroLayout:
    """ZeRO-3: each parameter's partitions in the ranks' flat groups; frozen ones in the ranks' fragments."""
    sizes = {r: [a.numel for a in p.groups] for r, p in parts.items()}
    if len({tuple(s) for s in sizes.values()}) > 1:
        report("size", "the ranks' flat groups differ in size")
    starts = {r: [0, *_running(s)] for r, s in sizes.items()}  # each group's first element in the rank's flat
    states, dtype = _state_names(parts, report), _master_dtype(parts, report)
    tensors: dict[str, DeepSpeedTensor] = {}
    for name, tensor in frozen_tensors(world, frozen_shapes or {}, fragments, report):
        tensors[name] = tensor
    merged = {k: v for d in param_shapes for k, v in d.items()}  # as zero_to_fp32 merges them
    offset = 0
    for name, shape in merged.items():
        n = math.prod(shape)
        per_rank = -(-n // world)
        got = _Collector(states)
        for r, part in parts.items():
            lo, hi = r * per_rank, min((r + 1) * per_rank, n)
            _place(got, part, starts[r], offset, lo, hi)
        tensors[name] = got.tensor(name, "trainable", shape, dtype or "float32", None)
        offset += per_rank
    for r, s in starts.items():
        if offset != s[-1]:
            report("size", f"rank {r}: the parameters take {offset} elements of each partition; it holds {s[-1]}",
                   None, parts[r].archive.file)
    return ZeroLayout(_report_incomplete(tensors, report), dtype, states)


def _running(values: list[int]) -> list[int]:
    out, at = [], 0
    for v in values:
        at += v
        out.append(at)
    return out


def _place(got: _Collector, part: Part, starts: list[int], offset: int, lo: int, hi: int) -> None:
    """Elements lo..hi of a parameter, at ``offset`` of the rank's flat groups laid end to end (a range may cross
    from one group into the next, as zero_to_fp32's GatheredTensor allows)."""
    at, start = offset, lo
    while start < hi:
        g = bisect.bisect_right(starts, at) - 1
        if g >= len(part.groups):  # past what the rank holds: the tensor stays incomplete
            return
        take = min(hi - start, starts[g + 1] - at)
        got.add(part, g, at - starts[g], start, take)
        at, start = at + take, start + take


def frozen_tensors(world: int, shapes: dict[str, tuple[int, ...]],
                   fragments: dict[int, dict[str, tuple[TorchArchive, StoredArray]]], report: Report
                   ) -> list[tuple[str, DeepSpeedTensor]]:
    """ZeRO-3's frozen parameters: rank r's fragment is the r-th ``ceil(numel / world)`` elements (DeepSpeed
    concatenates the fragments in rank order and drops the padding)."""
    out = []
    for name, shape in shapes.items():
        n = math.prod(shape)
        per_rank = -(-n // world)
        pieces, dtype = [], None
        for r in sorted(r for r in fragments if r < world):
            frag = fragments[r].get(name)
            if frag is None:
                continue
            archive, array = frag
            dtype = dtype or array.dtype
            if array.numel != per_rank:
                report("size", f"frozen {describe(name)}: rank {r}'s fragment has {array.numel} elements, "
                       f"not {per_rank}", name, archive.file)
                continue
            take = max(0, min(per_rank, n - r * per_rank))
            if take:
                pieces.append(_cut(r, archive, array, 0, r * per_rank, take))
        tensor = DeepSpeedTensor(name, "frozen", shape, dtype or "float32", tuple(pieces))
        if not covers(tensor.pieces, n):
            report("incomplete", f"frozen {describe(name)}: its fragments hold {sum(p.numel for p in pieces)} of "
                   f"its {n} elements", name)
        out.append((name, tensor))
    return out


__all__ = ["Part", "ZeroLayout", "flat_layout", "frozen_tensors", "zero3_layout"]
