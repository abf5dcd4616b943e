"""Launch a training run through torchrun (on this machine in its own process group, or on SLURM),
follow its state from files and the scheduler, and stop it.

The run directory layout is described in :mod:`.rundir`; it outlives the GUI and can be followed
from another machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ShardscopeError
from ..filenames import METADATA, step_from_name
from ..format import count
from ..formats import probe
from ..procs import pid_alive, terminate_tree
from . import slurm
from .report import ENV_RUN_DIR
from .rundir import (
    FINAL_STATES,
    MODEL_DEFAULTS,
    is_zombie,
    rank_exits,
    read_config,
    read_status,
    status_lock,
    torchrun_ended,
    torchrun_root_cause,
    update_status,
    write_json,
)

ENV_RESUME = "SHARDSCOPE_RESUME"  # the checkpoint to resume from, for a user's own script
WORKER = ["-m", "shardscope.backend.runs.worker_entry", "--"]
STOP_NOTE = ("\n--- stopped by the user from Shardscope (SIGTERM to every process of the run). A SignalException "
             "traceback from torchrun above is how torchrun reports that signal, not an error.\n")


@dataclass
class RunConfig:
    """What to launch: the built-in trainer (strategy, steps, model) or a user's script, where (on)."""

    strategy: str = "fsdp"
    nproc: int = 2  # processes (per node on SLURM)
    steps: int = 50
    checkpoint_every: int = 10
    device: str | None = None
    resume: str | None = None
    script: str | None = None  # a user's own script instead of the built-in trainer (absolute path)
    script_args: list[str] = field(default_factory=list)
    model: dict[str, Any] = field(default_factory=dict)  # width, depth, heads, seq_len, vocab, batch_size, lr, seed
    on: str = "local"  # "local" or "slurm"
    slurm: slurm.SlurmOptions | None = None

    def resolved(self, cwd: str | os.PathLike | None = None) -> RunConfig:
        """A copy with ``script`` and ``resume`` made absolute against ``cwd`` (the caller's working
        directory: the workers run in the run directory, where a relative path means something else)."""
        base = Path(cwd or os.getcwd())
        out = RunConfig(**{**self.__dict__})
        if out.script:
            out.script = str((base / Path(out.script).expanduser()).resolve())
        if out.resume:
            out.resume = str((base / Path(out.resume).expanduser()).resolve())
        return out

    def problems(self) -> dict[str, str]:
        """What is wrong with this config, by field name (empty when it can be launched)."""
        out: dict[str, str] = {}
        if self.nproc < 1:
            out["nproc"] = "needs at least 1 process"
        if self.script:
            if not Path(self.script).is_file():
                out["script"] = f"{self.script}: no such file"
        else:
            if self.steps < 1:
                out["steps"] = "steps must be at least 1"
            if self.checkpoint_every < 0:
                out["checkpoint_every"] = "must be 0 (never) or more"
            if self.strategy not in ("fsdp", "ddp"):
                out["strategy"] = f"unknown strategy {self.strategy!r} (fsdp or ddp)"
        if self.resume and not (Path(self.resume) / METADATA).is_file():
            out["resume"] = f"{self.resume}: not a DCP checkpoint (no .metadata)"
        if self.on not in ("local", "slurm"):
            out["on"] = f"unknown place to run {self.on!r} (local or slurm)"
        elif self.on == "slurm" and not slurm.available():
            out["on"] = "SLURM's sbatch/scontrol/sinfo are not on PATH here"
        return out

    @property
    def ranks(self) -> int:
        """How many ranks the run has: processes per node times nodes."""
        nodes = self.slurm.nodes if self.on == "slurm" and self.slurm else 1
        return self.nproc_per_node * max(1, nodes)

    @property
    def nproc_per_node(self) -> int:
        """Processes per node: the SLURM GPUs per node when set, else ``nproc``."""
        if self.on == "slurm" and self.slurm and self.slurm.gpus_per_node:
            return self.slurm.gpus_per_node
        return self.nproc

    def trainer_args(self, run_dir: str) -> list[str]:
        """Arguments for each rank: the user's script and its arguments, or the built-in trainer's flags."""
        if self.script:
            return [self.script, *self.script_args]
        args = ["--builtin", "--strategy", self.strategy, "--steps", str(self.steps),
                "--checkpoint-every", str(self.checkpoint_every), "--run-dir", run_dir]
        if self.device:
            args += ["--device", self.device]
        if self.resume:
            args += ["--resume", self.resume]
        for k, v in self.model.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        return args

    def record(self) -> dict[str, Any]:
        """What config.json records: only the fields that shaped this launch."""
        rec: dict[str, Any] = {"kind": "script" if self.script else "builtin", "nproc": self.nproc,
                               "device": self.device, "resume": self.resume, "on": self.on}
        if self.script:
            rec.update(script=self.script, script_args=list(self.script_args))
        else:
            rec.update(strategy=self.strategy, steps=self.steps, checkpoint_every=self.checkpoint_every,
                       model={**MODEL_DEFAULTS, **self.model})
        if self.on == "slurm":
            rec["slurm"] = asdict(self.slurm or slurm.SlurmOptions())
        return rec

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> RunConfig:
        """The config a config.json record describes (to resume the same run)."""
        known = {k: v for k, v in rec.items() if k in cls.__dataclass_fields__ and k != "slurm"}
        cfg = cls(**known)
        if isinstance(rec.get("slurm"), dict):
            fields = slurm.SlurmOptions.__dataclass_fields__
            cfg.slurm = slurm.SlurmOptions(**{k: v for k, v in rec["slurm"].items() if k in fields})
        return cfg


def resume_config(run_dir: str | os.PathLike, checkpoint: str, nproc: int) -> RunConfig:
    """The run in ``run_dir`` launched again from ``checkpoint`` on ``nproc`` processes (per node on SLURM): DCP
    reshards on load, so a checkpoint resumes at another world size, as ``shardscope train --resume`` does."""
    config = RunConfig.from_record(read_config(run_dir))
    config.resume, config.nproc = checkpoint, nproc
    return config


def resume_note(checkpoint: str, ranks: int) -> str:
    """What a resume does, in words: "resuming step 20 of a 2-rank run on 3 ranks"."""
    name = os.path.basename(os.path.normpath(checkpoint))
    step = step_from_name(name)
    what = f"step {step}" if step is not None else name
    try:
        facts = probe(checkpoint)
    except (CheckpointError, OSError):
        facts = None
    saved = len(facts.ranks) if facts is not None else 0
    if not saved:
        return f"resuming {what} on {count(ranks, 'rank')}"
    if saved == ranks:
        return f"resuming {what} of a {saved}-rank run on {count(ranks, 'rank')}, as it was saved"
    return f"resuming {what} of a {saved}-rank run on {count(ranks, 'rank')} (DCP reshards it as it loads)"


def describe_exit(code: int | None) -> str:
    """An exit code in words (negative: killed by a signal)."""
    if code is None:
        return "still running"
    if code == 0:
        return "success"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if code == -signal.SIGKILL:
            return f"killed by {name} (often the out-of-memory killer; see `dmesg`)"
        return f"killed by {name}"
    return f"exited with code {code}"


def run_status(run_dir: str | os.PathLike, exit_code: int | None = None, pid: int | None = None) -> dict[str, Any]:
    """The run's state now. status.json, brought up to date: from the scheduler for a SLURM run; for a
    local run whose torchrun has ended (``exit_code`` when we reaped it, else its pid is gone: the GUI
    that started it was closed) from the ranks' exit records. A final state is written once.

    ``exit_code`` is that of torchrun ``pid`` when given: it is ignored unless status.json describes
    that launch (not a resume started since in the same run directory)."""
    status = read_status(run_dir)
    if status.get("state") in FINAL_STATES:
        return status
    if status.get("scheduler") == "slurm":
        return slurm.refresh(Path(run_dir), status)
    if pid is not None and status.get("pid") != pid:
        # NOTE: the launcher of a run's earlier segment still answers its old exit code: applied to the
        # resumed launch it wrote "finished" over a running run, whose Stop then did nothing
        exit_code = None
    pid = status.get("pid")
    if exit_code is None:
        # NOTE: alive first, then reap: the other order read a torchrun that died between the two checks
        # as gone without a code ("the launcher is gone", for a run killed by a signal)
        if not torchrun_ended(status):
            return status
        exit_code = _reap_ended_child(pid)
    # NOTE: read again, under the status lock, now that torchrun is known to have ended. A stop writes
    # stop_requested (under the same lock) before its first signal, so it is seen here; the status read
    # above may predate it (a poll racing a Stop wrote "failed" over a run the user had stopped)
    with status_lock(run_dir):
        status = read_status(run_dir)
        if status.get("state") in FINAL_STATES or status.get("pid") != pid:
            return status  # settled meanwhile by another thread or process, or a new launch has begun
        return _settle(run_dir, status, exit_code)


def _settle(run_dir: str | os.PathLike, status: dict[str, Any], exit_code: int | None) -> dict[str, Any]:
    """Write the final state of a local run whose torchrun has ended (``exit_code``, None when unknown)."""
    exits = rank_exits(run_dir)
    failed = sorted(r for r, e in exits.items() if e.get("code"))
    nproc = read_config(run_dir).get("nproc")
    # a rank killed by the stop's SIGTERM writes no exit record: a clean record from every rank means the
    # run had finished its work before the stop arrived (Stop clicked during the last checkpoint or teardown)
    all_clean = bool(exits) and not failed and isinstance(nproc, int) and len(exits) >= nproc
    cause = None
    if status.get("stop_requested") and not all_clean:
        state, why = "stopped", "stopped by the user (SIGTERM to every process of the run)"
    elif status.get("stop_requested"):
        state, why = "finished", "every rank had finished when the stop arrived"
    elif not failed and (exit_code == 0 or (exit_code is None and exits)):
        state, why = "finished", "success" if exit_code == 0 else "every rank recorded a clean exit"
    else:
        state = "failed"
        why = describe_exit(exit_code) if exit_code is not None else \
            "the launcher is gone and no rank recorded an exit (killed?)" if not exits else \
            "the launcher is gone; state taken from the ranks' exit records"
        cause = torchrun_root_cause(run_dir, int(status.get("log_start") or 0))
        if cause is not None:  # the rank that failed first: the others often fail only because it went
            why = f"rank {cause[0]} {describe_exit(cause[1])}, the first rank to fail (torchrun: {why})"
    return update_status(run_dir, state, end_time=time.time(), exit_code=exit_code, failed_ranks=failed,
                         exit_codes={str(r): e.get("code") for r, e in exits.items()}, explanation=why,
                         root_cause_rank=cause[0] if cause else None)


def _reap_ended_child(pid: int) -> int | None:
    """The exit code of our own child torchrun that has ended, reaping it; None when it runs, or is not
    ours. NOTE: a launcher dropped with its Training tab leaves such a zombie: without this, the run
    read "running" for as long as the window lived."""
    if not is_zombie(pid):
        return None
    try:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None  # another process's child: it is not running, and its ranks' records tell the end
    return os.waitstatus_to_exitcode(wait_status) if done == pid else None


def stop_run(run_dir: str | os.PathLike, grace: float = 10.0) -> dict[str, Any]:
    """Stop a run, whoever started it: scancel for a SLURM job; else SIGTERM to torchrun's group and every
    descendant, SIGKILL after ``grace``. The run then reads "stopped". Returns its final status."""
    status = read_status(run_dir)
    if status.get("state") in FINAL_STATES:
        return status
    if status.get("scheduler") == "slurm":
        return slurm.cancel(Path(run_dir))
    update_status(run_dir, stop_requested=time.time())
    pid = status.get("pid")
    signalled = pid_alive(pid)
    if signalled:
        terminate_tree(pid, grace)
    final = run_status(run_dir, exit_code=-signal.SIGTERM, pid=pid)
    if signalled and final.get("state") == "stopped":
        with open(Path(run_dir) / "logs" / "launcher.log", "a") as log:
            log.write(STOP_NOTE)
    return final


class RunLauncher:
    """Starts one run (torchrun here, or a SLURM job); ``stop()`` ends every process of the run."""

    def __init__(self, run_dir: str | os.PathLike, config: RunConfig) -> None:
        self.run_dir = Path(run_dir).absolute()
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.note = ""  # what a resume does, in words (status.json's "resumed", the launcher's log)

    def start(self) -> RunLauncher:
        """Start the run. A run directory that already holds a run is continued only when resuming
        (metrics append; the plots mark the restart); anything else must be a new directory."""
        problems = self.config.problems()
        if problems:
            raise ShardscopeError("; ".join(problems.values()))
        self._check_directory()
        for sub in ("metrics", "logs", "checkpoints", "exit"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        for old in [*(self.run_dir / "exit").glob("*.json"), *self.run_dir.glob(".*.tmp")]:
            old.unlink()  # the last launch's exit records, and temporaries of a writer that was killed
        self._write_config()
        history = read_config(self.run_dir).get("history", [])
        log = self.run_dir / "logs" / "launcher.log"
        status = {"state": "starting", "start_time": time.time(), "restarts": len(history), "updated": time.time(),
                  "scheduler": self.config.on, "log_start": log.stat().st_size if log.exists() else 0}
        if self.config.resume:
            self.note = status["resumed"] = resume_note(self.config.resume, self.config.ranks)
            with open(log, "a") as out:
                out.write(f"shardscope: {self.note}\n")
        write_json(self.run_dir / "status.json", status)
        if self.config.on == "slurm":
            try:
                job_id = slurm.submit(self.run_dir / "job.sbatch")
            except ShardscopeError as exc:  # the run did not start: say so in its status, keep job.sbatch
                update_status(self.run_dir, "failed", explanation=f"not submitted: {exc}", end_time=time.time())
                raise
            update_status(self.run_dir, "queued", job_id=job_id, submit_time=time.time())
            return self
        env = {**os.environ, **self._env()}
        with open(self.run_dir / "logs" / "launcher.log", "ab") as log:
            # NOTE: a new session, so stop() can signal torchrun *and* its workers as one group.
            self.proc = subprocess.Popen(self.command(), cwd=str(self.run_dir), env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        with status_lock(self.run_dir):
            # NOTE: a stop that came while the run was "starting" (``shardscope stop`` from a terminal) found
            # no process and settled the run "stopped": the torchrun just started must not run on unseen
            stopped = read_status(self.run_dir).get("state") in FINAL_STATES
            if not stopped:
                update_status(self.run_dir, "running", pid=self.proc.pid)
        if stopped:
            terminate_tree(self.proc.pid, 10.0)
            self.proc.wait()
        return self

    def _check_directory(self) -> None:
        existing = (self.run_dir / "config.json").exists()
        if existing and not self.config.resume:
            raise ShardscopeError(f"{self.run_dir}: already holds a run; resume it from one of its checkpoints "
                                  "(--resume) or choose a new run directory.")
        if not existing and self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise ShardscopeError(f"{self.run_dir}: run directory is not empty; choose a new one.")
        if existing and run_status(self.run_dir).get("state") not in (*FINAL_STATES, None):
            raise ShardscopeError(f"{self.run_dir}: the run is still running.")

    def _env(self) -> dict[str, str]:
        env = {ENV_RUN_DIR: str(self.run_dir), "PYTHONUNBUFFERED": "1"}
        if self.config.resume:
            env[ENV_RESUME] = self.config.resume
        return env

    def _write_config(self) -> None:
        prev = read_config(self.run_dir)
        history = [*prev.pop("history", []), prev] if prev else []
        if self.config.on == "slurm":
            text = slurm.job_script(self.run_dir, self.config.slurm or slurm.SlurmOptions(),
                                    self.config.nproc_per_node, [*WORKER, *self.config.trainer_args(str(self.run_dir))],
                                    env=self._env())
            command = ["sbatch", str(slurm.write_script(self.run_dir, text))]
        else:
            command = self.command()
        write_json(self.run_dir / "config.json", {**self.config.record(), "command": command,
                                                  "launched_from": os.getcwd(), "launched_at": time.time(),
                                                  "history": history})

    def command(self) -> list[str]:
        """The local torchrun command line."""
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", str(self.config.nproc), *WORKER, *self.config.trainer_args(str(self.run_dir))]

    def status(self) -> dict[str, Any]:
        """The run's state now (reaps torchrun when it ended; see :func:`run_status`)."""
        if self.proc is None:
            return run_status(self.run_dir)
        return run_status(self.run_dir, exit_code=self.proc.poll(), pid=self.proc.pid)

    def wait(self, timeout: float | None = None, interval: float = 0.5) -> dict[str, Any]:
        """Wait until the run reaches a final state; returns its status (TimeoutError after ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.status()
            if status.get("state") in FINAL_STATES:
                return status
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.run_dir}: still {status.get('state')} after {timeout} s")
            if self.proc is not None:
                try:
                    self.proc.wait(interval)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(interval)

    def stop(self, grace: float = 10.0) -> dict[str, Any]:
        """Stop the run (see :func:`stop_run`); returns its final status."""
        status = stop_run(self.run_dir, grace)
        if self.proc is not None:
            self.proc.poll()
        return status
