"""Runs on a real one-node SLURM cluster (munged, slurmctld, slurmd started by the session fixture),
and the multi-node job script checked on paper against torchrun's multi-node requirements."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed.checkpoint as dcp
from conftest import run_cli, wait_for
from shardscope.backend.runs import slurm
from shardscope.backend.runs.launcher import RunConfig, RunLauncher, run_status
from shardscope.backend.runs.metric_logs import read_rank_metrics
from shardscope.backend.runs.rundir import checkpoints, log_tail, read_config, read_status
from slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

SMALL = {"width": 32, "depth": 1, "heads": 2, "seq_len": 16, "batch_size": 2}
DEADLINE = 240.0


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A real SLURM cluster for the session. Failing to start it fails the tests (never a skip)."""
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    old = os.environ.get("SLURM_CONF")
    try:
        c.start()
        os.environ["SLURM_CONF"] = str(c.conf)
        yield c
    finally:
        c.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def run_processes(run_dir: Path) -> list[psutil.Process]:
    """Every process that belongs to the run: its run directory in the environment or command line."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(run_dir) in " ".join(p.info["cmdline"] or []) or \
                    p.environ().get("SHARDSCOPE_RUN_DIR") == str(run_dir):
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def slurm_config(**kw) -> RunConfig:
    base = {"strategy": "ddp", "nproc": 2, "steps": 6, "checkpoint_every": 3, "device": "cpu", "model": SMALL,
            "on": "slurm", "slurm": slurm.SlurmOptions()}
    return RunConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def finished_run(cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("slurm-runs") / "ddp"
    try:
        proc = run_cli("train", "--on", "slurm", "--strategy", "ddp", "--nproc", "2", "--steps", "6",
                       "--checkpoint-every", "3", "--device", "cpu", "--width", "32", "--depth", "1", "--heads", "2",
                       "--seq-len", "16", "--batch-size", "2", "--run-dir", run_dir, "--time", "10:00")
    except subprocess.TimeoutExpired:  # a hung rank: have every worker print its stacks into its log first
        for p in run_processes(run_dir):
            if "worker_entry" in " ".join(p.cmdline()) and "torch.distributed.run" not in " ".join(p.cmdline()):
                p.send_signal(signal.SIGUSR1)
        time.sleep(3)
        raise AssertionError(f"the job did not end: {run_status(run_dir)}\n{log_tail(run_dir, 0, 80)}\n"
                             f"{log_tail(run_dir, 1, 80)}") from None
    assert proc.returncode == 0, proc.stdout + proc.stderr + log_tail(run_dir, -1, 60) + cluster.logs()[-3000:]
    return run_dir


def test_partitions_from_sinfo(cluster):
    parts = slurm.partitions()
    assert [p.name for p in parts] == ["debug"] and parts[0].default and parts[0].available


def test_two_process_job_finishes_with_metrics_and_checkpoints(finished_run):
    status = read_status(finished_run)
    assert status["state"] == "finished" and status["scheduler"] == "slurm"
    assert status["job_id"].isdigit() and status["slurm_state"] == "COMPLETED"
    metrics = read_rank_metrics(finished_run)
    assert sorted(metrics) == [0, 1]
    assert [r["step"] for r in metrics[1]] == list(range(1, 7))
    assert [c.name for c in checkpoints(finished_run)] == ["step_000003", "step_000006"]
    from shardscope.backend.runs.trainer import TinyLM

    model = TinyLM(96, 32, 1, 2, 16)
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(checkpoints(finished_run)[-1]))
    model.load_state_dict(sd["model"])
    script = (finished_run / "job.sbatch").read_text()
    assert "#SBATCH --time=10:00" in script and "srun --ntasks-per-node=1" in script
    cfg = read_config(finished_run)
    assert cfg["on"] == "slurm" and cfg["command"] == ["sbatch", str(finished_run / "job.sbatch")]
    assert (finished_run / "logs" / "rank_1.log").exists()
    assert f"job {status['job_id']}" in (finished_run / "logs" / "launcher.log").read_text()


def test_resume_from_a_checkpoint_on_slurm(finished_run):
    ck = checkpoints(finished_run)[0]
    status = RunLauncher(finished_run, slurm_config(steps=8, resume=str(ck))).start().wait(DEADLINE)
    assert status["state"] == "finished", log_tail(finished_run, 0) + log_tail(finished_run, -1)
    steps = [r["step"] for r in read_rank_metrics(finished_run)[0]]
    assert steps == [*range(1, 7), *range(4, 9)]
    assert len(read_config(finished_run)["history"]) == 1
    assert checkpoints(finished_run)[-1].name == "step_000008"


def test_scancel_mid_run_reads_stopped_and_leaves_no_process(cluster, tmp_path):
    run_dir = tmp_path / "long"
    launcher = RunLauncher(run_dir, slurm_config(steps=100000, checkpoint_every=0)).start()
    assert read_status(run_dir)["job_id"]
    wait_for(lambda: (run_dir / "metrics" / "rank_1.jsonl").exists(), "rank 1's first step")
    assert run_status(run_dir)["state"] == "running"
    cmds = [" ".join(p.cmdline()) for p in run_processes(run_dir)]
    workers = [c for c in cmds if "worker_entry" in c and "torch.distributed.run" not in c and "srun" not in c]
    assert len(workers) == 2, cmds
    status = launcher.stop()
    assert status["state"] == "stopped" and status["slurm_state"] == "CANCELLED"
    assert "scancel" in status["explanation"]
    wait_for(lambda: not run_processes(run_dir), "every process of the run to end", 60)


def test_failing_rank_reads_failed_with_its_traceback(cluster, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import time
        import torch.distributed as dist
        from shardscope import report
        dist.init_process_group("gloo")
        report(step=1, loss=1.0)
        if dist.get_rank() == 1:
            raise RuntimeError("boom on rank one under slurm")
        time.sleep(1)
    """))
    run_dir = tmp_path / "fails"
    status = RunLauncher(run_dir, slurm_config(script=str(script))).start().wait(DEADLINE)
    assert status["state"] == "failed" and status["failed_ranks"] == [1], status
    assert status["slurm_state"] == "FAILED"
    assert "RuntimeError: boom on rank one under slurm" in log_tail(run_dir, 1)
    assert read_config(run_dir)["kind"] == "script" and "steps" not in read_config(run_dir)


def test_job_asking_for_more_cpus_than_exist_is_queued_with_its_reason(cluster, tmp_path, qtbot, monkeypatch):
    """``train --on slurm --detach`` returns at once; while the job waits, the scheduler's pending reason is
    written to status.json with nobody watching; the window says why it waits; ``stop`` cancels it."""
    from shardscope.widgets.training_panel import TrainingPanel

    monkeypatch.setenv("SHARDSCOPE_PENDING_POLL", "0.5")
    run_dir = tmp_path / "big"
    proc = run_cli("train", "--on", "slurm", "--detach", "--strategy", "ddp", "--nproc", "2", "--steps", "6",
                   "--device", "cpu", "--width", "32", "--depth", "1", "--heads", "2", "--seq-len", "16",
                   "--batch-size", "2", "--cpus-per-task", str(cluster.cpus * 32), "--run-dir", run_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = read_status(run_dir)["job_id"]
    assert f"run directory: {run_dir}" in proc.stdout and f"as SLURM job {job}" in proc.stdout
    # read straight from the file, with no reader asking the scheduler: the run's pending watcher wrote it
    status = wait_for(lambda: (s := read_status(run_dir))["state"] == "queued" and s.get("reason") not in
                      (None, "", "None") and s, "a pending reason in status.json")
    assert status["reason"] in ("PartitionConfig", "Resources", "ReqNodeNotAvail"), status
    assert status["explanation"].startswith(status["reason"] + ":") and status["slurm_state"] == "PENDING"
    listed = {r["name"]: r for r in json.loads(run_cli("runs", tmp_path, "--json").stdout)["runs"]}["big"]
    assert listed["reason"] == status["reason"] and listed["job_id"] == job and listed["where"] == "slurm"
    panel = TrainingPanel(runs_root=tmp_path)  # the window says why it waits
    qtbot.addWidget(panel)
    try:
        panel.follow(str(run_dir))
        qtbot.waitUntil(lambda: f"waiting: {status['reason']}:" in panel.status.text(), timeout=30000)
        qtbot.waitUntil(lambda: panel.run_state(str(run_dir)) == "queued", timeout=30000)
        assert panel.stop_button.isEnabled()
    finally:
        panel.shutdown()
        from PySide6.QtCore import QThreadPool

        assert QThreadPool.globalInstance().waitForDone(60000)
    stop = run_cli("stop", run_dir)
    assert stop.returncode == 0 and "run stopped" in stop.stdout, stop.stdout + stop.stderr
    assert read_status(run_dir)["state"] == "stopped"
    wait_for(lambda: not run_processes(run_dir), "the pending watcher to end", 60)


def _sbatch_lines(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=?(\S*)", text, re.M))


def test_multi_node_script_meets_torchrun_requirements(tmp_path):
    """4 nodes x 8 GPUs, on paper: what torchrun's multi-node docs require of every node's command."""
    cfg = slurm_config(nproc=2, slurm=slurm.SlurmOptions(nodes=4, gpus_per_node=8, partition="gpu",
                                                          time="1-00:00:00", account="ml",
                                                          sbatch_args=["--mem=0", "--exclusive"]))
    text = slurm.job_script(tmp_path, cfg.slurm, cfg.nproc_per_node, ["-m", "x"], env={"A": "b c"})
    head = _sbatch_lines(text)
    assert head["nodes"] == "4" and head["ntasks-per-node"] == "1" and head["gpus-per-node"] == "8"
    assert head["partition"] == "gpu" and head["time"] == "1-00:00:00" and head["account"] == "ml"
    assert "mem" in head and "exclusive" in head
    launch = text[text.index("srun "):text.index("code=$?")].replace("\\\n", " ")
    words = shlex.split(launch, posix=True)
    assert words[:3] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    run = words[words.index("torch.distributed.run") + 1:]
    opts = dict(w[2:].split("=", 1) for w in run if w.startswith("--") and "=" in w)
    assert opts["nnodes"] == "$SLURM_NNODES" and opts["nproc-per-node"] == "8"
    assert opts["rdzv-backend"] == "c10d" and opts["rdzv-id"] == "$SLURM_JOB_ID"
    assert opts["rdzv-endpoint"] == "$head_node:$rdzv_port"
    assert "--standalone" not in run
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in text
    assert "export A='b c'" in text
    # the same command runs on every node (one srun task per node): same id, same endpoint everywhere
    assert text.count("torch.distributed.run") == 1


def test_window_runs_on_slurm_with_partitions_from_sinfo(cluster, qtbot, tmp_path):
    from PySide6.QtCore import QThreadPool
    from shardscope.widgets.run_form import SLURM
    from shardscope.widgets.training_panel import TrainingPanel

    panel = TrainingPanel(runs_root=tmp_path)
    qtbot.addWidget(panel)
    try:
        form = panel.form
        qtbot.waitUntil(lambda: form.partition.count() == 1, timeout=30000)
        assert form.partition.currentData() == "debug" and form.on.model().item(1).isEnabled()
        form.on.setCurrentText(SLURM)
        assert form.nodes.isVisibleTo(panel) and form.partition.isVisibleTo(panel)
        for w, v in ((form.steps, 4), (form.ckpt_every, 2), (form.width_, 32), (form.depth, 1), (form.heads, 2),
                     (form.batch, 2)):
            w.setValue(v)
        form.strategy.setCurrentText("ddp")
        form.device.setCurrentText("cpu")
        assert panel.start_run()
        qtbot.waitUntil(lambda: bool(panel.launchers), timeout=60000)
        run_dir = next(iter(panel.launchers))
        qtbot.waitUntil(lambda: "SLURM job" in panel.status.text(), timeout=60000)
        qtbot.waitUntil(lambda: panel.run_state(run_dir) == "finished", timeout=DEADLINE * 1000)
        assert read_status(run_dir)["job_id"] and (Path(run_dir) / "job.sbatch").exists()
        assert "#SBATCH --partition=debug" in (Path(run_dir) / "job.sbatch").read_text()
        qtbot.waitUntil(lambda: panel.ckpt_list.count() == 2, timeout=30000)
    finally:
        panel.shutdown()
        assert QThreadPool.globalInstance().waitForDone(60000)


def test_time_limit_ending_is_explained(cluster, tmp_path):
    """A job that outlives --time=1 (one minute) ends as SLURM's TIMEOUT, explained, not a bare failure."""
    script = tmp_path / "forever.py"
    script.write_text("import time\nfrom shardscope import report\nfor s in range(1, 10**9):\n"
                      "    report(step=s, loss=1.0)\n    time.sleep(1)\n")
    run_dir = tmp_path / "timeout"
    opts = slurm.SlurmOptions(time="1")
    status = RunLauncher(run_dir, slurm_config(script=str(script), nproc=1, slurm=opts)).start().wait(DEADLINE)
    assert status["slurm_state"] == "TIMEOUT" and status["state"] == "failed", status
    assert "time limit" in status["explanation"] and "resume" in status["explanation"]
    wait_for(lambda: not run_processes(run_dir), "every process of the run to end", 60)
