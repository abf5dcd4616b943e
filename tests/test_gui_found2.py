"""More bugs found by clicking the real window under Xvfb (the second pass), each pinned by a test on real
widgets offscreen."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gui_support import no_thread_left_running, open_view  # noqa: F401  (an autouse fixture)
from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDropEvent
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication
from test_training_panel import SHORT, fake_run

SLOW = 120000  # ms: a checkpoint load or a background read on a loaded 2-core machine


@pytest.fixture
def window(qtbot):
    from shardscope.app.main_window import MainWindow

    win = MainWindow()
    qtbot.addWidget(win)
    win.quiet = True  # no modal message boxes
    return win


def hf_folder(path: Path) -> Path:
    """An HF-style sharded folder as transformers writes it: two safetensors files and the index naming them."""
    import torch
    from safetensors.torch import save_file

    path.mkdir()
    weight_map = {}
    for i, names in enumerate((["model.embed.weight"], ["model.head.weight", "model.head.bias"]), start=1):
        file = f"model-{i:05d}-of-00002.safetensors"
        save_file({n: torch.randn(4, 3) for n in names}, str(path / file))
        weight_map.update(dict.fromkeys(names, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def test_an_hf_index_opened_as_a_file_names_its_tab_after_the_folder(qtbot, window, fixtures, tmp_path):
    """File › Open file… on an HF index named every HF model's tab "model.safetensors.index.json" (and a DCP
    .metadata ".metadata"): two models open side by side could not be told apart."""
    index = hf_folder(tmp_path / "llama-hf") / "model.safetensors.index.json"
    for path, folder in ((index, "llama-hf"), (fixtures["fsdp2_r2"] / ".metadata", "fsdp2_r2")):
        view = window.open_path(str(path))
        qtbot.waitUntil(lambda v=view: v.data is not None, timeout=SLOW)
        tabs = window.tabs
        assert tabs.tabText(tabs.indexOf(view)) == folder
        assert tabs.tabToolTip(tabs.indexOf(view)) == str(path)  # the full path is still one hover away


def drop_events(data: QMimeData, paths: list[str]) -> tuple[QDragEnterEvent, QDropEvent]:
    """A drag entering the window and its drop, carrying ``paths``. NOTE: the events keep a pointer to ``data``,
    not a reference: the caller keeps it alive while they are sent."""
    data.setUrls([QUrl(p) if "://" in p else QUrl.fromLocalFile(p) for p in paths])
    copy, none, plain = Qt.DropAction.CopyAction, Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier
    return (QDragEnterEvent(QPoint(50, 50), copy, data, none, plain),
            QDropEvent(QPointF(50, 50), copy, data, none, plain))


def test_a_drop_that_opens_files_is_accepted(qtbot, window, fixtures):
    """Dropping a file opened it, but the drop event was never accepted: the application the file came from
    was told the drop had been refused. A drag of web links only is refused at once (nothing would open)."""
    data = QMimeData()
    enter, drop = drop_events(data, [str(fixtures["hf_r2"])])
    QApplication.sendEvent(window, enter)
    assert enter.isAccepted()
    QApplication.sendEvent(window, drop)
    assert drop.isAccepted()
    view = window.current_view()
    assert view is not None and view.path == str(fixtures["hf_r2"])
    qtbot.waitUntil(lambda: view.data is not None, timeout=SLOW)
    links = QMimeData()
    enter, _ = drop_events(links, ["https://example.com/model.safetensors"])
    QApplication.sendEvent(window, enter)
    assert not enter.isAccepted()


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


def test_a_followed_run_renamed_on_disk_leaves_no_blank_entry(qtbot, tmp_path):
    """Renaming (or deleting) the run folder shown in the Training panel left a blank entry with its old name at
    the top of the Runs list for good, and the header said "no status.json: a run started outside Shardscope;
    following its files" about a folder that no longer existed."""
    from shardscope.widgets.training_panel import TrainingPanel

    panel = TrainingPanel(runs_root=tmp_path)
    qtbot.addWidget(panel)
    try:
        run = fake_run(tmp_path / "run-a", {"state": "finished", "explanation": "success"})
        panel.follow(str(run))
        panel.refresh_runs(select=str(run))

        def names() -> list[str]:
            return [panel.run_list.item(i).text().split()[0] for i in range(panel.run_list.count())]

        qtbot.waitUntil(lambda: names() == ["run-a"] and panel.ckpt_list.count() == 2, timeout=SHORT)
        run.rename(tmp_path / "my-run")
        panel.refresh_runs()
        qtbot.waitUntil(lambda: "no longer exists" in panel.status.text(), timeout=SHORT)
        panel.refresh_runs()
        qtbot.waitUntil(lambda: names() == ["my-run"], timeout=SHORT)
        assert "started outside Shardscope" not in panel.status.text()
        assert panel.ckpt_list.count() == 0  # its checkpoints went with it: nothing to open or resume
        assert not panel.stop_button.isEnabled() and not panel.resume_button.isEnabled()
        panel.run_list.setCurrentRow(0)  # picked again under its new name: followed as before
        qtbot.waitUntil(lambda: "finished" in panel.status.text() and panel.ckpt_list.count() == 2, timeout=SHORT)
        assert json.loads((tmp_path / "my-run" / "status.json").read_text())["state"] == "finished"
    finally:
        panel.shutdown()


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


def test_a_training_tab_opened_again_shows_the_run_still_going(qtbot, tmp_path):
    """Closing the Training tab while a run went on, then Run › Training panel (Ctrl+T): the new panel said "No
    run selected" with Stop disabled, though the run was still training."""
    import subprocess
    import sys
    import time

    from shardscope.widgets.training_panel import TrainingPanel

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    panel = None
    try:
        fake_run(tmp_path / "old", {"state": "finished", "explanation": "success"})
        running = fake_run(tmp_path / "going", {"state": "running", "pid": live.pid, "scheduler": "local",
                                                "start_time": time.time()})
        panel = TrainingPanel(runs_root=tmp_path)
        qtbot.addWidget(panel)
        qtbot.waitUntil(lambda: panel.follower is not None and panel.stop_button.isEnabled(), timeout=SHORT)
        assert panel.follower.run_dir == running
        assert panel.run_list.currentItem().data(Qt.ItemDataRole.UserRole) == str(running)
    finally:
        if panel is not None:
            panel.shutdown()
        live.kill()
        live.wait(60)


def test_reload_keeps_the_tab_in_its_place_and_the_selection(qtbot, window, fixtures):
    """File › Reload (F5) reopened the checkpoint as the last tab: with a few open, the tab jumped away."""
    first, second = (window.open_path(str(fixtures[n])) for n in ("fsdp2_r2", "ddp_r2"))
    qtbot.waitUntil(lambda: first.data is not None and second.data is not None, timeout=SLOW)
    where = window.tabs.indexOf(first)
    window.tabs.setCurrentIndex(where)
    assert first.select_path("model.blocks.0.fc1.weight")
    window.reload_current()
    new = window.current_view()
    assert new is not first and window.tabs.indexOf(new) == where and window.tabs.indexOf(second) == where + 1
    qtbot.waitUntil(lambda: new.selected_node() is not None, timeout=SLOW)
    assert new.selected_node().path == "model.blocks.0.fc1.weight"


def test_ctrl_w_closes_the_tab_in_front_but_not_the_library(qtbot, window, fixtures):
    """There was no way to close a tab from the keyboard (Ctrl+W did nothing); the Library stays."""
    from PySide6.QtGui import QAction, QKeySequence

    action = next(a for a in window.findChildren(QAction) if a.text() == "&Close tab")
    assert action.shortcut() == QKeySequence(QKeySequence.StandardKey.Close)
    view = window.open_path(str(fixtures["fsdp2_r2"]))
    qtbot.waitUntil(lambda: view.data is not None, timeout=SLOW)
    assert window.tabs.currentWidget() is view
    action.trigger()
    assert window.tabs.indexOf(view) < 0 and window.tabs.currentWidget() is window.library
    action.trigger()
    assert window.tabs.indexOf(window.library) == 0
