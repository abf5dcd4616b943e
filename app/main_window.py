"""The main window: checkpoints in tabs (two panes side by side), menus, recent list, drag and drop.

Starting the application and the --screenshot mode live in ``bootstrap.py`` and ``screenshot.py``;
what the window remembers lives in ``settings.py``."""

from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QAction, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressDialog,
    QPushButton,
    QSplitter,
    QTabBar,
    QTabWidget,
)
from shardscope.backend.checkpoint.storage import is_url
from shardscope.backend.compare.browse_file import TORCH_FILE
from shardscope.backend.export.dcp_writer import import_file
from shardscope.backend.format import count
from shardscope.widgets.checkpoint_view import CheckpointView
from shardscope.widgets.compare_view import CompareView
from shardscope.widgets.help import help_topics, show_help
from shardscope.widgets.library_view import LibraryView
from shardscope.widgets.training_panel import TrainingPanel
from shardscope.widgets.workers import run_in_background

from .settings import add_recent, library_roots, recent_paths, set_library_roots, settings

# What File › Open file offers (an index or a .metadata opens its folder)
CHECKPOINT_FILES = ("Checkpoints (*.safetensors *.pt *.pth *.bin *.ckpt model.safetensors.index.json .metadata);;"
                    "All files (*)")


class MainWindow(QMainWindow):
    def __init__(self) -> None:
        super().__init__()
        self.setWindowTitle("Shardscope")
        self.setAcceptDrops(True)
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
        self._build_menus()
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
        self._update_badge()

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

    # ------------------------------------------------------------------ menus
    def _action(self, menu, text: str, slot, shortcut: QKeySequence | str | None = None, tip: str = "") -> QAction:
        """One menu entry: text, what it does, its shortcut (shown in Help › Keyboard shortcuts) and tooltip."""
        act = QAction(text, self)
        if shortcut is not None:
            act.setShortcut(QKeySequence(shortcut))
        if tip:
            act.setToolTip(tip)
        act.triggered.connect(slot)
        menu.addAction(act)
        return act

    def _build_menus(self) -> None:
        bar, add = self.menuBar(), self._action
        file_menu = bar.addMenu("&File")
        add(file_menu, "&Open folder…", self.open_dialog, QKeySequence.StandardKey.Open,
            "A DCP or Lightning checkpoint folder, or an HF folder of safetensors files")
        add(file_menu, "Open &file…", self.open_file_dialog, "Ctrl+Shift+O",
            "A .safetensors, .pt/.pth/.bin/.ckpt file, an HF model.safetensors.index.json or a DCP .metadata")
        self.recent_menu = file_menu.addMenu("Open &recent")
        self.recent_menu.aboutToShow.connect(self._fill_recent)
        add(file_menu, "&Reload", self.reload_current, "F5")
        add(file_menu, "&Close tab", self.close_current_tab, QKeySequence.StandardKey.Close,
            "Close the tab in front (not the Library); its background work is cancelled")
        add(file_menu, "&Verify contents (read every byte)", self.verify_current, "Ctrl+Shift+V",
            "Read every stored item once and check its CRC32; findings go to the Health tab")
        add(file_menu, "&Import .pt / .safetensors as DCP…", self.import_dialog)
        self.export_action = add(file_menu, "&Export…", lambda: self.export_current(""), "Ctrl+E")
        file_menu.addSeparator()
        add(file_menu, "&Quit", self.close, QKeySequence.StandardKey.Quit)
        view_menu = bar.addMenu("&View")
        add(view_menu, "Move tab to the &other side", self.move_to_other_side, "Ctrl+Shift+M",
            "Show two checkpoints side by side")
        add(view_menu, "&Library", self.show_library, "Ctrl+L", "Every checkpoint of every run under your roots")
        add(view_menu, "&Compare…", self.compare_action, "Ctrl+D",
            "Compare the two checkpoints selected in the Library, or pick two")
        run_menu = bar.addMenu("&Run")
        add(run_menu, "&Training panel", lambda: self.training_panel(), "Ctrl+T")
        add(run_menu, "Run the &demo", self.run_demo, None,
            "Train a tiny model with FSDP on 2 CPU ranks, then open its last checkpoint")
        add(bar.addMenu("&Edit"), "&Find", self._focus_filter, QKeySequence.StandardKey.Find)
        help_menu = bar.addMenu("&Help")
        for topic in help_topics():
            add(help_menu, topic.title, lambda _c=False, t=topic.key: show_help(self, t), topic.shortcut or None)
        help_menu.addSeparator()
        add(help_menu, "&About Shardscope", lambda: show_help(self, "about"))

    def _fill_recent(self) -> None:
        self.recent_menu.clear()
        recent = recent_paths()
        if not recent:
            self.recent_menu.addAction("(none)").setEnabled(False)
        for p in recent:
            self.recent_menu.addAction(p, lambda p=p: self.open_path(p))

    def _focus_filter(self) -> None:
        view = self.current_view()
        if view:
            view.focus_filter()

    # ------------------------------------------------------------------ checkpoints
    def current_view(self) -> CheckpointView | None:
        w = self._active.currentWidget()
        return w if isinstance(w, CheckpointView) else None

    def open_dialog(self) -> None:
        start = (recent_paths() or [str(Path.home())])[0]
        path = QFileDialog.getExistingDirectory(self, "Open checkpoint folder", start)
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
        view.loaded.connect(lambda _d, v=view: self._on_loaded(v))
        view.contentsVerified.connect(lambda _p: self._update_badge())
        view.exportRequested.connect(self.export_current)
        pane = self._active
        idx = pane.addTab(view, tab_title(path))
        pane.setTabToolTip(idx, path)
        pane.setCurrentIndex(idx)
        self._restore_splitters(view)
        view.load()
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
        if view is None or view.data is None or view.data.problems is None:
            self.badge.setText("")
            return
        # NOTE: after Verify contents its findings (every byte read) replace the quick check's
        deep = view.verified_problems is not None
        n = len(view.verified_problems if deep else view.data.problems)
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
        from .first_run import start_demo

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
        """A run folder opened by hand joins the Library, unless a Library root already holds it."""
        inside = any(os.path.commonpath([os.path.abspath(path), r]) == r
                     for r in self.library.roots() if not is_url(r))
        if not inside:
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
        idx = pane.addTab(view, f"{Path(path_a).name} ↔ {Path(path_b).name}")
        pane.setTabToolTip(idx, f"A: {path_a}\nB: {path_b}")
        pane.setCurrentIndex(idx)
        view.start()
        return view

    def compare_dialog(self) -> QDialog:
        """Two pickers (A, B): open checkpoints first, then the Library's complete checkpoints."""
        opened = [v.path for v in self.all_views()]
        library = [p for p in reversed(self.library.known_paths()[:200]) if p not in opened]
        paths = opened + library
        # the checkpoints open in the window come first (they used to lose to the Library's last two)
        defaults = ["", "", *library[-2:], *opened][-2:]
        dlg = self.compare_picker = QDialog(self)
        dlg.setWindowTitle("Compare two checkpoints")
        form = QFormLayout(dlg)
        boxes = []
        for label, default in zip("AB", defaults, strict=True):
            box = QComboBox()
            box.setEditable(True)
            box.addItems(paths)
            box.setCurrentText(default)
            box.setMinimumWidth(480)
            browse = QPushButton("Browse…")
            browse.clicked.connect(lambda _c=False, b=box: self._browse_into(b))
            row = QHBoxLayout()
            row.addWidget(box, 1)
            row.addWidget(browse)
            form.addRow(label, row)
            boxes.append(box)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(dlg.accept)
        buttons.rejected.connect(dlg.reject)
        form.addRow(buttons)
        dlg.boxes = boxes

        def accepted() -> None:
            if boxes[0].currentText() and boxes[1].currentText():
                self.compare(boxes[0].currentText(), boxes[1].currentText())

        dlg.accepted.connect(accepted)
        dlg.open()  # NOTE: not exec(): no nested event loop, and tests can fill the pickers
        return dlg

    # ------------------------------------------------------------------ library (start page)
    def _make_library(self) -> LibraryView:
        from shardscope.backend.runs.rundir import default_runs_root

        lib = LibraryView(library_roots(), str(default_runs_root()), recent=recent_paths)
        lib.openRequested.connect(self.open_path)
        lib.exportRequested.connect(self._export_path)
        lib.compareRequested.connect(self.compare)
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

    def _browse_into(self, box: QComboBox) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "A consolidated file (or cancel to pick a folder)", "",
                                              "Checkpoints (*.pt *.pth *.bin *.safetensors);;All files (*)")
        if not path:
            path = QFileDialog.getExistingDirectory(self, "A checkpoint folder")
        if path:
            box.setCurrentText(path)

    def import_dialog(self) -> None:
        src, _ = QFileDialog.getOpenFileName(self, "Import a consolidated checkpoint", "",
                                             "Checkpoints (*.pt *.pth *.bin *.safetensors)")
        if not src:
            return
        dst, _ = QFileDialog.getSaveFileName(self, "New DCP checkpoint folder", str(Path(src).with_suffix("")) + "-dcp")
        if not dst:
            return
        ranks, ok = QInputDialog.getInt(self, "Import", "Write it as if saved by this many ranks:", 1, 1, 4096)
        if not ok:
            return
        prefix, ok = QInputDialog.getText(self, "Import", "Nest every key under (e.g. model; empty: as is):")
        if ok:
            self._run_dcp_job(import_file, src, dst, ranks, prefix or None, title=f"Importing {Path(src).name}")

    def _run_dcp_job(self, func, *args, title: str) -> None:
        progress = QProgressDialog(title, "Cancel", 0, 1000, self)
        progress.setMinimumDuration(300)

        def done(result) -> None:
            progress.close()
            if result.verified is False:
                QMessageBox.warning(self, title, result.summary())
                return
            self.statusBar().showMessage(result.summary().splitlines()[0], 8000)
            self.open_path(result.dst)

        def failed(message: str) -> None:
            progress.close()
            # NOTE: the backend speaks of the CLI's --force, which this window does not offer
            message = message.replace("give --force to overwrite it", "choose a folder that does not exist yet")
            QMessageBox.warning(self, title, f"{message}\n\nNothing was written.")

        # the dialog owns the job: its slots are skipped once it is gone; it is deleted when the job ends
        worker = run_in_background(func, *args, owner=progress, on_result=done, on_error=failed,
                                   on_progress=lambda d, t, _m: progress.setValue(int(1000 * d / max(t, 1))),
                                   on_cancelled=progress.close, on_finished=progress.deleteLater)
        progress.canceled.connect(worker.quit)

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
        if view.data.ckpt.format == TORCH_FILE:
            QMessageBox.information(self, "Export", f"{view.path} is a torch.save file: File › Import turns it "
                                    "into a DCP checkpoint, `shardscope import` too.")
            return
        from shardscope.widgets.export_dialog import ExportDialog

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
    if (p.name == ".metadata" or p.name.endswith(".index.json")) and p.parent.name:
        return p.parent.name
    return p.name or path


def default_size(window: QMainWindow) -> QSize:
    """1400 x 900, or 90 % of a smaller screen (a 1366 x 768 laptop)."""
    screen = window.screen() or QGuiApplication.primaryScreen()
    avail = screen.availableGeometry().size() if screen is not None else QSize(1400, 900)
    return QSize(min(1400, int(avail.width() * 0.9)), min(900, int(avail.height() * 0.9)))
