"""The main window: checkpoints in tabs (two panes side by side), opening paths, the Library start page, drag
and drop.

Starting the application and the --screenshot mode live in ``bootstrap.py`` and ``screenshot.py``; the menu
bar in ``menus.py``; File › Import in ``import_job.py``; the Compare pickers in ``compare_picker.py``; what the
window remembers in ``settings.py``."""

from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QFileDialog,
    QLabel,
    QMainWindow,
    QMessageBox,
    QSplitter,
    QTabBar,
    QTabWidget,
    QWidget,
)

from ..backend.checkpoint.storage import is_url
from ..backend.filenames import is_index_name, is_metadata_name
from ..backend.library.names import run_name
from ..backend.runs.rundir import default_runs_root
from ..backend.text import count
from ..widgets.checkpoint_view import CheckpointView
from ..widgets.compare_view import CompareView
from ..widgets.export_dialog import ExportDialog
from ..widgets.library_view import LibraryView
from ..widgets.series_dialogs import AverageDialog, BisectDialog
from ..widgets.training_panel import TrainingPanel
from .compare_picker import ComparePicker
from .first_run import start_demo
from .menus import build_menus
from .settings import add_recent, library_roots, recent_paths, set_library_roots, settings
from .window_keys import WindowKeysFirst

# What File › Open file offers (an index or a .metadata opens its folder)
CHECKPOINT_FILES = ("Checkpoints (*.safetensors *.pt *.pth *.bin *.ckpt model.safetensors.index.json .metadata);;"
                    "All files (*)")


class MainWindow(QMainWindow):
    def __init__(self) -> None:
        super().__init__()
        self.setWindowTitle("Shardscope")
        self.setAcceptDrops(True)
        self._note_about: QWidget | None = None  # the tab the status bar's standing note speaks of
        # Two tab panes side by side, so two checkpoints (two steps of a run) can be compared;
        # the right one is hidden while empty.
        self.tabs = self._make_pane()
        self.side_tabs = self._make_pane()
        self.side_tabs.hide()
        self._active = self.tabs
        self.panes = QSplitter(Qt.Orientation.Horizontal)
        self.panes.addWidget(self.tabs)
        self.panes.addWidget(self.side_tabs)
        self.setCentralWidget(self.panes)
        self.welcome = self.library = self._make_library()  # the start page: every checkpoint of every run
        self.badge = QLabel("")
        self.statusBar().addPermanentWidget(self.badge)
        self.recent_menu, self.export_action = build_menus(self)
        self.keys_first = WindowKeysFirst(self)  # Ctrl+E, Ctrl+D, ... whatever has focus (a filter box too)
        self._show_welcome_if_empty()
        self.quiet = False  # True in --screenshot mode: no modal message boxes
        geo = settings().value("window/geometry")
        if geo is None or not self.restoreGeometry(geo):
            self.resize(default_size(self))

    def _make_pane(self) -> QTabWidget:
        pane = QTabWidget()
        pane.setTabsClosable(True)
        pane.setDocumentMode(True)
        pane.tabCloseRequested.connect(lambda i, p=pane: self.close_tab(i, p))
        pane.currentChanged.connect(lambda _i, p=pane: self._activate(p))
        pane.tabBarClicked.connect(lambda _i, p=pane: self._activate(p))
        return pane

    def _activate(self, pane: QTabWidget) -> None:
        if pane.count():
            self._active = pane
        if self._note_about is not None and pane.currentWidget() is not self._note_about:
            self.clear_note()  # it spoke of another tab ("Demo finished: this is its last checkpoint …")
        self._update_badge()

    def show_note(self, text: str, about: QWidget) -> None:
        """A status bar message that stays while ``about`` (a tab) is shown, and goes when another tab is."""
        self.statusBar().showMessage(text)
        self._note_about = about

    def clear_note(self) -> None:
        if self._note_about is not None:
            self._note_about = None
            self.statusBar().clearMessage()

    def move_to_other_side(self) -> None:
        """Move the current checkpoint to the other pane (side-by-side comparison)."""
        src = self._active
        view = src.currentWidget()
        if not isinstance(view, CheckpointView):
            return
        dst = self.side_tabs if src is self.tabs else self.tabs
        title, tip = src.tabText(src.currentIndex()), src.tabToolTip(src.currentIndex())
        src.removeTab(src.currentIndex())
        idx = dst.addTab(view, title)
        dst.setTabToolTip(idx, tip)
        dst.setCurrentIndex(idx)
        self.side_tabs.setVisible(self.side_tabs.count() > 0)
        half = max(1, self.panes.width() // 2)
        self.panes.setSizes([half, half])
        self._activate(dst)
        self._show_welcome_if_empty()

    # ------------------------------------------------------------------ checkpoints
    def current_view(self) -> CheckpointView | None:
        w = self._active.currentWidget()
        return w if isinstance(w, CheckpointView) else None

    def open_dialog(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Open checkpoint folder", self.library.start_folder())
        if path:
            self.open_path(path)

    def open_file_dialog(self) -> None:
        """Pick a checkpoint file: a consolidated file, an HF index (its folder opens) or a .metadata."""
        start = os.path.dirname((recent_paths() or [str(Path.home()) + os.sep])[0])
        path, _ = QFileDialog.getOpenFileName(self, "Open checkpoint file", start, CHECKPOINT_FILES)
        if path:
            self.open_path(path)

    def open_path(self, path: str) -> CheckpointView:
        if not is_url(path):  # fsspec URLs (s3://, memory://, ...) are opened as they are
            path = os.path.abspath(os.path.expanduser(path))
        view = CheckpointView(path)
        view.failed.connect(lambda msg, v=view: self._on_failed(v, msg))
        view.openCancelled.connect(lambda: self.statusBar().showMessage("Opening cancelled: nothing was read", 5000))
        view.loaded.connect(lambda _d, v=view: self._on_loaded(v))
        view.healthChanged.connect(self._update_badge)
        view.exportRequested.connect(self.export_current)
        pane = self._active
        idx = pane.addTab(view, tab_title(path))
        pane.setTabToolTip(idx, path)
        pane.setCurrentIndex(idx)
        self._restore_splitters(view)
        view.load()
        self._note_about = None  # replaced: the note spoke of another checkpoint
        self.statusBar().showMessage(f"Opening {path} …")
        return view

    def _on_loaded(self, view: CheckpointView) -> None:
        add_recent(view.path)
        self.statusBar().showMessage(f"Opened {view.path}", 5000)
        self._update_badge()

    def _on_failed(self, view: CheckpointView, message: str) -> None:
        self.statusBar().showMessage("Could not open the checkpoint", 5000)
        if not self.quiet:
            QMessageBox.warning(self, "Cannot open checkpoint", f"{message}\n\nNothing was loaded or run; "
                                "choose another with File › Open folder or Open file.")
        self._update_badge()

    def _update_badge(self) -> None:
        view = self.current_view()
        # NOTE: after Verify contents its findings (every byte read) replace the quick check's; a CRC32 failure
        # any read found (the Inspector's values) is counted too
        problems, deep = view.problems() if view is not None else (None, False)
        if problems is None:
            self.badge.setText("")
            return
        n = len(problems)
        ok = "● verified" if deep else "● healthy"
        self.badge.setText(ok if n == 0 else f"● {count(n, 'problem')}")
        self.badge.setStyleSheet(f"color: {'#2ca02c' if n == 0 else '#d62728'}; font-weight: bold;")

    def reload_current(self) -> None:
        view = self.current_view()
        if view is None:
            return
        pane = self._active
        selected = view.selected_node().path if view.selected_node() else None
        where = pane.currentIndex()
        self.close_tab(where, pane)
        new = self.open_path(view.path)
        if pane.indexOf(new) >= 0:  # NOTE: in its old place among the tabs (it used to jump to the end)
            pane.tabBar().moveTab(pane.indexOf(new), min(where, pane.count() - 1))
        if selected:
            new.loaded.connect(lambda _d: new.select_path(selected))

    def verify_current(self) -> None:
        """Read every byte of the current checkpoint (in the background); findings go to its Health tab."""
        view = self.current_view()
        if view is None or view.data is None:
            self.statusBar().showMessage("Open a checkpoint first, then verify its contents.", 5000)
            return
        view.verify_contents()

    def run_demo(self) -> None:
        """Start the demo run in the Training tab; its last checkpoint opens when it ends."""
        start_demo(self)

    def close_tab(self, idx: int, pane: QTabWidget | None = None) -> None:
        pane = pane or self.tabs
        w = pane.widget(idx)
        if isinstance(w, CheckpointView):
            self._save_splitters(w)
            w.shutdown()
        if isinstance(w, CompareView):
            w.shutdown()
        if w is getattr(self, "_training", None):
            w.shutdown()
            self._training = None
        pane.removeTab(idx)
        if w is not None and w is not self.welcome:
            w.deleteLater()
        if pane is self.side_tabs and not pane.count():
            pane.hide()
            self._active = self.tabs
        self._show_welcome_if_empty()

    def close_current_tab(self) -> None:
        """Ctrl+W: the tab in front of the active side, unless it is the Library (the start page stays)."""
        pane = self._active
        if pane.currentWidget() is not None and pane.currentWidget() is not self.library:
            self.close_tab(pane.currentIndex(), pane)

    def _library_takes_folder(self, path: str) -> None:
        """A run folder opened by hand joins the Library if the user says so (NOTE: it used to become a root without
        a word, and Prune… over every root then covered it), unless a Library root already holds it."""
        inside = any(os.path.commonpath([os.path.abspath(path), r]) == r
                     for r in self.library.roots() if not is_url(r))
        if inside:
            return
        asked = QMessageBox.question(
            self, "Add to the Library?", f"{path} is followed in the Training tab. Add it to the Library as a root "
            "too, so its checkpoints are listed there (and Prune… and Watch plan… over every root cover them)?",
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No, QMessageBox.StandardButton.No)
        if asked == QMessageBox.StandardButton.Yes:
            self.library.add_root(path)

    def training_panel(self, run_dir: str | None = None) -> TrainingPanel:
        """The one Training tab (made on first use); optionally following ``run_dir``."""
        panel = getattr(self, "_training", None)
        if panel is None:
            panel = self._training = TrainingPanel()
            panel.openCheckpoint.connect(self.open_path)
            panel.compareRequested.connect(self.compare)
            panel.runFolderOpened.connect(self._library_takes_folder)
            pane = self.tabs
            pane.addTab(panel, "Training")
        for pane in (self.tabs, self.side_tabs):
            idx = pane.indexOf(panel)
            if idx >= 0:
                pane.setCurrentIndex(idx)
                self._activate(pane)
        if run_dir:
            panel.follow(os.path.abspath(run_dir))
            panel.refresh_runs(select=os.path.abspath(run_dir))
        return panel

    def compare(self, path_a: str, path_b: str) -> CompareView:
        view = CompareView(path_a, path_b)
        pane = self._active
        title = pair_title(path_a, path_b)
        idx = pane.addTab(view, title)
        pane.setTabToolTip(idx, f"A: {path_a}\nB: {path_b}")
        pane.setCurrentIndex(idx)
        view.finished.connect(lambda result, v=view: result is None and self._mark_failed(v, f"✕ {title}"))
        view.start()
        return view

    def compare_tensor(self, path_a: str, path_b: str, fqn: str) -> CompareView:
        """Compare two checkpoints with one tensor selected once compared (a Drift cell, a Bisect row)."""
        view = self.compare(path_a, path_b)
        view.finished.connect(lambda result, v=view: result is not None and v.select(fqn))
        return view

    def bisect_dialog(self, run_a: str, run_b: str) -> BisectDialog:
        """Bisect two runs in a modeless dialog; a differing entry opens Compare at the step found."""
        dlg = self.series_dialog = BisectDialog(run_a, run_b, self)
        dlg.compareRequested.connect(self.compare_tensor)
        dlg.open()
        return dlg

    def average_dialog(self, paths: list[str]) -> AverageDialog:
        dlg = self.series_dialog = AverageDialog(paths, self)
        dlg.open()
        return dlg

    def _mark_failed(self, view: QWidget, title: str) -> None:
        """A comparison that could not be made says so on its tab (its message is in the tab)."""
        for pane in (self.tabs, self.side_tabs):
            if pane.indexOf(view) >= 0:
                pane.setTabText(pane.indexOf(view), title)

    def compare_dialog(self) -> ComparePicker:
        """Two pickers (A, B): open checkpoints first, then the Library's complete checkpoints."""
        opened = [v.path for v in self.all_views()]
        library = [p for p in reversed(self.library.known_paths()[:200]) if p not in opened]
        # the checkpoints open in the window come first (they used to lose to the Library's last two)
        defaults = ["", "", *library[-2:], *opened][-2:]
        dlg = self.compare_picker = ComparePicker(opened + library, defaults, self.compare, self)
        dlg.open()  # NOTE: not exec(): no nested event loop, and tests can fill the pickers
        return dlg

    # ------------------------------------------------------------------ library (start page)
    def _make_library(self) -> LibraryView:
        lib = LibraryView(library_roots(), str(default_runs_root()), recent=recent_paths)
        lib.openRequested.connect(self.open_path)
        lib.exportRequested.connect(self._export_path)
        lib.compareRequested.connect(self.compare)
        lib.compareTensorRequested.connect(self.compare_tensor)
        lib.bisectRequested.connect(self.bisect_dialog)
        lib.averageRequested.connect(self.average_dialog)
        lib.openFolderRequested.connect(self.open_dialog)
        lib.demoRequested.connect(self.run_demo)
        lib.rootsChanged.connect(set_library_roots)
        return lib

    def show_library(self) -> None:
        self._show_welcome_if_empty()
        for pane in (self.tabs, self.side_tabs):
            if pane.indexOf(self.library) >= 0:
                pane.setCurrentWidget(self.library)

    def compare_action(self) -> None:
        """Ctrl+D / View › Compare: the two checkpoints selected in the Library, else two pickers."""
        if not (self.library.isVisible() and self.library.compare_selected()):
            self.compare_dialog()

    def _export_path(self, path: str) -> None:
        view = self.open_path(path)
        view.loaded.connect(lambda _d: self.export_current(""))

    def all_views(self) -> list[CheckpointView]:
        return [p.widget(i) for p in (self.tabs, self.side_tabs) for i in range(p.count())
                if isinstance(p.widget(i), CheckpointView)]

    def _show_welcome_if_empty(self) -> None:
        """The Library stays the first tab (no close button); it comes back if it was moved away and closed."""
        if self.tabs.indexOf(self.library) < 0 and self.side_tabs.indexOf(self.library) < 0:
            self.tabs.insertTab(0, self.library, "Library")
            self.tabs.tabBar().setTabButton(0, QTabBar.ButtonPosition.RightSide, None)
            self.tabs.tabBar().setTabButton(0, QTabBar.ButtonPosition.LeftSide, None)
        if self.tabs.count() == 1:
            self._active = self.tabs

    def export_current(self, prefix: str = "") -> None:
        view = self.current_view()
        if view is None or view.data is None:
            QMessageBox.information(self, "Export", "Open a checkpoint first.")
            return
        dlg = ExportDialog(view.data.ckpt, prefix, self)
        dlg.openRequested.connect(self.open_path)  # Open after an export: the written file or folder in a tab
        dlg.exec()

    # ------------------------------------------------------------------ drag and drop
    def dragEnterEvent(self, event) -> None:
        if any(url.isLocalFile() for url in event.mimeData().urls()):
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        paths = [url.toLocalFile() for url in event.mimeData().urls() if url.isLocalFile()]
        if not paths:
            event.ignore()
            return
        # NOTE: accepted, or the file manager the files came from is told the drop was refused
        event.acceptProposedAction()
        for path in paths:
            self.open_path(path)

    # ------------------------------------------------------------------ settings
    def _restore_splitters(self, view: CheckpointView) -> None:
        s = settings()
        for name, split in (("main", view.main_split), ("right", view.right_split)):
            state = s.value(f"splitters/{name}")
            if state is not None and split.restoreState(state):
                view.layout_restored = True

    def _save_splitters(self, view: CheckpointView) -> None:
        s = settings()
        s.setValue("splitters/main", view.main_split.saveState())
        s.setValue("splitters/right", view.right_split.saveState())

    def closeEvent(self, event) -> None:
        s = settings()
        s.setValue("window/geometry", self.saveGeometry())
        view = self.current_view()
        if view is not None:
            self._save_splitters(view)
        for w in self.all_views():
            w.shutdown()
        if getattr(self, "_training", None) is not None:
            self._training.shutdown()
        self.library.shutdown()
        super().closeEvent(event)


def tab_title(path: str) -> str:
    """A tab's name: the file or folder name, but the folder's for a file that only stands for its folder (an
    HF ``*.index.json`` or a DCP ``.metadata``): every HF model's tab used to read model.safetensors.index.json."""
    p = Path(path)
    if (is_metadata_name(p.name) or is_index_name(p.name)) and p.parent.name:
        return p.parent.name
    return p.name or path


def pair_title(path_a: str, path_b: str) -> str:
    """A Compare tab's name: both checkpoints' names, each with its run's when the two are in different folders
    (two runs' ``step_000030`` read the same: a failed pair's tab looked like the previous pair's)."""
    a, b = tab_title(path_a), tab_title(path_b)
    if os.path.dirname(path_a.rstrip("/")) != os.path.dirname(path_b.rstrip("/")):
        a, b = (f"{run}/{name}" if run else name for run, name in ((run_name(path_a), a), (run_name(path_b), b)))
    return f"{a} ↔ {b}"


def default_size(window: QMainWindow) -> QSize:
    """1400 x 900, or 90 % of a smaller screen (a 1366 x 768 laptop)."""
    screen = window.screen() or QGuiApplication.primaryScreen()
    avail = screen.availableGeometry().size() if screen is not None else QSize(1400, 900)
    return QSize(min(1400, int(avail.width() * 0.9)), min(900, int(avail.height() * 0.9)))
