"""``drift``: every tensor of a run's checkpoints, in step order: its L2 norm, its relative change since the
previous checkpoint ``||W_i - W_{i-1}|| / ||W_{i-1}||`` (float64, the relative L2 of :func:`.diff.value_change`),
its count of NaN/Inf, and for an optimizer's moments (``exp_avg``, ``exp_avg_sq``) its zeros and negatives; and
the first checkpoint and tensor where a value is not finite.

The checkpoints are opened together (their metadata) and read tensor by tensor: one tensor through every
checkpoint in step order, the previous checkpoint's value held, so every checkpoint's bytes are read once and
memory holds about three of the largest tensor (the previous value, the current one, and the next one read on a
thread while the statistics run) and cache-sized float64 blocks of :data:`STATS_BLOCK` elements."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint.sources import EntryInfo
from ..errors import ShardscopeError
from ..progress import Progress
from .diff import value_change
from .series import SeriesPoint, step_labels

MOMENTS = ("exp_avg", "exp_avg_sq")  # an Adam-like optimizer's moment tensors, by the last part of their name


def is_moment(fqn: str) -> bool:
    """True for an optimizer moment tensor (``...weight.exp_avg``, ``...weight.exp_avg_sq``)."""
    return fqn.rsplit(".", 1)[-1] in MOMENTS


@dataclass
class TensorDrift:
    """One tensor through the series; a list entry is None where the checkpoint lacks it (or, for
    ``rel_change``, at the first checkpoint, after one that lacks it or changed its shape, or when the change
    cannot be stated as a number: from all zeros to anything else)."""

    norm: list[float | None]
    rel_change: list[float | None]
    nonfinite: list[int | None]
    zeros: list[int | None] | None = None  # moments only
    negatives: list[int | None] | None = None

    def to_json(self) -> dict[str, Any]:
        """The tensor's series as JSON-ready lists (not-finite floats as null)."""
        out: dict[str, Any] = {"norm": [_number(v) for v in self.norm],
                               "rel_change": [_number(v) for v in self.rel_change], "nonfinite": self.nonfinite}
        if self.zeros is not None:
            out["zeros"], out["negatives"] = self.zeros, self.negatives
        return out


@dataclass
class DriftResult:
    """The whole series: steps (in order), the checkpoints' paths, every tensor's drift (in the order the
    checkpoints list them) and the first non-finite value (step, tensor) or None."""

    steps: list[int]
    paths: list[str]
    tensors: dict[str, TensorDrift] = field(default_factory=dict)
    first_nonfinite: tuple[int, str] | None = None

    def to_json(self) -> dict[str, Any]:
        """``{"steps", "paths", "tensors": {FQN: {...}}, "first_nonfinite": {"step", "fqn"} | null}``."""
        first = self.first_nonfinite
        return {"steps": self.steps, "paths": self.paths,
                "tensors": {k: v.to_json() for k, v in self.tensors.items()},
                "first_nonfinite": {"step": first[0], "fqn": first[1]} if first else None}


def _number(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


STATS_BLOCK = 1 << 15  # elements per block: float64 temporaries stay in the CPU's cache, and each op runs on one
# thread (torch splits work above 32,768 elements; on a loaded machine that costs more than it gains)
_FAST = ("torch.float16", "torch.bfloat16", "torch.float32", "torch.float64")  # dtypes with the fast change


def tensor_stats(t: Any, moment: bool) -> tuple[float, int, int, int]:
    """(L2 norm of the finite elements, NaN/Inf count, zeros, negatives) of a tensor, in float64 blocks;
    zeros and negatives are counted only for a ``moment`` (else 0). A block's sum of squares is one float64
    ``vector_norm`` of its values (cast as it reads; not BLAS's ``dot``, whose threads stall a loaded machine);
    only a block whose sum is not finite is looked at element by element."""
    import torch

    flat = t.reshape(-1)
    s2, nonfinite, zeros, negatives = 0.0, 0, 0, 0
    for s in range(0, flat.numel(), STATS_BLOCK):
        blk = flat[s:s + STATS_BLOCK]
        v = float(torch.linalg.vector_norm(blk, dtype=torch.float64)) ** 2
        if math.isfinite(v):
            s2 += v
        else:  # a NaN or Inf in the block (or a float64 square beyond its range)
            x = blk.to(torch.float64)
            finite = torch.isfinite(x)
            nonfinite += int(x.numel() - int(finite.sum()))
            s2 += float(x[finite].square().sum())
        if moment:
            zeros += int(torch.count_nonzero(blk == 0))
            negatives += int(torch.count_nonzero(blk < 0))
    return math.sqrt(s2), nonfinite, zeros, negatives


def rel_change(prev: Any, cur: Any, prev_norm: float) -> float | None:
    """``||cur - prev|| / ||prev||`` in float64 (:func:`.diff.value_change`'s relative L2; ``prev_norm``: prev's
    norm from :func:`tensor_stats`): 0.0 for equal values; from all zeros to anything else inf. Floating
    tensors are compared in float64 blocks of :data:`STATS_BLOCK` elements, one norm per block; a difference
    that is not finite (NaN, Inf) hands the pair to :func:`.diff.value_change`, which says what NaN equals."""
    import torch

    fa, fb = prev.reshape(-1), cur.reshape(-1)
    if fa.numel() == 0:
        return 0.0
    if str(fa.dtype) not in _FAST:
        change = value_change(prev, cur)
        return 0.0 if change is None else change[1]
    d2 = 0.0
    for s in range(0, fa.numel(), STATS_BLOCK):
        d = fb[s:s + STATS_BLOCK].to(torch.float64, copy=True)  # NOTE: a copy: float64 inputs are not changed
        torch.sub(fa[s:s + STATS_BLOCK].to(torch.float64), d, out=d)
        v = float(torch.linalg.vector_norm(d)) ** 2
        if not math.isfinite(v):
            change = value_change(prev, cur)
            return 0.0 if change is None else change[1]
        d2 += v
    return math.sqrt(d2) / prev_norm if prev_norm > 0 else (0.0 if d2 == 0 else math.inf)


def _tensor_names(entries: list[dict[str, EntryInfo]]) -> list[str]:
    """Every tensor name of the series: the first checkpoint's order, then those that appear later."""
    names: dict[str, None] = {}
    for listed in entries:
        for name, info in listed.items():
            if info.kind == "tensor":
                names.setdefault(name)
    return list(names)


def _follow(n: int, fqn: str, values: Iterator[tuple[int, Any]], progress: Progress | None) -> TensorDrift:
    """One tensor through the series: ``values`` gives (checkpoint index, its value) in step order for the
    checkpoints that hold it; the previous value is held for the change."""
    moment = is_moment(fqn)
    d = TensorDrift([None] * n, [None] * n, [None] * n, [None] * n if moment else None,
                    [None] * n if moment else None)
    prev, prev_i, prev_norm = None, -2, 0.0
    for i, cur in values:
        norm, d.nonfinite[i], zeros, negatives = tensor_stats(cur, moment)
        d.norm[i] = norm
        if d.zeros is not None and d.negatives is not None:
            d.zeros[i], d.negatives[i] = zeros, negatives
        if prev is not None and prev_i == i - 1 and prev.shape == cur.shape and prev.dtype == cur.dtype:
            d.rel_change[i] = rel_change(prev, cur, prev_norm)
        prev, prev_i, prev_norm = cur, i, norm
        if progress:
            progress.advance(1, fqn)
    return d


def _read_ahead(jobs: list[tuple[str, int]], read: Callable[[str, int], Any]
                ) -> Generator[tuple[str, int, Any], None, None]:
    """(fqn, checkpoint index, value) of every job in order; the next value is read on a thread of its own while
    the caller works on this one (reads and torch's arithmetic let go of the GIL), so reading and the statistics
    overlap. NOTE: so up to three tensors are held: the previous, the current and the one being read."""
    if not jobs:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="drift-read") as pool:
        nxt: Future[Any] | None = pool.submit(read, *jobs[0])
        try:
            for k, (fqn, i) in enumerate(jobs):
                assert nxt is not None  # set for every job but after the last
                cur = nxt.result()
                nxt = pool.submit(read, *jobs[k + 1]) if k + 1 < len(jobs) else None
                yield fqn, i, cur
        finally:
            if nxt is not None:
                nxt.cancel()


def drift(series: list[SeriesPoint], storage_options: dict | None = None,
          progress: Progress | None = None) -> DriftResult:
    """The drift of every tensor through the checkpoints of ``series`` (in the order given: step order)."""
    from ..formats import open_source

    if not series:
        raise ShardscopeError("drift needs at least one checkpoint.")
    result = DriftResult(step_labels(series), [p.path for p in series])
    with contextlib.ExitStack() as stack:
        sources = [stack.enter_context(open_source(p.path, storage_options)) for p in series]
        entries = [src.entries() for src in sources]
        names = _tensor_names(entries)
        if progress:
            progress.start(len(names) * len(sources), "reading")
        jobs = [(fqn, i) for fqn in names for i in range(len(sources))
                if (info := entries[i].get(fqn)) is not None and info.kind == "tensor"]
        # NOTE: closed before the sources (the stack unwinds in reverse): the read in flight ends first
        reads = stack.enter_context(contextlib.closing(_read_ahead(jobs, lambda fqn, i: sources[i].tensor(fqn))))
        for fqn, group in itertools.groupby(reads, key=lambda r: r[0]):
            result.tensors[fqn] = _follow(len(sources), fqn, ((i, v) for _, i, v in group), progress)
    result.first_nonfinite = _first_nonfinite(result)
    return result


def _first_nonfinite(result: DriftResult) -> tuple[int, str] | None:
    """The earliest checkpoint holding a NaN/Inf, and its first tensor (in the checkpoint's order) holding one."""
    for i, step in enumerate(result.steps):
        for fqn, d in result.tensors.items():
            if d.nonfinite[i]:
                return step, fqn
    return None


def run_drift(paths: list[str], storage_options: dict | None = None,
              progress: Progress | None = None) -> DriftResult:
    """The drift of the checkpoints under ``paths`` (a run folder, checkpoints), found and ordered by step."""
    from .series import checkpoint_series

    return drift(checkpoint_series(paths, progress), storage_options, progress)


def module_rows(names: list[str], depth: int) -> tuple[list[str], list[list[int]]]:
    """Rows of the heat map: every tensor (``depth`` 0), or the tensors grouped by the first ``depth`` parts
    of their names (a module), in first-seen order; (row labels, the tensors' indices in each row)."""
    if depth <= 0:
        return list(names), [[i] for i in range(len(names))]
    groups: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        groups.setdefault(".".join(n.split(".")[:depth]), []).append(i)
    return list(groups), list(groups.values())
__all__ = ["MOMENTS", "DriftResult", "TensorDrift", "drift", "is_moment", "module_rows", "rel_change", "run_drift",
           "tensor_stats"]
