"""The Library (widgets/library_view.py): why a double-click did not open, filtering by run name, the prune
preview following removals, Enter opening the selected checkpoint."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from gui_support import no_thread_left_running  # noqa: F401  (an autouse fixture)
from PySide6.QtCore import QModelIndex, Qt, QTimer

pytestmark = pytest.mark.gui


def test_library_says_why_a_double_click_did_not_open(qtbot, tmp_path, fixtures):
    """Double-clicking a consolidated .pt in the Library said "a.pt is complete; it opens once it is
    complete"; an unreadable checkpoint was also promised to open "once it is complete"."""
    import shutil

    import torch
    from shardscope.widgets.library_view import LibraryView

    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    torch.save({"w": torch.zeros(2)}, run / "a.pt")
    broken = run / "broken"
    shutil.copytree(fixtures["fsdp2_r2"], broken)
    (broken / ".metadata").write_bytes(b"")
    old = time.time() - 3600  # files that changed a moment ago are "writing"
    for p in [run / "a.pt", broken, *broken.iterdir()]:
        os.utime(p, (old, old))
    view = LibraryView([str(tmp_path / "runs")], None)
    qtbot.addWidget(view)
    view.show()
    qtbot.waitUntil(lambda: view.snapshot is not None and len(view.snapshot.listing.checkpoints) == 2,
                    timeout=120000)
    view.select_paths([str(run / "a.pt")])
    with qtbot.assertNotEmitted(view.openRequested, wait=100):
        view.open_selected()
    assert "consolidated file" in view.status.text() and "once it is complete" not in view.status.text()
    view.select_paths([str(broken)])
    with qtbot.assertNotEmitted(view.openRequested, wait=100):
        view.open_selected()
    assert "unreadable" in view.status.text() and "cannot be opened" in view.status.text()
    assert "once it is complete" not in view.open_button.toolTip()


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


def test_prune_plans_over_the_selected_runs_only(qtbot, runs_root, fixtures):
    """Prune… planned over every run under every root whatever was selected: a user who selected one run and
    clicked Move to the trash removed other runs' checkpoints. Now it plans over the selected runs (as Watch
    plan… does) and says which; with nothing selected, over every run, and says so."""
    from shardscope.widgets.prune_dialog import PruneDialog

    view = library(qtbot, runs_root)
    aged_copy(fixtures["ddp_r2"], runs_root / "runB" / "checkpoints" / "step_000020")
    qtbot.waitUntil(lambda: len(view.snapshot.listing.checkpoints) == 5, timeout=SLOW)
    seen: dict[str, object] = {}

    def drive() -> None:  # runs inside the dialog's exec()
        dlg = next((d for d in view.findChildren(PruneDialog) if d.isVisible()), None)
        if dlg is None:
            QTimer.singleShot(50, drive)
            return
        try:
            dlg.last_n.setValue(1)
            qtbot.waitUntil(lambda: dlg.plan is not None and dlg.plan.rules.keep_last == 1, timeout=SLOW)
            seen["plan"] = sorted((os.path.basename(d.checkpoint.run), d.checkpoint.name, d.remove)
                                  for d in dlg.plan.decisions)
            seen["scope"] = dlg.scope.text()
            if dlg.plan.remove:
                with qtbot.waitSignal(dlg.pruned, timeout=SLOW):
                    dlg.start_removal(delete=True)
        finally:
            dlg.reject()

    view.select_paths([str(runs_root / "runB" / "checkpoints" / "step_000020")])
    QTimer.singleShot(0, drive)
    view.prune_dialog()
    assert seen["plan"] == [("runB", "step_000010", True), ("runB", "step_000020", False)]
    assert "selected run only" in seen["scope"] and "runB" in seen["scope"] and "runA" not in seen["scope"]
    assert sorted(p.name for p in (runs_root / "runA" / "checkpoints").iterdir()) == [
        "step_000001", "step_000002", "step_000003"]  # another run's checkpoints are untouched
    assert [p.name for p in (runs_root / "runB" / "checkpoints").iterdir()] == ["step_000020"]
    view.tree.selectionModel().clearSelection()  # nothing selected: every run, and the dialog says so
    QTimer.singleShot(0, drive)
    view.prune_dialog()
    assert {run for run, _, _ in seen["plan"]} == {"runA", "runB"} and "every run" in seen["scope"]


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


def test_run_and_checkpoint_names_are_whole_in_the_library_at_1280x720(qtbot, tmp_path, fixtures):
    """At 1280x720 the Library's name column was what ten fixed-width columns left (90 px): every checkpoint read
    "step_0…" and every run "run-2026…". The name column is as wide as a run's name from `shardscope train`."""
    from PySide6.QtWidgets import QApplication
    from shardscope.widgets.library_view import LibraryView
    from test_tensor_tree import shown_name

    run = tmp_path / "runs" / "run-20261126-133538"
    for i in (10, 20, 30):
        aged_copy(fixtures["fsdp2_r2"], run / "checkpoints" / f"step_{i:06d}")
    lib = LibraryView([str(tmp_path / "runs")], None)
    qtbot.addWidget(lib)
    for size in ((1262, 640), (1902, 1000)):  # what the window's tab gives it at 1280x720 and 1920x1080
        lib.resize(*size)
        lib.show()
        qtbot.waitUntil(lambda: lib.snapshot is not None and len(lib.snapshot.listing.checkpoints) >= 3, timeout=SLOW)
        lib.tree.expandAll()
        for _ in range(5):
            QApplication.processEvents()
        names = []
        for idx in _rows(lib.tree.model(), QModelIndex()):
            text = idx.data(Qt.ItemDataRole.DisplayRole)
            if text and (text.startswith("step_") or text.startswith("run-2026")):
                names.append((text, shown_name(lib.tree, idx)))
        assert {t for t, _ in names} >= {"run-20261126-133538", "step_000010", "step_000020", "step_000030"}
        assert all(t == shown for t, shown in names), (size, names)
        header = lib.tree.header()  # every column but the last (source / exports) in view, the loss too
        last = header.count() - 1
        assert header.sectionViewportPosition(last) <= lib.tree.viewport().width(), size
        loss = header.logicalIndex(last - 1)
        fm = lib.tree.fontMetrics()
        assert fm.horizontalAdvance(lib.model.headerData(loss, Qt.Orientation.Horizontal)) < header.sectionSize(loss)


def _rows(model, parent):
    for r in range(model.rowCount(parent)):
        idx = model.index(r, 0, parent)
        yield idx
        yield from _rows(model, idx)


def test_every_library_column_is_whole_at_1280x720(qtbot, tmp_path, fixtures):
    """At 1280x720 the Library's `source / exports` column was off-screen (the loss header, "loss (mean of ranks)",
    took ~140 px) and Disk usage cut run names to "run-202…-133538". Every column's right edge is now in view with
    its header and a typical cell whole, and a run's name is whole in the tree and in Disk usage; at 1920x1080 too."""
    from conftest import run_cli
    from PySide6.QtWidgets import QApplication
    from shardscope.backend.runs.follow import LOSS_LABEL
    from shardscope.widgets.library_model import COLUMNS
    from shardscope.widgets.library_view import LibraryView
    from test_tensor_tree import shown_name

    run = tmp_path / "runs" / "run-20261126-133538"
    for i in (10, 20, 30):
        aged_copy(fixtures["fsdp2_r2"], run / "checkpoints" / f"step_{i:06d}")
    (run / "exports").mkdir()
    run_cli("export", run / "checkpoints" / "step_000020", run / "exports" / "weights.safetensors", check=True)
    aged_copy(fixtures["fsdp2_r2"], tmp_path / "runs" / "run-20261127-091204" / "checkpoints" / "step_000010")
    lib = LibraryView([str(tmp_path / "runs")], None)
    qtbot.addWidget(lib)
    lineage = COLUMNS.index("lineage")
    for size in ((1262, 640), (1902, 1000)):  # what the window's tab gives it at 1280x720 and 1920x1080
        lib.resize(*size)
        lib.show()
        qtbot.waitUntil(lambda: lib.snapshot is not None and len(lib.snapshot.listing.checkpoints) >= 5, timeout=SLOW)
        lib.tree.expandAll()
        for _ in range(5):
            QApplication.processEvents()
        header, fm = lib.tree.header(), lib.tree.fontMetrics()
        for col in range(header.count()):
            right = header.sectionViewportPosition(col) + header.sectionSize(col)
            assert right <= lib.tree.viewport().width(), (size, COLUMNS[col], right, lib.tree.viewport().width())
            title = lib.model.headerData(col, Qt.Orientation.Horizontal)
            assert fm.horizontalAdvance(title) < header.sectionSize(col), (size, title)
        cells = {idx.data(Qt.ItemDataRole.DisplayRole): idx for idx in _rows(lib.tree.model(), QModelIndex())}
        source = cells["step_000020"].siblingAtColumn(lineage)
        assert source.data(Qt.ItemDataRole.DisplayRole) == "exported to weights.safetensors"
        for idx in (cells["run-20261126-133538"], cells["weights.safetensors"].siblingAtColumn(lineage)):
            assert shown_name(lib.tree, idx) == idx.data(Qt.ItemDataRole.DisplayRole), size
        table = lib.usage_table
        names = [table.model().index(r, 0) for r in range(table.model().rowCount())]
        assert {n.data() for n in names} >= {"run-20261126-133538", "run-20261127-091204"}
        assert all(shown_name(table, n) == n.data() for n in names), (size, [shown_name(table, n) for n in names])
    loss = COLUMNS.index("loss")  # the header is short; what it means is in its tooltip
    assert LOSS_LABEL in lib.model.headerData(loss, Qt.Orientation.Horizontal, Qt.ItemDataRole.ToolTipRole)
