"""``train --on slurm --dry-run``: the job script for 4 nodes x 8 GPUs, written and printed, nothing submitted,
checked against torchrun's multi-node requirements. No cluster needed (nor any SLURM tool on PATH). And what
``train`` refuses before it launches anything."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from conftest import run_cli

TOOLS = ("sbatch", "scontrol", "scancel", "sinfo", "squeue", "sacct", "srun")


def fake_slurm(folder: Path) -> tuple[dict[str, str], Path]:
    """An environment whose SLURM tools only record that they were called (and fail)."""
    calls = folder / "calls"
    (folder / "bin").mkdir()
    for tool in TOOLS:
        exe = folder / "bin" / tool
        exe.write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {shlex.quote(str(calls))}\nexit 1\n")
        exe.chmod(0o755)
    return {**os.environ, "PATH": f"{folder / 'bin'}{os.pathsep}{os.environ['PATH']}"}, calls


def dry_run(env: dict[str, str], *args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardscope.app.cli", "train", "--on", "slurm", "--dry-run",
                           *map(str, args)], capture_output=True, text=True, env=env, timeout=120)


def test_dry_run_for_4_nodes_of_8_gpus_meets_torchrun_multi_node_requirements(tmp_path):
    env, calls = fake_slurm(tmp_path)
    run = tmp_path / "big"
    proc = dry_run(env, "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu", "--time", "1-00:00:00",
                   "--sbatch-arg=--exclusive", "--run-dir", run)
    assert proc.returncode == 0, proc.stderr
    text = (run / "job.sbatch").read_text()
    assert proc.stdout == text  # printed as written: `... --dry-run > job.sh` keeps it
    assert "nothing was submitted" in proc.stderr and str(run / "job.sbatch") in proc.stderr
    assert not calls.exists(), calls.read_text()  # no sbatch, no scontrol: nothing asked of any scheduler
    assert not (run / "status.json").exists() and not (run / "config.json").exists()  # not a run (yet)
    assert os.access(run / "job.sbatch", os.X_OK)
    head = dict(re.findall(r"^#SBATCH --([\w-]+)=?(\S*)", text, re.M))
    assert head["nodes"] == "4" and head["ntasks-per-node"] == "1" and head["gpus-per-node"] == "8"
    assert head["partition"] == "gpu" and head["time"] == "1-00:00:00" and "exclusive" in head
    assert head["output"] == str(run / "logs" / "launcher.log") and (run / "logs").is_dir()  # sbatch can open it
    # one torchrun per node (one srun task per node), the same command on every node
    launch = text[text.index("srun "):text.index("code=$?")].replace("\\\n", " ")
    words = shlex.split(launch)
    assert words[:3] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert text.count("torch.distributed.run") == 1
    torchrun = words[words.index("torch.distributed.run") + 1:words.index("shardscope.backend.runs.worker_entry")]
    opts = dict(w[2:].split("=", 1) for w in torchrun if w.startswith("--") and "=" in w)
    assert opts["nnodes"] == "$SLURM_NNODES" and opts["nproc-per-node"] == "8"
    assert opts["rdzv-backend"] == "c10d"
    assert opts["rdzv-id"] == "$SLURM_JOB_ID"  # unique per job, the same on every node
    assert opts["rdzv-endpoint"] == "$head_node:$rdzv_port"  # hosted on the job's first node
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in text
    assert "--standalone" not in torchrun
    # the script runs: bash reads it, and the endpoint is the first of the job's nodes
    shell = text.replace('$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)', "gpu-node-001")
    probe = shell[:shell.index("srun ")] + 'echo "$head_node:$rdzv_port"\n'
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=60,
                         env={**env, "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "gpu-node-[001-004]"})
    assert out.stdout.strip().splitlines()[-1] == f"gpu-node-001:{29500 + 123456 % 10000}", out.stderr
    # the folder still takes the real launch (the dry run left only its script and empty folders)
    again = dry_run(env, "--nodes", "2", "--run-dir", run)
    assert again.returncode == 0 and "#SBATCH --nodes=2" in again.stdout


def test_dry_run_needs_slurm_and_a_folder_that_holds_no_run(tmp_path):
    env, calls = fake_slurm(tmp_path)
    local = subprocess.run([sys.executable, "-m", "shardscope.app.cli", "train", "--dry-run", "--run-dir",
                            tmp_path / "x"], capture_output=True, text=True, env=env, timeout=120)
    assert local.returncode == 2 and "needs --on slurm" in local.stderr
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    proc = dry_run(env, "--run-dir", busy)
    assert proc.returncode == 2 and "not empty" in proc.stderr and not (busy / "job.sbatch").exists()
    assert not calls.exists()


def test_a_device_that_is_not_here_is_refused_before_launch(tmp_path):
    """`train --device cuda` without CUDA started torchrun and failed in init_process_group with NCCL's
    traceback; a device the machine lacks (or fewer CUDA devices than processes) is a bad option: exit 2."""
    import torch

    nproc = torch.cuda.device_count() + 1 if torch.cuda.is_available() else 1
    run_dir = tmp_path / "run"
    proc = run_cli("train", "--device", "cuda", "--nproc", nproc, "--steps", 1, "--run-dir", run_dir, timeout=600)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "device cuda: " in proc.stderr
    assert not run_dir.exists() and "run directory" not in proc.stdout


def test_script_authors_are_told_where_the_run_folder_and_checkpoints_are(qtbot):
    """The launcher sets $SHARDSCOPE_RUN_DIR and Training, Resume and the Library look for checkpoints under
    $SHARDSCOPE_RUN_DIR/checkpoints/step_NNNNNN: `train --help` and the Training panel's Script field say so."""
    from shardscope.widgets.run_form import RunForm

    proc = run_cli("train", "--help")
    assert proc.returncode == 0
    helped = " ".join(proc.stdout.split())
    assert "$SHARDSCOPE_RUN_DIR (the run folder)" in helped and "$SHARDSCOPE_RUN_DIR/checkpoints/step_NNNNNN" in helped
    form = RunForm()
    qtbot.addWidget(form)
    assert "$SHARDSCOPE_RUN_DIR/checkpoints/step_NNNNNN" in form.script.toolTip()
