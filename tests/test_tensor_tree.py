"""The tensor tree (widgets/tensor_tree.py) in a checkpoint view: every entry, the filter, the current row
highlighted on focus."""

from __future__ import annotations

from gui_support import leaf_paths, no_thread_left_running, open_view  # noqa: F401  (an autouse fixture)
from PySide6.QtCore import Qt
from shardscope.widgets.tensor_tree import TensorTreeModel


def test_tree_has_every_entry(qtbot, qtmodeltester, fixtures):
    view = open_view(qtbot, fixtures["fsdp2_r2"])
    ck = view.data.ckpt
    assert sorted(leaf_paths(view.proxy)) == sorted([t.fqn for t in ck.tensors] + [o.fqn for o in ck.objects])
    qtmodeltester.check(TensorTreeModel(view.data.tree, view.data.values))


def test_filter_narrows_rows(qtbot, fixtures):
    view = open_view(qtbot, fixtures["fsdp2_r2"])
    view.filter_edit.setText("fc1.weight")
    qtbot.waitUntil(lambda: len(leaf_paths(view.proxy)) < 10, timeout=120000)
    assert set(leaf_paths(view.proxy)) == {
        "model.blocks.0.fc1.weight", "model.blocks.1.fc1.weight",
        "optimizer.state.blocks.0.fc1.weight.exp_avg", "optimizer.state.blocks.0.fc1.weight.exp_avg_sq",
        "optimizer.state.blocks.1.fc1.weight.exp_avg", "optimizer.state.blocks.1.fc1.weight.exp_avg_sq",
        "optimizer.state.blocks.0.fc1.weight.step", "optimizer.state.blocks.1.fc1.weight.step"}
    view.filter_mode.setCurrentText("regex")
    view.filter_edit.setText(r"^model\.head\.")
    qtbot.waitUntil(lambda: set(leaf_paths(view.proxy)) == {"model.head.weight", "model.head.bias"}, timeout=120000)


def test_the_row_the_tree_makes_current_on_focus_is_highlighted(qtbot, fixtures):
    """Tabbing into the tensor tree (or activating the window) made its first row current without selecting it:
    the shard map drew "model: 15 tensors stacked" while no row of the tree was highlighted."""
    from gui_support import open_view
    from PySide6.QtCore import QEvent
    from PySide6.QtGui import QFocusEvent
    from PySide6.QtWidgets import QApplication

    view = open_view(qtbot, fixtures["fsdp2_r2"])
    assert not view.tree.currentIndex().isValid() and view.selected_node() is None
    QApplication.sendEvent(view.tree, QFocusEvent(QEvent.Type.FocusIn, Qt.FocusReason.TabFocusReason))
    current = view.tree.currentIndex()
    assert current.isValid() and view.selected_node() is not None  # what Qt does on focus, and what the map shows
    assert view.tree.selectionModel().isSelected(current)
    assert [i.row() for i in view.tree.selectionModel().selectedRows(0)] == [current.row()]
