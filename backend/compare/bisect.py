"""``bisect A B``: two series of checkpoints that should agree (a rerun with the same seed, a resumed copy, the
same recipe on other hardware), and the first step at which they part: a binary search over the steps both
series hold, comparing at most ``ceil(log2 N) + 1`` checkpoint pairs (the last step, then halving), each pair
compared by :func:`.diff.diff`. Once two runs part they stay parted, which is what makes the search valid.

A difference is any change in values, dtype, shape or entries; with a tolerance (``rtol``, ``atol``) a change in
values counts only where some element has ``|a - b| > atol + rtol * |b|`` (NaN equal to NaN), as torch.isclose
has it.

Sealed checkpoints (``shardscope seal``) are compared by digest where they can be: a tensor pair whose digests in
both manifests are equal is equal without a byte of it read (:func:`.diff.diff`); ``by_digest`` counts them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ShardscopeError
from ..progress import Progress
from .diff import BLOCK, Change, diff
from .drift import is_moment
from .series import SeriesPoint, step_labels


@dataclass
class BisectResult:
    """What the search found: the steps both series hold, the steps compared (in order), the first step that
    differs (None: none does) with its differing entries (most changed first) and which kind parted first."""

    steps: list[int]
    compared: list[int] = field(default_factory=list)
    first_step: int | None = None
    changes: list[Change] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)  # entries at the first step held by one side only
    only_b: list[str] = field(default_factory=list)
    paths: tuple[str, str] | None = None  # the checkpoints compared at the first step
    by_digest: int = 0  # tensor pairs, over every pair of checkpoints compared, equal by their sealed digests

    @property
    def tensors(self) -> list[str]:
        """The names that differ at the first step, most changed first (entries of one side only last)."""
        return [c.fqn for c in self.changes] + self.only_a + self.only_b

    @property
    def parted_first(self) -> str | None:
        """``weights``, ``moments`` (an optimizer's exp_avg/exp_avg_sq), ``both``, or ``other`` (only other
        optimizer state or non-tensor entries) at the first step; None when nothing differs."""
        if self.first_step is None:
            return None
        names = self.tensors
        moments = any(is_moment(n) for n in names)
        weights = any(not is_moment(n) and not n.split(".", 1)[0].startswith("optim") for n in names)
        return "both" if moments and weights else "moments" if moments else "weights" if weights else "other"

    def to_json(self) -> dict[str, Any]:
        """``{"first_step", "tensors", "parted_first", "changes", "steps", "compared", "paths"}``."""
        return {"first_step": self.first_step, "tensors": self.tensors, "parted_first": self.parted_first,
                "changes": [c.to_json() for c in self.changes], "only_a": self.only_a, "only_b": self.only_b,
                "steps": self.steps, "compared": self.compared, "paths": list(self.paths) if self.paths else None,
                "by_digest": self.by_digest}


def aligned(series_a: list[SeriesPoint], series_b: list[SeriesPoint]) -> list[tuple[int, str, str]]:
    """(step, A's checkpoint, B's checkpoint) for every step both series hold, in order; none is an error."""
    by_a = dict(zip(step_labels(series_a), (p.path for p in series_a)))
    by_b = dict(zip(step_labels(series_b), (p.path for p in series_b)))
    common = sorted(by_a.keys() & by_b.keys())
    if not common:
        raise ShardscopeError(f"{series_a[0].path} and {series_b[0].path}: no step is held by both series "
                              f"(A: {sorted(by_a)}, B: {sorted(by_b)}); nothing to compare.")
    return [(s, by_a[s], by_b[s]) for s in common]


def _beyond(a: Any, b: Any, rtol: float, atol: float) -> bool:
    """True when some element of a and b differs beyond ``atol + rtol * |b|`` (float64 blocks; NaN == NaN)."""
    import torch

    fa, fb = a.reshape(-1), b.reshape(-1)
    for s in range(0, fa.numel(), BLOCK):
        x, y = fa[s:s + BLOCK].to(torch.float64), fb[s:s + BLOCK].to(torch.float64)
        if not bool(torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True).all()):
            return True
    return False


@dataclass
class PairDifference:
    """Two checkpoints compared: the changes beyond the tolerance (most changed first), the entries held by one
    side only, and how many tensor pairs were equal by their sealed digests (none of their bytes read)."""

    changes: list[Change]
    only_a: list[str]
    only_b: list[str]
    by_digest: int = 0

    @property
    def differs(self) -> bool:
        return bool(self.changes or self.only_a or self.only_b)


def compare_pair(path_a: str, path_b: str, rtol: float = 0.0, atol: float = 0.0,
                 storage_options: dict | None = None) -> PairDifference:
    """Two checkpoints compared by :func:`.diff.diff` (sealed ones by digest where equal). An entry that cannot
    be read, or two checkpoints no name of which pairs, cannot be compared: an error."""
    from ..formats import open_source

    with open_source(path_a, storage_options) as a, open_source(path_b, storage_options) as b:
        result = diff(a, b)
        if result.unreadable:
            raise ShardscopeError(f"cannot compare {path_a} and {path_b}: {result.unreadable[0].detail}")
        if not result.pairing or not result.pairing.pairs:
            raise ShardscopeError(f"{path_a} and {path_b}: no entry name pairs; these are not the same model.")
        changes = [c for c in result.changed if c.kind != "layout"]
        if rtol or atol:
            changes = [c for c in changes if c.kind != "values" or c.rel_l2 is None or
                       _beyond(a.tensor(c.fqn_a or c.fqn), b.tensor(c.fqn_b or c.fqn), rtol, atol)]
    changes.sort(key=lambda c: -(math.inf if c.rel_l2 is None or c.rel_l2 != c.rel_l2 else c.rel_l2))
    return PairDifference(changes, result.only_a, result.only_b, result.by_digest)


def bisect(series_a: list[SeriesPoint], series_b: list[SeriesPoint], rtol: float = 0.0, atol: float = 0.0,
           storage_options: dict | None = None, progress: Progress | None = None) -> BisectResult:
    """The first aligned step at which A and B differ: the last step compared first (nothing differs there:
    done), then a binary search below it, keeping the comparison at the lowest differing step found."""
    pairs = aligned(series_a, series_b)
    res = BisectResult([s for s, _, _ in pairs])
    if progress:
        progress.start(math.ceil(math.log2(len(pairs))) + 1, "comparing")

    def parts(i: int) -> PairDifference | None:
        step, pa, pb = pairs[i]
        res.compared.append(step)
        if progress:
            progress.advance(1, f"step {step}")
        found = compare_pair(pa, pb, rtol, atol, storage_options)
        res.by_digest += found.by_digest
        return found if found.differs else None

    lo, hi = 0, len(pairs) - 1
    found = parts(hi)
    if found is None:
        return res
    while lo < hi:
        mid = (lo + hi) // 2
        here = parts(mid)
        if here is not None:
            hi, found = mid, here
        else:
            lo = mid + 1
    res.first_step, res.paths = pairs[hi][0], (pairs[hi][1], pairs[hi][2])
    res.changes, res.only_a, res.only_b = found.changes, found.only_a, found.only_b
    return res


def run_bisect(path_a: str, path_b: str, rtol: float = 0.0, atol: float = 0.0, storage_options: dict | None = None,
               progress: Progress | None = None) -> BisectResult:
    """:func:`bisect` of the checkpoints under two runs' folders (or URLs), each found and ordered by step."""
    from .series import checkpoint_series

    return bisect(checkpoint_series([path_a]), checkpoint_series([path_b]), rtol, atol, storage_options, progress)


__all__ = ["BisectResult", "PairDifference", "aligned", "bisect", "compare_pair", "run_bisect"]
