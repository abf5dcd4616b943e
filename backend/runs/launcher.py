"""Launch a training run through torchrun (on this machine under its supervisor, or on SLURM), read its
state from files and the scheduler, and stop it.

A local launch starts the run's supervisor (:mod:`.supervisor`) detached and returns: the supervisor owns
torchrun and writes the run's state; whoever launched it is only a follower. The run directory layout is
described in :mod:`.rundir`; it outlives the GUI and the terminal and can be followed from another machine.
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
from ..filenames import step_from_name
from ..formats import probe
from ..formats.dcp import is_finished_save
from ..procs import process_running, process_started, send_signal, terminate_tree
from ..text import count
from . import slurm
from .report import ENV_RUN_DIR
from .rundir import (
    ENDED,
    FINAL_STATES,
    MODEL_DEFAULTS,
    OVER_STATES,
    STATUS_LOCK_NAME,
    STOP_REQUEST,
    gone_explanation,
    read_config,
    read_status,
    run_gone,
    state_of,
    status_lock,
    this_host,
    update_status,
    write_json,
)
from .supervisor import settle_abandoned

ENV_RESUME = "SHARDSCOPE_RESUME"  # the checkpoint to resume from, for a user's own script
# what a user's own script is told (``train --script``'s help, the Training panel's Script field)
SCRIPT_CONTRACT = (f"The launcher sets ${ENV_RUN_DIR} (the run folder) in every rank, and ${ENV_RESUME} (the "
                   f"checkpoint) when resuming. Save checkpoints as ${ENV_RUN_DIR}/checkpoints/step_NNNNNN (DCP, "
                   f"e.g. step_000100) for Training, Resume and the Library to find them; report metrics with "
                   f"shardscope.report(step=..., loss=...).")
WORKER = ["-m", "shardscope.backend.runs.worker_entry", "--"]
SUPERVISOR = ["-m", "shardscope.backend.runs.supervisor"]
STOP_TIMEOUT = 60.0  # s past the grace for a supervisor to answer a stop before the stop ends the run itself
# what a folder that holds only a dry run (``train --on slurm --dry-run``) or a status lock has: it can still take
# a new run
DRY_RUN_ENTRIES = {"job.sbatch", "metrics", "logs", "checkpoints", "exit", STATUS_LOCK_NAME}


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
    stall_seconds: float | None = None  # a rank with no new step for this long is stalled (None: the default)

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

    def problems(self, submitting: bool = True) -> dict[str, str]:
        """What is wrong with this config, by field name (empty when it can be launched). ``submitting``:
        False for a dry run, which needs no SLURM tools here."""
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
        if self.resume and not is_finished_save(self.resume):
            out["resume"] = f"{self.resume}: not a DCP checkpoint (no .metadata)"
        if self.on not in ("local", "slurm"):
            out["on"] = f"unknown place to run {self.on!r} (local or slurm)"
        elif self.on == "slurm" and submitting and not slurm.available():
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
        if self.stall_seconds is not None:  # what the window and `follow` flag a stalled rank by
            rec["stall_seconds"] = self.stall_seconds
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


def run_status(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run's state now, for a follower: status.json as the run's supervisor wrote it; for a SLURM run from
    the scheduler (which writes the pending reason and the final state there); for a local run whose
    supervisor is gone without settling it (killed), state "ended" and why. Writes nothing for a local run."""
    status = read_status(run_dir)
    if status.get("state") in FINAL_STATES:
        return status
    if status.get("scheduler") == "slurm":
        return slurm.refresh(Path(run_dir), status)
    if state_of(status) == ENDED:
        return {**status, "state": ENDED, "explanation": f"{gone_explanation(status)}; torchrun and the ranks end "
                "with it. `shardscope stop` records the end; its checkpoints can be resumed"}
    return status


def stop_run(run_dir: str | os.PathLike, grace: float = 10.0, timeout: float = STOP_TIMEOUT) -> dict[str, Any]:
    """Stop a run from any process (``shardscope stop``, the window, an attached ``train``): scancel for a
    SLURM job; else RUN/stop.request and SIGTERM to the run's supervisor, which ends torchrun and every rank
    (SIGKILL after ``grace``) and records "stopped". Returns the final status once none of the run's
    processes lives. A supervisor that is gone or does not answer within ``grace`` + ``timeout`` s: its
    processes are ended here and the run recorded here."""
    run_dir = Path(run_dir)
    status = read_status(run_dir)
    if status.get("state") in FINAL_STATES:
        return status
    if status.get("scheduler") == "slurm":
        return slurm.cancel(run_dir)
    with status_lock(run_dir):
        status = read_status(run_dir)
        if status.get("state") in FINAL_STATES:
            return status
        write_json(run_dir / STOP_REQUEST, {"time": time.time(), "grace": grace, "by_pid": os.getpid(),
                                            "host": this_host()})
        status = update_status(run_dir, stop_requested=time.time())
    supervisor = status.get("supervisor_pid")
    here = status.get("host", this_host()) == this_host()
    if here and not run_gone(status) and isinstance(supervisor, int):
        send_signal(supervisor, signal.SIGTERM)
    elif here and supervisor is None and process_running(status.get("pid")):
        terminate_tree(status["pid"], grace)  # a run started before runs had supervisors: torchrun alone
    deadline = time.monotonic() + grace + timeout
    while True:
        status = read_status(run_dir)
        if status.get("state") in FINAL_STATES or run_gone(status):
            break
        if time.monotonic() > deadline:
            if not here:
                raise ShardscopeError(f"{run_dir}: the run's supervisor on {status.get('host')} did not stop it in "
                                      f"{grace + timeout:.0f} s (is that machine up?)")
            break
        time.sleep(0.1)
    if status.get("state") not in FINAL_STATES:  # the supervisor is gone, or does not answer: end it all here
        if supervisor is not None and process_running(supervisor, status.get("supervisor_started")):
            send_signal(supervisor, signal.SIGKILL)  # torchrun gets its parent-death signal
            _wait_gone({k: status.get(k) for k in ("supervisor_pid", "supervisor_started")}, grace)
        status = settle_abandoned(run_dir, grace)
    if here:  # elsewhere, its supervisor waited for them before it recorded the end
        _wait_gone(status, grace + timeout)
    return status


def _wait_gone(status: dict[str, Any], timeout: float) -> None:
    """Wait until the run's supervisor and torchrun no longer run (the supervisor records the end just before
    it exits; torchrun's ranks end before torchrun does)."""
    deadline = time.monotonic() + timeout
    while process_running(status.get("supervisor_pid"), status.get("supervisor_started")) or \
            process_running(status.get("pid"), status.get("pid_started")):
        if time.monotonic() > deadline:
            raise ShardscopeError(f"the run's processes (pid {status.get('supervisor_pid')}, {status.get('pid')}) "
                                  f"still run {timeout:.0f} s after the stop")
        time.sleep(0.1)


def device_missing(device: str | None, nproc: int) -> str | None:
    """Why a local run cannot use ``device`` with ``nproc`` processes on this machine (one CUDA device per
    rank), or None. NOTE: without this check a run asked for cuda on a machine without CUDA started and
    failed in init_process_group with NCCL's traceback."""
    if device != "cuda":
        return None
    import torch  # NOTE: here, not at the top: the window imports this module on its GUI thread

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        return "device cuda: this machine has no CUDA device (torch.cuda.is_available() is False); use device cpu"
    if have < nproc:
        return (f"device cuda: {count(nproc, 'process', 'processes')} need one CUDA device each and this machine "
                f"has {have}")
    return None


class RunLauncher:
    """Starts one run: its supervisor here (which starts torchrun), or a SLURM job; ``stop()`` ends every
    process of the run. ``proc`` is the supervisor, our child: polling it reaps it once it has ended."""

    def __init__(self, run_dir: str | os.PathLike, config: RunConfig) -> None:
        self.run_dir = Path(run_dir).absolute()
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.note = ""  # what a resume does, in words (status.json's "resumed", the launcher's log)

    def start(self) -> RunLauncher:
        """Start the run and return at once. A run directory that already holds a run is continued only when
        resuming (metrics append; the plots mark the restart); anything else must be a new directory."""
        problems = self.config.problems()
        missing = device_missing(self.config.device, self.config.nproc_per_node) if self.config.on == "local" else None
        if missing:
            problems["device"] = missing
        if problems:
            raise ShardscopeError("; ".join(problems.values()))
        self._check_directory()
        for sub in ("metrics", "logs", "checkpoints", "exit"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        for old in [*(self.run_dir / "exit").glob("*.json"), *self.run_dir.glob(".*.tmp"), self.run_dir / STOP_REQUEST]:
            old.unlink(missing_ok=True)  # the last launch's exit records and stop, a killed writer's temporaries
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
            self._detached("--pending")  # writes the job's pending reason to status.json while it waits
            return self
        # NOTE: the supervisor outlives this process, its terminal (SIGHUP) and its Ctrl-C; it starts torchrun
        # in a further session, so a stop can signal torchrun's group alone
        self.proc = self._detached()
        # the supervisor records itself too; this covers the moment before it does
        update_status(self.run_dir, supervisor_pid=self.proc.pid, supervisor_started=process_started(self.proc.pid),
                      host=this_host())
        return self

    def _detached(self, *flags: str) -> subprocess.Popen:
        """Start the supervisor (or the SLURM pending watcher) in a session of its own, output to the run's
        launcher log."""
        with open(self.run_dir / "logs" / "launcher.log", "ab") as out:
            return subprocess.Popen([sys.executable, *SUPERVISOR, *flags, str(self.run_dir)], cwd=str(self.run_dir),
                                    env={**os.environ, **self._env()}, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)

    def dry_run(self) -> Path:
        """Write RUN/job.sbatch (and the folders it writes into) for a SLURM run, submitting nothing; its path.
        The folder can still take the real launch."""
        if self.config.on != "slurm":
            raise ShardscopeError("a dry run writes a SLURM job script: it needs --on slurm")
        problems = self.config.problems(submitting=False)
        if problems:
            raise ShardscopeError("; ".join(problems.values()))
        self._check_directory()
        for sub in ("metrics", "logs", "checkpoints", "exit"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        return self._job_script()

    def _check_directory(self) -> None:
        existing = (self.run_dir / "config.json").exists()
        if existing and not self.config.resume:
            raise ShardscopeError(f"{self.run_dir}: already holds a run; resume it from one of its checkpoints "
                                  "(--resume) or choose a new run directory.")
        if not existing and self.run_dir.exists() and not _empty_or_dry_run(self.run_dir):
            raise ShardscopeError(f"{self.run_dir}: run directory is not empty; choose a new one.")
        if existing:
            settle_abandoned(self.run_dir)  # a run whose supervisor was killed: recorded as it ended first
            state = run_status(self.run_dir).get("state")
            if state not in (*FINAL_STATES, None):
                raise ShardscopeError(f"{self.run_dir}: the run is still {state}.")

    def _env(self) -> dict[str, str]:
        env = {ENV_RUN_DIR: str(self.run_dir), "PYTHONUNBUFFERED": "1"}
        if self.config.resume:
            env[ENV_RESUME] = self.config.resume
        return env

    def _job_script(self) -> Path:
        text = slurm.job_script(self.run_dir, self.config.slurm or slurm.SlurmOptions(), self.config.nproc_per_node,
                                [*WORKER, *self.config.trainer_args(str(self.run_dir))], env=self._env())
        return slurm.write_script(self.run_dir, text)

    def _write_config(self) -> None:
        prev = read_config(self.run_dir)
        history = [*prev.pop("history", []), prev] if prev else []
        command = ["sbatch", str(self._job_script())] if self.config.on == "slurm" else self.command()
        write_json(self.run_dir / "config.json", {**self.config.record(), "command": command,
                                                  "launched_from": os.getcwd(), "launched_at": time.time(),
                                                  "history": history})

    def command(self) -> list[str]:
        """The local torchrun command line (what the supervisor runs, from config.json)."""
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", str(self.config.nproc), *WORKER, *self.config.trainer_args(str(self.run_dir))]

    def status(self) -> dict[str, Any]:
        """The run's state now (see :func:`run_status`); reaps the supervisor when it has ended."""
        if self.proc is not None:
            self.proc.poll()
        return run_status(self.run_dir)

    def wait(self, timeout: float | None = None, interval: float = 0.5) -> dict[str, Any]:
        """Wait until the run is over (a final state, or "ended": its supervisor was killed); returns its
        status (TimeoutError after ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.status()
            if status.get("state") in OVER_STATES:
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


def _empty_or_dry_run(folder: Path) -> bool:
    """True for an empty folder, or one that holds only a dry run's job script, empty folders, a status lock."""
    entries = list(folder.iterdir())
    return all(e.name in DRY_RUN_ENTRIES and (e.is_file() or not any(e.iterdir())) for e in entries)
