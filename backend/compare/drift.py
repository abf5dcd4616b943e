"""``drift``: every tensor of a run's checkpoints, in step order: its L2 norm, its relative change since the
previous checkpoint ``||W_i - W_{i-1}|| / ||W_{i-1}||`` (float64, the relative L2 of :func:`.diff.value_change`),
its count of NaN/Inf, and for an optimizer's moments (``exp_avg``, ``exp_avg_sq``) its zeros and negatives; and
the first checkpoint and tensor where a value is not finite.

The checkpoints are opened together (their metadata) and read tensor by tensor: one tensor through every
checkpoint in step order, the previous checkpoint's value held, so every checkpoint's bytes are read once and
memory holds about two of the largest tensor (and float64 blocks of :data:`.diff.BLOCK` elements)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint.sources import EntryInfo, Source
from ..errors import ShardscopeError
from ..progress import Progress
from .diff import BLOCK, value_change
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


def tensor_stats(t: Any, moment: bool) -> tuple[float, int, int, int]:
    """(L2 norm of the finite elements, NaN/Inf count, zeros, negatives) of a tensor, in float64 blocks;
    zeros and negatives are counted only for a ``moment`` (else 0)."""
    import torch

    flat = t.reshape(-1)
    s2, nonfinite, zeros, negatives = 0.0, 0, 0, 0
    for s in range(0, flat.numel(), BLOCK):
        x = flat[s:s + BLOCK].to(torch.float64)
        lo, hi = (float(v) for v in torch.aminmax(x)) if x.numel() else (0.0, 0.0)
        if math.isfinite(lo) and math.isfinite(hi):
            s2 += float(torch.dot(x, x))
        else:
            finite = torch.isfinite(x)
            nonfinite += int(x.numel() - int(finite.sum()))
            s2 += float(x[finite].square().sum())
        if moment:
            zeros += int((x == 0).sum())
            negatives += int((x < 0).sum())
    return math.sqrt(s2), nonfinite, zeros, negatives


def _tensor_names(entries: list[dict[str, EntryInfo]]) -> list[str]:
    """Every tensor name of the series: the first checkpoint's order, then those that appear later."""
    names: dict[str, None] = {}
    for listed in entries:
        for name, info in listed.items():
            if info.kind == "tensor":
                names.setdefault(name)
    return list(names)


def _follow(sources: list[Source], entries: list[dict[str, EntryInfo]], fqn: str,
            progress: Progress | None) -> TensorDrift:
    """One tensor through every checkpoint in order, the previous value held."""
    n = len(sources)
    moment = is_moment(fqn)
    d = TensorDrift([None] * n, [None] * n, [None] * n, [None] * n if moment else None,
                    [None] * n if moment else None)
    prev = None
    for i, src in enumerate(sources):
        info = entries[i].get(fqn)
        if info is None or info.kind != "tensor":
            prev = None
            continue
        cur = src.tensor(fqn)
        norm, d.nonfinite[i], zeros, negatives = tensor_stats(cur, moment)
        d.norm[i] = norm
        if d.zeros is not None and d.negatives is not None:
            d.zeros[i], d.negatives[i] = zeros, negatives
        if prev is not None and prev.shape == cur.shape and prev.dtype == cur.dtype:
            change = value_change(prev, cur)
            d.rel_change[i] = 0.0 if change is None else change[1]
        prev = cur
        if progress:
            progress.advance(1, fqn)
    return d


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
        for fqn in names:
            result.tensors[fqn] = _follow(sources, entries, fqn, progress)
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
__all__ = ["MOMENTS", "DriftResult", "TensorDrift", "drift", "is_moment", "module_rows", "run_drift", "tensor_stats"]
