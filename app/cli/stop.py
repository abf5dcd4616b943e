"""``shardscope stop RUN``: stop a local or SLURM run from anywhere and wait until none of its processes lives."""

from __future__ import annotations

import argparse
from typing import Any

from shardscope.backend.errors import EXIT_OK

from .output import add_command


def register(sub: Any) -> None:
    sp = add_command(sub, "stop", run, "Stop a run (local: its supervisor sends SIGTERM to every process, SIGKILL "
                     "after the grace; SLURM: scancel) and wait until none of its processes lives. Exit 0.")
    sp.add_argument("run", metavar="RUN", help="a run directory, or a run's name in the runs directory")
    sp.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (default 10)")


def run(args: argparse.Namespace) -> int:
    from shardscope.backend.runs.launcher import stop_run
    from shardscope.backend.runs.rundir import FINAL_STATES, read_status
    from shardscope.backend.runs.store import find_run

    run_dir = find_run(args.run)
    before = read_status(run_dir).get("state")
    if before in FINAL_STATES:
        print(f"{run_dir}: already {before}; nothing to stop")
        return EXIT_OK
    print(f"stopping {run_dir} ...", flush=True)
    status = stop_run(run_dir, grace=args.grace)
    print(f"run {status.get('state')}: {status.get('explanation', '')}")
    return EXIT_OK
