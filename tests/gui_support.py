"""What the window tests share: opening a checkpoint view and waiting for it, and the check that no
background worker outlives a test (import ``no_thread_left_running`` into a test module to use it)."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QThreadPool
from shardscope.widgets.checkpoint_view import CheckpointView


@pytest.fixture(autouse=True)
def no_thread_left_running():
    yield
    assert QThreadPool.globalInstance().waitForDone(10000), "a background worker was left running"


def open_view(qtbot, path) -> CheckpointView:
    """A CheckpointView of ``path``, shown at 1200x800, once its checkpoint has loaded."""
    view = CheckpointView(str(path))
    qtbot.addWidget(view)
    view.resize(1200, 800)
    view.show()
    with qtbot.waitSignal(view.loaded, timeout=120000):
        view.load()
    return view
