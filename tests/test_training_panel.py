"""The Training panel and the run follower, under pytest-qt; a real run for the end-to-end check."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("PySide6")

from PySide6.QtCore import QThreadPool
from shardscope.backend.runs.follow import RunFollower
from shardscope.backend.runs.launcher import RunConfig, RunLauncher, checkpoints, effective_status
from shardscope.widgets.training_panel import TrainingPanel

SMALL = {"width": 32, "depth": 1, "heads": 2, "seq_len": 16, "batch_size": 2}


@pytest.fixture(autouse=True)
def no_thread_left_running():
    yield
    assert QThreadPool.globalInstance().waitForDone(20000), "a background worker was left running"


def write_metrics(run_dir, rank, steps, t0=None, loss=lambda s: 5.0 / s):
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    t0 = time.time() if t0 is None else t0
    with open(run_dir / "metrics" / f"rank_{rank}.jsonl", "a") as f:
        for s in steps:
            f.write(json.dumps({"time": t0 + s * 0.01, "rank": rank, "step": s, "loss": loss(s),
                                "rss": 100 * 2**20, "tokens_per_s": 1000.0}) + "\n")


def test_panel_plots_points_as_lines_arrive(qtbot, tmp_path):
    run = tmp_path / "run"
    write_metrics(run, 0, range(1, 11))
    write_metrics(run, 1, range(1, 11))
    panel = TrainingPanel(runs_root=tmp_path)
    qtbot.addWidget(panel)
    panel.follow(str(run))
    qtbot.waitUntil(lambda: panel.plots.curve_points(("raw", 0)) == 10, timeout=10000)
    assert panel.plots.curve_points(("raw", 1)) == 10
    assert panel.plots.curve_points(("mean",)) == 10
    write_metrics(run, 0, range(11, 31))
    with open(run / "metrics" / "rank_1.jsonl", "a") as f:
        f.write('{"time": 1, "rank": 1, "step": 11, "lo')  # a line still being written is not read yet
    qtbot.waitUntil(lambda: panel.plots.curve_points(("raw", 0)) == 30, timeout=10000)
    assert panel.plots.curve_points(("raw", 1)) == 10
    assert set(panel.log_views) >= {0, 1}
    panel.shutdown()


def test_resumed_run_is_split_and_marked(qtbot, tmp_path):
    run = tmp_path / "run"
    write_metrics(run, 0, range(1, 21))
    write_metrics(run, 0, range(11, 31))  # resumed from step 10 into the same run directory
    panel = TrainingPanel(runs_root=tmp_path)
    qtbot.addWidget(panel)
    panel.follow(str(run))
    qtbot.waitUntil(lambda: panel.plots.curve_points(("raw", 0)) == 40, timeout=10000)
    assert panel.follower.series[0].restarts == [20]
    assert len(panel.plots._restart_lines) == 1 and panel.plots._restart_lines[0].value() == 11
    x = panel.plots._curves[("raw", 0)].xData
    assert sum(v != v for v in x) == 1  # one NaN break between the two segments
    panel.shutdown()


def test_stalled_rank_is_flagged(tmp_path):
    run = tmp_path / "run"
    now = time.time()
    write_metrics(run, 0, range(1, 5), t0=now - 1)
    write_metrics(run, 1, range(1, 5), t0=now - 500)
    (run / "status.json").write_text(json.dumps({"state": "running"}))
    follower = RunFollower(run, stall_seconds=60)
    snap = follower.poll(now=now)
    assert snap.stalled == [1]
    (run / "status.json").write_text(json.dumps({"state": "finished"}))
    assert follower.poll(now=now).stalled == []


def test_smoothing_slider_changes_the_smoothed_curve(qtbot, tmp_path):
    run = tmp_path / "run"
    write_metrics(run, 0, range(1, 101), loss=lambda s: float(s % 7))
    panel = TrainingPanel(runs_root=tmp_path)
    qtbot.addWidget(panel)
    panel.follow(str(run))
    qtbot.waitUntil(lambda: panel.plots.curve_points(("smooth", 0)) == 100, timeout=10000)
    before = panel.plots._curves[("smooth", 0)].yData.copy()
    panel.plots.slider.setValue(0)
    panel.plots.redraw()
    after = panel.plots._curves[("smooth", 0)].yData
    raw = panel.plots._curves[("raw", 0)].yData
    assert (after == raw).all() and not (before == raw).all()
    panel.shutdown()


def test_panel_starts_follows_and_stops_a_real_run(qtbot, tmp_path):
    panel = TrainingPanel(runs_root=tmp_path)
    qtbot.addWidget(panel)
    panel.strategy.setCurrentText("ddp")
    panel.steps.setValue(100000)
    panel.ckpt_every.setValue(0)
    panel.width_.setValue(32)
    panel.depth.setValue(1)
    panel.heads.setValue(2)
    panel.batch.setValue(2)
    run_dir = panel.start_run()
    assert run_dir is not None
    qtbot.waitUntil(lambda: panel.plots.curve_points(("raw", 1)) >= 3, timeout=120000)
    qtbot.waitUntil(lambda: panel.stop_button.isEnabled(), timeout=10000)
    panel.stop_button.click()
    qtbot.waitUntil(lambda: effective_status(run_dir).get("state") == "stopped", timeout=30000)
    launcher = panel.launchers[run_dir]
    assert launcher.proc.poll() is not None
    panel.shutdown()


def test_gui_restart_reads_final_state_from_exit_records(tmp_path):
    """A run whose launcher is gone (the GUI that started it was closed) is not shown as running."""
    run = tmp_path / "run"
    cfg = RunConfig(strategy="ddp", nproc=1, steps=3, checkpoint_every=3, model=SMALL)
    RunLauncher(run, cfg).start().wait(300)
    status = json.loads((run / "status.json").read_text())
    status["state"] = "running"  # as if nobody reaped it
    (run / "status.json").write_text(json.dumps(status))
    assert effective_status(run)["state"] == "finished"
    assert [c.name for c in checkpoints(run)] == ["step_000003"]
