"""``diff A B``: which entries exist on one side only, which changed dtype, shape, layout or values,
and by how much; one tensor pair in memory at a time."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint.values import finite_histogram
from ..progress import Progress
from .sources import Source

BLOCK = 1 << 22


@dataclass
class Change:
    """One entry that differs between A and B, and how."""
    fqn: str
    kind: str  # values, dtype, shape, layout
    max_abs_diff: float | None = None
    rel_l2: float | None = None
    frac_changed: float | None = None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        """The change as a JSON-ready dict: name, kind and how much the values differ."""
        return {"fqn": self.fqn, "kind": self.kind, "max_abs_diff": self.max_abs_diff, "rel_l2": self.rel_l2,
                "frac_changed": self.frac_changed}


@dataclass
class DiffResult:
    """Everything ``diff`` found: entries on one side only, changed entries, and the unchanged count."""
    a: str
    b: str
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    changed: list[Change] = field(default_factory=list)
    unchanged: int = 0

    @property
    def differs(self) -> bool:
        """True when anything but the layout differs (the exit status, as cmp has it)."""
        return bool(self.only_a or self.only_b or any(c.kind != "layout" for c in self.changed))

    def to_json(self) -> dict[str, Any]:
        """The whole comparison as a JSON-ready dict: entries only in A, only in B, changed, unchanged."""
        return {"only_a": self.only_a, "only_b": self.only_b, "changed": [c.to_json() for c in self.changed],
                "unchanged": self.unchanged}


def value_change(a: Any, b: Any) -> tuple[float, float, float] | None:
    """(max |a-b|, ||a-b|| / ||a||, fraction of elements that differ), or None when bit-identical.
    NaN equals NaN here; computed in float64 blocks."""
    import torch

    fa, fb = a.reshape(-1), b.reshape(-1)
    if fa.numel() == 0 or torch.equal(fa.contiguous().view(torch.uint8), fb.contiguous().view(torch.uint8)):
        return None
    max_abs = 0.0
    d2 = a2 = 0.0
    changed = 0
    for s in range(0, fa.numel(), BLOCK):
        x = fa[s:s + BLOCK].to(torch.float64)
        y = fb[s:s + BLOCK].to(torch.float64)
        if x.is_complex():
            x, y = torch.view_as_real(x), torch.view_as_real(y)
        both_nan = torch.isnan(x) & torch.isnan(y)
        ne = (x != y) & ~both_nan
        changed += int(ne.sum())
        d = torch.where(both_nan, torch.zeros_like(x), x - y)
        finite = torch.isfinite(d)
        if bool(finite.any()):
            max_abs = max(max_abs, float(d[finite].abs().max()))
        if not bool(finite.all()):
            max_abs = math.inf
        d2 += float((d[finite] ** 2).sum())
        xf = x[torch.isfinite(x)]
        a2 += float((xf ** 2).sum())
    if changed == 0:  # differs only in the bit patterns of NaNs or signed zeros
        return 0.0, 0.0, 0.0
    rel = math.sqrt(d2) / math.sqrt(a2) if a2 > 0 else (0.0 if d2 == 0 else math.inf)
    return max_abs, rel, changed / fa.numel()


def _same_object(x: Any, y: Any) -> bool:
    import torch

    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype and \
            x.shape == y.shape and value_change(x, y) is None
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same_object(x[k], y[k]) for k in x)
    if isinstance(x, list | tuple) and isinstance(y, list | tuple):
        return len(x) == len(y) and all(_same_object(p, q) for p, q in zip(x, y, strict=True))
    return bool(x == y)


def diff(a: Source, b: Source, progress: Progress | None = None) -> DiffResult:
    """Compare two sources entry by entry, one tensor pair in memory at a time."""
    ea, eb = a.entries(), b.entries()
    res = DiffResult(a.name, b.name, sorted(set(ea) - set(eb)), sorted(set(eb) - set(ea)))
    common = sorted(set(ea) & set(eb))
    if progress:
        progress.start(len(common), "comparing")
    for fqn in common:
        x, y = ea[fqn], eb[fqn]
        if progress:
            progress.advance(1, fqn)
        if x.kind != y.kind:
            res.changed.append(Change(fqn, "shape", detail=f"{x.kind} vs {y.kind}"))
            continue
        if x.kind == "object":
            if _same_object(a.object(fqn), b.object(fqn)):
                res.unchanged += 1
            else:
                res.changed.append(Change(fqn, "values", detail="non-tensor value"))
            continue
        if x.dtype != y.dtype:
            res.changed.append(Change(fqn, "dtype", detail=f"{x.dtype} vs {y.dtype}"))
            continue
        if x.shape != y.shape:
            res.changed.append(Change(fqn, "shape", detail=f"{list(x.shape or ())} vs {list(y.shape or ())}"))
            continue
        ch = value_change(a.tensor(fqn), b.tensor(fqn))
        if ch is not None:
            res.changed.append(Change(fqn, "values", *ch))
        elif x.layout is not None and y.layout is not None and x.layout != y.layout:
            res.changed.append(Change(fqn, "layout", detail=f"{len(x.layout)} vs {len(y.layout)} chunks"))
        else:
            res.unchanged += 1
    order = {"shape": 0, "dtype": 1, "values": 2, "layout": 3}
    res.changed.sort(key=lambda c: (order[c.kind], -(c.rel_l2 if c.rel_l2 is not None and c.rel_l2 == c.rel_l2
                                                      else 0.0), c.fqn))
    return res


@dataclass
class DifferenceDetail:
    """For one entry in both sources: the histogram of a - b (float64), for the Compare view."""

    fqn: str
    counts: list[int]
    edges: list[float]
    nonzero: int
    numel: int


def difference_histogram(a: Source, b: Source, fqn: str, bins: int = 64,
                         progress: Progress | None = None) -> DifferenceDetail:
    """The histogram of a - b of one entry in float64 blocks (the Compare view's detail)."""
    import numpy as np
    import torch

    x = a.tensor(fqn).reshape(-1)
    y = b.tensor(fqn).reshape(-1)
    if x.shape != y.shape:
        return DifferenceDetail(fqn, [], [], 0, x.numel())

    def blocks() -> Any:
        for s in range(0, x.numel(), BLOCK):
            yield x[s:s + BLOCK].to(torch.float64) - y[s:s + BLOCK].to(torch.float64)

    lo, hi = math.inf, -math.inf
    for d in blocks():
        d = d[torch.isfinite(d)]
        if d.numel():
            lo, hi = min(lo, float(d.min())), max(hi, float(d.max()))
        if progress:
            progress.check()
    if lo > hi:
        return DifferenceDetail(fqn, [], [], 0, x.numel())
    nonzero = [0]

    def count_nonzero(d: Any) -> None:
        nonzero[0] += int((d != 0).sum())

    edges = np.linspace(lo, hi if hi > lo else lo + 1e-12, bins + 1)
    counts = finite_histogram(blocks, edges, progress, count_nonzero)
    return DifferenceDetail(fqn, counts.tolist(), edges.tolist(), nonzero[0], x.numel())
