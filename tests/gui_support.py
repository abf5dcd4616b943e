"""What the window tests share: opening a checkpoint view and waiting for it, the tree's leaf paths, a widget's
settled minimum width, and the check that no background worker outlives a test (import
``no_thread_left_running`` into a test module to use it)."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QThreadPool
from PySide6.QtWidgets import QApplication
from shardscope.backend.checkpoint.tree import TreeNode
from shardscope.widgets.checkpoint_view import CheckpointView
from shardscope.widgets.tensor_tree import NodeRole


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


def wait_loaded(qtbot, view: CheckpointView) -> None:
    """Wait until a view opened elsewhere (the window's open_path) has its tree and analysis shown."""
    qtbot.waitUntil(lambda: view.data is not None and view.data.problems is not None and view.progress.isHidden(),
                    timeout=120000)


def leaf_paths(model, parent=None):
    from PySide6.QtCore import QModelIndex

    parent = parent or QModelIndex()
    out = []
    for r in range(model.rowCount(parent)):
        idx = model.index(r, 0, parent)
        node: TreeNode = idx.data(NodeRole)
        if node.entry is not None:
            out.append(node.path)
        out += leaf_paths(model, idx)
    return out


def min_width(widget) -> int:
    """The widget's minimum width once Qt has run the layout requests its labels posted."""
    for _ in range(5):
        QApplication.processEvents()
    return widget.minimumSizeHint().width()


def label_fits(label) -> bool:
    """Every line of a label's text is shown whole: one line no wider than the label, or wrapped lines no taller."""
    rect = label.contentsRect()
    if label.wordWrap():
        return label.heightForWidth(rect.width()) <= rect.height()
    return label.sizeHint().width() <= rect.width()
