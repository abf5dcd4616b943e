"""The main window's menu bar: File, View, Run, Edit and Help, each entry with its shortcut (listed by Help ›
Keyboard shortcuts) and tooltip. Every entry calls the window: the MainWindow is passed in, never imported."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QMainWindow, QMenu

from ..widgets.help import help_topics, show_help
from .import_job import import_dialog
from .settings import recent_paths


def add_action(window: QMainWindow, menu: QMenu, text: str, slot, shortcut: QKeySequence | str | None = None,
               tip: str = "") -> QAction:
    """One menu entry: text, what it does, its shortcut (shown in Help › Keyboard shortcuts) and tooltip."""
    act = QAction(text, window)
    if shortcut is not None:
        act.setShortcut(QKeySequence(shortcut))
    if tip:
        act.setToolTip(tip)
    act.triggered.connect(slot)
    menu.addAction(act)
    return act


def build_menus(window) -> tuple[QMenu, QAction]:
    """Fill the menu bar of ``window`` (the MainWindow); returns its Open recent menu and its Export action."""
    bar = window.menuBar()

    def add(menu: QMenu, text: str, slot, shortcut: QKeySequence | str | None = None, tip: str = "") -> QAction:
        return add_action(window, menu, text, slot, shortcut, tip)

    file_menu = bar.addMenu("&File")
    add(file_menu, "&Open folder…", window.open_dialog, QKeySequence.StandardKey.Open,
        "A DCP or Lightning checkpoint folder, or an HF folder of safetensors files")
    add(file_menu, "Open &file…", window.open_file_dialog, "Ctrl+Shift+O",
        "A .safetensors, .pt/.pth/.bin/.ckpt file, an HF model.safetensors.index.json or a DCP .metadata")
    recent_menu = file_menu.addMenu("Open &recent")
    recent_menu.aboutToShow.connect(lambda: fill_recent(recent_menu, window.open_path))
    add(file_menu, "&Reload", window.reload_current, "F5")
    add(file_menu, "&Close tab", window.close_current_tab, QKeySequence.StandardKey.Close,
        "Close the tab in front (not the Library); its background work is cancelled")
    add(file_menu, "&Verify contents (read every byte)", window.verify_current, "Ctrl+Shift+V",
        "Read every stored item once and check its CRC32; findings go to the Health tab")
    add(file_menu, "&Import .pt / .safetensors as DCP…", lambda: import_dialog(window))
    export_action = add(file_menu, "&Export…", lambda: window.export_current(""), "Ctrl+E")
    file_menu.addSeparator()
    add(file_menu, "&Quit", window.close, QKeySequence.StandardKey.Quit)
    view_menu = bar.addMenu("&View")
    add(view_menu, "Move tab to the &other side", window.move_to_other_side, "Ctrl+Shift+M",
        "Show two checkpoints side by side")
    add(view_menu, "&Library", window.show_library, "Ctrl+L", "Every checkpoint of every run under your roots")
    add(view_menu, "&Compare…", window.compare_action, "Ctrl+D",
        "Compare the two checkpoints selected in the Library, or pick two")
    run_menu = bar.addMenu("&Run")
    add(run_menu, "&Training panel", lambda: window.training_panel(), "Ctrl+T")
    add(run_menu, "Run the &demo", window.run_demo, None,
        "Train a tiny model with FSDP on 2 CPU ranks, then open its last checkpoint")
    add(bar.addMenu("&Edit"), "&Find", lambda: focus_filter(window), QKeySequence.StandardKey.Find)
    help_menu = bar.addMenu("&Help")
    for topic in help_topics():
        add(help_menu, topic.title, lambda _c=False, t=topic.key: show_help(window, t), topic.shortcut or None)
    help_menu.addSeparator()
    add(help_menu, "&About Shardscope", lambda: show_help(window, "about"))
    return recent_menu, export_action


def fill_recent(menu: QMenu, open_path: Callable[[str], object]) -> None:
    """File › Open recent, filled as it opens."""
    menu.clear()
    recent = recent_paths()
    if not recent:
        menu.addAction("(none)").setEnabled(False)
    for p in recent:
        menu.addAction(p, lambda p=p: open_path(p))


def focus_filter(window) -> None:
    """Edit › Find: the filter box of the checkpoint in front."""
    view = window.current_view()
    if view:
        view.focus_filter()
