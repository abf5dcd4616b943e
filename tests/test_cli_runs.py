"""``train --detach``, ``runs``, ``follow`` and ``stop`` on real runs (torchrun, gloo CPU ranks, real signals):
a run's state is written by its supervisor, whoever launched or follows it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import run_cli, wait_for
from shardscope.backend.runs.rundir import read_status, run_state

pytestmark = pytest.mark.slow

SMALL = ["--strategy", "ddp", "--nproc", "2", "--checkpoint-every", "0", "--width", "32", "--depth", "1",
         "--heads", "2", "--seq-len", "16", "--batch-size", "2"]


def detach(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """``train --detach``: it must return at once (no waiting for the run), exit 0, naming the run directory."""
    t0 = time.monotonic()
    proc = run_cli("train", "--detach", *SMALL, "--run-dir", run_dir, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"run directory: {run_dir}" in proc.stdout and "shardscope stop" in proc.stdout
    assert time.monotonic() - t0 < 60
    return proc


def cli(*args: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shardscope.app.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ})


def runs_json(root: Path) -> dict[str, dict]:
    proc = run_cli("runs", root, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["roots"] == [str(root)]
    return {r["name"]: r for r in out["runs"]}


def family(run_dir: Path) -> list[psutil.Process]:
    """The run's supervisor, torchrun and the ranks."""
    sup = psutil.Process(read_status(run_dir)["supervisor_pid"])
    return [sup, *sup.children(recursive=True)]


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def kill_all(procs: list[psutil.Process]) -> None:
    """Nothing left training, whatever a failed test left behind."""
    for p in alive(procs):
        p.kill()


def test_a_detached_run_settles_with_its_follower_killed_and_runs_lists_it(tmp_path):
    root = tmp_path / "runs"
    run = root / "a"
    detach(run, "--steps", "40", "--checkpoint-every", "20")
    follower = cli("follow", run)
    try:
        wait_for(lambda: (run / "metrics" / "rank_0.jsonl").exists(), "the first step")
    finally:
        follower.kill()  # SIGKILL: the run must not notice
    out, _ = follower.communicate(timeout=60)
    assert "Ctrl-C detaches (the run goes on)" in out
    status = wait_for(lambda: (s := read_status(run))["state"] in ("finished", "failed", "stopped") and s,
                      "the run to settle with nobody watching")
    assert status["state"] == "finished" and status["exit_code"] == 0, status
    assert status["exit_codes"] == {"0": 0, "1": 0} and status["failed_ranks"] == []
    again = run_cli("follow", run)  # a run that is over: how it ended, at once
    assert again.returncode == 0 and "run finished: success" in again.stdout, again.stdout + again.stderr
    last = [ln for ln in again.stdout.splitlines() if ln.startswith("step ")]
    assert last and last[-1].startswith("step 40"), again.stdout  # its last step, though it was over before
    ck = run / "checkpoints" / "step_000020"
    detach(run, "--steps", "44", "--resume", ck)  # into the same folder: the listing names the checkpoint
    follow = run_cli("follow", run)
    assert follow.returncode == 0 and "run finished" in follow.stdout, follow.stdout + follow.stderr
    listed = runs_json(root)["a"]
    assert listed["state"] == "finished" and listed["step"] == 44 and isinstance(listed["loss"], float)
    assert listed["where"] == "local" and listed["job_id"] is None and listed["resumed_from"] == str(ck)
    assert listed["path"] == str(run) and listed["updated"] >= status["end_time"]
    table = run_cli("runs", root)
    assert table.returncode == 0 and f"{run}  (from {ck})" in table.stdout and "finished" in table.stdout
    missing = run_cli("runs", tmp_path / "nowhere")
    assert missing.returncode == 2 and "no such folder" in missing.stderr


def test_follow_detaches_and_stop_from_another_process_leaves_nothing(tmp_path):
    root = tmp_path / "runs"
    run = root / "long"
    detach(run, "--steps", "100000")
    wait_for(lambda: (run / "metrics" / "rank_1.jsonl").exists(), "rank 1's first step")
    procs = family(run)
    try:
        assert len(procs) == 4, [p.cmdline() for p in procs]  # supervisor, torchrun, two ranks
        follower = cli("follow", run)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(follower.stdout), daemon=True)  # never a full pipe
        reader.start()
        wait_for(lambda: any("step" in ln for ln in lines), "the follower's first progress line")
        follower.send_signal(signal.SIGINT)
        follower.wait(timeout=120)
        reader.join(timeout=60)
        out, err = "".join(lines), follower.stderr.read()
        assert follower.returncode == 130, out + err
        assert "detached (Ctrl-C): the run goes on" in out and "Traceback" not in err
        procs[0].send_signal(signal.SIGHUP)  # a lost terminal or SSH session: the supervisor carries on
        time.sleep(1)
        assert len(alive(procs)) == 4 and read_status(run)["state"] == "running"
        listed = runs_json(root)["long"]
        assert listed["state"] == "running" and listed["step"] >= 1 and listed["supervisor_pid"] == procs[0].pid
        t0 = time.monotonic()
        stop = run_cli("stop", run, "--grace", "5")
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert "run stopped: stopped by the user" in stop.stdout
        assert time.monotonic() - t0 < 60
        assert not alive(procs), alive(procs)  # `stop` returns once none of the run's processes lives
        status = read_status(run)
        assert status["state"] == "stopped" and status["stop_requested"], status
        assert "stopped by the user from Shardscope" in (run / "logs" / "launcher.log").read_text()
        again = run_cli("stop", run)
        assert again.returncode == 0 and "already stopped" in again.stdout
    finally:
        kill_all(procs)


def test_a_killed_supervisor_is_reported_not_left_running(tmp_path):
    root = tmp_path / "runs"
    run = root / "orphan"
    detach(run, "--steps", "100000")
    wait_for(lambda: (run / "metrics" / "rank_1.jsonl").exists(), "rank 1's first step")
    procs = family(run)
    try:
        procs[0].kill()  # kill -9 of the supervisor: torchrun and the ranks go with it
        wait_for(lambda: not alive(procs), "torchrun and the ranks to end with their supervisor", 90)
        assert read_status(run)["state"] == "running"  # nobody recorded the end...
        assert run_state(run) == "ended"  # ...and every reader says so: the Library, ls, prune
        listed = runs_json(root)["orphan"]
        assert listed["state"] == "ended" and "supervisor" in listed["explanation"], listed
        follow = run_cli("follow", run)
        assert follow.returncode == 1 and "run ended: its supervisor" in follow.stdout, follow.stdout
        assert read_status(run)["state"] == "running"  # followers only read
        stop = run_cli("stop", run)
        assert stop.returncode == 0 and "run stopped" in stop.stdout, stop.stdout + stop.stderr
        status = read_status(run)
        assert status["state"] == "stopped" and "supervisor" in status["explanation"], status
    finally:
        kill_all(procs)
