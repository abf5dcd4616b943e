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
from shardscope.backend.formats import open_checkpoint
from shardscope.backend.runs.launcher import RunConfig, RunLauncher
from shardscope.backend.runs.metric_logs import read_rank_metrics
from shardscope.backend.runs.rundir import checkpoints, read_status
from torch.distributed.checkpoint import FileSystemReader

pytestmark = pytest.mark.slow

SMALL = {"width": 32, "depth": 2, "heads": 2, "seq_len": 32, "batch_size": 4}


def losses(run_dir, rank=0):
    return [r["loss"] for r in read_rank_metrics(run_dir)[rank]]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "fsdp"
    cfg = RunConfig(strategy="fsdp", nproc=2, steps=40, checkpoint_every=20, model=dict(SMALL, lr=1e-2))
    launcher = RunLauncher(run_dir, cfg).start()
    assert launcher.wait(300)["state"] == "finished", (run_dir / "logs" / "launcher.log").read_text()
    return run_dir


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_run_writes_metrics_and_learns(strategy, fsdp_run, tmp_path):
    if strategy == "fsdp":
        run_dir = fsdp_run
    else:
        run_dir = tmp_path / "ddp"
        cfg = RunConfig(strategy="ddp", nproc=2, steps=40, checkpoint_every=20, model=dict(SMALL, lr=1e-2))
        assert RunLauncher(run_dir, cfg).start().wait(300)["state"] == "finished"
    metrics = read_rank_metrics(run_dir)
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
    recorded = json.loads((run_dir / "config.json").read_text())
    assert recorded["strategy"] == strategy
    # what was launched: the user's settings merged over the trainer's own defaults, every field named
    assert recorded["model"]["width"] == SMALL["width"] and set(recorded["model"]) >= {"vocab", "lr", "seed"}


@pytest.mark.parametrize("world", [1, 3])
def test_resume_at_another_world_size(fsdp_run, tmp_path, world):
    """Resume a 2-rank checkpoint at 1 and 3 ranks: the first resumed step sees exactly the weights
    that were saved. The trainer's global batch for a step does not depend on the world size, so the
    loss at step 21 must equal the straight run's (up to summation order)."""
    ck20 = checkpoints(fsdp_run)[0]
    run_dir = tmp_path / f"resume{world}"
    cfg = RunConfig(strategy="fsdp", nproc=world, steps=21, checkpoint_every=21, resume=str(ck20),
                    model=dict(SMALL, lr=1e-2))
    launcher = RunLauncher(run_dir, cfg).start()
    assert launcher.wait(300)["state"] == "finished", (run_dir / "logs" / "rank_0.log").read_text()
    ranks = "1 rank" if world == 1 else f"{world} ranks"
    assert launcher.note.startswith(f"resuming step 20 of a 2-rank run on {ranks} (")  # said, and recorded
    assert read_status(run_dir)["resumed"] == launcher.note
    resumed = read_rank_metrics(run_dir)
    assert [r["step"] for r in resumed[0]] == [21]  # step numbers continue from the checkpoint
    straight = read_rank_metrics(fsdp_run)
    global_batch = 2 * SMALL["batch_size"]
    per = -(-global_batch // world)
    sizes = [max(0, min(per, global_batch - r * per)) for r in range(world)]
    resumed_loss = sum(resumed[r][0]["loss"] * sizes[r] for r in range(world)) / global_batch
    straight_loss = sum(straight[r][20]["loss"] for r in range(2)) / 2
    assert straight[0][20]["step"] == 21
    assert resumed_loss == pytest.approx(straight_loss, rel=1e-5, abs=1e-6)
    b = open_checkpoint(checkpoints(run_dir)[-1])
    assert b.ranks == list(range(world))
    assert {t.fqn for t in b.tensors} == {t.fqn for t in open_checkpoint(ck20).tensors}


def test_runs_are_deterministic(fsdp_run, tmp_path):
    cfg = RunConfig(strategy="fsdp", nproc=2, steps=8, checkpoint_every=0, model=dict(SMALL, lr=1e-2))
    assert RunLauncher(tmp_path / "again", cfg).start().wait(300)["state"] == "finished"
    again = [r["loss"] for r in read_rank_metrics(tmp_path / "again")[0]]
    assert again == [r["loss"] for r in read_rank_metrics(fsdp_run)[0][:8]]


def test_stop_leaves_no_process(tmp_path):
    cfg = RunConfig(strategy="ddp", nproc=2, steps=100000, checkpoint_every=0, model=SMALL)
    launcher = RunLauncher(tmp_path / "stop", cfg).start()
    deadline = time.monotonic() + 120
    while not (tmp_path / "stop" / "metrics" / "rank_1.jsonl").exists():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    children = psutil.Process(launcher.proc.pid).children(recursive=True)  # the supervisor's: torchrun, ranks
    family = [*children, psutil.Process(launcher.proc.pid)]
    try:
        cmds = [" ".join(p.cmdline()) for p in children]
        assert len([c for c in cmds if "worker_entry" in c and "torch.distributed.run" not in c]) == 2, cmds
    except BaseException:
        launcher.stop(grace=2)
        raise
    t0 = time.monotonic()
    launcher.stop(grace=5)
    assert time.monotonic() - t0 < 10
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    status = read_status(tmp_path / "stop")
    assert status["state"] == "stopped" and status["exit_code"] is not None and status["exit_code"] != 0, status


def test_stop_after_every_rank_finished_reads_finished(tmp_path):
    """Stop clicked while torchrun tears down after the last step: the run finished, it was not stopped."""
    from shardscope.backend.runs.launcher import stop_run
    from shardscope.backend.runs.supervisor import STOP_NOTE

    cfg = RunConfig(strategy="ddp", nproc=2, steps=2, checkpoint_every=0, model=SMALL)
    launcher = RunLauncher(tmp_path / "late", cfg).start()
    deadline = time.monotonic() + 180
    while len(list((tmp_path / "late" / "exit").glob("rank_*.json"))) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    final = stop_run(tmp_path / "late", grace=5)
    launcher.proc.wait(60)
    assert final["state"] == "finished", final
    assert read_status(tmp_path / "late")["state"] == "finished"
    assert STOP_NOTE.strip() not in (tmp_path / "late" / "logs" / "launcher.log").read_text()


def test_a_run_finishes_and_settles_after_its_launcher_is_killed(tmp_path):
    """The window's launch (RunLauncher.start) from a process killed with SIGKILL at once, as a window that
    crashed or was closed: the run trains on under its supervisor and status.json settles to finished, with
    every rank's exit code, with nobody watching (it read "running" until a window looked again)."""
    import subprocess
    import sys

    run = tmp_path / "orphan"
    script = ("import os, signal, sys\n"
              "from shardscope.backend.runs.launcher import RunConfig, RunLauncher\n"
              f"cfg = RunConfig(strategy='ddp', nproc=2, steps=6, checkpoint_every=3, model={SMALL!r})\n"
              "RunLauncher(sys.argv[1], cfg).start()\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(run)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    status = read_status(run)
    assert status["state"] in ("starting", "running") and status["supervisor_pid"]
    deadline = time.monotonic() + 240
    while read_status(run).get("state") not in ("finished", "failed", "stopped"):
        assert time.monotonic() < deadline, read_status(run)
        time.sleep(0.5)
    status = read_status(run)
    assert status["state"] == "finished" and status["exit_code"] == 0, status
    assert status["exit_codes"] == {"0": 0, "1": 0}
    assert [c.name for c in checkpoints(run)] == ["step_000003", "step_000006"]
    sup = status["supervisor_pid"]
    deadline = time.monotonic() + 30
    while psutil.pid_exists(sup) and psutil.Process(sup).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the supervisor outlived its run"
        time.sleep(0.2)


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


def test_sigterm_to_train_stops_the_run_like_ctrl_c(tmp_path):
    """A scheduler or `kill` stopping `shardscope train` stops torchrun and every rank; nothing is left."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import time
        import torch.distributed as dist
        from shardscope import report
        dist.init_process_group("gloo")
        for step in range(1, 100000):
            report(step=step, loss=1.0)
            time.sleep(0.2)
    """))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "shardscope.app.cli", "train", "--script", str(script),
                             "--nproc", "2", "--run-dir", str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ})
    deadline = time.monotonic() + 180
    while not all((run_dir / "metrics" / f"rank_{r}.jsonl").exists() for r in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    torchrun = read_status(run_dir)["pid"]
    ranks = [c.pid for c in psutil.Process(torchrun).children(recursive=True)]
    assert ranks
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 1, (out, err)
        assert "Ctrl-C stops the run" in out  # said when it starts, as `follow` says Ctrl-C detaches
        assert "stopping the run (SIGTERM)" in out and "Traceback" not in err
        assert read_status(run_dir)["state"] == "stopped"
        deadline = time.monotonic() + 60
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                  for p in [torchrun, *ranks]):
            assert time.monotonic() < deadline, "torchrun or a rank outlived the stop"
            time.sleep(0.2)
    finally:  # a failing run of this test must not leave the ranks behind
        for p in [torchrun, *ranks]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


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


def test_resume_into_the_same_run_directory(tmp_path):
    run_dir = tmp_path / "same"
    base = ["train", "--strategy", "ddp", "--nproc", "2", "--run-dir", run_dir, "--checkpoint-every", "4",
            "--width", "32", "--depth", "1", "--heads", "2", "--seq-len", "16", "--batch-size", "2"]
    assert run_cli(*base, "--steps", "8").returncode == 0
    again = run_cli(*base, "--steps", "8")
    assert again.returncode == 2 and "already holds a run" in again.stderr
    proc = run_cli(*base, "--steps", "10", "--resume", run_dir / "checkpoints" / "step_000004")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resuming step 4 of a 2-rank run on 2 ranks, as it was saved" in proc.stdout
    steps = [r["step"] for r in read_rank_metrics(run_dir)[0]]
    assert steps == [*range(1, 9), *range(5, 11)]
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["resume"].endswith("step_000004") and len(cfg["history"]) == 1
    assert read_status(run_dir)["state"] == "finished"


def _torchrun_report(tmp_path, failures):
    """A failure report exactly as torchrun prints it (torch's own ChildFailedError): ``failures`` maps a
    rank to its exit code and, for a rank that raised, the second its error file records."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    made = {}
    for rank, (code, stamp) in failures.items():
        error_file = str(tmp_path / f"error_{rank}.json")
        if stamp is not None:
            (tmp_path / f"error_{rank}.json").write_text(json.dumps({"message": {
                "message": "RuntimeError: Connection reset by peer",
                "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  rank      : 7 (local_rank: 7)\n"
                                              "RuntimeError: Connection reset by peer", "timestamp": str(stamp)}}}))
        made[rank] = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file=error_file)
    return ChildFailedError("train.py", made).format_msg()


@pytest.mark.parametrize("killed", [0, 1, 3])
def test_root_cause_is_the_rank_killed_by_a_signal_not_torchruns_first_stamp(tmp_path, killed):
    """torchrun stamps a rank killed by SIGKILL when it notices it, its peers' "Connection reset" with the
    second they raised in: in a tie (seen in CI) or a later poll it names a peer as the first failure."""
    from shardscope.backend.runs.rundir import torchrun_root_cause

    now = int(time.time())
    failures = {r: (1, now - 1) for r in range(4) if r != killed}
    failures[killed] = (-9, None)
    report = _torchrun_report(tmp_path, failures)
    log = tmp_path / "run" / "logs" / "launcher.log"
    log.parent.mkdir(parents=True)
    log.write_text("an earlier launch\n" + _torchrun_report(tmp_path, {2: (1, now)}) + "\nresumed\n" + report + "\n")
    assert f"rank      : {killed} " not in report.split("Root Cause")[1]  # torchrun blames a peer
    assert torchrun_root_cause(tmp_path / "run") == (killed, -9)
    # a rank's watchdog abort is a consequence of a peer's failure, and torchrun's pick stands
    log.write_text(_torchrun_report(tmp_path, {0: (1, now - 1), 1: (-6, None)}))
    assert torchrun_root_cause(tmp_path / "run") == (0, 1)
    # a report cut short, or none, names nobody
    log.write_text(report.split("Root Cause")[0])
    assert torchrun_root_cause(tmp_path / "run") is None


def test_status_updates_from_threads_and_processes_are_never_lost(tmp_path):
    """status.json is changed by the window's poll, a Stop and ``shardscope stop`` in a terminal at once:
    every read-modify-write holds the run's status lock, so no change is written over by another."""
    import subprocess
    import sys
    import threading

    from shardscope.backend.runs.rundir import update_status

    update_status(tmp_path, "running")
    n = 150
    script = ("import sys\nfrom shardscope.backend.runs.rundir import update_status\n"
              f"for i in range({n}): update_status(sys.argv[1], **{{f'{{sys.argv[2]}}{{i}}': i}})\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), f"p{k}_"]) for k in range(2)]
    threads = [threading.Thread(target=lambda k=k: [update_status(tmp_path, **{f"t{k}_{i}": i}) for i in range(n)])
               for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(p.wait(timeout=300) == 0 for p in procs)
    status = json.loads((tmp_path / "status.json").read_text())
    missing = [f"{w}_{i}" for w in ("p0", "p1", "t0", "t1") for i in range(n) if f"{w}_{i}" not in status]
    assert not missing, f"{len(missing)} updates lost, e.g. {missing[:5]}"
    assert status["state"] == "running"


def test_a_stop_asked_before_torchrun_starts_starts_nothing(tmp_path):
    """``shardscope stop`` can come while a run is "starting": its supervisor sees the stop request before it
    starts torchrun, records "stopped" and starts nothing. The launcher and the supervisor are held at their
    first status write (the test holds the run's status lock) while the request is written."""
    import threading

    from shardscope.backend.runs.rundir import STOP_REQUEST, status_lock, write_json

    run = tmp_path / "early"
    run.mkdir()  # so that the lock is the folder's file lock, which holds the supervisor's process too
    launcher = RunLauncher(run, RunConfig(strategy="ddp", nproc=2, steps=100000, checkpoint_every=0, model=SMALL))
    with status_lock(run):
        starter = threading.Thread(target=launcher.start)
        starter.start()
        deadline = time.monotonic() + 120
        while launcher.proc is None:  # the supervisor is started; its first status write waits for the lock
            assert time.monotonic() < deadline
            time.sleep(0.05)
        write_json(run / STOP_REQUEST, {"time": time.time(), "grace": 5})
    starter.join(120)
    status = launcher.wait(120)
    assert status["state"] == "stopped" and "pid" not in status, status
    assert launcher.proc.wait(60) == 0


def test_a_stop_ends_the_run_itself_when_its_supervisor_does_not_answer(tmp_path):
    """A supervisor that hangs (here SIGSTOPped) does not answer the stop: after the grace and the timeout the
    stop kills it (torchrun follows it, by its parent-death signal), waits for every process and records the
    run "stopped"."""
    import signal

    from shardscope.backend.runs.launcher import stop_run

    run = tmp_path / "hung"
    launcher = RunLauncher(run, RunConfig(strategy="ddp", nproc=2, steps=100000, checkpoint_every=0, model=SMALL))
    launcher.start()
    deadline = time.monotonic() + 120
    while not (run / "metrics" / "rank_1.jsonl").exists():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    family = [psutil.Process(launcher.proc.pid), *psutil.Process(launcher.proc.pid).children(recursive=True)]
    try:
        family[0].send_signal(signal.SIGSTOP)
        status = stop_run(run, grace=2, timeout=3)
        assert status["state"] == "stopped" and "supervisor" in status["explanation"], status
        assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        for p in family:
            if p.is_running():
                p.kill()


def test_a_run_from_before_supervisors_is_stopped_too(tmp_path):
    """status.json of a run launched before runs had supervisors names torchrun alone: ``stop`` ends it."""
    import subprocess
    import sys

    from shardscope.backend.runs.launcher import stop_run

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    run = tmp_path / "old"
    run.mkdir()
    (run / "status.json").write_text(json.dumps({"state": "running", "pid": live.pid, "scheduler": "local"}))
    try:
        status = stop_run(run, grace=2)
        assert status["state"] == "stopped", status
        live.wait(10)
        assert not psutil.pid_exists(live.pid)
    finally:
        live.kill()
        live.wait(10)


def test_first_rank_to_fail_is_the_one_that_exited_not_the_one_torchrun_ended(tmp_path):
    """A rank failed in init_process_group (exit 1) and torchrun ended its peer with SIGTERM: the run named
    the SIGTERM'd rank "the first rank to fail". The exit records, written as each rank writes its own, say
    which rank failed first; a rank torchrun ended writes none."""
    from shardscope.backend.runs.rundir import read_status
    from shardscope.backend.runs.supervisor import settle
    from shardscope.backend.runs.worker_entry import record_exit

    now = int(time.time())
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "exit").mkdir()
    report = _torchrun_report(tmp_path, {0: (1, now + 5), 1: (-15, None)})
    assert "rank      : 1 " in report.split("Root Cause")[1]  # torchrun blames the rank it ended itself
    (run / "logs" / "launcher.log").write_text(report + "\n")
    record_exit(str(run), 0, 1, "RuntimeError: ProcessGroupNCCL is only supported with GPUs, no GPUs found!")
    status = settle(run, {"state": "running"}, 1)
    assert status["state"] == "failed" and status["root_cause_rank"] == 0
    assert status["explanation"].startswith("rank 0 exited with code 1, the first rank to fail")
    assert read_status(run)["root_cause_rank"] == 0
    # two ranks exited 1 in the same second: torchrun names the lower one; the exit records say which was first
    (run / "logs" / "launcher.log").write_text(_torchrun_report(tmp_path, {0: (1, now), 1: (1, now)}) + "\n")
    record_exit(str(run), 1, 1, "RuntimeError: CUDA out of memory")
    time.sleep(0.05)
    record_exit(str(run), 0, 1, "RuntimeError: Connection reset by peer")
    assert settle(run, {"state": "running"}, 1)["root_cause_rank"] == 1
