"""The main window (app/main_window.py): tabs (opened, dropped, reloaded, closed), two checkpoints side by
side, a checkpoint on an fsspec URL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gui_support import no_thread_left_running, wait_loaded  # noqa: F401  (an autouse fixture)
from PySide6.QtCore import QEvent, QMimeData, QObject, QPoint, QPointF, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDropEvent
from PySide6.QtWidgets import QApplication
from shardscope.widgets.checkpoint_view import CheckpointView

pytestmark = pytest.mark.gui


def test_two_checkpoints_side_by_side(qtbot, fixtures):
    from shardscope.app.main_window import MainWindow

    win = MainWindow()
    qtbot.addWidget(win)
    win.quiet = True
    a = win.open_path(str(fixtures["fsdp2_r2"]))
    wait_loaded(qtbot, a)
    b = win.open_path(str(fixtures["fsdp2_r4"]))
    wait_loaded(qtbot, b)
    def views(pane) -> list:  # the checkpoint tabs of a pane (the window may hold others, e.g. Library)
        return [pane.widget(i) for i in range(pane.count()) if isinstance(pane.widget(i), CheckpointView)]

    assert views(win.tabs) == [a, b] and win.side_tabs.isHidden()
    win.move_to_other_side()
    assert views(win.tabs) == [a] and views(win.side_tabs) == [b] and win.side_tabs.count() == 1
    assert not win.side_tabs.isHidden()
    assert win.current_view() is b
    win.close_tab(0, win.side_tabs)
    assert win.side_tabs.isHidden() and win.current_view() is a


def test_window_opens_a_checkpoint_on_an_fsspec_url(qtbot, fixtures):
    import fsspec
    from shardscope.app.main_window import MainWindow

    fs = fsspec.filesystem("memory")
    for f in fixtures["ddp_r2"].iterdir():
        fs.pipe(f"/gui-ck/{f.name}", f.read_bytes())
    win = MainWindow()
    qtbot.addWidget(win)
    win.quiet = True
    view = win.open_path("memory://gui-ck")
    wait_loaded(qtbot, view)  # a condition, not the signal: it may have fired already on a fast load
    assert view.path == "memory://gui-ck" and view.data.problems == []
    with qtbot.waitSignal(view.statsReady, timeout=120000):
        assert view.select_path("model.emb.weight")


SLOW = 120000  # ms: a checkpoint load or a background read on a loaded 2-core machine


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



def shown_window(qtbot, window):
    """The window shown and active, so keys sent to the focused widget go through its shortcut map."""
    window.resize(1280, 720)
    window.show()
    qtbot.waitExposed(window)
    window.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is window, timeout=10000)
    return window


class X11LineEditKeys(QObject):
    """What a QLineEdit claims on X11 (Qt's X11 key bindings: Ctrl+E end of line, Ctrl+D delete) and not on the
    offscreen platform, whose bindings are Windows': a focused box takes the key from the window's shortcuts by
    accepting its ShortcutOverride, as QWidgetLineControl does there."""

    def eventFilter(self, watched, event) -> bool:
        if event.type() == QEvent.Type.ShortcutOverride and event.modifiers() == Qt.KeyboardModifier.ControlModifier \
                and event.key() in (Qt.Key.Key_E, Qt.Key.Key_D):
            event.accept()
        return False


def test_window_shortcuts_work_while_the_filter_box_has_focus(qtbot, window, fixtures):
    """Ctrl+E (advertised by the demo's hint) did nothing right after a checkpoint opened: the filter box has
    the focus then and took it as "end of line". Ctrl+D did nothing after Escape closed the Export dialog back
    onto a filter with text in it (a line edit's "delete"). The keys go to the window whatever has focus."""
    from PySide6.QtCore import QTimer
    from shardscope.widgets.export_dialog import ExportDialog

    shown_window(qtbot, window)
    view = window.open_path(str(fixtures["fsdp2_r2"]))
    wait_loaded(qtbot, view)
    x11 = X11LineEditKeys(view.filter_edit)
    view.filter_edit.installEventFilter(x11)
    view.focus_filter()
    qtbot.keyClicks(QApplication.focusWidget(), "weight")
    assert QApplication.focusWidget() is view.filter_edit and view.filter_edit.text() == "weight"
    seen: dict[str, object] = {}

    def close_export(tries: int = 0) -> None:  # runs inside the dialog's exec()
        dlg = QApplication.activeModalWidget()
        if not isinstance(dlg, ExportDialog):
            if tries < 40:  # no dialog came: the key went elsewhere (the test fails below)
                QTimer.singleShot(50, lambda: close_export(tries + 1))
            return
        seen["export"] = dlg.windowTitle()
        qtbot.keyClick(dlg, Qt.Key.Key_Escape)

    QTimer.singleShot(0, close_export)
    qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_E, Qt.KeyboardModifier.ControlModifier)
    assert seen.get("export") == "Export"
    window.activateWindow()  # NOTE: what a window manager does when the dialog goes; offscreen Qt does not
    qtbot.waitUntil(lambda: QApplication.focusWidget() is view.filter_edit, timeout=10000)
    assert view.filter_edit.text() == "weight"  # the box keeps what was typed: no key of the window lands in it
    qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_D, Qt.KeyboardModifier.ControlModifier)
    picker = getattr(window, "compare_picker", None)
    assert picker is not None and picker.isVisible()
    assert view.filter_edit.text() == "weight"
    picker.reject()
    qtbot.keyClick(view.filter_edit, Qt.Key.Key_A, Qt.KeyboardModifier.ControlModifier)  # its own keys stay
    assert view.filter_edit.selectedText() == "weight"


def test_the_demos_closing_hint_goes_when_another_tab_is_shown(qtbot, window, fixtures, tmp_path):
    """"Demo finished: this is its last checkpoint …" stayed in the status bar while other checkpoints and runs
    were shown: it speaks of the demo's checkpoint, and goes when another tab comes to the front."""
    import shutil

    from shardscope.app.first_run import HINT, DemoGuide

    run = tmp_path / "demo-run"
    shutil.copytree(fixtures["fsdp2_r2"], run / "checkpoints" / "step_000030")
    other = window.open_path(str(fixtures["ddp_r2"]))
    wait_loaded(qtbot, other)
    guide = DemoGuide(window, str(run))
    guide.on_state(str(run), "finished")  # what the Training tab says when the demo's run ends
    qtbot.waitUntil(lambda: window.statusBar().currentMessage() == HINT, timeout=SLOW)
    assert window.current_view() is guide.view
    window.tabs.setCurrentWidget(other)
    assert window.statusBar().currentMessage() == ""
    window.tabs.setCurrentWidget(guide.view)  # it does not come back: it was said
    assert window.statusBar().currentMessage() == ""
    window.show_note(HINT, guide.view)
    window.training_panel()  # the Training tab (another run) comes to the front
    assert window.statusBar().currentMessage() == ""


def test_window_shows_the_tensors_of_torchs_zstd_dcp(qtbot, window, tmp_path):
    """Issue 32, item 1: a DCP folder torch compressed (FileSystemWriter(_extensions=[ZStandard()])) opens like any
    other: its tensors in the tree, no problems, a tensor's statistics read through the codec."""
    from fuzz.zstd_files import write_zstd_checkpoint
    from gui_support import leaf_paths

    folder = write_zstd_checkpoint(tmp_path / "zstd")
    view = window.open_path(str(folder))
    wait_loaded(qtbot, view)
    assert view.data.problems == []
    assert {"model.w", "model.b", "model.h", "extra.t"} <= set(leaf_paths(view.tree.model()))
    with qtbot.waitSignal(view.statsReady, timeout=SLOW):
        assert view.select_path("model.w")
