"""The checkpoint view (widgets/checkpoint_view.py): the header, and Down from the filter box into the tree."""

from __future__ import annotations

import pytest
from gui_support import no_thread_left_running, open_view  # noqa: F401  (an autouse fixture)
from PySide6.QtCore import Qt
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication

pytestmark = pytest.mark.gui


def test_header_names_the_format_and_counts_ranks_in_words(qtbot, fixtures):
    """The header said "1 writer ranks" for a one-process save and showed the raw format id "hf-safetensors"."""
    view = open_view(qtbot, fixtures["nopg"])
    assert "1 writer rank ·" in view.header.text()
    view = open_view(qtbot, fixtures["hf_r2"])
    assert "hf-safetensors" not in view.header.text() and "safetensors files" in view.header.text()


def test_down_in_the_filter_box_goes_on_to_the_matches(qtbot, fixtures):
    """Ctrl+F, type, then Down (or Enter) did nothing: the focus stayed in the filter box, so the tree could not
    be reached without the mouse."""
    view = open_view(qtbot, fixtures["fsdp2_r2"])
    view.focus_filter()
    QTest.keyClicks(view.filter_edit, "fc1.weight")
    QTest.keyClick(view.filter_edit, Qt.Key.Key_Down)
    assert view.tree.hasFocus() or QApplication.focusWidget() is view.tree
    assert view.selected_node() is not None
    assert "fc1" in view.selected_node().path  # the first match, filtered with what was typed at once
    QTest.keyClick(view.tree, Qt.Key.Key_Down)  # and on through the matches with the arrows
    assert view.selected_node() is not None
