"""The ranks view (widgets/ranks_view.py): a click on a rank filters the tree and highlights its chunks."""

from __future__ import annotations

import pytest
from gui_support import leaf_paths, no_thread_left_running, open_view  # noqa: F401  (an autouse fixture)

pytestmark = pytest.mark.gui


def test_rank_click_filters_tree_and_highlights(qtbot, fixtures):
    view = open_view(qtbot, fixtures["ddp_r2"])
    before = set(leaf_paths(view.proxy))
    view.ranks.select_rank(1)
    after = set(leaf_paths(view.proxy))
    ck = view.data.ckpt
    expected = {t.fqn for t in ck.tensors if 1 in t.ranks} | {o.fqn for o in ck.objects if o.rank == 1}
    assert after == expected and after < before
    view.ranks.select_rank(None)
    assert set(leaf_paths(view.proxy)) == before


def test_the_ranks_note_is_read_whole_at_1280x720(qtbot, fixtures):
    """At 1280x720 the Ranks tab's note ran under its "log scale" box: "... hover for exact v"."""
    from gui_support import label_fits, wait_loaded
    from PySide6.QtWidgets import QApplication
    from shardscope.app.main_window import MainWindow

    win = MainWindow()
    qtbot.addWidget(win)
    win.quiet = True
    for size in ((1280, 720), (1024, 768), (1920, 1080)):
        win.resize(*size)
        win.show()
        view = win.current_view() or win.open_path(str(fixtures["fsdp2_r2"]))
        wait_loaded(qtbot, view)
        view.show_tab("ranks")
        for _ in range(5):
            QApplication.processEvents()
        note = view.ranks.hover
        assert note.isVisible() and note.text().endswith("hover for exact values.")
        assert label_fits(note), (size, note.width())
        assert note.geometry().right() < view.ranks.log_box.geometry().left()
