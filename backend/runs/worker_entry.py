"""What torchrun starts on each rank: redirect this rank's output to RUN/logs/rank_N.log, record
its exit in RUN/exit/rank_N.json (with the traceback's end on failure), then run the target."""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback

WATCH_SECONDS = 1.0


def record_exit(run_dir: str, rank: int, code: int, tb: str) -> None:
    with open(os.path.join(run_dir, "exit", f"rank_{rank}.json"), "w") as f:
        json.dump({"rank": rank, "code": code, "time": time.time(), "traceback_tail": tb[-4000:]}, f)


def _end_with_torchrun(run_dir: str, rank: int) -> None:
    """End this rank when torchrun is gone. NOTE: torchrun ends its ranks itself, except when it is
    killed (SIGKILL, the OOM killer): its ranks were re-parented and trained on, unseen and unstoppable,
    into a run that read "failed" (and that a resume would write into twice)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_SECONDS)
        msg = f"torchrun (pid {parent}) is gone (killed?): rank {rank} ended itself instead of training on alone"
        sys.stderr.write(msg + "\n")
        record_exit(run_dir, rank, 1, msg)
        os._exit(1)

    threading.Thread(target=watch, name="shardscope-torchrun-watch", daemon=True).start()


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
    _end_with_torchrun(run_dir, rank)
    argv = sys.argv[1:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    code = 0
    tb = ""
    try:
        if argv[0] == "--builtin":
            from .trainer import main as trainer_main

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
    record_exit(run_dir, rank, code, tb)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
