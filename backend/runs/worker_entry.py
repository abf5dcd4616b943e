"""What torchrun starts on each rank: redirect this rank's output to RUN/logs/rank_N.log, record
its exit in RUN/exit/rank_N.json (with the traceback's end on failure), then run the target."""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import signal
import sys
import traceback


def main() -> None:
    """Run this rank's target with output in RUN/logs/rank_N.log, record its exit in RUN/exit/rank_N.json."""
    run_dir = os.environ["SHARDSCOPE_RUN_DIR"]
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    os.makedirs(os.path.join(run_dir, "exit"), exist_ok=True)
    log = os.open(os.path.join(run_dir, "logs", f"rank_{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    # `kill -USR1 PID` prints every thread's stack into this rank's log: how to see where a hung rank waits
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    argv = sys.argv[1:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    code = 0
    tb = ""
    try:
        if argv[0] == "--builtin":
            from shardscope.backend.runs.trainer import main as trainer_main

            code = trainer_main(argv[1:]) or 0
        else:
            sys.argv = argv
            # NOTE: the script's globals are kept until os._exit below, so a DDP model is never freed on
            # the way out (see the note at the end of trainer.main: a teardown deadlock in torch's gloo)
            kept = runpy.run_path(argv[0], run_name="__main__")  # noqa: F841
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        tb = traceback.format_exc()
        sys.stderr.write(tb)
        code = 1
    with open(os.path.join(run_dir, "exit", f"rank_{rank}.json"), "w") as f:
        json.dump({"rank": rank, "code": code, "traceback_tail": tb[-4000:]}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
