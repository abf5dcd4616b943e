"""The run directory on disk, in one place: its name, status.json, config.json, per-rank metrics,
logs and exit records, checkpoints, and whether a folder is a run at all.

    RUN/config.json          what was launched (see RunConfig.record)
    RUN/status.json          state: queued | starting | running | finished | failed | stopped, written by the
                             run's supervisor (its pid and start time, torchrun's pid, the host, exit codes)
    RUN/stop.request         a stop asked for (by ``shardscope stop``, the window, any process): the supervisor acts
    RUN/metrics/rank_N.jsonl one line per report() call
    RUN/logs/rank_N.log      each rank's output; logs/launcher.log torchrun's and the supervisor's (or the SLURM job's)
    RUN/exit/rank_N.json     each rank's exit code and the end of its traceback
    RUN/checkpoints/step_*   DCP checkpoints
    RUN/job.sbatch           the SLURM job script of a run launched with --on slurm
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..atomic_file import write_atomic
from ..filenames import HF_INDEXES, HF_MODEL_FILES
from ..formats import RESUMABLE, WEIGHTS, detect_file, detect_folder
from ..procs import process_running
from .metric_logs import EVENT_MARK

RUN_NAME_FORMAT = "run-%Y%m%d-%H%M%S"
ACTIVE_STATES = ("queued", "starting", "running")
FINAL_STATES = ("finished", "failed", "stopped")
ENDED = "ended"  # read-only view of an active run whose supervisor is gone without settling it (see run_state)
OVER_STATES = (*FINAL_STATES, ENDED)  # nothing runs any more
STOP_REQUEST = "stop.request"
STARTING_GRACE = 60.0  # s: a run "starting" with no supervisor recorded for this long was never started
SCALAR_LOG_NAMES = ("metrics.csv",)  # Lightning's CSVLogger; TensorBoard files have EVENT_MARK in their name
SKIP_DIRS = {"exit", "__pycache__", "node_modules"}
SEARCH_DEPTH = 4
# The built-in trainer's model and optimiser settings when the user names none (config.json records the
# settings a run actually used, these merged with the user's).
MODEL_DEFAULTS: dict[str, int | float] = {"width": 64, "depth": 2, "heads": 4, "seq_len": 64, "vocab": 96,
                                          "batch_size": 8, "lr": 3e-3, "seed": 0, "grad_clip": 1.0}


def default_runs_root() -> Path:
    """Where new runs go: $SHARDSCOPE_DATA_DIR/runs, else the XDG data dir."""
    base = os.environ.get("SHARDSCOPE_DATA_DIR") or os.environ.get("XDG_DATA_HOME") or \
        os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / ("runs" if os.environ.get("SHARDSCOPE_DATA_DIR") else "shardscope/runs")


def new_run_dir(root: str | os.PathLike | None = None) -> Path:
    """A fresh run directory name (not created) under ``root`` (default: :func:`default_runs_root`)."""
    root = Path(root) if root else default_runs_root()
    path = root / time.strftime(RUN_NAME_FORMAT)
    n = 1
    while path.exists():
        n += 1
        path = root / f"{time.strftime(RUN_NAME_FORMAT)}-{n}"
    return path


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file; {} when it is missing or not (yet) a complete object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def write_json(path: Path, value: dict[str, Any]) -> None:
    """Write a JSON object atomically (see :func:`..atomic_file.write_atomic`)."""
    write_atomic(path, json.dumps(value, indent=2))


def read_status(run_dir: str | os.PathLike) -> dict[str, Any]:
    """status.json as written (see :func:`shardscope.backend.runs.launcher.run_status` for the live state)."""
    return read_json(Path(run_dir) / "status.json")


def this_host() -> str:
    """This machine's name, as status.json records where a local run's processes live."""
    return socket.gethostname()


def run_gone(status: dict[str, Any]) -> bool:
    """True when the local run a status describes has no supervisor any more (killed: kill -9, the OOM
    killer, a reboot), so nobody will settle it. Never for a SLURM run (the scheduler says), nor for one whose
    processes live on another host (a run folder on shared storage). The one rule a listing
    (:func:`run_state`), a follower and the launcher go by.

    NOTE: a status from before the supervisor names torchrun alone (``pid``): that run is gone with it."""
    if status.get("scheduler") == "slurm" or status.get("host", this_host()) != this_host():
        return False
    if "supervisor_pid" in status:
        return not process_running(status["supervisor_pid"], status.get("supervisor_started"))
    if "pid" in status:
        return not process_running(status["pid"])
    updated = status.get("updated")
    return isinstance(updated, (int, float)) and time.time() - updated > STARTING_GRACE


def gone_explanation(status: dict[str, Any]) -> str:
    """Why a run that :func:`run_gone` reads "ended", in the user's words."""
    if "supervisor_pid" in status:
        return f"its supervisor (pid {status['supervisor_pid']}) is gone without recording how the run ended (killed?)"
    if "pid" in status:
        return f"torchrun (pid {status['pid']}) is gone and nothing recorded how the run ended"
    return "the run never started: its launcher went away before starting it"


def run_state(run_dir: str | os.PathLike) -> str | None:
    """A run's state, read-only (see :func:`state_of`)."""
    return state_of(read_status(run_dir))


def state_of(status: dict[str, Any], local: bool = True) -> str | None:
    """A run's state from its status.json, read-only: the state written, except that an active state whose
    supervisor is gone reads ``ENDED`` (``local``: the pid is one of this machine's; a run listed under a
    URL is taken as written). NOTE: "ended" is not a state of status.json: the run is over but nobody
    recorded how (its supervisor, the one writer, was killed); ``shardscope stop`` or a resume records it."""
    state = status.get("state")
    if local and state in ACTIVE_STATES and run_gone(status):
        return ENDED
    return state if isinstance(state, str) else None


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


STATUS_LOCK_NAME = ".status.lock"
_held: dict[str, list] = {}  # run folder -> [RLock, depth, fd of the flock'ed lock file or None]
_held_guard = threading.Lock()


@contextmanager
def status_lock(run_dir: str | os.PathLike) -> Iterator[None]:
    """Hold status.json for a read-modify-write, against other threads and other processes (the window's
    poll, a Stop, ``shardscope stop`` from a terminal). Re-entrant in a thread. Where no lock can be taken
    (a read-only folder, a system without ``flock``) it holds the threads of this process only.

    NOTE: without it a poll that settled a run "failed" could write over the stop_requested a Stop had
    written a moment before (lost update), and the run read "failed" although the user had stopped it."""
    key = os.path.abspath(run_dir)
    with _held_guard:
        entry = _held.setdefault(key, [threading.RLock(), 0, None])
    with entry[0]:
        if entry[1] == 0:
            entry[2] = _flock(Path(key) / STATUS_LOCK_NAME)
        entry[1] += 1
        try:
            yield
        finally:
            entry[1] -= 1
            if entry[1] == 0 and entry[2] is not None:
                os.close(entry[2])  # closing the descriptor releases the flock
                entry[2] = None


def _flock(path: Path) -> int | None:
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:  # a file system without locks (some network mounts)
        os.close(fd)
        return None
    return fd


def update_status(run_dir: str | os.PathLike, state: str | None = None, **changes: Any) -> dict[str, Any]:
    """Merge ``changes`` (and the new ``state``) into status.json, under :func:`status_lock`; returns the
    new status."""
    with status_lock(run_dir):
        status = read_status(run_dir)
        status.update(changes, updated=time.time())
        if state is not None:
            status["state"] = state
        write_json(Path(run_dir) / "status.json", status)
    return status


def read_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """config.json: what was launched (the latest launch; earlier ones under "history")."""
    return read_json(Path(run_dir) / "config.json")


def rank_exits(run_dir: str | os.PathLike) -> dict[int, dict]:
    """Each rank's exit record (code, end of traceback), by rank."""
    out = {}
    for p in sorted((Path(run_dir) / "exit").glob("rank_*.json")):
        rec = read_json(p)
        if isinstance(rec.get("rank"), int):
            out[rec["rank"]] = rec
    return out


def log_tail(run_dir: str | os.PathLike, rank: int, lines: int = 30) -> str:
    """The last ``lines`` lines of a rank's log (-1: the launcher's)."""
    p = Path(run_dir) / "logs" / ("launcher.log" if rank == -1 else f"rank_{rank}.log")
    try:
        with open(p, "rb") as f:
            f.seek(max(0, p.stat().st_size - 64_000))
            return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-lines:])
    except OSError:
        return ""


# torchrun's error summary: "Failures:" then "Root Cause (first observed failure):", each failure as
# "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 123)" (torch.distributed.elastic's template)
_REPORT = re.compile(rb"\nFailures:\n(.*?)\nRoot Cause \(first observed failure\):\n(.*?)(?:\n={20}|\Z)", re.S)
_FAILURE = re.compile(rb"^  rank      : (\d+) \(local_rank: \d+\)\n  exitcode  : (-?\d+) \(pid: ", re.M)
# a rank's own watchdog aborts it (SIGABRT) when a peer fails, and torchrun ends the ranks still running
# with SIGTERM once one has failed: those deaths are consequences, not causes
_CONSEQUENT_SIGNALS = {-signal.SIGABRT, -signal.SIGTERM}


def _torchrun_failures(run_dir: str | os.PathLike, start: int) -> list[tuple[int, int]]:
    """(rank, exit code) of each failure in torchrun's last failure report in launcher.log after byte
    ``start``, torchrun's "first observed failure" first; [] without a whole report."""
    p = Path(run_dir) / "logs" / "launcher.log"
    try:
        with open(p, "rb") as f:
            size = p.stat().st_size
            f.seek(max(start, size - 256_000, 0))
            data = f.read(256_000)
    except OSError:
        return []
    reports = list(_REPORT.finditer(data))
    if not reports:
        return []
    others, root = reports[-1].group(1), reports[-1].group(2)
    first = _FAILURE.search(root)
    if first is None:
        return []
    return [(int(first.group(1)), int(first.group(2))),
            *((int(m.group(1)), int(m.group(2))) for m in _FAILURE.finditer(others))]


def _exit_time(run_dir: str | os.PathLike, rank: int, record: dict) -> float:
    """When a rank wrote its exit record: the time it records, else the file's modification time."""
    stamp = record.get("time")
    if isinstance(stamp, (int, float)):
        return float(stamp)
    try:
        return (Path(run_dir) / "exit" / f"rank_{rank}.json").stat().st_mtime
    except OSError:
        return float("inf")


def torchrun_root_cause(run_dir: str | os.PathLike, start: int = 0,
                        exits: dict[int, dict] | None = None) -> tuple[int, int] | None:
    """The rank and exit code that ended the run first, from torchrun's last failure report in
    launcher.log after byte ``start`` (where this launch's output begins: a resumed run appends to the
    same log) and the ranks' exit records (``exits``, default :func:`rank_exits`).

    NOTE: torchrun's own "first observed failure" is the failure with the smallest whole-second
    timestamp, and a rank killed by a signal (the OOM killer's SIGKILL) is stamped when torchrun notices
    it, while its peers' "Connection reset by peer" carry the second they raised in: the killed rank
    then loses, or ties and loses to the lower rank. A rank ended by a signal that is not a consequence
    of a peer's failure is therefore the cause whenever torchrun reports one. Otherwise the cause is the
    rank whose exit record says it failed first (a rank torchrun ended with SIGTERM writes none; torchrun
    named such a rank "the first to fail" when a peer had exited 1 in the same second)."""
    failures = _torchrun_failures(run_dir, start)
    killed = [f for f in failures if f[1] < 0 and f[1] not in _CONSEQUENT_SIGNALS]
    if killed and failures[0] not in killed:
        return min(killed)
    exits = rank_exits(run_dir) if exits is None else exits
    errored = sorted((_exit_time(run_dir, r, e), r, e["code"]) for r, e in exits.items()
                     if isinstance(e.get("code"), int) and e["code"] > 0)
    if errored and not killed:
        return errored[0][1], errored[0][2]
    return failures[0] if failures else None


def _listing(p: Path) -> tuple[set[str], list[str]] | None:
    try:
        with os.scandir(p) as it:
            entries = list(it)
    except OSError:
        return None
    return ({e.name for e in entries if not e.is_dir(follow_symlinks=False)},
            [e.name for e in entries if e.is_dir(follow_symlinks=False)])


def _resumable_folder(p: Path) -> bool:
    """A checkpoint folder a run resumes from, as the formats detect it (DCP, Lightning, a Trainer's)."""
    listed = _listing(p)
    fmt = detect_folder(p.name, *listed) if listed is not None else None
    return fmt is not None and fmt.kind == RESUMABLE


def _resumable_file(p: Path, size: int) -> bool:
    """A single-file checkpoint unless it is whole and holds weights only: a Lightning ``.ckpt`` or a ``.pt`` with
    an optimizer's state, or one that cannot be judged (cut short, damaged: shown, so that opening it says why)."""
    fmt = detect_file(p.name)
    facts = fmt.probe_file(str(p), size) if fmt is not None else None
    return facts is not None and not (facts.state == "complete" and facts.kind == WEIGHTS)


def scan(run_dir: str | os.PathLike) -> tuple[list[Path], list[Path]]:
    """One walk of a run folder (a few levels down, no symlinks, not into checkpoints): its checkpoints (what
    the formats detect as training state: DCP and Lightning folders, Trainer checkpoints, ``.ckpt`` and ``.pt``
    files with optimizer state; not exported weights) and its scalar logs (TensorBoard event files, Lightning
    CSVLogger metrics.csv)."""
    found: list[Path] = []
    logs: list[Path] = []
    stack = [(Path(run_dir), 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for e in entries:
            p = Path(e.path)
            if e.is_dir(follow_symlinks=False):
                if _resumable_folder(p):
                    found.append(p)
                elif depth < SEARCH_DEPTH and e.name not in SKIP_DIRS and not e.name.startswith("."):
                    stack.append((p, depth + 1))
            elif EVENT_MARK in e.name or e.name in SCALAR_LOG_NAMES:
                logs.append(p)
            elif detect_file(e.name) is not None and _resumable_file(p, e.stat(follow_symlinks=False).st_size):
                found.append(p)
    return sorted(found, key=lambda p: (str(p.parent), p.name)), sorted(logs)


def checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Checkpoints in a run folder: ours under checkpoints/step_*, or anywhere a few levels down in a
    folder launched by hand (see :func:`scan`)."""
    return scan(run_dir)[0]


def scalar_logs(run_dir: str | os.PathLike) -> list[Path]:
    """TensorBoard event files and Lightning CSVLogger metrics.csv files in a run folder."""
    return scan(run_dir)[1]


# a Hugging Face model folder (an export, a from_pretrained folder): its config.json is the model's
MODEL_FOLDER_FILES = (*HF_INDEXES, *HF_MODEL_FILES)


def is_run_dir(path: str | os.PathLike) -> bool:
    """A folder the Training panel can follow: one of ours (config.json with status.json, or metrics/), or
    any folder with TensorBoard event files or a Lightning metrics.csv, such as a run launched on a cluster
    by hand. NOTE: config.json alone made every Hugging Face model folder (an export) a run: ``gui FOLDER``
    opened an empty Training tab instead of the checkpoint."""
    p = Path(path)
    listed = _listing(p) if p.is_dir() else None
    if listed is None or detect_folder(p.name, *listed) is not None or any(n in listed[0] for n in MODEL_FOLDER_FILES):
        return False
    ours = (p / "config.json").is_file() and (p / "status.json").is_file()
    return ours or (p / "metrics").is_dir() or bool(scalar_logs(p))
