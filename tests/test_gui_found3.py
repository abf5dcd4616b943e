"""Bugs found by clicking the real window under Xvfb (the third pass), each pinned by a test on real widgets
offscreen."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from gui_support import no_thread_left_running  # noqa: F401  (an autouse fixture)
from PySide6.QtCore import QModelIndex, Qt, QTimer

SLOW = 120000  # ms: a checkpoint load or a background job on a loaded 2-core machine


def aged_copy(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint folder whose files are an hour old (files that changed a moment ago are "writing")."""
    shutil.copytree(src, dst)
    old = time.time() - 3600
    for p in [dst, *dst.iterdir()]:
        os.utime(p, (old, old))
    return dst


@pytest.fixture
def runs_root(tmp_path, fixtures) -> Path:
    """Two runs: runA with three complete checkpoints, runB with one."""
    base = tmp_path.resolve() / "root"
    for i in (1, 2, 3):
        aged_copy(fixtures["fsdp2_r2"], base / "runA" / "checkpoints" / f"step_{i:06d}")
    aged_copy(fixtures["ddp_r2"], base / "runB" / "checkpoints" / "step_000010")
    return base


def library(qtbot, root: Path):
    from shardscope.widgets.library_view import LibraryView

    view = LibraryView([str(root)], None)
    qtbot.addWidget(view)
    view.show()
    qtbot.waitUntil(lambda: view.snapshot is not None and len(view.snapshot.listing.checkpoints) == 4,
                    timeout=SLOW)
    return view


def test_a_second_export_from_the_dialog_can_be_cancelled(qtbot, fixtures, tmp_path):
    """After one export the dialog swaps Cancel for Close; a second export (another destination) then ran with
    only Close, which shut the dialog instead of stopping the export, and Show in folder still pointed at the
    first output."""
    from shardscope.backend.checkpoint.reader import open_checkpoint
    from shardscope.widgets.export_dialog import ExportDialog

    dlg = ExportDialog(open_checkpoint(fixtures["fsdp2_r2"]))
    qtbot.addWidget(dlg)
    dlg.show()
    dlg.dst.setText(str(tmp_path / "a.safetensors"))
    with qtbot.waitSignal(dlg.finished_export, timeout=SLOW) as first:
        dlg.export_button.click()
    assert first.args[0] is not None
    assert dlg.close_button.isVisibleTo(dlg) and not dlg.cancel_button.isVisibleTo(dlg)
    dlg.dst.setText(str(tmp_path / "b.pt"))
    with qtbot.waitSignal(dlg.finished_export, timeout=SLOW) as second:
        dlg.export_button.click()
        # the results arrive through the event loop: this is the dialog while the second export runs
        assert dlg.cancel_button.isVisibleTo(dlg) and dlg.cancel_button.isEnabled()
        assert not dlg.close_button.isVisibleTo(dlg) and not dlg.show_button.isVisibleTo(dlg)
    assert second.args[0] is not None and (tmp_path / "b.pt").exists()
    assert dlg.close_button.isVisibleTo(dlg) and dlg.show_button.isVisibleTo(dlg)


def test_filtering_the_library_by_a_run_name_keeps_its_checkpoints(qtbot, runs_root):
    """Typing a run's name into the Library's filter showed the run ("3 ckpt") with nothing under it to open."""
    view = library(qtbot, runs_root)
    view.filter.setText("runA")
    proxy = view.proxy
    assert proxy.rowCount(QModelIndex()) == 1
    run = proxy.index(0, 0, QModelIndex())
    assert proxy.rowCount(run) == 3
    view.select_paths([str(runs_root / "runA" / "checkpoints" / "step_000002")])
    assert [c.name for c in view.selected_checkpoints()] == ["step_000002"] and view.open_button.isEnabled()
    view.filter.setText("step_000010")  # a checkpoint's name still finds it alone, under its run
    assert proxy.rowCount(QModelIndex()) == 1 and proxy.rowCount(proxy.index(0, 0, QModelIndex())) == 1


def test_the_prune_preview_follows_the_library_after_a_removal(qtbot, runs_root, fixtures):
    """After Move to the trash the preview still listed the removed checkpoints as "remove" with their bytes
    ("Removes 2 of 4"), whatever rule was changed next, and the button stayed disabled for good: the dialog
    planned on the listing it was opened with. Now it follows the Library's scans (a run writing new
    checkpoints too)."""
    from shardscope.widgets.prune_dialog import PruneDialog

    view = library(qtbot, runs_root)
    seen: dict[str, object] = {}

    def drive() -> None:  # runs inside the dialog's exec()
        dlg = view.findChild(PruneDialog)
        if dlg is None or not dlg.isVisible():
            QTimer.singleShot(50, drive)
            return
        try:
            dlg.last_n.setValue(1)
            qtbot.waitUntil(lambda: dlg.plan is not None and len(dlg.plan.remove) == 2, timeout=SLOW)
            with qtbot.waitSignal(dlg.pruned, timeout=SLOW):
                dlg.start_removal(delete=True)
            # the Library rescans; the preview is planned again on what is left
            qtbot.waitUntil(lambda: dlg.plan is not None and len(dlg.plan.decisions) == 2, timeout=SLOW)
            seen["after"] = (dlg.summary.text(), dlg.act_button.isEnabled())
            aged_copy(fixtures["fsdp2_r2"], runs_root / "runA" / "checkpoints" / "step_000004")
            qtbot.waitUntil(lambda: dlg.plan is not None and len(dlg.plan.decisions) == 3, timeout=SLOW)
            seen["new"] = ([d.checkpoint.name for d in dlg.plan.remove], dlg.act_button.isEnabled())
        finally:
            dlg.reject()

    QTimer.singleShot(0, drive)
    view.prune_dialog()
    summary, enabled = seen["after"]
    assert "2 checkpoints deleted" in summary and "Removes 0 of 2 checkpoints" in summary and not enabled
    assert seen["new"] == (["step_000003"], True)  # a new checkpoint: the rule has work again, and may act
    assert sorted(p.name for p in (runs_root / "runA" / "checkpoints").iterdir()) == ["step_000003", "step_000004"]


def test_enter_opens_the_selected_checkpoint_in_the_library_and_the_training_panel(qtbot, runs_root, tmp_path):
    """Keyboard-only use: Enter on a checkpoint did nothing in the Library or in the Training panel's Checkpoints
    list; only a double-click opened it."""
    from PySide6.QtTest import QTest
    from shardscope.widgets.training_panel import TrainingPanel
    from test_training_panel import SHORT, fake_run

    view = library(qtbot, runs_root)
    wanted = str(runs_root / "runB" / "checkpoints" / "step_000010")
    view.select_paths([wanted])
    view.tree.setCurrentIndex(view.tree.selectionModel().selectedRows(0)[0])
    view.tree.setFocus()
    with qtbot.waitSignal(view.openRequested, timeout=5000) as opened:
        QTest.keyClick(view.tree, Qt.Key.Key_Return)
    assert opened.args == [wanted]

    panel = TrainingPanel(runs_root=tmp_path / "runs")
    qtbot.addWidget(panel)
    try:
        run = fake_run(tmp_path / "runs" / "r", {"state": "finished", "explanation": "success"})
        panel.follow(str(run))
        qtbot.waitUntil(lambda: panel.ckpt_list.count() == 2, timeout=SHORT)
        panel.ckpt_list.setCurrentRow(1)
        with qtbot.waitSignal(panel.openCheckpoint, timeout=5000) as opened:
            QTest.keyClick(panel.ckpt_list, Qt.Key.Key_Return)
        assert opened.args[0].endswith("step_000001")
    finally:
        panel.shutdown()


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


def test_overwrite_into_a_model_folder_keeps_the_files_an_export_does_not_write(qtbot, fixtures, tmp_path):
    """Export (sharded, Overwrite ticked) into an existing HF model folder replaced the whole folder: its
    config.json and tokenizer.json were deleted without a word. Now an earlier export's weights go, the
    folder's other files stay, and the result says which were kept."""
    from shardscope.backend.checkpoint.reader import open_checkpoint
    from shardscope.widgets.export_dialog import ExportDialog

    folder = tmp_path / "llama-hf"
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"old weights")
    dlg = ExportDialog(open_checkpoint(fixtures["fsdp2_r2"]))
    qtbot.addWidget(dlg)
    dlg.dst.setText(str(folder))
    dlg.shard.setText("3KB")
    dlg.force.setChecked(True)
    with qtbot.waitSignal(dlg.finished_export, timeout=SLOW) as done:
        dlg.export_button.click()
    assert done.args[0] is not None, dlg.message.text()
    names = sorted(p.name for p in folder.iterdir())
    assert "config.json" in names and "tokenizer" in names and "pytorch_model.bin" not in names
    assert (folder / "tokenizer" / "tokenizer.json").read_text() == "{}"
    assert "model.safetensors.index.json" in names
    assert "kept in the folder (not written by an export): config.json, tokenizer" in dlg.message.text()
    dlg.shard.setText("5KB")  # over its own earlier export: the old shards go, the kept files stay
    with qtbot.waitSignal(dlg.finished_export, timeout=SLOW) as again:
        dlg.export_button.click()
    assert again.args[0] is not None
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert {p.name for p in folder.iterdir()} == {*shards, "model.safetensors.index.json", "config.json", "tokenizer"}


def test_a_killed_torchrun_is_not_blamed_on_its_omp_notice(qtbot, tmp_path):
    """kill -9 of torchrun itself: its log holds only the OMP_NUM_THREADS start-up notice, and the panel said
    "torchrun failed: Setting OMP_NUM_THREADS environment variable ..." under "killed by SIGKILL", with the
    notice offered as the traceback. A real traceback after the notice is still shown."""
    from shardscope.widgets.training_panel import TrainingPanel
    from test_training_panel import SHORT, fake_run

    notice = ("*****************************************\nSetting OMP_NUM_THREADS environment variable for each "
              "process to be 1 in default, to avoid your system being overloaded, please further tune the "
              "variable for optimal performance in your application as needed. \n"
              "*****************************************\n")
    run = fake_run(tmp_path / "runs" / "killed", {"state": "failed", "exit_code": -9, "failed_ranks": [],
                                                  "explanation": "killed by SIGKILL (often the out-of-memory "
                                                                 "killer; see `dmesg`)"})
    (run / "logs").mkdir()
    (run / "logs" / "launcher.log").write_text(notice)
    panel = TrainingPanel(runs_root=tmp_path / "runs")
    qtbot.addWidget(panel)
    try:
        panel.follow(str(run))
        qtbot.waitUntil(lambda: "killed by SIGKILL" in panel.status.text(), timeout=SHORT)
        assert "OMP_NUM_THREADS" not in panel.status.text() and "torchrun failed" not in panel.status.text()
        assert not panel.details_button.isVisibleTo(panel)
        (run / "logs" / "launcher.log").write_text(notice + "Traceback (most recent call last):\n"
                                                   "RuntimeError: rendezvous failed\n")
        qtbot.waitUntil(lambda: "torchrun failed: RuntimeError: rendezvous failed" in panel.status.text(),
                        timeout=SHORT)
        assert "OMP_NUM_THREADS" not in panel.details.toPlainText()
    finally:
        panel.shutdown()


def test_open_after_an_export_shows_the_written_file_in_the_window(qtbot, fixtures, tmp_path):
    """After File › Export the only way to look at the result was File › Open file and typing its path again;
    Open now brings the written file (or sharded folder) up in a tab and closes the dialog."""
    from PySide6.QtWidgets import QApplication
    from shardscope.app.main_window import MainWindow
    from shardscope.widgets.export_dialog import ExportDialog

    win = MainWindow()
    qtbot.addWidget(win)
    win.quiet = True
    view = win.open_path(str(fixtures["fsdp2_r2"]))
    qtbot.waitUntil(lambda: view.data is not None, timeout=SLOW)
    dst = tmp_path / "sharded"
    seen: dict[str, bool] = {}

    def drive() -> None:  # runs inside the dialog's exec()
        dlg = QApplication.activeModalWidget()
        if not isinstance(dlg, ExportDialog):
            QTimer.singleShot(50, drive)
            return
        try:
            assert dlg.open_button.isHidden()  # nothing written yet
            dlg.dst.setText(str(dst))
            dlg.shard.setText("3KB")
            with qtbot.waitSignal(dlg.finished_export, timeout=SLOW):
                dlg.export_button.click()
            seen["shown"] = dlg.open_button.isVisibleTo(dlg)
            dlg.open_button.click()
        finally:
            dlg.reject()  # a no-op once Open has closed it

    QTimer.singleShot(0, drive)
    win.export_current("")
    assert seen == {"shown": True}
    opened = win.current_view()
    assert opened is not view and opened.path == str(dst)
    qtbot.waitUntil(lambda: opened.data is not None, timeout=SLOW)
    assert len(opened.data.ckpt.tensors) == 15
