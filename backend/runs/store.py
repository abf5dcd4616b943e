"""Run directories on disk: listing them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .launcher import run_status
from .rundir import is_run_dir


@dataclass(frozen=True)
class RunInfo:
    """A run directory found on disk: its state, last change and the explanation from its status."""

    path: Path
    state: str
    mtime: float
    explanation: str = ""


def list_runs(root: str | os.PathLike) -> list[RunInfo]:
    """Run directories under ``root``, newest first."""
    root = Path(root)
    out = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for p in entries:
        if is_run_dir(p):
            try:
                mtime = p.stat().st_mtime
            except OSError:
                continue
            status = run_status(p)
            out.append(RunInfo(p, status.get("state", "?"), mtime, status.get("explanation", "")))
    return sorted(out, key=lambda r: r.mtime, reverse=True)


