"""The Compare pickers (app/compare_picker.py): they start on the checkpoints open in the window."""

from __future__ import annotations

import pytest
from gui_support import no_thread_left_running  # noqa: F401  (an autouse fixture)

pytestmark = pytest.mark.gui

SLOW = 120000  # ms: a checkpoint load or a background read on a loaded 2-core machine


def test_compare_pickers_start_on_the_checkpoints_open_in_the_window(qtbot, window, fixtures, tmp_path):
    """With two checkpoints open, Ctrl+D's pickers offered them but preselected the Library's two newest
    checkpoints instead; OK compared two checkpoints the user was not looking at."""
    import shutil

    ckpts = tmp_path / "root" / "runA" / "checkpoints"
    for i, name in enumerate(("fsdp2_r2", "ddp_r2")):
        shutil.copytree(fixtures[name], ckpts / f"step_{i:06d}")
    window.library.user_roots = [str(tmp_path / "root")]
    window.library.poll(force=True)
    qtbot.waitUntil(lambda: len(window.library.known_paths()) >= 2, timeout=SLOW)
    a, b = (window.open_path(str(fixtures[n])) for n in ("fsdp2_r4", "ddp_r2"))
    qtbot.waitUntil(lambda: a.data is not None and b.data is not None, timeout=SLOW)
    picker = window.compare_dialog()
    try:
        assert [box.currentText() for box in picker.boxes] == [a.path, b.path]
        offered = [picker.boxes[0].itemText(i) for i in range(picker.boxes[0].count())]
        assert set(window.library.known_paths()) <= set(offered)  # the Library's are still offered
    finally:
        picker.reject()
        window.library.shutdown()


def test_typing_in_a_replaces_the_proposal_and_a_failed_pair_gets_its_own_title(qtbot, window, fixtures, tmp_path):
    """The A field arrived filled and unselected: typing a path appended it to the proposal
    (…/step_000030/tmp/nu/bigrun/…), and the error landed in a tab whose title read like the previous pair's
    (two runs' step_000020 ↔ step_000030 look the same)."""
    import shutil

    from PySide6.QtWidgets import QApplication
    from shardscope.widgets.compare_view import CompareView

    ckpts = tmp_path / "runA" / "checkpoints"
    for step, name in ((20, "fsdp2_r2"), (30, "ddp_r2")):
        shutil.copytree(fixtures[name], ckpts / f"step_{step:06d}")
    a, b = str(ckpts / "step_000020"), str(ckpts / "step_000030")
    views = [window.open_path(p) for p in (a, b)]  # the pickers propose the checkpoints open in the window
    qtbot.waitUntil(lambda: all(v.data is not None for v in views), timeout=SLOW)
    first = window.compare(a, b)
    qtbot.waitUntil(lambda: first.result is not None, timeout=SLOW)
    first_title = window.tabs.tabText(window.tabs.indexOf(first))
    assert first_title == "step_000020 ↔ step_000030"
    window.resize(1280, 720)
    window.show()
    qtbot.waitExposed(window)
    picker = window.compare_dialog()
    try:
        picker.activateWindow()
        qtbot.waitUntil(lambda: QApplication.activeWindow() is picker, timeout=10000)
        assert picker.boxes[0].currentText() == a  # a proposal is there ...
        typed = str(tmp_path / "runB" / "checkpoints" / "step_000020")  # ... and typing replaces it
        qtbot.keyClicks(QApplication.focusWidget(), typed)
        assert picker.boxes[0].currentText() == typed
        picker.boxes[1].setCurrentText(b)
        picker.accept()
    finally:
        picker.reject()
    failed = window.tabs.currentWidget()
    assert isinstance(failed, CompareView) and failed is not first and failed.path_a == typed
    qtbot.waitUntil(lambda: failed.progress.isHidden(), timeout=SLOW)
    assert "runB" in failed.summary.text() and failed.result is None  # the error names the path that failed
    title = window.tabs.tabText(window.tabs.indexOf(failed))
    assert title == "✕ runB/step_000020 ↔ runA/step_000030" and title != first_title


def test_ok_waits_for_both_checkpoints(qtbot, window, fixtures):
    """With one checkpoint open and the Library not scanned yet, A arrived empty; OK (or Enter) closed the picker
    and compared nothing, without a word. OK is enabled once A and B both name a checkpoint."""
    from PySide6.QtCore import Qt
    from PySide6.QtTest import QTest
    from PySide6.QtWidgets import QApplication, QDialogButtonBox

    view = window.open_path(str(fixtures["fsdp2_r2"]))
    qtbot.waitUntil(lambda: view.data is not None, timeout=SLOW)
    picker = window.compare_dialog()
    ok = picker.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Ok)
    try:
        a, b = picker.boxes
        a.setCurrentText("")
        assert b.currentText() == view.path and not ok.isEnabled()
        QTest.keyClick(a, Qt.Key.Key_Return)  # Enter does not compare nothing either
        QApplication.processEvents()
        assert picker.isVisible()
        a.setFocus()
        QTest.keyClicks(a, str(fixtures["fsdp2_r4"]))
        assert ok.isEnabled()
    finally:
        picker.reject()
        window.library.shutdown()
