"""Following runs that log with TensorBoard or Lightning's CSVLogger instead of report(): real writers
(torch.utils.tensorboard.SummaryWriter, lightning's CSVLogger) writing while the follower reads."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from shardscope.backend.runs.follow import EXTERNAL_BASE, RunFollower
from shardscope.backend.runs.metric_logs import field_for
from shardscope.backend.runs.rundir import checkpoints, is_run_dir, scalar_logs
from torch.utils.tensorboard import SummaryWriter

pytestmark = pytest.mark.slow


def test_tag_names_map_to_fields():
    assert field_for("train/loss") == field_for("train_loss") == field_for("loss_step") == "loss"
    assert field_for("Loss/train") == "loss"
    assert field_for("lr-AdamW") == field_for("learning_rate") == "lr"
    assert field_for("val_loss") is None and field_for("val/loss") is None and field_for("epoch") is None
    assert field_for("gpu_memory_allocated") == "cuda_allocated"


def test_summary_writer_read_live_while_it_writes(tmp_path):
    run = tmp_path / "tb_run"
    writer = SummaryWriter(log_dir=str(run / "tb"))
    follower = RunFollower(run)
    try:
        for step in range(1, 11):
            writer.add_scalar("train/loss", 5.0 / step, step)
            writer.add_scalar("lr", 1e-3, step)
            writer.add_scalar("val/loss", 99.0, step)
        writer.flush()
        assert is_run_dir(run)
        follower.poll()
        s = follower.series[EXTERNAL_BASE]
        assert list(s.column("step")) == list(range(1, 11))
        assert np.allclose(s.column("loss"), [5.0 / k for k in range(1, 11)])
        assert np.allclose(s.column("lr"), 1e-3)
        assert follower.label(EXTERNAL_BASE) == "TensorBoard: tb"
        for step in range(11, 16):  # the writer keeps writing; only the new points arrive
            writer.add_scalar("train/loss", 5.0 / step, step)
        writer.flush()
        snap = follower.poll()
        assert snap.new_points == 5
        assert list(follower.series[EXTERNAL_BASE].column("step")) == list(range(1, 16))
    finally:
        writer.close()


def test_lightning_csv_logger_read_live_and_after_a_header_rewrite(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path), name="csvrun")
    run = tmp_path / "csvrun"
    for step in range(5):
        logger.log_metrics({"train_loss": 2.0 - 0.1 * step}, step=step)
    logger.save()
    follower = RunFollower(run)
    follower.poll()
    key = EXTERNAL_BASE
    assert list(follower.series[key].column("step")) == [0, 1, 2, 3, 4]
    assert follower.label(key) == "CSV: version_0"
    # a new column makes Lightning rewrite the file with a new header: the series is read again
    for step in range(5, 8):
        logger.log_metrics({"train_loss": 2.0 - 0.1 * step, "lr-Adam": 0.01}, step=step)
        logger.log_metrics({"val_loss": 3.0}, step=step)
    logger.save()
    snap = follower.poll()
    assert key in snap.replaced
    s = follower.series[key]
    assert list(s.column("step")) == list(range(8))
    assert np.allclose(s.column("loss"), [2.0 - 0.1 * k for k in range(8)])
    assert np.isnan(s.column("lr")[:5]).all() and np.allclose(s.column("lr")[5:], 0.01)
    assert s.restarts == []


def test_a_csv_log_in_the_run_folder_itself_is_named_by_its_file(tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    (run / "metrics.csv").write_text("epoch,step,train_loss\n0,0,2.0\n0,1,1.5\n")
    follower = RunFollower(run)
    follower.poll()
    assert len(follower.series[EXTERNAL_BASE]) == 2
    assert follower.label(EXTERNAL_BASE) == "CSV: metrics.csv"


def test_a_folder_launched_by_hand_shows_its_logs_and_checkpoints(tmp_path):
    """A cluster run's folder: no config.json or status.json, a TensorBoard log and DCP checkpoints."""
    run = tmp_path / "by_hand"
    writer = SummaryWriter(log_dir=str(run / "logs" / "tb"))
    writer.add_scalar("loss", 1.0, 1)
    writer.close()
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(run / "ckpt" / "step_1"))
    (run / "lightning" / "checkpoints").mkdir(parents=True)
    (run / "lightning" / "checkpoints" / "epoch=0-step=1.ckpt").write_bytes(b"x")
    assert is_run_dir(run) and not is_run_dir(run / "ckpt" / "step_1")
    assert [p.name for p in checkpoints(run)] == ["step_1", "epoch=0-step=1.ckpt"]
    assert [p.parent.name for p in scalar_logs(run)] == ["tb"]
    follower = RunFollower(run)
    snap = follower.poll()
    assert snap.status == {} and [p.name for p in snap.checkpoints] == ["step_1", "epoch=0-step=1.ckpt"]
    assert follower.label(EXTERNAL_BASE) == "TensorBoard: logs/tb" and len(follower.series[EXTERNAL_BASE]) == 1


def test_tensorboard_run_in_the_window(tmp_path, qtbot):
    from shardscope.widgets.training_panel import TrainingPanel

    run = tmp_path / "tb_gui"
    writer = SummaryWriter(log_dir=str(run))
    for step in range(1, 21):
        writer.add_scalar("train/loss", 3.0 / step, step)
    writer.close()
    panel = TrainingPanel(runs_root=tmp_path)
    qtbot.addWidget(panel)
    panel.follow(str(run))
    qtbot.waitUntil(lambda: panel.plots.curve_points(("raw", EXTERNAL_BASE)) == 20, timeout=30000)
    qtbot.waitUntil(lambda: "TensorBoard: event files" in panel.plots.legend.text(), timeout=10000)
    panel.shutdown()


def test_gui_command_opens_a_tensorboard_folder(tmp_path):
    run = tmp_path / "tb_cli"
    writer = SummaryWriter(log_dir=str(run))
    for step in range(1, 6):
        writer.add_scalar("loss", 1.0 / step, step)
    writer.close()
    shot = tmp_path / "shot.png"
    proc = subprocess.run([sys.executable, "-m", "shardscope.app.cli", "gui", str(run), "--screenshot", str(shot),
                           "--size", "1280x720"], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert proc.returncode == 0, proc.stderr
    assert shot.stat().st_size > 10_000


@pytest.mark.parametrize("name", ["events.out.tfevents.123.host", "metrics.csv"])
def test_empty_logs_are_harmless(tmp_path, name):
    run = tmp_path / "empty"
    run.mkdir()
    (run / name).write_bytes(b"")
    snap = RunFollower(run).poll()
    assert snap.new_points == 0 and not snap.problems


def test_a_model_folder_with_config_json_is_not_a_run(tmp_path):
    """An HF model folder (an export with --config, a from_pretrained folder) has a config.json, as our runs
    do: ``gui FOLDER`` opened an empty Training tab on it instead of the checkpoint."""
    from safetensors.torch import save_file

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.ones(2)}, str(model / "model.safetensors"))
    assert not is_run_dir(model)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    assert not is_run_dir(bare)  # a config.json of anything, with no run status, metrics or logs
    (bare / "status.json").write_text('{"state": "running"}')
    assert is_run_dir(bare)


def _report_steps(run, rank: int, steps: int, seconds_per_step: float) -> None:
    """Rank ``rank`` of a run reports ``steps`` steps through report(), in a process of its own; its records'
    times ``seconds_per_step`` apart (a slow model), as the launcher's ranks write them."""
    code = ("import sys, time; from shardscope import report\n"
            "t0 = time.time()\n"
            "for s in range(1, int(sys.argv[1]) + 1):\n"
            "    report(step=s, loss=float(s + 10 * int(sys.argv[3])), time=t0 + s * float(sys.argv[2]))\n")
    subprocess.run([sys.executable, "-c", code, str(steps), str(seconds_per_step), str(rank)], check=True,
                   env={**os.environ, "SHARDSCOPE_RUN_DIR": str(run), "RANK": str(rank)})


def test_progress_says_how_many_ranks_the_loss_covers_and_slow_steps_read_as_seconds(tmp_path):
    """Rank 1 stalled at step 2 while rank 0 reached step 3: the header's "loss (mean of ranks)" was rank 0's
    loss alone; it says it is the mean of 1 of 2 ranks. 45 s a step read "0.0 steps/s"."""
    run = tmp_path / "run"
    _report_steps(run, 0, 3, 45.0)
    _report_steps(run, 1, 2, 45.0)
    follower = RunFollower(run)
    follower.poll()
    line = follower.progress(10)
    assert "step 3/10" in line and "loss (mean of 1 of 2 ranks) 3.0000" in line
    assert "45 s/step" in line and "steps/s" not in line
    _report_steps(run, 1, 3, 45.0)  # rank 1 catches up (a second process appends steps 1-3 again)
    follower.poll()
    assert "loss (mean of ranks) 8.0000" in follower.progress(10)
