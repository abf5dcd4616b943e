"""Training runs: real torchrun subprocesses on CPU (gloo)."""

from __future__ import annotations

import json
import textwrap
import time

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_cli
from shardscope.backend.checkpoint import open_checkpoint
from shardscope.backend.checkpoint.values import ChunkReader
from shardscope.backend.runs.launcher import RunConfig, RunLauncher, checkpoints, read_metrics, read_status
from torch.distributed.checkpoint import FileSystemReader

SMALL = {"width": 32, "depth": 2, "heads": 2, "seq_len": 32, "batch_size": 4}


def losses(run_dir, rank=0):
    return [r["loss"] for r in read_metrics(run_dir)[rank]]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "fsdp"
    cfg = RunConfig(strategy="fsdp", nproc=2, steps=40, checkpoint_every=20, model=dict(SMALL, lr=1e-2))
    launcher = RunLauncher(run_dir, cfg).start()
    assert launcher.wait(300) == 0, (run_dir / "logs" / "launcher.log").read_text()
    return run_dir


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_run_writes_metrics_and_learns(strategy, fsdp_run, tmp_path):
    if strategy == "fsdp":
        run_dir = fsdp_run
    else:
        run_dir = tmp_path / "ddp"
        cfg = RunConfig(strategy="ddp", nproc=2, steps=40, checkpoint_every=20, model=dict(SMALL, lr=1e-2))
        assert RunLauncher(run_dir, cfg).start().wait(300) == 0
    metrics = read_metrics(run_dir)
    assert sorted(metrics) == [0, 1]
    for rank, recs in metrics.items():
        assert [r["step"] for r in recs] == list(range(1, 41))
        assert all(r["rank"] == rank and r["rss"] > 0 for r in recs)
    loss = losses(run_dir)
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.3
    status = read_status(run_dir)
    assert status["state"] == "finished" and status["exit_codes"] == {"0": 0, "1": 0}
    cks = checkpoints(run_dir)
    assert [c.name for c in cks] == ["step_000020", "step_000040"]
    md = FileSystemReader(str(cks[-1])).read_metadata()
    keys = set(md.state_dict_metadata)
    assert "model.tok.weight" in keys and "optimizer.state.tok.weight.exp_avg" in keys and "step" in keys
    assert json.loads((run_dir / "config.json").read_text())["strategy"] == strategy


@pytest.mark.parametrize("world", [1, 3])
def test_resume_at_another_world_size(fsdp_run, tmp_path, world):
    ck20 = checkpoints(fsdp_run)[0]
    run_dir = tmp_path / f"resume{world}"
    cfg = RunConfig(strategy="fsdp", nproc=world, steps=21, checkpoint_every=21, resume=str(ck20),
                    model=dict(SMALL, lr=1e-2))
    launcher = RunLauncher(run_dir, cfg).start()
    assert launcher.wait(300) == 0, (run_dir / "logs" / "rank_0.log").read_text()
    steps = [r["step"] for r in read_metrics(run_dir)[0]]
    assert steps == [21]  # step numbers continue from the checkpoint
    # the weights it resumed from are the saved ones: the resharded save at step 21 differs
    # from step 20 only by one optimizer step; load the step-20 weights through DCP at this world size
    a = open_checkpoint(ck20)
    b = open_checkpoint(checkpoints(run_dir)[-1])
    assert {t.fqn for t in a.tensors} == {t.fqn for t in b.tensors}
    assert b.ranks == list(range(world))
    straight = open_checkpoint(checkpoints(fsdp_run)[-1])  # the straight run's later checkpoint
    with ChunkReader(a) as ra, ChunkReader(b) as rb:
        w20 = ra.read_tensor(a.tensor("model.tok.weight"))
        w21 = rb.read_tensor(b.tensor("model.tok.weight"))
    assert not torch.equal(w20, w21) and torch.allclose(w20, w21, atol=0.05)
    assert straight.tensor("model.tok.weight").shape == w21.shape


def test_stop_leaves_no_process(tmp_path):
    cfg = RunConfig(strategy="ddp", nproc=2, steps=100000, checkpoint_every=0, model=SMALL)
    launcher = RunLauncher(tmp_path / "stop", cfg).start()
    deadline = time.monotonic() + 120
    while not (tmp_path / "stop" / "metrics" / "rank_1.jsonl").exists():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    children = psutil.Process(launcher.proc.pid).children(recursive=True)
    family = [*children, psutil.Process(launcher.proc.pid)]
    try:
        workers = [p for p in children if "worker_entry" in " ".join(p.cmdline())]
        assert len(workers) == 2
    except BaseException:
        launcher.stop(grace=2)
        raise
    t0 = time.monotonic()
    launcher.stop(grace=5)
    assert time.monotonic() - t0 < 10
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert read_status(tmp_path / "stop")["state"] == "stopped"


def test_failing_rank_marks_run_failed_with_traceback(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        import torch.distributed as dist
        from shardscope import report
        dist.init_process_group("gloo")
        report(step=1, loss=1.0)
        if dist.get_rank() == 1:
            raise RuntimeError("boom on rank one " + sys.argv[1])
        time.sleep(2)
    """))
    proc = run_cli("train", "--script", script, "--nproc", "2", "--run-dir", tmp_path / "run", "--", "xyz")
    assert proc.returncode == 1
    assert "rank 1 failed" in proc.stdout and "RuntimeError: boom on rank one xyz" in proc.stdout
    status = read_status(tmp_path / "run")
    assert status["state"] == "failed" and 1 in status["failed_ranks"]
    assert (tmp_path / "run" / "metrics" / "rank_0.jsonl").exists()


def test_report_is_a_noop_outside_a_run(monkeypatch, tmp_path):
    from shardscope import report

    monkeypatch.delenv("SHARDSCOPE_RUN_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert report(step=1, loss=2.0) is False
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("SHARDSCOPE_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    assert report(step=1, loss=torch.tensor(2.5)) is True
    rec = json.loads((tmp_path / "metrics" / "rank_3.jsonl").read_text())
    assert rec["loss"] == 2.5 and rec["rank"] == 3 and rec["rss"] > 0


def test_checkpoints_load_with_torch(fsdp_run):
    from shardscope.backend.runs.trainer import TinyLM

    model = TinyLM(96, 32, 2, 2, 32)
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(checkpoints(fsdp_run)[-1]))
    model.load_state_dict(sd["model"])
