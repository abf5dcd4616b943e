"""Launch a training run through torchrun in its own process group, and follow it from files.

A run directory holds config.json, status.json, metrics/rank_N.jsonl, logs/rank_N.log,
exit/rank_N.json and checkpoints/; it outlives the GUI and can be followed from another machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ShardscopeError
from ..procs import pid_alive
from .report import ENV_RUN_DIR

STATES = ("starting", "running", "finished", "failed", "stopped")


@dataclass
class RunConfig:
    strategy: str = "fsdp"
    nproc: int = 2
    steps: int = 50
    checkpoint_every: int = 10
    device: str | None = None
    resume: str | None = None
    script: str | None = None  # a user's own script instead of the built-in trainer
    script_args: list[str] = field(default_factory=list)
    model: dict[str, Any] = field(default_factory=dict)  # width, depth, heads, seq_len, vocab, batch_size, lr, seed

    def trainer_args(self, run_dir: str) -> list[str]:
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


def default_runs_root() -> Path:
    base = os.environ.get("SHARDSCOPE_DATA_DIR") or os.environ.get("XDG_DATA_HOME") or \
        os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / ("runs" if os.environ.get("SHARDSCOPE_DATA_DIR") else "shardscope/runs")


def describe_exit(code: int | None) -> str:
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


class RunLauncher:
    """Starts torchrun for one run; ``stop()`` ends every process of the run."""

    def __init__(self, run_dir: str | os.PathLike, config: RunConfig) -> None:
        self.run_dir = Path(run_dir).absolute()
        self.config = config
        self.proc: subprocess.Popen | None = None

    def start(self) -> RunLauncher:
        """Start the run. A run directory that already holds a run is continued only when resuming
        (metrics append; the plots mark the restart); anything else must be a new directory."""
        existing = (self.run_dir / "config.json").exists()
        if existing and not self.config.resume:
            raise ShardscopeError(f"{self.run_dir}: already holds a run; resume it from one of its checkpoints "
                                  "(--resume) or choose a new run directory.")
        if not existing and self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise ShardscopeError(f"{self.run_dir}: run directory is not empty; choose a new one.")
        if existing and read_status(self.run_dir).get("state") in ("starting", "running") and \
                pid_alive(read_status(self.run_dir).get("pid")):
            raise ShardscopeError(f"{self.run_dir}: the run is still running.")
        for sub in ("metrics", "logs", "checkpoints", "exit"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        for old in (self.run_dir / "exit").glob("rank_*.json"):
            old.unlink()
        cfg = asdict(self.config)
        cfg["command"] = self.command()
        history = []
        if existing:
            try:
                prev = json.loads((self.run_dir / "config.json").read_text())
                history = [*prev.pop("history", []), prev]
            except (OSError, ValueError):
                history = []
        cfg["history"] = history
        (self.run_dir / "config.json").write_text(json.dumps(cfg, indent=2))
        status_file = self.run_dir / "status.json"
        if status_file.exists():
            status_file.unlink()
        self._status("starting", start_time=time.time(), restarts=len(history))
        env = {**os.environ, ENV_RUN_DIR: str(self.run_dir), "PYTHONUNBUFFERED": "1"}
        log = open(self.run_dir / "logs" / "launcher.log", "ab")
        # NOTE: a new session, so stop() can signal torchrun *and* its workers as one group.
        self.proc = subprocess.Popen(self.command(), cwd=str(self.run_dir), env=env, stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self._status("running", pid=self.proc.pid)
        return self

    def command(self) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", str(self.config.nproc), "-m", "shardscope.backend.runs.worker_entry", "--",
                *self.config.trainer_args(str(self.run_dir))]

    def poll(self) -> int | None:
        code = self.proc.poll() if self.proc else None
        if code is not None:
            self._finish(code)
        return code

    def wait(self, timeout: float | None = None) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout)
        self._finish(code)
        return code

    def stop(self, grace: float = 10.0) -> int:
        """SIGTERM to the whole process group, then SIGKILL after ``grace`` seconds."""
        if self.proc is None:
            return 0
        self._stopping = True
        pgid = self.proc.pid
        # NOTE: torchrun starts its workers in sessions of their own, so signalling our group
        # alone would orphan them if torchrun dies first: collect every descendant up front.
        family = run_processes(pgid)
        _signal_group(pgid, signal.SIGTERM)
        for p in family:
            _signal_pid(p.pid, signal.SIGTERM)
        try:
            code = self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            _signal_group(pgid, signal.SIGKILL)
            code = self.proc.wait()
        import psutil

        _gone, alive = psutil.wait_procs(family, timeout=max(0.1, grace / 2))
        for p in alive:
            _signal_pid(p.pid, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=grace)
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
        self._finish(code)
        return code

    def _finish(self, code: int) -> None:
        status = read_status(self.run_dir)
        if status.get("state") in ("finished", "failed", "stopped"):
            return
        exits = rank_exits(self.run_dir)
        failed = [r for r, e in exits.items() if e.get("code")]
        if getattr(self, "_stopping", False):
            state = "stopped"
        else:
            state = "finished" if code == 0 and not failed else "failed"
        self._status(state, end_time=time.time(), exit_code=code,
                     exit_codes={str(r): e.get("code") for r, e in exits.items()},
                     failed_ranks=failed, explanation=describe_exit(code))

    def _status(self, state: str, **extra: Any) -> None:
        status = read_status(self.run_dir)
        status.update(extra, state=state, updated=time.time())
        tmp = self.run_dir / "status.json.tmp"
        tmp.write_text(json.dumps(status, indent=2))
        os.replace(tmp, self.run_dir / "status.json")


def stop_run(run_dir: str | os.PathLike, grace: float = 10.0) -> int | None:
    """Stop a run this process did not start (a GUI reopened on it): SIGTERM to torchrun's group and
    every descendant, SIGKILL after ``grace``; mark it stopped. Returns torchrun's pid, or None."""
    import psutil

    status = read_status(run_dir)
    pid = status.get("pid")
    if not pid_alive(pid):
        return None
    family = run_processes(pid)
    _signal_group(pid, signal.SIGTERM)
    for p in family:
        _signal_pid(p.pid, signal.SIGTERM)
    _gone, alive = psutil.wait_procs(family, timeout=grace)
    for p in alive:
        _signal_pid(p.pid, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=grace)
    status.update(state="stopped", end_time=time.time(), updated=time.time(),
                  explanation="stopped from Shardscope (SIGTERM, then SIGKILL after the grace period)")
    tmp = Path(run_dir) / "status.json.tmp"
    tmp.write_text(json.dumps(status, indent=2))
    os.replace(tmp, Path(run_dir) / "status.json")
    return pid


def run_processes(pid: int) -> list:
    """torchrun and every process it started (psutil handles)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def read_status(run_dir: str | os.PathLike) -> dict[str, Any]:
    try:
        return json.loads((Path(run_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def effective_status(run_dir: str | os.PathLike) -> dict[str, Any]:
    """status.json, corrected for a run whose launcher is gone (the GUI that started it was closed,
    or it was killed): a "running" run with no live process ended, as its ranks' exit records say."""
    status = read_status(run_dir)
    if status.get("state") in ("starting", "running") and "pid" in status and not pid_alive(status["pid"]):
        exits = rank_exits(run_dir)
        failed = [r for r, e in exits.items() if e.get("code")]
        status = {**status, "state": "failed" if failed or not exits else "finished", "failed_ranks": failed,
                  "exit_codes": {str(r): e.get("code") for r, e in exits.items()},
                  "explanation": "the launcher is gone; state taken from the ranks' exit records"
                  if exits else "the launcher is gone and no rank recorded an exit (killed?)"}
    return status


def rank_exits(run_dir: str | os.PathLike) -> dict[int, dict]:
    out = {}
    for p in sorted((Path(run_dir) / "exit").glob("rank_*.json")):
        try:
            rec = json.loads(p.read_text())
            out[int(rec["rank"])] = rec
        except (OSError, ValueError, KeyError):
            continue
    return out


def read_metrics(run_dir: str | os.PathLike, offsets: dict[int, int] | None = None
                 ) -> dict[int, list[dict[str, Any]]]:
    """New metric records per rank since ``offsets`` (byte positions, updated in place)."""
    offsets = offsets if offsets is not None else {}
    out: dict[int, list[dict]] = {}
    for p in sorted((Path(run_dir) / "metrics").glob("rank_*.jsonl")):
        rank = int(p.stem.split("_")[1])
        with open(p, "rb") as f:
            f.seek(offsets.get(rank, 0))
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        offsets[rank] = offsets.get(rank, 0) + end
        recs = []
        for line in data[:end].splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue
        out[rank] = recs
    return out


def log_tail(run_dir: str | os.PathLike, rank: int, lines: int = 30) -> str:
    p = Path(run_dir) / "logs" / f"rank_{rank}.log"
    try:
        with open(p, "rb") as f:
            f.seek(max(0, p.stat().st_size - 64_000))
            return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-lines:])
    except OSError:
        return ""


def checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if (p / ".metadata").exists())
