"""The Library window under pytest-qt: the model (qtmodeltester), live updates from disk, writing
checkpoints that do not open, Compare from two selections (and Ctrl+D's two pickers), and the Prune
dialog's live preview and removal."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings, QThreadPool, QTimer
from shardscope.backend.library import Rules, scan
from shardscope.backend.library.snapshot import take_snapshot
from shardscope.widgets.library_model import COLUMNS, LibraryModel
from shardscope.widgets.library_view import LibraryView
from shardscope.widgets.prune_dialog import PruneDialog

pytestmark = [pytest.mark.slow, pytest.mark.gui]

TIMEOUT = 60_000


@pytest.fixture(autouse=True)
def _own_settings(tmp_path_factory):
    """QSettings in a temporary folder: the tests never see or change the user's Library roots."""
    QSettings.setDefaultFormat(QSettings.Format.IniFormat)
    QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, str(tmp_path_factory.mktemp("qs")))


def _age(path: Path, seconds: float = 3600) -> None:
    t = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (t, t))


@pytest.fixture
def root(tmp_path, fixtures) -> Path:
    """A run folder with three complete DCP checkpoints (steps 1, 2, 3)."""
    base = tmp_path.resolve() / "root"
    ckpts = base / "runA" / "checkpoints"
    shutil.copytree(fixtures["fsdp2_r2"], ckpts / "step_000001")
    shutil.copytree(fixtures["steps_r2"] / "step2", ckpts / "step_000002")
    shutil.copytree(fixtures["steps_r2"] / "step3", ckpts / "step_000003")
    _age(base)
    return base


def _names(model: LibraryModel) -> list[list[str]]:
    return [[c.name for c in run.checkpoints] for run in model.runs]


def test_library_model_passes_qtmodeltester(qtmodeltester, root, fixtures):
    model = LibraryModel()
    model.set_snapshot(take_snapshot([str(root)]))
    qtmodeltester.check(model, force_py=True)
    assert _names(model) == [["step_000001", "step_000002", "step_000003"]]
    run_index = model.index(0, 0)
    assert model.data(run_index) == "runA"
    ck = model.index(2, COLUMNS.index("step"), run_index)
    assert model.data(ck) == "3" and model.parent(ck) == run_index
    assert model.data(model.index(2, COLUMNS.index("state"), run_index)) == "complete"
    # an update in place: one checkpoint gone, one new, a second run
    shutil.rmtree(root / "runA" / "checkpoints" / "step_000002")
    shutil.copytree(fixtures["fsdp2_r2"], root / "runA" / "checkpoints" / "step_000004")
    shutil.copytree(fixtures["fsdp2_r2"], root / "runB" / "checkpoints" / "step_000001")
    _age(root)
    model.set_snapshot(take_snapshot([str(root)]))
    qtmodeltester.check(model, force_py=True)
    assert _names(model) == [["step_000001", "step_000003", "step_000004"], ["step_000001"]]


def test_a_run_without_checkpoints_shows_no_time_or_size(root):
    """A run that failed before its first save showed "?" for its time and "0 B" for its size."""
    run = root / "run-failed"
    run.mkdir()
    (run / "status.json").write_text('{"state": "failed"}')
    (run / "config.json").write_text("{}")
    model = LibraryModel()
    model.set_snapshot(take_snapshot([str(root)]))
    row = next(r for r in range(model.rowCount()) if model.data(model.index(r, 0)) == "run-failed")
    cells = {name: model.data(model.index(row, COLUMNS.index(name))) for name in ("step", "modified", "size", "state")}
    assert cells == {"step": "no ckpt", "modified": "", "size": "", "state": "failed"}


def _state(view: LibraryView, path: Path) -> str | None:
    snap = view.snapshot
    rec = snap.listing.find(str(path)) if snap else None
    return rec.state if rec else None


def test_library_follows_the_disk_and_opens_only_complete(qtbot, qtmodeltester, root, fixtures):
    view = LibraryView([str(root)], None)
    qtbot.addWidget(view)
    view.resize(1280, 700)
    view.show()
    qtbot.waitUntil(lambda: view.snapshot is not None and len(view.snapshot.listing.checkpoints) == 3,
                    timeout=TIMEOUT)
    assert view.tree.model().rowCount() == 1
    # a save starts: data files, no .metadata yet -> it shows as being written and does not open
    new = root / "runA" / "checkpoints" / "step_000004"
    new.mkdir()
    shutil.copy(fixtures["fsdp2_r2"] / "__0_0.distcp", new / "__0_0.distcp")
    qtbot.waitUntil(lambda: _state(view, new) == "writing", timeout=TIMEOUT)
    view.select_paths([str(new)])
    assert len(view.selected_checkpoints()) == 1
    assert not view.open_button.isEnabled() and "opens once it is complete" in view.open_button.toolTip()
    with qtbot.assertNotEmitted(view.openRequested, wait=100):
        view.open_selected()
    # the save finishes: it becomes complete (once its files stop changing) and opens
    for name in ("__1_0.distcp", ".metadata"):
        shutil.copy(fixtures["fsdp2_r2"] / name, new / name)
    qtbot.waitUntil(lambda: _state(view, new) == "complete", timeout=TIMEOUT)
    view.select_paths([str(new)])
    assert view.open_button.isEnabled()
    with qtbot.waitSignal(view.openRequested) as opened:
        view.open_button.click()
    assert opened.args == [str(new)]
    # two selected -> Compare, the older one as A
    a, b = root / "runA" / "checkpoints" / "step_000003", root / "runA" / "checkpoints" / "step_000001"
    view.select_paths([str(a), str(b)])
    assert view.compare_button.isEnabled() and not view.open_button.isEnabled()
    with qtbot.waitSignal(view.compareRequested) as compared:
        view.compare_button.click()
    assert compared.args == [str(b), str(a)]
    # the disk-usage view: the run, its size, what the rules (keep the last 3) would free
    assert view.usage.rowCount() == 1
    qtmodeltester.check(view.usage, force_py=True)
    freed = view.usage.data(view.usage.index(0, 3))
    assert freed != "—" and "would free" in view.rules_label.text()
    view.shutdown()
    assert QThreadPool.globalInstance().waitForDone(TIMEOUT)


def test_adding_a_root_shows_its_disk_usage(qtbot, root, tmp_path):
    """Disk usage turns to the root just added (it used to stay on the first, often empty, root)."""
    default = tmp_path / "default_runs"
    default.mkdir()
    view = LibraryView([], str(default))
    qtbot.addWidget(view)
    view.show()
    qtbot.waitUntil(lambda: view.snapshot is not None, timeout=TIMEOUT)
    assert view.root_box.currentData() == str(default) and view.usage.rowCount() == 0
    view.add_root(str(root))
    qtbot.waitUntil(lambda: view.root_box.currentData() == str(root) and view.usage.rowCount() == 1,
                    timeout=TIMEOUT)
    assert view.remove_root_button.isEnabled()
    view.shutdown()
    assert QThreadPool.globalInstance().waitForDone(TIMEOUT)


@pytest.fixture
def keep_alive():
    """Widgets that must outlive the fixtures requested after this one (qtmodeltester disconnects from its
    model when it is torn down; qtbot.addWidget would delete the model's dialog before that)."""
    held: list = []
    yield held
    for w in held:
        w.close()


def test_prune_dialog_preview_and_removal(qtbot, keep_alive, qtmodeltester, root):
    dlg = PruneDialog(scan([root]), Rules(keep_last=2))
    keep_alive.append(dlg)
    qtbot.waitUntil(lambda: dlg.plan is not None, timeout=TIMEOUT)
    assert [d.checkpoint.name for d in dlg.plan.remove] == ["step_000001"]
    assert "Removes 1 of 3 checkpoints" in dlg.summary.text()
    assert dlg.model.rowCount() == 3 and dlg.act_button.isEnabled()
    qtmodeltester.check(dlg.model, force_py=True)
    dlg.last_n.setValue(1)  # the preview follows the rules
    qtbot.waitUntil(lambda: dlg.plan is not None and len(dlg.plan.remove) == 2, timeout=TIMEOUT)
    assert "Removes 2 of 3" in dlg.summary.text()
    dlg.last_on.setChecked(False)  # no rule at all: nothing to do, and it says why
    qtbot.waitUntil(lambda: dlg.plan is None, timeout=TIMEOUT)
    assert "give at least one rule" in dlg.summary.text() and not dlg.act_button.isEnabled()
    dlg.last_on.setChecked(True)
    qtbot.waitUntil(lambda: dlg.plan is not None and len(dlg.plan.remove) == 2, timeout=TIMEOUT)
    dlg.delete.setChecked(True)
    assert dlg.act_button.text() == "Delete for good"
    with qtbot.waitSignal(dlg.pruned, timeout=TIMEOUT) as done:
        dlg.start_removal(delete=True)
    assert len(done.args[0].removed) == 2 and not done.args[0].failed
    ckpts = root / "runA" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000003"]
    assert "2 checkpoints deleted" in dlg.summary.text()
    assert QThreadPool.globalInstance().waitForDone(TIMEOUT)


def test_compare_from_the_window_with_two_selected_or_two_pickers(qtbot, root):
    from shardscope.app.main_window import MainWindow
    from shardscope.widgets.compare_view import CompareView

    win = MainWindow()
    qtbot.addWidget(win)
    win.resize(1280, 720)
    win.show()
    assert win.tabs.widget(0) is win.library and win.tabs.tabText(0) == "Library"
    win.library.user_roots = [str(root)]
    win.library.poll(force=True)
    qtbot.waitUntil(lambda: win.library.snapshot is not None and
                    len([c for c in win.library.snapshot.listing.checkpoints if c.run.startswith(str(root))]) == 3,
                    timeout=TIMEOUT)
    action = next(a for a in win.findChildren(type(win.menuBar().actions()[0])) if a.text() == "&Compare…")
    assert action.shortcut().toString() == "Ctrl+D"
    one, three = (str(root / "runA" / "checkpoints" / f"step_00000{i}") for i in (1, 3))
    win.library.select_paths([three, one])
    action.trigger()
    views = [w for w in (win.tabs.widget(i) for i in range(win.tabs.count())) if isinstance(w, CompareView)]
    assert [(v.path_a, v.path_b) for v in views] == [(one, three)]
    # nothing selected: two pickers, which offer the Library's checkpoints
    win.show_library()
    win.library.tree.clearSelection()
    action.trigger()
    picker = win.compare_picker
    assert picker.isVisible() and len(picker.boxes) == 2
    offered = [picker.boxes[0].itemText(i) for i in range(picker.boxes[0].count())]
    assert one in offered and three in offered
    picker.boxes[0].setCurrentText(three)
    picker.boxes[1].setCurrentText(one)
    picker.accept()
    views = [w for w in (win.tabs.widget(i) for i in range(win.tabs.count())) if isinstance(w, CompareView)]
    assert [(v.path_a, v.path_b) for v in views][-1] == (three, one)
    for v in views:
        v.shutdown()
    win.library.shutdown()
    assert QThreadPool.globalInstance().waitForDone(TIMEOUT)


def test_run_the_demo_from_the_library_and_watch_its_checkpoints_arrive(qtbot):
    """The Library's "Run the demo" starts the real demo run (torchrun, in the Training tab) without blocking;
    the run's checkpoints appear in the Library as they are written, by polling."""
    from shardscope.app.main_window import MainWindow
    from shardscope.backend.runs.rundir import default_runs_root

    win = MainWindow()
    qtbot.addWidget(win)
    win.show()
    qtbot.waitUntil(lambda: win.library.snapshot is not None, timeout=TIMEOUT)
    assert str(default_runs_root()) in win.library.roots()
    demo = next(b for b in win.library.findChildren(type(win.library.open_button)) if b.text() == "Run the demo")
    demo.click()
    panel = win._training
    assert panel is not None
    qtbot.waitUntil(lambda: len(panel.launchers) == 1, timeout=TIMEOUT)  # started in a worker
    run_dir = next(iter(panel.launchers))
    seen: set[str] = set()

    def arrived() -> bool:
        if not win.library.isVisible():  # the demo opens its last checkpoint when it ends: come back
            win.show_library()
        snap = win.library.snapshot
        cks = [c for c in snap.listing.checkpoints if c.run == run_dir] if snap else []
        seen.update(c.state for c in cks)
        return any(c.state == "complete" for c in cks)

    try:
        win.show_library()
        qtbot.waitUntil(arrived, timeout=300_000)
    finally:
        for launcher in panel.launchers.values():
            launcher.stop(grace=5)
    assert "complete" in seen
    win.library.shutdown()
    panel.shutdown()
    assert QThreadPool.globalInstance().waitForDone(TIMEOUT)


def answer_question(qtbot, button, seen: list[str]) -> None:
    """Answer the next question box with ``button`` (runs inside its exec()), noting its text in ``seen``."""
    from PySide6.QtWidgets import QApplication, QMessageBox

    def answer() -> None:
        box = QApplication.activeModalWidget()
        if not isinstance(box, QMessageBox):
            QTimer.singleShot(50, answer)
            return
        seen.append(box.text())
        box.button(button).click()

    QTimer.singleShot(0, answer)


def test_a_run_folder_opened_by_hand_joins_the_library_if_the_user_says_so(qtbot, tmp_path):
    """Training › Open run folder: the folder's checkpoints join the Library (issue 13 §2), but it became a root
    without a word (and Prune… over every root then covered it): now the window asks first (issue #30 item 7)."""
    from PySide6.QtWidgets import QMessageBox
    from shardscope.app.main_window import MainWindow

    win = MainWindow()
    qtbot.addWidget(win)
    panel = win.training_panel()
    elsewhere = tmp_path / "cluster-run"
    (elsewhere / "checkpoints").mkdir(parents=True)
    asked: list[str] = []
    answer_question(qtbot, QMessageBox.StandardButton.No, asked)
    panel.runFolderOpened.emit(str(elsewhere))
    assert len(asked) == 1 and str(elsewhere) in asked[0]
    assert str(elsewhere) not in win.library.roots()  # followed in the Training tab only
    answer_question(qtbot, QMessageBox.StandardButton.Yes, asked)
    panel.runFolderOpened.emit(str(elsewhere))
    assert len(asked) == 2 and str(elsewhere) in win.library.roots()
    inside = win.library.roots()[0]
    before = win.library.roots()
    panel.runFolderOpened.emit(os.path.join(inside, "run-1"))  # already under a root: no second root, no question
    assert win.library.roots() == before and len(asked) == 2
    win.library.shutdown()
    panel.shutdown()
    assert QThreadPool.globalInstance().waitForDone(TIMEOUT)


def test_watch_plan_dialog_shows_what_a_watch_would_do_and_did(qtbot, keep_alive, qtmodeltester, tmp_path,
                                                                fixtures):
    """The Library's Watch plan…: for the selected run, the plan ``watch --dry-run`` prints (the same decisions,
    line for line), with each checkpoint's record of what a watch did (exported and verified, removed)."""
    from conftest import run_cli
    from shardscope.backend.library.watch import EXPORT, NOT_EXPORTED, VERIFIED

    root = tmp_path.resolve() / "root"
    ckpts = root / "runA" / "checkpoints"
    for s in (10, 20):
        shutil.copytree(fixtures["fsdp2_r2"], ckpts / f"step_{s:06d}")
    _age(root)
    first = run_cli("watch", root, "--export", "safetensors", "--once", "--keep-last", "1", "--delete")
    assert first.returncode == 0, first.stdout + first.stderr  # exports 10 and 20, removes 10
    for s in (30, 40):
        _age(shutil.copytree(fixtures["fsdp2_r2"], ckpts / f"step_{s:06d}"))
    shutil.copytree(fixtures["fsdp2_r2"], ckpts / "step_000050")
    (ckpts / "step_000050" / ".metadata").unlink()  # a save that failed: never exported (no clock in the test)
    _age(ckpts / "step_000050")
    view = LibraryView([str(root)], None)
    qtbot.addWidget(view)
    view.resize(1280, 720)
    view.show()
    qtbot.waitUntil(lambda: view.snapshot is not None and len(view.snapshot.listing.checkpoints) >= 4,
                    timeout=TIMEOUT)
    view.select_paths([str(ckpts / "step_000030")])
    assert view.watch_roots() == [str(root / "runA")]
    dlg = view.watch_dialog()
    keep_alive.append(dlg)  # closed (and deleted) after qtmodeltester lets go of its model
    dlg.last_n.setValue(1)
    qtbot.waitUntil(lambda: dlg.plan is not None and dlg.plan.rules is not None and dlg.plan.rules.keep_last == 1
                    and not dlg.planning, timeout=TIMEOUT)
    qtmodeltester.check(dlg.model, force_py=True)
    rows = [[dlg.model.data(dlg.model.index(r, c)) for c in range(dlg.model.columnCount())]
            for r in range(dlg.model.rowCount())]
    by_name = {r[1]: r for r in rows}
    assert [r[1] for r in rows] == ["step_000020", "step_000030", "step_000040", "step_000050", "step_000010"]
    assert by_name["step_000020"][3:6] == ["exported", "step_000020.safetensors", "remove"]
    assert by_name["step_000020"][7].startswith("exported ") and by_name["step_000020"][7].endswith(", verified")
    assert by_name["step_000030"][3:6] == ["will export", "step_000030.safetensors", "remove once exported"]
    assert by_name["step_000040"][5:7] == ["keep", "the newest resumable checkpoint of its run; keep-last 1"]
    assert by_name["step_000050"][3] == "not exported" and by_name["step_000050"][6].startswith("incomplete")
    assert by_name["step_000010"][4:6] == ["step_000010.safetensors", "removed"]
    assert "verified; removed " in by_name["step_000010"][7]
    assert [s.action for r in dlg.plan.runs for s in r.exports] == [VERIFIED, EXPORT, EXPORT, NOT_EXPORTED]
    assert "A watch would export 2 checkpoints to safetensors and remove 2 checkpoints" in dlg.summary.text()
    # the record's verified exports, also step 10's, whose checkpoint a watch removed since
    assert "2 verified exports, 1 checkpoint removed" in dlg.summary.text()
    cmd = dlg.command_line()
    assert cmd == f"shardscope watch {root / 'runA'} --export safetensors --keep-last 1"
    # the very plan the command line prints
    dry = run_cli(*cmd.split()[1:], "--dry-run")
    assert dry.returncode == 0 and dry.stdout.splitlines() == dlg.plan.lines()
    if os.environ.get("SHARDSCOPE_SCREENSHOT"):  # a picture of the Library with the plan (1280x720)
        from PySide6.QtGui import QPainter

        dlg.resize(1100, 560)
        picture = view.grab()
        painter = QPainter(picture)
        painter.drawPixmap(90, 120, dlg.grab())
        painter.end()
        picture.save(os.environ["SHARDSCOPE_SCREENSHOT"])
    view.shutdown()
    assert QThreadPool.globalInstance().waitForDone(TIMEOUT)


def test_watch_plan_dialog_takes_a_hugging_face_model_export_with_its_config(qtbot, tmp_path):
    """Watch plan… with the hf format: the config field is taken (disabled for other formats), the plan names the
    model folders a watch writes (RUN/exports/<name>-hf), and the command line it shows, --config included, prints
    the very plan."""
    from conftest import run_cli
    from shardscope.widgets.watch_dialog import WatchPlanDialog
    from titan_names import write, write_config

    root = tmp_path.resolve() / "root"
    write(root / "runA" / "checkpoints" / "step_000010")
    _age(root)
    config = write_config(tmp_path / "config.json")
    dlg = WatchPlanDialog([str(root / "runA")], Rules(keep_last=1))
    qtbot.addWidget(dlg)
    assert not dlg.config_field.isEnabled()
    dlg.format.setCurrentText("hf")
    dlg.config_field.edit.setText(str(config))
    qtbot.waitUntil(lambda: dlg.plan is not None and dlg.plan.format == "hf" and not dlg.planning, timeout=TIMEOUT)
    assert dlg.config_field.isEnabled()
    assert [s.export for r in dlg.plan.runs for s in r.exports] == \
        [str(root / "runA" / "exports" / "step_000010-hf")]
    cmd = dlg.command_line()
    assert cmd == f"shardscope watch {root / 'runA'} --export hf --config {config} --keep-last 1"
    dry = run_cli(*cmd.split()[1:], "--dry-run")
    assert dry.returncode == 0 and dry.stdout.splitlines() == dlg.plan.lines()


def test_open_folder_starts_in_the_library_not_in_an_unrelated_earlier_folder(qtbot, root, tmp_path):
    """File › Open folder started in the last checkpoint opened, whatever it was; now in the run of the checkpoint
    selected in the Library, else in the root Disk usage shows."""
    from PySide6.QtWidgets import QApplication, QFileDialog
    from shardscope.app.main_window import MainWindow
    from shardscope.app.settings import add_recent

    unrelated = tmp_path / "unrelated" / "ck"
    unrelated.mkdir(parents=True)
    add_recent(str(unrelated))
    win = MainWindow()
    qtbot.addWidget(win)
    win.library.add_root(str(root))
    # (earlier tests of the session left their roots in the window's settings: count this root's checkpoints)
    qtbot.waitUntil(lambda: win.library.snapshot is not None and sum(
        c.path.startswith(f"{root}/") for c in win.library.snapshot.listing.checkpoints) == 3
                    and win.library.root_box.currentData() == str(root), timeout=TIMEOUT)
    started: list[str] = []

    def look() -> None:  # runs inside the dialog's exec()
        dlg = QApplication.activeModalWidget()
        if not isinstance(dlg, QFileDialog):
            QTimer.singleShot(50, look)
            return
        started.append(dlg.directory().absolutePath())
        dlg.reject()

    QTimer.singleShot(0, look)
    win.open_dialog()
    win.library.select_paths([str(root / "runA" / "checkpoints" / "step_000002")])
    QTimer.singleShot(0, look)
    win.open_dialog()
    assert started == [str(root), str(root / "runA")]
    win.library.shutdown()
