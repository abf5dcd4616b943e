"""The tensor tree (widgets/tensor_tree.py) in a checkpoint view: every entry, the filter, the current row
highlighted on focus."""

from __future__ import annotations

import pytest
from gui_support import leaf_paths, no_thread_left_running, open_view  # noqa: F401  (an autouse fixture)
from PySide6.QtCore import Qt
from shardscope.widgets.tensor_tree import TensorTreeModel

pytestmark = pytest.mark.gui


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


def shown_name(tree, index) -> str:
    """The name as the tree paints it in its cell: elided by the column's delegate to the cell's text room."""
    from PySide6.QtWidgets import QStyle, QStyleOptionViewItem

    option = QStyleOptionViewItem()
    option.initFrom(tree)
    option.rect = tree.visualRect(index)
    delegate = tree.itemDelegateForIndex(index)
    delegate.initStyleOption(option, index)
    margin = tree.style().pixelMetric(QStyle.PixelMetric.PM_FocusFrameHMargin, None, tree) + 1
    return option.fontMetrics.elidedText(option.text, option.textElideMode, option.rect.width() - 2 * margin)


def test_deep_names_stay_apart_in_the_tree(qtbot, fixtures):
    """At 1280x720 the deepest names elided in the middle to "e…g": exp_avg and exp_avg_sq looked the same. The
    tree keeps room for its deepest names, and a name cut short keeps its end."""
    from gui_support import min_width

    view = open_view(qtbot, fixtures["fsdp2_r2"])
    stem = "optimizer.state.blocks.0.fc1.weight."
    for width, height in ((1280, 720), (1920, 1080), (900, 600)):
        view.resize(width, height)
        min_width(view)
        assert view.select_path(stem + "exp_avg_sq")
        qtbot.waitUntil(lambda: view._stats_worker is None, timeout=120000)
        min_width(view)
        names = []
        for leaf in ("exp_avg", "exp_avg_sq"):
            src = view.model.index_for_path(stem + leaf)
            names.append(shown_name(view.tree, view.proxy.mapFromSource(view.rank_proxy.mapFromSource(src))))
        assert names == ["exp_avg", "exp_avg_sq"], (width, names)
    delegate = view.tree.itemDelegateForColumn(0)  # too narrow for a whole name: its end is kept
    view.tree.setColumnWidth(0, view.tree.indentation() * 8 + 30)
    src = view.model.index_for_path(stem + "exp_avg_sq")
    shown = shown_name(view.tree, view.proxy.mapFromSource(view.rank_proxy.mapFromSource(src)))
    assert delegate is not None and shown.startswith("…") and shown.endswith("sq"), shown


def _narrow_saved_layout() -> None:
    """The splitter state a session at another size left: the tree at 40 % of 1262 px (503 px)."""
    from PySide6.QtWidgets import QLabel, QSplitter
    from shardscope.app.settings import settings

    split = QSplitter()
    split.addWidget(QLabel())
    split.addWidget(QLabel())
    split.resize(1262, 400)
    split.setSizes([503, 755])
    settings().setValue("splitters/main", split.saveState())


def test_every_column_and_the_deepest_names_fit_at_1280_and_1024(qtbot, fixtures):
    """At 1280x720 with the layout an earlier session saved, the ranks column was cut at the tree's right edge
    ("ran", "0-1") once the name column kept room for the deepest names; at 1024x768 the tree scrolled sideways
    from the start. The tree side is widened to what its columns need, as far as the detail side allows."""
    from gui_support import wait_loaded
    from PySide6.QtWidgets import QApplication
    from shardscope.app.main_window import MainWindow
    from shardscope.app.settings import settings

    stem = "optimizer.state.blocks.0.fc1.weight."
    try:
        for (width, height), saved in (((1280, 720), True), ((1024, 768), False), ((1920, 1080), True)):
            settings().remove("splitters")
            if saved:
                _narrow_saved_layout()
            win = MainWindow()
            qtbot.addWidget(win)
            win.quiet = True
            win.resize(width, height)
            win.show()
            qtbot.waitExposed(win)
            view = win.open_path(str(fixtures["fsdp2_r2"]))
            wait_loaded(qtbot, view)
            assert view.select_path(stem + "exp_avg_sq")
            qtbot.waitUntil(lambda v=view: not v.values_pending(), timeout=120000)
            for _ in range(5):
                QApplication.processEvents()
            tree, header = view.tree, view.tree.header()
            right = header.sectionViewportPosition(5) + header.sectionSize(5)
            assert right <= tree.viewport().width(), (width, right, tree.viewport().width())
            assert tree.horizontalScrollBar().maximum() == 0, (width, "the tree scrolls sideways")
            names = []
            for leaf in ("exp_avg", "exp_avg_sq"):
                src = view.model.index_for_path(stem + leaf)
                names.append(shown_name(tree, view.proxy.mapFromSource(view.rank_proxy.mapFromSource(src))))
            assert names == ["exp_avg", "exp_avg_sq"], (width, names)
            win.close()
    finally:
        settings().remove("splitters")
