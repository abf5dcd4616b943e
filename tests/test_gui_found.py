"""Bugs found by clicking the real window for a long time (Xvfb), each pinned by a test on real widgets."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QThreadPool
from PySide6.QtWidgets import QApplication
from shardscope.widgets.checkpoint_view import CheckpointView


@pytest.fixture(autouse=True)
def no_thread_left_running():
    yield
    assert QThreadPool.globalInstance().waitForDone(10000), "a background worker was left running"


def open_view(qtbot, path) -> CheckpointView:
    view = CheckpointView(str(path))
    qtbot.addWidget(view)
    view.resize(1200, 800)
    view.show()
    with qtbot.waitSignal(view.loaded, timeout=120000):
        view.load()
    return view


def min_width(widget) -> int:
    """The widget's minimum width once Qt has run the layout requests its labels posted."""
    for _ in range(5):
        QApplication.processEvents()
    return widget.minimumSizeHint().width()


def test_value_read_error_does_not_widen_the_window(qtbot, copy_of):
    """A chunk in a truncated file: the inspector's one-line error (a long path) used to set the view's
    minimum width to the whole line (1528 px), so the main window grew past a 1280 px screen."""
    ckpt = copy_of("fsdp2_r2")
    data = ckpt / "__1_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(50000)
    view = open_view(qtbot, ckpt)
    before = min_width(view)
    with qtbot.waitSignal(view.valuesDone, timeout=120000):
        assert view.select_path("optimizer.state.head.weight.exp_avg_sq")
    assert "truncated" in view.inspector.stats.text()
    assert min_width(view) <= max(before, 700)


def test_long_tensor_name_does_not_widen_the_window(qtbot, tmp_path):
    """A transformers-style optimizer key (long FQN) in the inspector title must not set the minimum width."""
    import torch
    import torch.distributed.checkpoint as dcp

    name = "optimizer.state." + ".".join(["model.decoder.layers.31.self_attn.q_proj_with_a_long_name"] * 3)
    dcp.save({name: torch.zeros(4, 3)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    view = open_view(qtbot, tmp_path / "ck")
    before = min_width(view)
    with qtbot.waitSignal(view.valuesDone, timeout=120000):
        assert view.select_path(name)
    assert name in view.inspector.title.text()
    assert min_width(view) <= max(before, 700)
