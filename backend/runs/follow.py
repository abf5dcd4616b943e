"""Follow a run directory from files alone (ours or one written by `report()` elsewhere):
new metric lines, status, per-rank logs, checkpoints, stalled ranks. Qt-free."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .launcher import checkpoints, effective_status, read_metrics
from .metrics import Series, records_to_columns

LOG_CHUNK = 1 << 20


@dataclass
class RunSnapshot:
    """What changed since the last read."""

    records: dict[int, dict] = field(default_factory=dict)  # rank -> columns (records_to_columns)
    new_points: int = 0
    new_log: dict[int, str] = field(default_factory=dict)  # -1: launcher.log
    status: dict = field(default_factory=dict)
    stalled: list[int] = field(default_factory=list)
    checkpoints: list[Path] = field(default_factory=list)


class RunFollower:
    def __init__(self, run_dir: str | os.PathLike, stall_seconds: float = 60.0) -> None:
        self.run_dir = Path(run_dir)
        self.stall_seconds = stall_seconds
        self.series: dict[int, Series] = {}
        self._metric_offsets: dict[int, int] = {}
        self._log_offsets: dict[str, int] = {}
        self.last_seen: dict[int, float] = {}  # wall time of each rank's newest record

    def read(self) -> RunSnapshot:
        """The file I/O half (safe on a worker thread; one read at a time): what is new on disk."""
        snap = RunSnapshot()
        raw = read_metrics(self.run_dir, self._metric_offsets)
        snap.records = {rank: records_to_columns(recs) for rank, recs in raw.items()}
        snap.new_points = sum(len(r) for r in raw.values())
        for p in sorted((self.run_dir / "logs").glob("*.log")):
            text = self._read_new(p)
            if text:
                key = -1 if p.stem == "launcher" else int(p.stem.split("_")[1]) if p.stem.startswith("rank_") else -2
                snap.new_log[key] = text
        snap.status = effective_status(self.run_dir)
        snap.checkpoints = checkpoints(self.run_dir)
        return snap

    def apply(self, snap: RunSnapshot, now: float | None = None) -> RunSnapshot:
        """The in-memory half (on the thread that draws): append the new points, find stalls."""
        for rank, cols in snap.records.items():
            series = self.series.setdefault(rank, Series())
            if len(cols["step"]):
                series.append_columns(cols)
                t = cols["time"][np.isfinite(cols["time"])]
                if len(t):
                    self.last_seen[rank] = max(self.last_seen.get(rank, 0.0), float(t.max()))
        snap.stalled = self.stalled(snap.status, now)
        return snap

    def poll(self, now: float | None = None) -> RunSnapshot:
        return self.apply(self.read(), now)

    def stalled(self, status: dict, now: float | None = None) -> list[int]:
        """Ranks with no new step for ``stall_seconds`` while the run is running."""
        if status.get("state") not in ("running", None) or not self.last_seen:
            return []
        now = time.time() if now is None else now
        return sorted(r for r, t in self.last_seen.items() if now - t > self.stall_seconds)

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

    def csv(self) -> str:
        """All metric points of all ranks as CSV."""
        from .metrics import FIELDS

        lines = ["rank," + ",".join(FIELDS)]
        for rank in sorted(self.series):
            s = self.series[rank]
            cols = [s.column(f) for f in FIELDS]
            for i in range(len(s)):
                lines.append(f"{rank}," + ",".join("" if v != v else repr(float(v)) for v in (c[i] for c in cols)))
        return "\n".join(lines) + "\n"
