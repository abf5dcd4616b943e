"""A run's supervisor: one small process per local launch, started detached (a session of its own, its
output in logs/launcher.log) by :class:`.launcher.RunLauncher`. It owns torchrun and its ranks and is the one
writer of the run's state: "running" once torchrun has started, then finished / failed / stopped with exit
codes when the ranks end, whoever watches. Closing the window, losing the terminal or killing a follower
changes nothing; followers (``shardscope train``/``follow``, the window, ``runs``) only read.

A stop is asked for with RUN/stop.request (any process that sees the folder, also on another host) or
SIGTERM/SIGINT to the supervisor: SIGTERM to torchrun's group and every descendant, SIGKILL after the grace,
and the run reads "stopped". A supervisor killed itself (kill -9) takes torchrun with it (Linux's parent-death
signal) and leaves status.json active: followers read it "ended" (see :func:`.rundir.run_gone`).

A SLURM job is its own supervisor (the scheduler's state is the run's). While it waits in the queue, a
detached watcher (``--pending``) writes the scheduler's state and pending reason to status.json, and exits
once the job runs or has ended.

    python -m shardscope.backend.runs.supervisor RUN_DIR
    python -m shardscope.backend.runs.supervisor --pending RUN_DIR
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from ..errors import ShardscopeError
from ..procs import process_running, process_started, terminate_tree
from . import slurm
from .rundir import (
    ACTIVE_STATES,
    FINAL_STATES,
    STOP_REQUEST,
    describe_exit,
    gone_explanation,
    rank_exits,
    read_config,
    read_json,
    read_status,
    run_gone,
    status_lock,
    this_host,
    torchrun_root_cause,
    update_status,
)

POLL = 0.2  # s between looks at torchrun and at a stop request
GRACE = 10.0  # s between SIGTERM and SIGKILL when nothing else is asked for
PENDING_POLL = float(os.environ.get("SHARDSCOPE_PENDING_POLL", "5"))  # s between looks at a queued SLURM job
PR_SET_PDEATHSIG = 1
STOP_NOTE = ("\n--- stopped by the user from Shardscope (SIGTERM to every process of the run). A SignalException "
             "traceback from torchrun above is how torchrun reports that signal, not an error.\n")


def stop_grace(run_dir: str | os.PathLike) -> float:
    """The grace a stop request asks for (RUN/stop.request's ``grace``), else :data:`GRACE`."""
    grace = read_json(Path(run_dir) / STOP_REQUEST).get("grace")
    return float(grace) if isinstance(grace, (int, float)) and 0 <= grace <= 3600 else GRACE


def settle(run_dir: str | os.PathLike, status: dict[str, Any], exit_code: int | None,
           gone: str | None = None) -> dict[str, Any]:
    """Write the final state of a local run whose torchrun has ended (``exit_code``, None when unknown), from
    the stop request and the ranks' exit records. ``gone``: why nobody saw torchrun end (its supervisor was
    killed), said when that decides the state."""
    exits = rank_exits(run_dir)
    failed = sorted(r for r, e in exits.items() if e.get("code"))
    nproc = read_config(run_dir).get("nproc")
    # a rank killed by the stop's SIGTERM writes no exit record: a clean record from every rank means the
    # run had finished its work before the stop arrived (Stop clicked during the last checkpoint or teardown)
    all_clean = bool(exits) and not failed and isinstance(nproc, int) and len(exits) >= nproc
    cause = None
    if status.get("stop_requested") and not all_clean:
        state, why = "stopped", "stopped by the user (SIGTERM to every process of the run)"
        if gone:
            why += f"; before that, {gone}"  # stopped with `shardscope stop` after its supervisor had gone
    elif status.get("stop_requested"):
        state, why = "finished", "every rank had finished when the stop arrived"
    elif not failed and (exit_code == 0 or (exit_code is None and all_clean)):
        state, why = "finished", "success" if exit_code == 0 else "every rank recorded a clean exit"
    else:
        state = "failed"
        why = describe_exit(exit_code) if exit_code is not None else gone or "no rank recorded an exit (killed?)"
        cause = torchrun_root_cause(run_dir, int(status.get("log_start") or 0), exits)
        if cause is not None:  # the rank that failed first: the others often fail only because it went
            why = f"rank {cause[0]} {describe_exit(cause[1])}, the first rank to fail (torchrun: {why})"
    return update_status(run_dir, state, end_time=time.time(), exit_code=exit_code, failed_ranks=failed,
                         exit_codes={str(r): e.get("code") for r, e in exits.items()}, explanation=why,
                         root_cause_rank=cause[0] if cause else None)


def settle_abandoned(run_dir: str | os.PathLike, grace: float = GRACE) -> dict[str, Any]:
    """Record how a run whose supervisor is gone ended (``shardscope stop``, a resume): whatever of it still
    runs is ended first. Returns the status, unchanged when the run has a supervisor or a final state."""
    with status_lock(run_dir):
        status = read_status(run_dir)
        if status.get("state") not in ACTIVE_STATES or not run_gone(status):
            return status
        pid = status.get("pid")
        # torchrun, still ending (its parent-death signal)
        if pid is not None and process_running(pid, status.get("pid_started")):
            terminate_tree(pid, grace)
        return settle(run_dir, status, None, gone=gone_explanation(status))


def _parent_death_signal() -> Any:
    """A function for Popen's ``preexec_fn``: the child gets SIGTERM when this process dies (Linux), so a
    supervisor killed with SIGKILL does not leave torchrun training on, unseen and unsettled."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the ranks still end with torchrun (worker_entry)
        prctl = None
    parent = os.getpid()

    def setup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # the supervisor ignores it; torchrun need not
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the supervisor died before the line above
            os._exit(1)

    return setup


class Supervisor:
    """Runs one launch of a run to its end: see the module's docstring."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir).absolute()
        self.signalled: str | None = None

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.signalled = signal.Signals(signum).name

    def stop_asked(self) -> bool:
        return self.signalled is not None or (self.run_dir / STOP_REQUEST).exists()

    def run(self) -> int:
        """Start torchrun (unless a stop came first), follow it to its end, settle the run; the exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # NOTE: a lost terminal or SSH session must not end the run
        me = os.getpid()
        update_status(self.run_dir, supervisor_pid=me, supervisor_started=process_started(me), host=this_host())
        proc = None
        try:
            if self.stop_asked():
                update_status(self.run_dir, stop_requested=time.time())
                settle(self.run_dir, read_status(self.run_dir), None)
                return 0
            proc = self._start()
            if proc is None:
                return 0
            code = self._follow(proc)
            with status_lock(self.run_dir):
                status = read_status(self.run_dir)
                if status.get("state") not in FINAL_STATES:  # a stop that gave up on us may have settled it
                    status = settle(self.run_dir, status, code)
            if status.get("state") == "stopped":
                print(STOP_NOTE, end="", flush=True)
            return 0
        except BaseException as exc:  # the run must not read "running" after its supervisor failed
            print(f"shardscope supervisor failed:\n{traceback.format_exc()}", flush=True)
            if proc is not None and proc.poll() is None:
                terminate_tree(proc.pid, GRACE)
            with status_lock(self.run_dir):
                if read_status(self.run_dir).get("state") not in FINAL_STATES:
                    update_status(self.run_dir, "failed", end_time=time.time(),
                                  explanation=f"the run's supervisor failed: {type(exc).__name__}: {exc}")
            return 1

    def _start(self) -> subprocess.Popen | None:
        """torchrun, as config.json records it, in a session of its own (so its group can be signalled)."""
        command = read_config(self.run_dir).get("command")
        if not isinstance(command, list) or not all(isinstance(a, str) for a in command) or not command:
            raise ValueError(f"{self.run_dir / 'config.json'}: no command to run")
        proc = subprocess.Popen(command, cwd=str(self.run_dir), stdout=sys.stdout.fileno(), stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_parent_death_signal())  # NOTE: safe: this process has no threads
        with status_lock(self.run_dir):
            # NOTE: a stop that gave up on the supervisor settles the run itself (see launcher.stop_run)
            stopped = read_status(self.run_dir).get("state") in FINAL_STATES
            if not stopped:
                update_status(self.run_dir, "running", pid=proc.pid, pid_started=process_started(proc.pid))
        if stopped:
            terminate_tree(proc.pid, GRACE)
            proc.wait()
            return None
        return proc

    def _follow(self, proc: subprocess.Popen) -> int:
        """Wait for torchrun to end, stopping it when asked; its exit code."""
        while True:
            try:
                return proc.wait(POLL)
            except subprocess.TimeoutExpired:
                pass
            if self.stop_asked():
                how = self.signalled or "a stop request"
                update_status(self.run_dir, stop_requested=time.time(), stop_how=how)
                print(f"\n--- shardscope supervisor: stopping the run ({how})", flush=True)
                code = terminate_tree(proc.pid, stop_grace(self.run_dir))  # NOTE: it reaps torchrun
                waited = proc.wait()
                return code if code is not None else waited


def watch_pending(run_dir: str | os.PathLike) -> int:
    """Write a queued SLURM job's state and pending reason to status.json (:func:`.slurm.refresh` writes what
    changed) until the job runs or has ended; the exit code."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    run_dir = Path(run_dir)
    while run_dir.is_dir():
        try:
            status = slurm.refresh(run_dir, read_status(run_dir))
        except ShardscopeError as exc:  # the controller did not answer this time: ask again
            print(f"shardscope: {exc}", flush=True)
            status = read_status(run_dir)
        if status.get("state") not in ("starting", "queued"):
            return 0
        time.sleep(PENDING_POLL)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    pending = args[:1] == ["--pending"]
    args = args[1:] if pending else args
    if len(args) != 1 or not (Path(args[0]) / "config.json").is_file():
        print(f"usage: python -m shardscope.backend.runs.supervisor [--pending] RUN_DIR (got {json.dumps(args)})",
              file=sys.stderr)
        return 2
    return watch_pending(args[0]) if pending else Supervisor(args[0]).run()


if __name__ == "__main__":
    sys.exit(main())
