"""``shardscope runs``: every run under some folders (default: the runs directory) with its state, newest step
and loss, last update, where it runs and the checkpoint it resumed from. Reads only."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from shardscope.backend.errors import EXIT_OK, ShardscopeError
from shardscope.backend.text import escape_name

from .output import add_command


def register(sub: Any) -> None:
    sp = add_command(sub, "runs", run, "List the training runs under ROOTs (default: the runs directory): state, "
                     "step, loss (the mean of the ranks' losses at that step), last update, local or SLURM job, "
                     "the checkpoint each resumed from.")
    sp.add_argument("roots", nargs="*", metavar="ROOT", help="a folder of runs, or a run directory")
    sp.add_argument("--json", action="store_true", help='print {"roots", "runs": [{"path", "name", "state", '
                    '"explanation", "step", "loss", "updated", "where", "job_id", "supervisor_pid", "reason", '
                    '"resumed_from", "mtime"}]}')


def _where(r: Any) -> str:
    from shardscope.backend.runs.rundir import ACTIVE_STATES

    if r.where == "slurm":
        return f"SLURM job {r.job_id}" if r.job_id else "SLURM"
    live = r.where == "local" and r.supervisor_pid and r.state in ACTIVE_STATES
    return f"local pid {r.supervisor_pid}" if live else r.where or "-"


def run(args: argparse.Namespace) -> int:
    from shardscope.backend.runs.rundir import default_runs_root
    from shardscope.backend.runs.store import list_runs

    roots = [Path(r) for r in args.roots] or [default_runs_root()]
    for root in args.roots:
        if not Path(root).is_dir():
            raise ShardscopeError(f"{root}: no such folder")
    runs = [r for root in roots for r in list_runs(root)]
    if args.json:
        json.dump({"roots": [str(r) for r in roots], "runs": [r.to_json() for r in runs]}, sys.stdout)
        sys.stdout.write("\n")
        return EXIT_OK
    if not runs:
        print(f"no runs under {', '.join(escape_name(str(r)) for r in roots)}")
        return EXIT_OK
    print(f"{'STATE':<9}  {'STEP':>8}  {'MEAN LOSS':>9}  {'UPDATED':<16}  {'WHERE':<18}  RUN (resumed from)")
    for r in runs:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.updated)) if r.updated else "-"
        loss = f"{r.loss:.4f}" if r.loss is not None else "-"
        resumed = f"  (from {escape_name(r.resumed_from)})" if r.resumed_from else ""
        print(f"{r.state:<9}  {'-' if r.step is None else r.step:>8}  {loss:>9}  {when:<16}  {_where(r):<18}  "
              f"{escape_name(str(r.path))}{resumed}")
        if r.state in ("queued", "ended", "failed") and r.explanation:
            print(f"{'':<9}  {escape_name(r.explanation)}")
    return EXIT_OK
