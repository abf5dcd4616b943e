"""``shardscope follow RUN``: the attached progress line of ``train`` for a run started elsewhere (``train
--detach``, the window, another terminal, a SLURM job). Ctrl-C detaches: the run goes on."""

from __future__ import annotations

import argparse
from typing import Any

from .output import add_command
from .train import attach


def register(sub: Any) -> None:
    sp = add_command(sub, "follow", run, "Show a run's progress until it ends (Ctrl-C detaches; the run goes on). "
                     "Exit 0 finished, 1 failed, stopped or ended, 130 detached.")
    sp.add_argument("run", metavar="RUN", help="a run directory, or a run's name in the runs directory")
    sp.add_argument("--stall-seconds", type=float,
                    help="warn when a rank reports no new step for this long (default: the run's own, "
                         "train --stall-seconds, else 60)")


def run(args: argparse.Namespace) -> int:
    from shardscope.backend.runs.launcher import run_status
    from shardscope.backend.runs.rundir import OVER_STATES, read_config
    from shardscope.backend.runs.store import find_run

    run_dir = find_run(args.run)
    print(f"run directory: {run_dir}", flush=True)
    config = read_config(run_dir)
    total = config.get("steps") if config.get("kind") == "builtin" else None
    if run_status(run_dir).get("state") not in OVER_STATES:
        print("following; Ctrl-C detaches (the run goes on)", flush=True)
    # a run that is over: its last step and how it ended, at once (attach reads once and stops)
    return attach(run_dir, total if isinstance(total, int) else None, args.stall_seconds, stops=False)
