"""Runs on SLURM: the job script (RUN/job.sbatch), submission, state from the scheduler, scancel.

We call ``sbatch``/``scontrol``/``sacct``/``scancel``/``sinfo`` directly (not submitit): the job script
stays a plain file a user can read and resubmit by hand with ``sbatch RUN/job.sbatch``, the same
torchrun command as a local run does the work, and the scheduler's own words (states, pending
reasons) reach the user unchanged. submitit would pickle a Python callable into the job instead.

Each node runs one torchrun through ``srun --ntasks-per-node=1``; torchrun's c10d rendezvous is
hosted on the job's first node, with the job id as rendezvous id, as torchrun's multi-node docs ask.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..atomic_file import write_atomic
from ..errors import ShardscopeError
from .rundir import FINAL_STATES, rank_exits, read_json, read_status, status_lock, update_status

TOOL_TIMEOUT = 30.0
RDZV_PORT_BASE = 29500

# SLURM job states -> our run states
QUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED"}
RUNNING = {"CONFIGURING", "RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING"}
STOPPED = {"CANCELLED", "PREEMPTED"}
ENDINGS = {
    "COMPLETED": "the job completed",
    "FAILED": "the job script ended with a non-zero exit code",
    "CANCELLED": "cancelled with scancel (by you, Shardscope or an administrator)",
    "TIMEOUT": "hit its time limit (--time); resume from the last checkpoint with a longer --time",
    "OUT_OF_MEMORY": "a process used more memory than the job was given (--mem/--mem-per-cpu); "
                     "ask for more memory or use a smaller batch",
    "NODE_FAIL": "a node of the job failed; resume from the last checkpoint (SLURM may have drained the node)",
    "PREEMPTED": "preempted by a higher-priority job; resume from the last checkpoint",
    "BOOT_FAIL": "a node failed to boot for the job",
    "DEADLINE": "the job's deadline passed before it could finish",
}
PENDING_REASONS = {
    "Resources": "waiting for resources (CPUs, GPUs, memory or nodes) to become free",
    "Priority": "other jobs with higher priority are ahead in the queue",
    "PartitionConfig": "the request does not fit the partition's nodes or limits (more CPUs, GPUs or memory "
                       "per node than any node has?); it will wait until the partition changes",
    "ReqNodeNotAvail": "a node the job needs is down, drained or reserved",
    "PartitionTimeLimit": "--time is longer than the partition allows",
    "PartitionNodeLimit": "more nodes than the partition allows",
    "Dependency": "waiting for a job it depends on",
    "BeginTime": "its start time has not come yet",
    "JobHeldUser": "held by the user (scontrol release JOBID)",
    "JobHeldAdmin": "held by an administrator",
    "QOSMaxJobsPerUserLimit": "you already run the most jobs your QOS allows",
    "AssocGrpGRES": "your account's GPU limit is reached",
    "InvalidAccount": "the account (--account) is not valid for this partition",
}


@dataclass
class SlurmOptions:
    """What ``train --on slurm`` asks the scheduler for."""

    nodes: int = 1
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None  # default: one CPU per process
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    sbatch_args: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class JobState:
    """What the scheduler says about a job. ``slurm_state`` is SLURM's word (PENDING, TIMEOUT, ...)."""

    slurm_state: str
    reason: str = ""
    exit_code: int | None = None
    signal: int | None = None
    nodes: str = ""


def available() -> bool:
    """True when the SLURM client programs are on PATH."""
    return all(shutil.which(t) for t in ("sbatch", "scontrol", "scancel", "sinfo"))


def _tool(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=TOOL_TIMEOUT, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise ShardscopeError(f"{args[0]}: not found on PATH (is this a SLURM login node?)") from None
    except subprocess.TimeoutExpired:
        raise ShardscopeError(f"{args[0]}: no answer from the SLURM controller in {TOOL_TIMEOUT:.0f} s") from None
    if check and proc.returncode != 0:
        msg = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        last = msg[-1].removeprefix(f"{args[0]}: ") if msg else f"exit code {proc.returncode}"
        raise ShardscopeError(f"{args[0]}: {last}")
    return proc


@dataclass(frozen=True)
class Partition:
    """One SLURM partition as ``sinfo`` reports it: up or not, node count, CPUs and GPUs (gres)."""

    name: str
    default: bool
    available: bool
    nodes: int
    cpus: str
    gres: str


def partitions() -> list[Partition]:
    """The cluster's partitions from ``sinfo`` (default first). Raises ShardscopeError without SLURM."""
    out = _tool(["sinfo", "-h", "-o", "%P|%a|%D|%c|%G"]).stdout
    parts: dict[str, Partition] = {}
    for line in out.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5:
            continue
        name, avail, nodes, cpus, gres = fields
        default = name.endswith("*")
        name = name.rstrip("*")
        prev = parts.get(name)
        count = int(nodes) if nodes.isdigit() else 0
        parts[name] = Partition(name, default, avail == "up", count + (prev.nodes if prev else 0), cpus,
                                gres if gres != "(null)" else "")
    return sorted(parts.values(), key=lambda p: (not p.default, p.name))


def job_script(run_dir: Path, opts: SlurmOptions, nproc_per_node: int, worker_args: list[str],
               env: dict[str, str], python: str | None = None) -> str:
    """The text of RUN/job.sbatch: one torchrun per node through srun, c10d rendezvous on the first node."""
    run_dir = Path(run_dir)
    q = shlex.quote
    head = ["#!/bin/bash",
            f"# Shardscope run {run_dir.name}: one torchrun per node, {nproc_per_node} process(es) per node.",
            f"# Resubmit by hand with: sbatch {q(str(run_dir / 'job.sbatch'))}",
            f"#SBATCH --job-name=shardscope-{run_dir.name}",
            f"#SBATCH --nodes={opts.nodes}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --cpus-per-task={opts.cpus_per_task or nproc_per_node}",
            f"#SBATCH --chdir={run_dir}",
            f"#SBATCH --output={run_dir / 'logs' / 'launcher.log'}",
            "#SBATCH --open-mode=append"]
    if opts.gpus_per_node:
        head.append(f"#SBATCH --gpus-per-node={opts.gpus_per_node}")
    for flag, value in (("partition", opts.partition), ("time", opts.time), ("account", opts.account)):
        if value:
            head.append(f"#SBATCH --{flag}={value}")
    head += [f"#SBATCH {arg}" for arg in opts.sbatch_args]
    torchrun = [q(python or sys.executable), "-m", "torch.distributed.run",
                '--nnodes="$SLURM_NNODES"', f"--nproc-per-node={nproc_per_node}",
                '--rdzv-id="$SLURM_JOB_ID"', "--rdzv-backend=c10d", '--rdzv-endpoint="$head_node:$rdzv_port"',
                *(q(a) for a in worker_args)]
    body = [
        "",
        "set -uo pipefail",
        *(f"export {k}={q(v)}" for k, v in env.items()),
        "# torchrun's c10d rendezvous is hosted on the job's first node; every node uses the same id and endpoint",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        f"rdzv_port=$(( {RDZV_PORT_BASE} + SLURM_JOB_ID % 10000 ))",
        'echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST; rendezvous at $head_node:$rdzv_port"',
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        "  " + " \\\n    ".join(torchrun),
        "code=$?",
        "# the job's own ending, for when the scheduler has forgotten the job (no accounting database)",
        'printf \'{"job_id": "%s", "code": %d, "time": %s}\\n\' "$SLURM_JOB_ID" "$code" "$(date +%s)" '
        f"> {q(str(run_dir / 'exit' / 'job.json'))}",
        'exit "$code"',
        ""]
    return "\n".join(head + body)


def submit(script: Path) -> str:
    """``sbatch --parsable SCRIPT``; returns the job id."""
    out = _tool(["sbatch", "--parsable", str(script)]).stdout.strip()
    job_id = out.split(";")[0]
    if not job_id.isdigit():
        raise ShardscopeError(f"sbatch: unexpected answer {out!r} for {script}")
    return job_id


def _exit_code(text: str) -> tuple[int | None, int | None]:
    m = re.match(r"(\d+):(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def query(job_id: str) -> JobState | None:
    """The job's state from ``scontrol show job`` (pending, running, and ended jobs the controller still
    remembers), else from ``sacct`` (with an accounting database); None when neither knows it."""
    proc = _tool(["scontrol", "show", "job", "-o", str(job_id)], check=False)
    if proc.returncode == 0 and "JobState=" in proc.stdout:
        kv = dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
        code, sig = _exit_code(kv.get("ExitCode", ""))
        return JobState(kv.get("JobState", "UNKNOWN"), kv.get("Reason", ""), code, sig, kv.get("NodeList", ""))
    if shutil.which("sacct"):
        proc = _tool(["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "State,ExitCode,Reason,NodeList"],
                     check=False)
        line = proc.stdout.strip().splitlines()[:1] if proc.returncode == 0 else []
        if line and line[0].count("|") >= 3:
            state, exit_code, reason, nodes = line[0].split("|")[:4]
            code, sig = _exit_code(exit_code)
            return JobState(state.split()[0], reason, code, sig, nodes)
    return None


def explain_pending(reason: str) -> str:
    """SLURM's pending reason, and what it means."""
    if not reason or reason == "None":
        return "waiting to be scheduled"
    return f"{reason}: {PENDING_REASONS[reason]}" if reason in PENDING_REASONS else reason


def refresh(run_dir: Path, status: dict[str, Any]) -> dict[str, Any]:
    """The run's state from the scheduler; a final state is written to status.json (the controller
    forgets ended jobs after a few minutes when there is no accounting database)."""
    job_id = status.get("job_id")
    if not job_id or status.get("state") in FINAL_STATES:
        return status
    job = query(job_id)
    if job is None:
        return _ended_unknown(run_dir, status)
    if job.slurm_state in QUEUED:  # the pending reason goes to status.json, for whoever reads it next
        return _record(run_dir, status, "queued", slurm_state=job.slurm_state, reason=job.reason,
                       explanation=explain_pending(job.reason))
    if job.slurm_state in RUNNING:
        return _record(run_dir, status, "running", nodes=job.nodes, slurm_state=job.slurm_state, reason=None,
                       explanation="")
    return _ended(run_dir, status, job)


def _record(run_dir: Path, status: dict[str, Any], state: str, **changes: Any) -> dict[str, Any]:
    """Write what the scheduler says of a job that has not ended, when it differs from status.json. NOTE:
    decided on a fresh read under the status lock: a stale read must not write "queued" over a final state
    that ``stop`` (or another follower) recorded meanwhile."""
    if status.get("state") == state and all(status.get(k) == v for k, v in changes.items()):
        return status
    with status_lock(run_dir):
        status = read_status(run_dir)
        if status.get("state") in FINAL_STATES:
            return status
        return update_status(run_dir, state, **changes)


def _ended(run_dir: Path, status: dict[str, Any], job: JobState) -> dict[str, Any]:
    exits = rank_exits(run_dir)
    failed = sorted(r for r, e in exits.items() if e.get("code"))
    slurm_state = job.slurm_state
    if slurm_state == "CANCELLED" and status.get("stop_requested"):
        state, why = "stopped", "stopped from Shardscope (scancel)"
    elif slurm_state in STOPPED:
        state, why = "stopped", ENDINGS[slurm_state]
    elif slurm_state == "COMPLETED" and not failed:
        state, why = "finished", ENDINGS["COMPLETED"]
    else:
        state = "failed"
        why = ENDINGS.get(slurm_state, slurm_state.lower())
        if failed:
            why = f"rank(s) {', '.join(map(str, failed))} failed; {why}"
    return update_status(run_dir, state, slurm_state=slurm_state, exit_code=job.exit_code, explanation=why,
                         failed_ranks=failed, exit_codes={str(r): e.get("code") for r, e in exits.items()},
                         end_time=time.time())


def _ended_unknown(run_dir: Path, status: dict[str, Any]) -> dict[str, Any]:
    """The controller no longer knows the job and there is no accounting: the job's own record and the
    ranks' exit records decide."""
    job = read_json(Path(run_dir) / "exit" / "job.json")
    if isinstance(job.get("code"), int):
        return _ended(run_dir, status, JobState("COMPLETED" if job["code"] == 0 else "FAILED", "", job["code"]))
    if time.time() - float(status.get("submit_time", 0)) < 60:
        return status  # just submitted: the controller may not list it yet
    return update_status(run_dir, "failed", slurm_state="UNKNOWN", failed_ranks=[], end_time=time.time(),
                         explanation="the scheduler no longer knows the job and it recorded no ending "
                                     "(cancelled, timed out or its node failed?)")


def cancel(run_dir: Path, timeout: float = 120.0) -> dict[str, Any]:
    """``scancel`` the run's job and wait until the scheduler says it ended; returns the final status."""
    status = read_status(run_dir)
    job_id = status.get("job_id")
    if not job_id:
        raise ShardscopeError(f"{run_dir}: no SLURM job id in status.json")
    if status.get("state") in FINAL_STATES:
        return status
    update_status(run_dir, stop_requested=time.time())
    _tool(["scancel", str(job_id)])
    deadline = time.monotonic() + timeout
    while True:
        status = refresh(run_dir, read_status(run_dir))
        if status.get("state") in FINAL_STATES:
            return status
        if time.monotonic() > deadline:
            raise ShardscopeError(f"job {job_id}: still {status.get('slurm_state', '?')} {timeout:.0f} s after "
                                  "scancel")
        time.sleep(0.5)


def write_script(run_dir: Path, text: str) -> Path:
    """Write RUN/job.sbatch (executable, so it can also be looked at and run by hand)."""
    path = Path(run_dir) / "job.sbatch"
    write_atomic(path, text, mode=0o755)
    return path
