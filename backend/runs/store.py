"""Run directories on disk: listing them, with what ``shardscope runs`` and the Training panel's Runs list
show of each (read-only: a listing never writes to a local run)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import ShardscopeError
from .launcher import run_status
from .rundir import default_runs_root, is_run_dir, read_config

TAIL_BYTES = 16_384  # the end of a metrics file read for its newest record


@dataclass(frozen=True)
class RunInfo:
    """A run directory found on disk: its state, last change and the explanation from its status; its newest
    step and the mean of the ranks' losses there, where it runs (this machine's supervisor, or a SLURM job) and the
    checkpoint it resumed from."""

    path: Path
    state: str
    mtime: float
    explanation: str = ""
    step: int | None = None
    loss: float | None = None
    updated: float | None = None  # the newest of status.json's last change and the newest metric record
    where: str = ""  # "local" or "slurm"
    job_id: str | None = None
    supervisor_pid: int | None = None
    reason: str | None = None  # SLURM's pending reason
    resumed_from: str | None = None
    started: float | None = None  # status.json's start_time: when the run was (last) launched

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path), "name": self.path.name}


def _rank_files(run_dir: str | os.PathLike) -> list[Path]:
    return sorted((Path(run_dir) / "metrics").glob("rank_*.jsonl"),
                  key=lambda p: int(p.stem[5:]) if p.stem[5:].isdigit() else 1 << 30)


def _tail_records(path: Path) -> list[dict[str, Any]]:
    """The complete records at the end of a metrics file, newest first (the end only: listings stay cheap)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - TAIL_BYTES))
            lines = f.read().split(b"\n")
    except OSError:
        return []
    out = []
    for line in reversed(lines[:-1]):  # the part after the last newline may be a record being written
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def last_record(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The newest complete record of the lowest rank that reported (rank 0 in our runs). {} when none."""
    for path in _rank_files(run_dir):
        records = _tail_records(path)
        if records:
            return records[0]
    return {}


def mean_loss_at(run_dir: str | os.PathLike, step: Any) -> float | None:
    """The mean over the ranks of each rank's last loss at ``step`` among its newest records: the one loss
    per step the Training header and the Library show (see ``follow.RunFollower.mean_loss``)."""
    values = []
    for path in _rank_files(run_dir):
        rec = next((r for r in _tail_records(path) if r.get("step") == step), None)
        loss = rec.get("loss") if rec is not None else None
        if isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss):
            values.append(float(loss))
    return sum(values) / len(values) if values else None


def describe(path: Path) -> RunInfo:
    """What a listing shows of one run directory."""
    status = run_status(path)
    try:
        mtime = path.stat().st_mtime
    except OSError:
        mtime = 0.0
    rec = last_record(path)
    step, when = rec.get("step"), rec.get("time")
    loss = mean_loss_at(path, step) if isinstance(step, int) else None
    times = [t for t in (status.get("updated"), when) if isinstance(t, (int, float))]
    resume = read_config(path).get("resume")
    started = status.get("start_time")
    started = float(started) if isinstance(started, int | float) and not isinstance(started, bool) else None
    return RunInfo(path, status.get("state", "?"), mtime, status.get("explanation", ""),
                   step=step if isinstance(step, int) else None,
                   loss=loss,
                   updated=max(times) if times else None,
                   where=status.get("scheduler") or ("local" if status else ""),
                   job_id=status.get("job_id"), supervisor_pid=status.get("supervisor_pid"),
                   reason=status.get("reason") or None, resumed_from=resume if isinstance(resume, str) else None,
                   started=started)


def list_runs(root: str | os.PathLike) -> list[RunInfo]:
    """Run directories under ``root`` (its folders; ``root`` itself when it is one of ours), newest first: by start
    time (status.json), else the folder's modification time (NOTE: by that alone, a finished run whose folder was
    touched, by an export or a prune, jumped above the run started after it)."""
    root = Path(root)
    if (root / "status.json").is_file() and (root / "config.json").is_file():
        return [describe(root)]
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    return sorted((describe(p) for p in entries if is_run_dir(p)), key=lambda r: r.started or r.mtime, reverse=True)


def find_run(name: str | os.PathLike) -> Path:
    """The run directory a command names: a path, else a run's name under the default runs directory.
    Raises ShardscopeError (exit 2) when neither is a run."""
    path = Path(name).expanduser()
    if not path.exists() and len(path.parts) == 1:
        path = default_runs_root() / path
    if not path.is_dir():
        raise ShardscopeError(f"{name}: no such run directory (nor a run of that name in {default_runs_root()})")
    if not ((path / "status.json").is_file() or (path / "config.json").is_file()):
        raise ShardscopeError(f"{path}: not a Shardscope run directory (no status.json)")
    return path.absolute()
