"""``shardscope demo``: the see-it-work command (train a tiny FSDP model, then show its checkpoint)."""

from __future__ import annotations

import argparse
from typing import Any

from shardscope.backend.errors import EXIT_OK, EXIT_PROBLEMS
from shardscope.backend.text import count, ranks_text

from .gui import no_display
from .output import add_command
from .train import add_train_options, follow_run, run_config


def register(sub: Any) -> None:
    sp = add_command(sub, "demo", run, "Train a tiny FSDP model on 2 CPU ranks with checkpoints, then open the GUI "
                     "on it.")
    add_train_options(sp, 30)
    sp.add_argument("--no-gui", action="store_true", help="train and inspect, but do not open a window")


def run(args: argparse.Namespace) -> int:
    from shardscope.backend.checkpoint.verify import verify
    from shardscope.backend.formats import open_checkpoint
    from shardscope.backend.runs.rundir import checkpoints

    if not args.no_gui and not no_display():
        # The window opens at once on the Training tab with the run live; it opens the last checkpoint
        # itself when the run ends (app/first_run.py).
        from shardscope.app.bootstrap import run_demo

        return run_demo(run_config(args), args.run_dir)
    code, run_dir = follow_run(args)
    if code != EXIT_OK:
        return code
    ckpts = checkpoints(run_dir)
    if not ckpts:
        print("the run wrote no checkpoint")
        return EXIT_PROBLEMS
    last = ckpts[-1]
    ck = open_checkpoint(last)
    problems = verify(ck, deep=True)
    print(f"last checkpoint {last}: {count(len(ck.tensors), 'tensor')} over ranks {ranks_text(ck.ranks)}, "
          f"{'healthy' if not problems else count(len(problems), 'problem')}")
    print(f"try: shardscope inspect {last}\n     shardscope export {last} model.safetensors --strip-prefix model.")
    if problems:
        return EXIT_PROBLEMS
    if not args.no_gui:
        print(f"no display here, so the window is not opened; on a desktop: shardscope gui {last} --run {run_dir}")
    return EXIT_OK
