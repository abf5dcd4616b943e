"""A run's checkpoints in step order, as ``drift``, ``bisect`` and ``average`` read them: the checkpoints the
Library's walk finds under the paths or URLs given (a run folder, checkpoints named one by one, or both), each
with the step its name (or its format's state) states, ordered by step."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardscopeError
from ..formats.base import RESUMABLE
from ..library.records import order_key
from ..library.scan import scan
from ..progress import Progress


@dataclass(frozen=True, slots=True)
class SeriesPoint:
    """One checkpoint of a series: its step (None when nothing states one) and where it is."""

    step: int | None
    path: str


def checkpoint_series(paths: list[str], progress: Progress | None = None) -> list[SeriesPoint]:
    """The checkpoints under ``paths`` in step order (then by time), complete ones only (the newest of a
    running run while its save is unfinished is left out). Where a run holds both
    training checkpoints and exports of them, the training checkpoints are the series (an export repeats its
    source's step). A step found twice is an error naming both checkpoints; nothing found is an error naming
    the paths."""
    listing = scan(paths, writing_seconds=0.0, progress=progress)  # named by the user: no file age is suspect
    records = [c for run in listing.runs for c in run.checkpoints if c.state == "complete"]
    if any(c.kind == RESUMABLE for c in records):
        records = [c for c in records if c.kind == RESUMABLE]
    records.sort(key=order_key)
    if not records:
        raise ShardscopeError(f"{', '.join(paths)}: no complete checkpoint found.")
    seen: dict[int, str] = {}
    for c in records:
        if c.step is not None and c.step in seen:
            raise ShardscopeError(f"{c.path}: step {c.step} again (also {seen[c.step]}); name one series of "
                                  "checkpoints.")
        if c.step is not None:
            seen[c.step] = c.path
    return [SeriesPoint(c.step, c.path) for c in records]


def step_labels(series: list[SeriesPoint]) -> list[int]:
    """The steps of a series, a checkpoint whose step is not known numbered by its place (0, 1, ...)."""
    return [p.step if p.step is not None else i for i, p in enumerate(series)]


__all__ = ["SeriesPoint", "checkpoint_series", "step_labels"]
