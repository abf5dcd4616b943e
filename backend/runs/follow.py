"""Follow a run directory from files alone (ours, one written by `report()` elsewhere, or any folder
with TensorBoard event files or a Lightning metrics.csv): new metric points, status, per-rank logs,
checkpoints, stalled ranks. Qt-free."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ShardscopeError
from ..text import step_rate
from .launcher import run_status
from .metric_logs import CsvLogSource, EventFileSource, open_metric_log, read_rank_metrics
from .metrics import FIELDS, Series, field_text, records_to_columns
from .rundir import log_tail, rank_exits, read_config, scan

LOG_CHUNK = 1 << 20
STALL_SECONDS = 60.0  # a rank with no new step for this long is stalled, unless the run records its own
LOSS_LABEL = "loss (mean of ranks)"  # what the Training header, train's progress line and the Library show
EXTERNAL_BASE = 1000  # series keys from this on are scalar logs (TensorBoard, CSV), not ranks


@dataclass
class RunSnapshot:
    """What changed since the last read."""

    records: dict[int, dict] = field(default_factory=dict)  # key -> columns (records_to_columns)
    replaced: set[int] = field(default_factory=set)  # keys whose log was rewritten: start their series again
    labels: dict[int, str] = field(default_factory=dict)  # names of new scalar-log series
    new_points: int = 0
    new_log: dict[int, str] = field(default_factory=dict)  # -1: launcher.log
    status: dict = field(default_factory=dict)
    stalled: list[int] = field(default_factory=list)
    stall_seconds: float | None = None  # the run's own (config.json), once it is read
    checkpoints: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    failures: dict[int, str] = field(default_factory=dict)  # failed rank (-1: launcher) -> end of its traceback


def is_rank(key: int) -> bool:
    """True for a rank's series, False for a scalar log's."""
    return 0 <= key < EXTERNAL_BASE


class RunFollower:
    """Follows one run directory: reads new metrics and logs as they are written and notices stalled ranks."""

    def __init__(self, run_dir: str | os.PathLike, stall_seconds: float | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.stall_seconds = stall_seconds  # asked for; None: the run's own (see :attr:`stall_limit`)
        self.run_stall_seconds: float | None = None  # what the run's config.json records (train --stall-seconds)
        self.series: dict[int, Series] = {}
        self.labels: dict[int, str] = {}
        self._metric_offsets: dict[int, int] = {}
        self._log_offsets: dict[str, int] = {}
        self._sources: dict[Path, tuple[int, EventFileSource | CsvLogSource]] = {}
        self._broken: set[Path] = set()
        self.last_seen: dict[int, float] = {}  # wall time of each rank's newest record

    def read(self) -> RunSnapshot:
        """The file I/O half (safe on a worker thread; one read at a time): what is new on disk."""
        snap = RunSnapshot()
        raw = read_rank_metrics(self.run_dir, self._metric_offsets)
        snap.records = {rank: records_to_columns(recs) for rank, recs in raw.items()}
        snap.new_points = sum(len(r) for r in raw.values())
        snap.checkpoints, logs = scan(self.run_dir)
        self._read_scalar_logs(snap, logs)
        for p in sorted((self.run_dir / "logs").glob("*.log")):
            text = self._read_new(p)
            if text:
                key = -1 if p.stem == "launcher" else int(p.stem.split("_")[1]) if p.stem.startswith("rank_") else -2
                snap.new_log[key] = text
        snap.status = run_status(self.run_dir)
        if self.run_stall_seconds is None:  # config.json is written once per launch, before any rank starts
            recorded = read_config(self.run_dir).get("stall_seconds")
            if isinstance(recorded, (int, float)) and not isinstance(recorded, bool) and recorded > 0:
                snap.stall_seconds = float(recorded)
        if snap.status.get("state") == "failed":
            snap.failures = self.failures(snap.status)
        return snap

    def failures(self, status: dict) -> dict[int, str]:
        """The end of each failed rank's traceback (its exit record, else its log); the launcher's log
        when no rank recorded a failure (torchrun itself failed, or the job was killed)."""
        exits = rank_exits(self.run_dir)
        out = {}
        for r in status.get("failed_ranks") or []:
            tb = exits.get(r, {}).get("traceback_tail") or log_tail(self.run_dir, r, 40)
            out[int(r)] = tb.strip()
        return out or {-1: log_tail(self.run_dir, -1, 40).strip()}

    def _read_scalar_logs(self, snap: RunSnapshot, logs: list[Path]) -> None:
        for path in logs:
            if path in self._broken:
                continue
            if path not in self._sources:
                try:
                    source = open_metric_log(path)
                except ShardscopeError as exc:
                    self._broken.add(path)
                    snap.problems.append(str(exc))
                    continue
                key = EXTERNAL_BASE + len(self._sources)
                self._sources[path] = (key, source)
                kind = "TensorBoard" if isinstance(source, EventFileSource) else "CSV"
                # a log in the run folder itself is named by its file ("CSV: ." said nothing)
                where = path.parent.relative_to(self.run_dir) if path.parent != self.run_dir else \
                    path.name if kind == "CSV" else "event files"
                snap.labels[key] = f"{kind}: {where}"
            key, source = self._sources[path]
            batch = source.read()
            if batch.replace:
                snap.replaced.add(key)
            if batch.records:
                snap.records[key] = records_to_columns(_merge_steps(batch.records))
                snap.new_points += len(batch.records)

    def apply(self, snap: RunSnapshot, now: float | None = None) -> RunSnapshot:
        """The in-memory half (on the thread that draws): append the new points, find stalls."""
        self.labels.update(snap.labels)
        if snap.stall_seconds is not None:
            self.run_stall_seconds = snap.stall_seconds
        for key in snap.replaced:
            self.series[key] = Series()
        for key, cols in snap.records.items():
            series = self.series.setdefault(key, Series())
            if len(cols["step"]):
                series.append_columns(cols)
                t = cols["time"][np.isfinite(cols["time"])]
                if len(t) and is_rank(key):
                    self.last_seen[key] = max(self.last_seen.get(key, 0.0), float(t.max()))
        snap.stalled = self.stalled(snap.status, now)
        return snap

    def poll(self, now: float | None = None) -> RunSnapshot:
        """Read what is new and apply it in one go (for callers on a single thread)."""
        return self.apply(self.read(), now)

    def label(self, key: int) -> str:
        """The display name of series ``key``: its log's label, or "rank N"."""
        return self.labels.get(key, f"rank {key}")

    @property
    def stall_limit(self) -> float:
        """Seconds without a new step after which a rank is stalled: the value asked for, else the run's own
        (``train --stall-seconds``, the window's "Stalled after"), else :data:`STALL_SECONDS`."""
        if self.stall_seconds is not None:
            return self.stall_seconds
        return self.run_stall_seconds if self.run_stall_seconds is not None else STALL_SECONDS

    def stalled(self, status: dict, now: float | None = None) -> list[int]:
        """Ranks with no new step for :attr:`stall_limit` while the run is running. Only ranks that have
        reported since this launch count: after a resume, the old segment's last steps say nothing."""
        if status.get("state") not in ("running", None) or not self.last_seen:
            return []
        now = time.time() if now is None else now
        started = float(status.get("start_time") or 0.0)
        return sorted(r for r, t in self.last_seen.items() if t >= started and now - t > self.stall_limit)

    def _read_new(self, path: Path) -> str:
        off = self._log_offsets.get(str(path), 0)
        try:
            size = path.stat().st_size
            if size < off:  # truncated or replaced: start again
                off = 0
            if size == off:
                return ""
            with open(path, "rb") as f:
                f.seek(max(off, size - LOG_CHUNK))  # a huge backlog: only its last MiB
                data = f.read(size - f.tell())
        except OSError:
            return ""
        self._log_offsets[str(path)] = off + len(data) if off >= size - LOG_CHUNK else size
        return data.decode("utf-8", "replace")

    def mean_loss(self, step: float) -> float:
        """The mean over the ranks of each rank's (last) loss at ``step``: the one loss per step Shardscope
        shows, here and in the Library (``library.step_metrics``); NaN when no rank logged one."""
        return self.loss_of_ranks(step)[0]

    def loss_of_ranks(self, step: float) -> tuple[float, int, int]:
        """(:meth:`mean_loss` at ``step``, how many ranks it is the mean of, how many ranks report): a stalled
        rank has no loss at the others' newest step, and their mean then covers fewer than every rank."""
        values, ranks = [], 0
        for key in sorted(self.series):
            s = self.series[key]
            if not is_rank(key) or not len(s):
                continue
            ranks += 1
            at = np.flatnonzero(s.column("step") == step)
            if at.size and math.isfinite(v := float(s.column("loss")[at[-1]])):
                values.append(v)
        return (sum(values) / len(values) if values else math.nan), len(values), ranks

    def progress(self, total_steps: int | None = None) -> str:
        """One line about rank 0's (or the first series') newest point: what the run reported, nothing
        invented (no total unless known, steps/s from the records' own times when not reported). The loss is
        the mean of the ranks' losses at that step (a scalar log's own loss when no rank reports)."""
        key = 0 if 0 in self.series else min(self.series, default=None)
        if key is None or not len(self.series[key]):
            return ""
        s = self.series[key]
        step = s.column("step")[-1]
        parts = [f"step {step:.0f}" + (f"/{total_steps}" if total_steps else "")]
        if is_rank(key):
            loss, covered, ranks = self.loss_of_ranks(step)
            if math.isfinite(loss):
                label = LOSS_LABEL if covered == ranks else f"loss (mean of {covered} of {ranks} ranks)"
                parts.append(f"{label} {loss:.4f}")
        elif math.isfinite(loss := s.column("loss")[-1]):
            parts.append(f"loss {loss:.4f}")
        sps = s.column("steps_per_s")[-1]
        if not math.isfinite(sps) and len(s) >= 2:
            t, st = s.column("time")[-2:], s.column("step")[-2:]
            dt = t[1] - t[0]
            sps = (st[1] - st[0]) / dt if math.isfinite(dt) and dt > 0 and st[1] > st[0] else math.nan
        if math.isfinite(sps):
            parts.append(step_rate(sps))
        return "  ".join(parts)

    def csv(self) -> str:
        """All metric points of all series as CSV (``source`` is the rank, or the scalar log's name)."""
        lines = ["source," + ",".join(FIELDS)]
        for key in sorted(self.series):
            s = self.series[key]
            cols = [s.column(f) for f in FIELDS]
            name = str(key) if is_rank(key) else self.label(key).replace(",", ";")
            for i in range(len(s)):
                lines.append(f"{name}," + ",".join(field_text(f, c[i]) for f, c in zip(FIELDS, cols, strict=True)))
        return "\n".join(lines) + "\n"


def _merge_steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records of the same step (a logger writing loss and lr in separate rows) as one point."""
    out: list[dict[str, Any]] = []
    for rec in records:
        if out and out[-1].get("step") == rec.get("step"):
            out[-1].update(rec)
        else:
            out.append(dict(rec))
    return out
