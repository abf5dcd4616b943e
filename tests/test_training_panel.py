"""The Training panel and the run follower, under pytest-qt; real runs for the end-to-end checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from itertools import pairwise
from pathlib import Path

import psutil
import pytest
from PySide6.QtCore import Qt, QThreadPool
from shardscope.backend.runs.follow import RunFollower
from shardscope.backend.runs.launcher import RunConfig, RunLauncher, run_status
from shardscope.backend.runs.rundir import checkpoints, read_config, read_status, torchrun_root_cause, update_status
from shardscope.backend.runs.supervisor import STOP_NOTE
from shardscope.widgets.training_panel import TrainingPanel

pytestmark = [pytest.mark.slow, pytest.mark.gui]

SMALL = {"width": 32, "depth": 1, "heads": 2, "seq_len": 16, "batch_size": 2}
LONG = 300_000  # ms: a deadline for anything a real torchrun does on a loaded 2-core machine (imports torch)
SHORT = 120_000  # ms: a deadline for the panel's own polling (every 0.5 s, the Runs list every 2 s)


@pytest.fixture(autouse=True)
def no_thread_left_running():
    yield
    assert QThreadPool.globalInstance().waitForDone(60000), "a background worker was left running"


@pytest.fixture
def panel(qtbot, tmp_path):
    p = TrainingPanel(runs_root=tmp_path)
    qtbot.addWidget(p)
    yield p
    p.shutdown()
    for launcher in p.launchers.values():  # a test that failed half-way leaves no torchrun behind
        if launcher.proc is not None and launcher.proc.poll() is None:
            launcher.stop(grace=5)


def write_metrics(run_dir, rank, steps, t0=None, loss=lambda s: 5.0 / s, **extra):
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    t0 = time.time() if t0 is None else t0
    with open(run_dir / "metrics" / f"rank_{rank}.jsonl", "a") as f:
        for s in steps:
            f.write(json.dumps({"time": t0 + s * 0.01, "rank": rank, "step": s, "loss": loss(s),
                                "rss": 100 * 2**20, "tokens_per_s": 1000.0, **extra}) + "\n")


def small_form(panel, steps=100000):
    panel.form.strategy.setCurrentText("ddp")
    panel.form.steps.setValue(steps)
    panel.form.ckpt_every.setValue(0)
    panel.form.width_.setValue(32)
    panel.form.depth.setValue(1)
    panel.form.heads.setValue(2)
    panel.form.batch.setValue(2)


def test_panel_plots_points_as_lines_arrive(qtbot, panel, tmp_path):
    run = tmp_path / "run"
    write_metrics(run, 0, range(1, 11))
    write_metrics(run, 1, range(1, 11))
    assert not panel.plots.csv_button.isEnabled() and not panel.plots.png_button.isEnabled()  # nothing to save
    panel.follow(str(run))
    assert panel.plots.csv_button.isEnabled() and panel.plots.png_button.isEnabled()
    qtbot.waitUntil(lambda: panel.plots.curve_points(("raw", 0)) == 10, timeout=10000)
    assert panel.plots.curve_points(("raw", 1)) == 10
    assert panel.plots.curve_points(("mean",)) == 10
    write_metrics(run, 0, range(11, 31))
    with open(run / "metrics" / "rank_1.jsonl", "a") as f:
        f.write('{"time": 1, "rank": 1, "step": 11, "lo')  # a line still being written is not read yet
    qtbot.waitUntil(lambda: panel.plots.curve_points(("raw", 0)) == 30, timeout=10000)
    assert panel.plots.curve_points(("raw", 1)) == 10
    assert set(panel.log_views) >= {0, 1}


def test_legends_do_not_cover_the_curves(qtbot, panel, tmp_path):
    run = tmp_path / "run"
    write_metrics(run, 0, range(1, 11), cuda_allocated=2**30, cuda_reserved=2**31)
    write_metrics(run, 1, range(1, 11), cuda_allocated=2**30, cuda_reserved=2**31)
    panel.resize(1024, 700)
    panel.follow(str(run))
    qtbot.waitUntil(lambda: panel.plots.curve_points(("cuda_reserved", 1)) == 10, timeout=10000)
    for plot in (panel.plots.loss, panel.plots.memory, panel.plots.speed):
        assert plot.getPlotItem().legend is None  # no legend box inside any plot
    text = panel.plots.legend.text()
    assert "rank 0" in text and "rank 1" in text and "mean of ranks" in text
    assert "dashed CUDA allocated" in text and "dotted CUDA reserved" in text


def test_resumed_run_is_split_and_memory_is_plotted_per_step(qtbot, panel, tmp_path):
    run = tmp_path / "run"
    write_metrics(run, 0, range(1, 21), t0=time.time() - 86400)  # the first segment, a day ago
    write_metrics(run, 0, range(11, 31))  # resumed from step 10 into the same run directory
    panel.follow(str(run))
    qtbot.waitUntil(lambda: panel.plots.curve_points(("raw", 0)) == 40, timeout=10000)
    assert panel.follower.series[0].restarts == [20]
    assert len(panel.plots._restart_lines) == 1 and panel.plots._restart_lines[0].value() == 11
    x = panel.plots._curves[("raw", 0)].xData
    assert sum(v != v for v in x) == 1  # one NaN break between the two segments
    y = panel.plots._curves[("raw", 0)].yData
    old = panel.plots._curves[("old", 0)]  # steps 11-20 of the first segment, replaced by the resume
    assert sorted(old.xData[old.yData == old.yData]) == list(range(11, 21))
    assert list(x[:20]) == list(range(1, 21)) and all(v != v for v in y[10:20])  # hidden in the live curve
    assert all(v == v for v in y[21:])
    assert "replaced" in panel.plots.legend.text()
    mem_x = panel.plots._curves[("rss", 0)].xData
    finite = mem_x[mem_x == mem_x]
    assert finite.min() == 1 and finite.max() == 30  # the day between the segments takes no room



def tick_texts(axis) -> list:
    """(rect, flags, text) of each tick label the axis would draw now."""
    from PySide6.QtGui import QImage, QPainter

    image = QImage(10, 10, QImage.Format.Format_ARGB32)
    painter = QPainter(image)
    try:
        return axis.generateDrawSpecs(painter)[2]
    finally:
        painter.end()


def test_memory_axis_labels_do_not_run_together_at_1280x720(qtbot, panel, tmp_path):
    """At 1280x720 the memory plot is about 50 px tall, and its y axis labelled 330, 332, ... 338 one against the
    next: a value axis labels only as many values as fit, half a line apart at least."""
    run = tmp_path / "run"
    t0 = time.time()
    for step in range(1, 31):  # RSS creeping from 330 to 338 MiB, as the demo's did
        write_metrics(run, 0, [step], t0=t0, rss=(330 + 8 * step / 30) * 2**20)
    panel.resize(1280, 640)  # what the window leaves it at 1280x720
    panel.show()
    qtbot.waitExposed(panel)
    panel.follow(str(run))
    qtbot.waitUntil(lambda: panel.plots.curve_points(("rss", 0)) == 30, timeout=10000)
    for plot in (panel.plots.memory, panel.plots.loss):
        qtbot.waitUntil(lambda p=plot: p.getViewBox().viewRange()[1][1] > 1, timeout=10000)
        axis = plot.getAxis("left")
        texts = tick_texts(axis)
        rects = sorted((r for r, _flags, text in texts if text), key=lambda r: r.top())
        assert len(rects) >= 2, [t for _r, _f, t in texts]
        for upper, lower in pairwise(rects):  # a clear half line between two labels
            assert lower.top() - upper.bottom() >= upper.height() / 2, (plot, [(t, r.top()) for r, _f, t in texts])

def test_throughput_ticks_are_short_enough_not_to_touch_the_axis_title(qtbot, panel, tmp_path):
    """At 1280x720 "50000" on the throughput axis touched its "tokens/s" title: large values read 50k, 1.5M."""
    run = tmp_path / "run"
    for step in range(1, 31):
        write_metrics(run, 0, [step], tokens_per_s=40_000.0 + 500 * step)
    panel.resize(1280, 640)
    panel.show()
    qtbot.waitExposed(panel)
    panel.follow(str(run))
    qtbot.waitUntil(lambda: panel.plots.speed.isVisible() and
                    panel.plots.speed.getViewBox().viewRange()[1][1] > 10_000, timeout=10000)
    axis = panel.plots.speed.getAxis("left")
    texts = tick_texts(axis)
    shown = [t for _r, _f, t in texts if t]
    assert shown and all(t.endswith("k") for t in shown), shown
    assert axis.tickStrings([10_000, 12_500], 1, 2_500) == ["10.0k", "12.5k"]
    assert axis.tickStrings([0, 1.5e6], 1, 5e5) == ["0", "1.5M"]
    assert axis.tickStrings([330, 335], 1, 5) == ["330", "335"]


def test_stall_detection_waits_for_the_resumed_ranks(tmp_path):
    run = tmp_path / "run"
    now = time.time()
    write_metrics(run, 0, range(1, 5), t0=now - 500)  # the previous segment's last steps: long ago
    write_metrics(run, 1, range(1, 5), t0=now - 500)
    (run / "status.json").write_text(json.dumps({"state": "running", "start_time": now - 1}))
    follower = RunFollower(run, stall_seconds=60)
    assert follower.poll(now=now).stalled == []  # resumed one second ago: nothing has started yet
    write_metrics(run, 0, range(5, 7), t0=now - 0.05)
    assert follower.poll(now=now).stalled == []
    assert follower.poll(now=now + 120).stalled == [0]  # rank 0 started, then went quiet
    (run / "status.json").write_text(json.dumps({"state": "finished"}))
    assert follower.poll(now=now + 120).stalled == []


def test_smoothing_slider_changes_the_smoothed_curve(qtbot, panel, tmp_path):
    run = tmp_path / "run"
    write_metrics(run, 0, range(1, 101), loss=lambda s: float(s % 7))
    panel.follow(str(run))
    qtbot.waitUntil(lambda: panel.plots.curve_points(("smooth", 0)) == 100, timeout=10000)
    before = panel.plots._curves[("smooth", 0)].yData.copy()
    panel.plots.slider.setValue(0)
    panel.plots.redraw()
    after = panel.plots._curves[("smooth", 0)].yData
    raw = panel.plots._curves[("raw", 0)].yData
    assert (after == raw).all() and not (before == raw).all()


def test_form_says_what_is_wrong_next_to_the_field(qtbot, panel, tmp_path):
    small_form(panel)
    panel.form.steps.setValue(0)
    assert panel.form.steps.value() == 0  # 0 can be typed (and is refused), not silently replaced
    assert panel.start_run() is False
    assert panel.form.errors["steps"].isVisibleTo(panel) and "at least 1" in panel.form.errors["steps"].text()
    panel.form.steps.setValue(5)
    panel.form.script.setText(str(tmp_path / "nope.py"))
    assert panel.start_run() is False
    assert not panel.form.errors["steps"].isVisibleTo(panel)
    assert "nope.py: no such file" in panel.form.errors["script"].text()
    assert panel.form.errors["script"].isVisibleTo(panel)
    assert not panel.launchers and [p.name for p in tmp_path.iterdir()] == []
    panel.form.script.setText("")  # editing the field answers its message: no stale error stays under it
    assert not panel.form.errors["script"].isVisibleTo(panel)



def wheel(widget, notches: int = -1) -> None:
    """A real wheel event over the middle of ``widget`` (one notch down by default), delivered as Qt delivers a
    mouse's: to the widget, then up to its parents while nobody accepts it."""
    from PySide6.QtCore import QPoint, QPointF
    from PySide6.QtGui import QWheelEvent
    from PySide6.QtWidgets import QApplication

    pos = QPointF(widget.rect().center())
    event = QWheelEvent(pos, QPointF(widget.mapToGlobal(pos.toPoint())), QPoint(0, 0), QPoint(0, 120 * notches),
                        Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(widget, event)


def test_the_wheel_scrolls_the_form_without_changing_its_values(qtbot, panel):
    """At 1280x720 the form needs scrolling, and the wheel over it turned Heads from 4 to 1 with no notice: a
    spin or combo box takes the wheel only once it has the focus; until then the wheel scrolls the form."""
    from PySide6.QtWidgets import QAbstractSpinBox, QComboBox, QScrollArea

    panel.resize(1280, 520)
    panel.show()
    qtbot.waitExposed(panel)
    scroll = panel.findChild(QScrollArea)
    bar = scroll.verticalScrollBar()
    assert bar.maximum() > 0  # the form does not fit: it scrolls
    fields = [w for w in panel.form.findChildren(QAbstractSpinBox) + panel.form.findChildren(QComboBox)
              if w.isVisibleTo(panel)] + [panel.compare]
    values = {id(w): (w.value() if isinstance(w, QAbstractSpinBox) else w.currentIndex()) for w in fields}
    assert panel.form.heads.value() == 4
    for w in fields:
        bar.setValue(0)
        wheel(w, notches=-3)
        wheel(w, notches=+1)
        assert (w.value() if isinstance(w, QAbstractSpinBox) else w.currentIndex()) == values[id(w)], w
    bar.setValue(0)
    wheel(panel.form.heads, notches=-3)
    assert bar.value() > 0 and panel.form.heads.value() == 4  # the form scrolled instead
    panel.form.heads.setFocus()
    qtbot.waitUntil(panel.form.heads.hasFocus, timeout=5000)
    wheel(panel.form.heads, notches=+1)  # focused (clicked or tabbed into), it takes the wheel as before
    assert panel.form.heads.value() == 5

def test_failure_traceback_is_collapsed_and_does_not_squash_the_plots(qtbot, panel, tmp_path):
    run = tmp_path / "run"
    write_metrics(run, 0, range(1, 11))
    (run / "exit").mkdir()
    tb = "Traceback (most recent call last):\n" + "".join(f'  File "x.py", line {i}, in f\n    g()\n'
                                                          for i in range(60)) + "RuntimeError: boom on rank 0"
    (run / "exit" / "rank_0.json").write_text(json.dumps({"rank": 0, "code": 1, "traceback_tail": tb}))
    (run / "status.json").write_text(json.dumps({"state": "failed", "failed_ranks": [0], "exit_code": 1,
                                                 "explanation": "exited with code 1"}))
    panel.resize(1280, 720)
    panel.show()
    qtbot.waitExposed(panel)
    before = panel.plots.loss.height()
    panel.follow(str(run))
    qtbot.waitUntil(lambda: "rank 0 failed: RuntimeError: boom on rank 0" in panel.status.text(), timeout=10000)
    qtbot.wait(50)
    assert panel.details_button.isVisible() and not panel.details.isVisible()
    assert panel.status.text().count("<br>") < 6  # one line per failed rank, not the traceback
    assert panel.plots.loss.height() >= before * 0.85
    panel.details_button.click()
    assert panel.details.isVisible() and "RuntimeError: boom on rank 0" in panel.details.toPlainText()
    assert panel.details.maximumHeight() <= 200


def test_panel_starts_follows_and_stops_a_real_run(qtbot, panel, tmp_path):
    """Every wait is on a condition, with a deadline a loaded 2-core machine meets (torch is imported by
    three processes before the first point); nothing waits on a signal that may already have fired."""
    small_form(panel)
    panel.show()  # the traceback button is checked for visibility below: shown, so the check can fail
    assert panel.start_run() is True
    qtbot.waitUntil(lambda: bool(panel.launchers), timeout=SHORT)
    run_dir = next(iter(panel.launchers))
    qtbot.waitUntil(lambda: panel.plots.curve_points(("raw", 1)) >= 3, timeout=LONG)
    qtbot.waitUntil(lambda: panel.run_state(run_dir) == "running", timeout=SHORT)
    stall_free = time.time() - run_status(run_dir)["start_time"] < panel.follower.stall_limit
    assert "stalled" not in panel.status.text() or not stall_free
    qtbot.waitUntil(lambda: panel.stop_button.isEnabled(), timeout=SHORT)
    assert not panel.resume_button.isEnabled()  # a running run is not resumed
    panel.stop_button.click()
    assert not panel.stop_button.isEnabled()  # one stop at a time, until the run has ended
    qtbot.waitUntil(lambda: run_status(run_dir).get("state") == "stopped", timeout=SHORT)
    qtbot.waitUntil(lambda: panel.run_state(run_dir) == "stopped", timeout=SHORT)  # the Runs list follows
    qtbot.waitUntil(lambda: "stopped by the user" in panel.status.text(), timeout=SHORT)
    assert "exited with code" not in panel.status.text() and "failed" not in panel.status.text()
    assert "stopping" not in panel.status.text() and not panel.stop_button.isEnabled()
    assert panel.isVisible() and not panel.details_button.isVisible()
    # NOTE: a poll may settle "stopped" as soon as torchrun is gone, while the Stop still waits for the
    # ranks to exit; the note follows once they have (read at once, this failed under load)
    log = Path(run_dir) / "logs" / "launcher.log"
    qtbot.waitUntil(lambda: STOP_NOTE.strip() in log.read_text(), timeout=SHORT)
    qtbot.waitUntil(lambda: panel.launchers[run_dir].proc.poll() is not None, timeout=SHORT)


def test_runs_list_follows_a_run_to_its_end(qtbot, panel, tmp_path):
    small_form(panel, steps=3)
    panel.form.nproc.setValue(1)
    assert panel.start_run()
    qtbot.waitUntil(lambda: bool(panel.launchers), timeout=SHORT)
    run_dir = next(iter(panel.launchers))
    qtbot.waitUntil(lambda: panel.run_state(run_dir) == "finished", timeout=LONG)
    assert read_config(run_dir)["kind"] == "builtin" and read_config(run_dir)["steps"] == 3


def test_config_record_round_trips_for_resume():
    from shardscope.backend.runs.rundir import MODEL_DEFAULTS
    from shardscope.backend.runs.slurm import SlurmOptions

    builtin = RunConfig(strategy="ddp", nproc=3, steps=7, checkpoint_every=2, model=SMALL)
    back = RunConfig.from_record(json.loads(json.dumps(builtin.record())))
    # the record names every model setting the run used (the user's over the trainer's defaults), so the
    # resumed config launches the same run and records the same thing again
    assert back.record() == builtin.record() and back.model == {**MODEL_DEFAULTS, **SMALL}
    assert (back.strategy, back.nproc, back.steps, back.checkpoint_every) == ("ddp", 3, 7, 2)
    script = RunConfig(nproc=2, script="/abs/train.py", script_args=["--x", "1"], on="slurm",
                       slurm=SlurmOptions(nodes=2, gpus_per_node=8, partition="gpu", sbatch_args=["--mem=0"]))
    rec = json.loads(json.dumps({**script.record(), "command": ["sbatch"], "history": []}))
    assert "steps" not in rec and "strategy" not in rec
    back = RunConfig.from_record(rec)
    assert back.script == "/abs/train.py" and back.slurm == script.slurm and back.on == "slurm"


def test_a_run_settles_with_nobody_following_it(tmp_path):
    """A run whose launcher is gone (the GUI that started it was closed) is not shown as running: its
    supervisor wrote the final state, with nobody following."""
    run = tmp_path / "run"
    cfg = RunConfig(strategy="ddp", nproc=1, steps=3, checkpoint_every=3, model=SMALL)
    RunLauncher(run, cfg).start().proc.wait(300)  # the supervisor; nothing here reads the run
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "finished" and status["exit_codes"] == {"0": 0}, status
    assert [c.name for c in checkpoints(run)] == ["step_000003"]


def test_closing_the_panel_leaves_the_run_going_and_it_settles(qtbot, tmp_path):
    """The window closed mid-run (its panel shut down and deleted): the run goes on and status.json settles to
    finished with exit codes; it used to read "running" until a window showed the Training panel again."""
    panel = TrainingPanel(runs_root=tmp_path)
    qtbot.addWidget(panel)
    small_form(panel, steps=40)
    assert panel.start_run()
    qtbot.waitUntil(lambda: bool(panel.launchers), timeout=SHORT)
    run_dir = Path(next(iter(panel.launchers)))
    qtbot.waitUntil(lambda: panel.run_state(str(run_dir)) == "running", timeout=LONG)
    panel.shutdown()
    panel.close()
    panel.deleteLater()
    assert QThreadPool.globalInstance().waitForDone(60000)
    deadline = time.monotonic() + LONG / 1000
    while read_status(run_dir)["state"] not in ("finished", "failed", "stopped"):
        assert time.monotonic() < deadline, read_status(run_dir)
        time.sleep(0.5)
    status = read_status(run_dir)
    assert status["state"] == "finished" and status["exit_codes"] == {"0": 0, "1": 0}, status


SCRIPT = textwrap.dedent("""
    import time
    from shardscope import report
    for step in range(1, 5):
        report(step=step, loss=1.0 / step)
        time.sleep(0.05)
""")


def test_script_path_is_resolved_against_the_callers_directory(tmp_path):
    """`train --script train.py` from the script's folder: found (not looked up in the run directory),
    recorded absolute, config.json says what ran, and progress shows no invented total or speed."""
    (tmp_path / "train.py").write_text(SCRIPT)
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "shardscope.app.cli", "train", "--script", "train.py", "--nproc",
                           "1", "--run-dir", str(run)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cfg = read_config(run)
    assert cfg["kind"] == "script" and cfg["script"] == str(tmp_path / "train.py")
    assert "steps" not in cfg and "strategy" not in cfg and "model" not in cfg
    steps = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert steps and steps[-1].startswith("step 4  loss (mean of ranks) 0.2500")
    assert "/50" not in proc.stdout and "0.0 steps/s" not in proc.stdout
    missing = subprocess.run([sys.executable, "-m", "shardscope.app.cli", "train", "--script", "gone.py",
                              "--run-dir", str(tmp_path / "run2")], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2 and "gone.py: no such file" in missing.stderr
    assert not (tmp_path / "run2").exists()


def test_cuda_memory_stats_are_sampled_when_a_device_is_in_use(monkeypatch, tmp_path):
    """No GPU here: torch.cuda is patched at its boundary (is_available, is_initialized, memory_stats);
    report() must take allocated / reserved / peak from memory_stats, next to RSS."""
    import torch
    from shardscope import report

    stats = {"allocated_bytes.all.current": 3 * 2**30, "reserved_bytes.all.current": 4 * 2**30,
             "allocated_bytes.all.peak": 5 * 2**30}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    monkeypatch.setenv("SHARDSCOPE_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    assert report(step=1, loss=1.0)
    rec = json.loads((tmp_path / "metrics" / "rank_0.jsonl").read_text())
    assert rec["cuda_allocated"] == 3 * 2**30 and rec["cuda_reserved"] == 4 * 2**30
    assert rec["cuda_peak"] == 5 * 2**30 and rec["rss"] > 0


def test_compare_choice_survives_a_new_run_appearing(qtbot, panel, tmp_path):
    """The Runs list is refilled when a run appears: the compared run stays chosen, and its dashed curve
    is never left in the plot while the picker says "(none)"."""
    write_metrics(tmp_path / "run-a", 0, range(1, 11))
    write_metrics(tmp_path / "run-b", 0, range(1, 11))
    panel.refresh_runs()
    qtbot.waitUntil(lambda: panel.compare.findData(str(tmp_path / "run-b")) > 0, timeout=30000)
    panel.follow(str(tmp_path / "run-a"))
    panel.compare.setCurrentIndex(panel.compare.findData(str(tmp_path / "run-b")))
    qtbot.waitUntil(lambda: panel.plots.overlay is not None, timeout=30000)
    write_metrics(tmp_path / "run-c", 0, range(1, 4))
    panel.refresh_runs()
    qtbot.waitUntil(lambda: panel.compare.findData(str(tmp_path / "run-c")) > 0, timeout=30000)
    assert panel.compare.currentData() == str(tmp_path / "run-b") and panel.plots.overlay is not None
    shutil.rmtree(tmp_path / "run-b")  # the compared run goes: so does its curve
    panel.refresh_runs()
    qtbot.waitUntil(lambda: panel.compare.findData(str(tmp_path / "run-b")) < 0, timeout=30000)
    assert panel.compare.currentData() == "" and panel.plots.overlay is None


def test_a_run_without_memory_does_not_keep_the_last_runs_axes(qtbot, panel, tmp_path):
    panel.resize(1200, 800)
    panel.show()  # the plots' ranges follow their data only when shown
    write_metrics(tmp_path / "run-a", 0, range(1, 41))
    panel.follow(str(tmp_path / "run-a"))
    qtbot.waitUntil(lambda: panel.plots.curve_points(("raw", 0)) == 40, timeout=30000)
    qtbot.waitUntil(lambda: panel.plots.memory.viewRange()[0][1] >= 40, timeout=30000)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.csv").write_text("epoch,step,train_loss\n0,0,2.0\n0,1,1.5\n")
    panel.follow(str(bare))
    qtbot.waitUntil(lambda: "CSV: metrics.csv" in panel.plots.legend.text(), timeout=30000)
    assert panel.plots.memory.viewRange()[0][1] < 40  # not the previous run's steps 1..40


RESUMABLE = textwrap.dedent("""
    import os, time
    import torch
    import torch.distributed.checkpoint as dcp
    from shardscope import report

    resume = os.environ.get("SHARDSCOPE_RESUME")
    step = int(os.path.basename(resume).split("_")[-1]) if resume else 0
    while True:  # the first launch ends after step 3 with a checkpoint; a resumed one runs until stopped
        step += 1
        report(step=step, loss=1.0 / step)
        if not resume and step == 3:
            dcp.save({"w": torch.full((4,), 3.0)},
                     checkpoint_id=os.path.join(os.environ["SHARDSCOPE_RUN_DIR"], "checkpoints", "step_000003"))
            break
        time.sleep(0.05)
""")


def header_state(panel) -> str:
    """The state word in the header (after the run's bold name)."""
    text = panel.status.text()
    if "</b>: " not in text:
        return ""
    head = text.split("</b>: ", 1)[1].split("<br>", 1)[0]
    return head.split(">", 1)[1].split("<", 1)[0] if head.startswith("<span") else head.split(" ", 1)[0]


def test_old_launcher_does_not_end_the_resumed_run(tmp_path):
    """The launcher of a run's finished first segment still answers its exit code 0. Asked after a resume
    (as the panel's poll in flight did), it used to write "finished" over the running resumed run, whose
    header then stayed "finished" and whose Stop did nothing (its torchrun trained on, unstoppable)."""
    run = tmp_path / "run"
    first = RunLauncher(run, RunConfig(strategy="ddp", nproc=1, steps=3, checkpoint_every=3, model=SMALL)).start()
    assert first.wait(LONG / 1000)["state"] == "finished"
    resume = RunConfig(strategy="ddp", nproc=1, steps=100000, checkpoint_every=0, model=SMALL,
                       resume=str(checkpoints(run)[-1]))
    second = RunLauncher(run, resume).start()
    try:
        deadline = time.monotonic() + LONG / 1000
        while run_status(run)["state"] == "starting":  # until its supervisor has started torchrun
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert first.status()["state"] == "running"
        assert run_status(run)["state"] == "running" and second.status()["state"] == "running"
    finally:
        assert second.stop()["state"] == "stopped"
    assert second.proc.poll() is not None


def test_resuming_a_finished_run_shows_it_running_and_stops_it(qtbot, panel, tmp_path):
    """Resume of a finished run: the header, the Runs list and the buttons follow the resumed run (real
    torchrun launches of a user script that writes a real DCP checkpoint)."""
    script = tmp_path / "resumable.py"
    script.write_text(RESUMABLE)
    panel.form.script.setText(str(script))
    panel.form.nproc.setValue(1)
    assert panel.start_run()
    assert not panel.start_button.isEnabled()  # no second Start while this one is on its way
    qtbot.waitUntil(lambda: bool(panel.launchers), timeout=SHORT)
    run_dir = next(iter(panel.launchers))
    qtbot.waitUntil(lambda: header_state(panel) == "finished" and panel.ckpt_list.count() == 1, timeout=LONG)
    qtbot.waitUntil(lambda: panel.run_state(run_dir) == "finished", timeout=SHORT)
    assert panel.start_button.isEnabled() and not panel.stop_button.isEnabled()
    assert not panel.resume_button.isEnabled()  # no checkpoint selected yet
    panel.ckpt_list.item(0).setSelected(True)
    assert panel.resume_button.isEnabled()
    first = panel.launchers[run_dir]
    panel.resume_button.click()
    assert not panel.resume_button.isEnabled() and not panel.start_button.isEnabled()  # one launch at a time
    qtbot.waitUntil(lambda: panel.launchers[run_dir] is not first, timeout=SHORT)
    first.status()  # what a poll in flight during the resume asked: it must not end the resumed run
    qtbot.waitUntil(lambda: header_state(panel) == "running" and panel.run_state(run_dir) == "running",
                    timeout=SHORT)
    qtbot.waitUntil(lambda: panel.follower.series.get(0) is not None and
                    panel.follower.series[0].column("step")[-1] >= 6, timeout=LONG)  # the resumed steps arrive
    assert header_state(panel) == "running" and list(panel.follower.series[0].column("step")[:4]) == [1, 2, 3, 4]
    qtbot.waitUntil(lambda: panel.stop_button.isEnabled(), timeout=SHORT)
    assert not panel.resume_button.isEnabled()
    assert len(run_processes(script)) == 2  # torchrun and the rank, found by the script they run
    panel.stop_button.click()
    qtbot.waitUntil(lambda: header_state(panel) == "stopped" and panel.run_state(run_dir) == "stopped",
                    timeout=SHORT)
    qtbot.waitUntil(lambda: panel.launchers[run_dir].proc.poll() is not None, timeout=SHORT)
    qtbot.waitUntil(lambda: not run_processes(script), timeout=SHORT)  # the Stop ends every rank too


def run_processes(name: str | os.PathLike) -> list[int]:
    """Live processes (not zombies) whose command line names ``name``."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.pid != os.getpid() and p.info["status"] != psutil.STATUS_ZOMBIE and \
                str(name) in " ".join(p.info["cmdline"] or []):
            out.append(p.pid)
    return out


def test_compare_chooser_lists_only_the_other_runs(qtbot, panel, tmp_path):
    for name in ("run-a", "run-b", "run-c"):
        write_metrics(tmp_path / name, 0, range(1, 11))
    panel.refresh_runs()
    qtbot.waitUntil(lambda: panel.compare.count() == 4, timeout=SHORT)  # (none) and the three runs

    def offered():
        return sorted(Path(panel.compare.itemData(i)).name for i in range(1, panel.compare.count()))

    panel.follow(str(tmp_path / "run-a"))
    assert offered() == ["run-b", "run-c"]
    panel.compare.setCurrentIndex(panel.compare.findData(str(tmp_path / "run-c")))
    qtbot.waitUntil(lambda: panel.plots.overlay is not None, timeout=SHORT)
    panel.follow(str(tmp_path / "run-b"))  # another run shown: still compared with run-c
    assert offered() == ["run-a", "run-c"] and panel.compare.currentData() == str(tmp_path / "run-c")
    assert panel.plots.overlay is not None
    panel.follow(str(tmp_path / "run-c"))  # the compared run is now the one shown: no comparing with itself
    assert offered() == ["run-a", "run-b"] and panel.compare.currentData() == "" and panel.plots.overlay is None
    (tmp_path / "run-a").rename(tmp_path / "run-a2")
    write_metrics(tmp_path / "run-d", 0, range(1, 4))
    panel.refresh_runs()
    qtbot.waitUntil(lambda: offered() == ["run-a2", "run-b", "run-d"], timeout=SHORT)
    shutil.rmtree(tmp_path / "run-b")
    panel.refresh_runs()
    qtbot.waitUntil(lambda: offered() == ["run-a2", "run-d"], timeout=SHORT)
    assert panel.run_list.currentItem().data(Qt.ItemDataRole.UserRole) == str(tmp_path / "run-c")  # still the run shown


def test_a_late_compare_read_does_not_bring_back_a_dropped_choice(qtbot, panel, tmp_path):
    write_metrics(tmp_path / "run-a", 0, range(1, 11))
    write_metrics(tmp_path / "run-b", 0, range(1, 11))
    panel.refresh_runs()
    qtbot.waitUntil(lambda: panel.compare.count() == 3, timeout=SHORT)
    panel.follow(str(tmp_path / "run-a"))
    panel.compare.setCurrentIndex(panel.compare.findData(str(tmp_path / "run-b")))
    panel.compare.setCurrentIndex(0)  # changed back before run-b was read
    assert QThreadPool.globalInstance().waitForDone(SHORT)
    qtbot.wait(100)  # the queued results of the finished reads are delivered
    assert panel.compare.currentData() == "" and panel.plots.overlay is None


def fake_run(path: Path, status: dict, ckpts: int = 2) -> Path:
    """A run folder as the launcher leaves it: status.json, one metric line, ``ckpts`` checkpoint folders."""
    write_metrics(path, 0, range(1, 3))
    for i in range(ckpts):
        (path / "checkpoints" / f"step_{i:06d}").mkdir(parents=True)
        (path / "checkpoints" / f"step_{i:06d}" / ".metadata").write_bytes(b"")
    (path / "status.json").write_text(json.dumps(status))
    return path


def test_buttons_follow_the_shown_runs_state(qtbot, panel, tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        running = fake_run(tmp_path / "running", {"state": "running", "pid": live.pid, "scheduler": "local",
                                                  "start_time": time.time()})
        done = fake_run(tmp_path / "done", {"state": "finished", "explanation": "success"})
        panel.follow(str(running))
        qtbot.waitUntil(lambda: panel.stop_button.isEnabled() and panel.ckpt_list.count() == 2, timeout=SHORT)
        panel.ckpt_list.item(0).setSelected(True)
        assert not panel.resume_button.isEnabled()  # running: stop it first
        panel.follow(str(done))
        assert not panel.stop_button.isEnabled()  # at once, not at the next poll: Stop would stop another run
        qtbot.waitUntil(lambda: header_state(panel) == "finished" and panel.ckpt_list.count() == 2, timeout=SHORT)
        assert not panel.resume_button.isEnabled() and not panel.compare_button.isEnabled()
        panel.ckpt_list.item(0).setSelected(True)
        assert panel.resume_button.isEnabled() and not panel.compare_button.isEnabled()
        panel.ckpt_list.item(1).setSelected(True)
        assert panel.compare_button.isEnabled() and not panel.resume_button.isEnabled()
        update_status(running, stop_requested=time.time())  # a stop under way (from the CLI, say)
        panel.follow(str(running))
        qtbot.waitUntil(lambda: "stopping: SIGTERM" in panel.status.text(), timeout=SHORT)
        assert header_state(panel) == "running" and not panel.stop_button.isEnabled()
    finally:
        live.kill()
        live.wait(60)


def test_header_names_the_rank_that_was_killed(qtbot, panel, tmp_path):
    """A rank killed by SIGKILL (the OOM killer's signal) writes no exit record; the other ranks then fail
    with gloo's "Connection reset by peer". The header names the killed rank first, from torchrun's own
    root-cause report, and the run is failed (not stoppable, resumable)."""
    small_form(panel)
    panel.show()
    assert panel.start_run()
    qtbot.waitUntil(lambda: bool(panel.launchers), timeout=SHORT)
    run_dir = next(iter(panel.launchers))
    qtbot.waitUntil(lambda: panel.plots.curve_points(("raw", 1)) >= 2, timeout=LONG)
    workers = psutil.Process(panel.launchers[run_dir].proc.pid).children(recursive=True)
    rank1 = next(p for p in workers if p.environ().get("RANK") == "1")
    rank1.kill()
    qtbot.waitUntil(lambda: header_state(panel) == "failed", timeout=LONG)
    text = panel.status.text()
    assert "rank 1 killed by SIGKILL (often the out-of-memory killer" in text, text
    assert " failed: " not in text or text.index("rank 1 killed") < text.index(" failed: ")  # the cause first
    assert torchrun_root_cause(run_dir) == (1, -9) and run_status(run_dir)["root_cause_rank"] == 1
    assert not panel.stop_button.isEnabled() and panel.details_button.isVisible()
    qtbot.waitUntil(lambda: panel.run_state(run_dir) == "failed", timeout=SHORT)


def test_ranks_end_when_torchrun_is_killed(qtbot, panel, tmp_path):
    """torchrun killed by SIGKILL cannot end its ranks: they used to train on, re-parented, while the run
    read "failed" and Stop was off. They now end themselves, and the header says torchrun was killed."""
    small_form(panel)
    assert panel.start_run()
    qtbot.waitUntil(lambda: bool(panel.launchers), timeout=SHORT)
    run_dir = next(iter(panel.launchers))
    qtbot.waitUntil(lambda: panel.plots.curve_points(("raw", 1)) >= 2, timeout=LONG)
    torchrun = psutil.Process(read_status(run_dir)["pid"])
    ranks = [p for p in torchrun.children(recursive=True) if "worker_entry" in " ".join(p.cmdline())]
    assert len(ranks) == 2
    torchrun.kill()
    try:
        qtbot.waitUntil(lambda: header_state(panel) == "failed", timeout=LONG)
        assert "killed by SIGKILL" in panel.status.text()
        _gone, alive = psutil.wait_procs(ranks, timeout=SHORT / 1000)
        assert not alive, alive
    finally:
        for p in ranks:  # nothing left training, whatever happened above
            if p.is_running():
                p.kill()
    logs = [(Path(run_dir) / "logs" / f"rank_{r}.log").read_text() for r in (0, 1)]
    assert any("torchrun (pid" in text for text in logs)  # the first to notice says why (the other may fail first)
    qtbot.waitUntil(lambda: panel.run_state(run_dir) == "failed", timeout=SHORT)
    assert not panel.stop_button.isEnabled()


WORLD_SIZE_SCRIPT = textwrap.dedent("""
    import os
    run = os.environ["SHARDSCOPE_RUN_DIR"]
    with open(os.path.join(run, f"seen_{os.environ['RANK']}"), "w") as f:
        f.write(f"{os.environ['WORLD_SIZE']} {os.path.basename(os.environ['SHARDSCOPE_RESUME'])}")
""")


def test_resume_from_the_window_runs_on_the_forms_processes_and_says_so(qtbot, panel, tmp_path, fixtures):
    """With Processes set to 3, Resume from selected on a 2-rank run's checkpoint resumed on 2 ranks, silently
    (config.json said 2). The CLI resumes at another world size (DCP reshards on load); the window does too, and
    says what it does."""
    script = tmp_path / "world.py"
    script.write_text(WORLD_SIZE_SCRIPT)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(fixtures["fsdp2_r2"], run / "checkpoints" / "step_000020")  # written by 2 ranks
    config = RunConfig(nproc=2, script=str(script))
    (run / "config.json").write_text(json.dumps(config.record()))
    (run / "status.json").write_text(json.dumps({"state": "finished", "scheduler": "local"}))
    panel.follow(str(run))
    qtbot.waitUntil(lambda: header_state(panel) == "finished" and panel.ckpt_list.count() == 1, timeout=SHORT)
    panel.form.nproc.setValue(3)
    panel.ckpt_list.item(0).setSelected(True)
    panel.resume_button.click()
    assert "on 3 process" in panel.status.text()
    qtbot.waitUntil(lambda: str(run) in panel.launchers, timeout=SHORT)
    assert read_config(run)["nproc"] == 3
    said = "step 20 of a 2-rank run on 3 ranks"
    qtbot.waitUntil(lambda: said in panel.status.text(), timeout=SHORT)  # "resuming ..." while it runs
    qtbot.waitUntil(lambda: header_state(panel) == "finished", timeout=LONG)
    assert f"launched to resume {said}" in panel.status.text()  # once over, what is true then
    seen = sorted((run / f"seen_{r}").read_text() for r in range(3))
    assert seen == ["3 step_000020"] * 3  # three ranks resumed from it
    assert f"resuming {said}" in (run / "logs" / "launcher.log").read_text()


def test_the_mean_of_ranks_is_taken_step_by_step_after_a_resume_on_more_ranks(qtbot, panel, tmp_path):
    """A 2-rank run resumed from step 10 on 3 ranks: the mean of ranks was taken record by record, so rank 2's
    steps 11-30 were averaged into steps 1-20 (the black curve lay below both ranks before the resume)."""
    run = tmp_path / "run"
    for rank, value in ((0, 1.0), (1, 3.0)):
        write_metrics(run, rank, range(1, 21), t0=time.time() - 86400, loss=lambda s, v=value: v)
    for rank, value in ((0, 1.0), (1, 3.0), (2, 5.0)):
        write_metrics(run, rank, range(11, 31), loss=lambda s, v=value: v)
    panel.follow(str(run))
    qtbot.waitUntil(lambda: panel.plots.curve_points(("raw", 2)) == 20 and
                    panel.plots.curve_points(("mean",)) >= 30, timeout=10000)
    curve = panel.plots._curves[("mean",)]
    by_step: dict[float, list[float]] = {}
    for x, y in zip(curve.xData, curve.yData, strict=True):
        if x == x and y == y:
            by_step.setdefault(float(x), []).append(float(y))
    assert all(v == pytest.approx(2.0) for s in range(1, 11) for v in by_step[s]), by_step  # ranks 0 and 1
    assert all(v == pytest.approx(3.0) for s in range(21, 31) for v in by_step[s]), by_step  # ranks 0, 1 and 2


def test_a_run_without_steps_says_so_instead_of_empty_axes(qtbot, panel, tmp_path):
    """A run started from the panel showed empty loss and memory axes from 0 to 1 (0.1 ... 0.9) until its first
    step, as if that were data; the loss plot says no step was reported yet, until one is drawn."""
    from shardscope.widgets.run_plots import NO_STEPS

    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    panel.follow(str(run))
    qtbot.waitUntil(lambda: panel.plots.follower is not None, timeout=10000)
    note = panel.plots.no_steps
    assert note.isVisible() and note.toPlainText() == NO_STEPS and note in panel.plots.loss.getPlotItem().items
    write_metrics(run, 0, range(1, 11))
    write_metrics(run, 1, range(1, 11))
    qtbot.waitUntil(lambda: panel.plots.curve_points(("raw", 0)) == 10, timeout=10000)
    assert not note.isVisible()


def test_a_resume_stopped_before_its_first_step_is_not_still_resuming(tmp_path):
    """The header said "resuming step 40 ..." above "stopped by the user" after a resumed run was stopped early:
    once the run is over it says what is true then."""
    from shardscope.backend.runs.follow import RunSnapshot
    from shardscope.widgets.run_header import header_html

    note = "resuming step 40 of a 2-rank run on 3 ranks (DCP reshards it as it loads)"
    follower = RunFollower(tmp_path)
    live = header_html(follower, RunSnapshot(status={"state": "running", "resumed": note}), False, {})
    assert note in live
    over = header_html(follower, RunSnapshot(status={"state": "stopped", "resumed": note,
                                                     "explanation": "stopped by the user"}), False, {})
    assert "resuming" not in over and "launched to resume step 40 of a 2-rank run on 3 ranks<br>" in over


def test_runs_are_listed_by_start_time_and_the_csv_writes_counts_as_integers(qtbot, panel, tmp_path):
    """The Runs and "Compare loss with" lists followed the folders' modification times (a finished run whose folder
    was touched later, by an export, jumped above the runs started after it): now their start time. Save CSV wrote
    steps and RSS as floats (``1.0``, ``104857600.0``): now whole numbers."""
    now = time.time()
    for name, started_ago in (("first", 3 * 3600), ("second", 2 * 3600), ("third", 3600)):
        run = fake_run(tmp_path / name, {"state": "finished", "start_time": now - started_ago})
        os.utime(run, (now - 4 * 3600, now - 4 * 3600))
    os.utime(tmp_path / "first", None)  # the oldest run's folder changed last
    panel.refresh_runs()
    qtbot.waitUntil(lambda: panel.run_list.count() == 3, timeout=SHORT)
    names = [panel.run_list.item(i).data(Qt.ItemDataRole.UserRole) for i in range(3)]
    assert [os.path.basename(n) for n in names] == ["third", "second", "first"]
    panel.follow(str(tmp_path / "third"))
    assert [panel.compare.itemText(i) for i in range(panel.compare.count())] == ["(none)", "second", "first"]
    qtbot.waitUntil(lambda: bool(panel.follower.series), timeout=SHORT)
    header, *rows = panel.follower.csv().splitlines()
    columns = header.split(",")
    first = dict(zip(columns, rows[0].split(","), strict=True))
    assert first["step"] == "1" and first["rss"] == str(100 * 2**20), rows[0]
    assert float(first["loss"]) == 5.0 and first["tokens_per_s"] == "1000.0"


def test_the_form_shows_the_run_it_starts(qtbot, panel, tmp_path):
    """The demo runs 30 steps with a checkpoint every 10 while the form showed its own 200 and 50."""
    from dataclasses import replace

    from shardscope.app.first_run import demo_config

    assert (panel.form.steps.value(), panel.form.ckpt_every.value()) == (200, 50)
    config = replace(demo_config(), resume=str(tmp_path / "no-such-checkpoint"))  # refused: nothing is launched
    assert not panel.start_run(str(tmp_path / "r"), config)
    assert (panel.form.steps.value(), panel.form.ckpt_every.value()) == (demo_config().steps, 10)
    assert panel.form.nproc.value() == 2 and panel.form.strategy.currentText() == "fsdp"


def test_the_window_flags_stalls_by_the_runs_own_stall_seconds(qtbot, panel, tmp_path):
    """`train --stall-seconds 5` warned after 5 s but the window, following the run, waited its form's 60 s:
    the run records its limit in config.json and the window uses it; a run without one keeps the default."""
    from shardscope.app.cli.main import build_parser
    from shardscope.app.cli.train import run_config

    args = build_parser()[0].parse_args(["train", "--stall-seconds", "5", "--steps", "10"])
    assert RunConfig.from_record(run_config(args).record()).stall_seconds == 5  # what `train` records
    for run, config in ((tmp_path / "quick", run_config(args)), (tmp_path / "plain", RunConfig())):
        run.mkdir()
        (run / "config.json").write_text(json.dumps(config.record()))
    quick, plain = tmp_path / "quick", tmp_path / "plain"
    for run in (quick, plain):
        (run / "status.json").write_text(json.dumps({"state": "running", "start_time": time.time() - 30}))
        write_metrics(run, 0, range(1, 4), t0=time.time() - 20)  # rank 0's last step 20 s ago
    panel.follow(str(quick))
    qtbot.waitUntil(lambda: "stalled" in panel.status.text(), timeout=SHORT)
    assert "no new step from rank(s) 0 for 5 s" in panel.status.text()
    panel.follow(str(plain))
    qtbot.waitUntil(lambda: "plain" in panel.status.text() and "step 3" in panel.status.text(), timeout=SHORT)
    assert "stalled" not in panel.status.text() and panel.follower.stall_limit == 60
