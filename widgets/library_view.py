"""The Library: every checkpoint of every run under the user's roots, the start page of the window.

A tree of runs -> checkpoints (step, time, size with a bar, writer ranks, format, state, loss at the
step, an export's source and a checkpoint's exports, warned when the source changed), refreshed by a
scan in a worker every two seconds (so a network file system never blocks the window), a disk-usage
table per root with what the prune rules would free, and the actions: Open, Export, Show in folder,
Compare (two selected), Watch plan (what ``shardscope watch`` would do and what it did), Prune.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QModelIndex, QSortFilterProxyModel, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QInputDialog,
    QLabel,
    QLineEdit,
    QMenu,
    QPushButton,
    QSplitter,
    QTreeView,
    QVBoxLayout,
    QWidget,
)

from ..backend.filenames import is_url
from ..backend.library.prune import Rules
from ..backend.library.records import CheckpointRecord, RunRecord
from ..backend.library.snapshot import LibrarySnapshot, take_snapshot
from ..backend.text import count, human_bytes
from .drift_view import DriftView
from .library_model import NAME_SAMPLE, SIZE_COLUMN, LibraryModel, SortRole
from .library_usage import DiskUsagePanel, SizeBarDelegate
from .prune_dialog import PruneDialog
from .watch_dialog import WatchPlanDialog
from .workers import Worker, run_in_background

CHECKPOINT_SAMPLE = "weights.safetensors"  # a checkpoint's name (an export's), one level deeper than NAME_SAMPLE
# what each column after the name must show whole (its header too)
COLUMN_SAMPLES = ("000000", "2026-11-26 13:35", "1023.9 MiB", "000–000", "resumable", "lightning", "incomplete",
                  "00.0000", "source / exports")

POLL_MS = 2000
OPENABLE = ("complete",)


def why_not_opened(c: CheckpointRecord) -> str:
    """What the Library says when a double-click cannot open ``c`` in the browser."""
    if c.is_file and c.state in OPENABLE:  # NOTE: it used to say "a.pt is complete; it opens once it is complete"
        return (f"{c.name} is a consolidated file: the browser opens checkpoint folders. Select it with another "
                "checkpoint and Compare them.")
    reason = f": {c.reason}" if c.reason else ""
    if c.state == "unreadable":
        return f"{c.name} is unreadable{reason}; it cannot be opened."
    return f"{c.name} is {c.state}{reason}; it opens once it is complete."



class LibraryView(QWidget):
    """The start page: the library tree, the disk-usage table and the actions."""

    openRequested = Signal(str)
    exportRequested = Signal(str)
    compareRequested = Signal(str, str)
    compareTensorRequested = Signal(str, str, str)  # two checkpoints and the tensor to select (a Drift cell)
    bisectRequested = Signal(str, str)  # two runs
    averageRequested = Signal(list)  # checkpoints
    openFolderRequested = Signal()
    demoRequested = Signal()
    rootsChanged = Signal(list)  # the roots the user added (the default runs directory is not among them)
    refreshed = Signal()  # a poll's snapshot was applied

    def __init__(self, roots: list[str], default_root: str | None = None, rules: Rules | None = None,
                 recent: Callable[[], list[str]] | None = None, parent=None) -> None:
        super().__init__(parent)
        self.recent = recent or list  # the window's recently opened checkpoints (read when the menu opens)
        self.user_roots = [r if is_url(r) else os.path.abspath(os.path.expanduser(r)) for r in roots]
        self.default_root = default_root
        self.rules = rules or Rules(keep_last=3)
        self.snapshot: LibrarySnapshot | None = None
        self._worker: Worker | None = None
        self._stale = False
        self._started = 0.0
        self._show_root: str | None = None
        self.model = LibraryModel(self)
        self.proxy = QSortFilterProxyModel(self)
        self.proxy.setSourceModel(self.model)
        self.proxy.setSortRole(SortRole)
        self.proxy.setRecursiveFilteringEnabled(True)
        # NOTE: a run whose name matches keeps its checkpoints (filtering by a run's name used to show the run
        # with "3 ckpt" and nothing under it to open)
        self.proxy.setAutoAcceptChildRows(True)
        self.proxy.setFilterCaseSensitivity(Qt.CaseSensitivity.CaseInsensitive)
        self.proxy.setFilterKeyColumn(0)
        lay = QVBoxLayout(self)
        lay.addLayout(self._build_buttons())
        self.empty_hint = QLabel()
        self.empty_hint.setWordWrap(True)
        self.empty_hint.hide()
        lay.addWidget(self.empty_hint)
        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(self._build_tree())
        split.addWidget(self._build_usage())
        # NOTE: Disk usage as wide as a run's name needs, the tree the rest (it had a quarter: at 1280x720 the
        # tree's last column was off-screen and Disk usage cut run names to "run-202…-133538")
        split.setStretchFactor(0, 1)
        split.setStretchFactor(1, 0)
        split.setSizes([10 * self.usage_panel.wanted_width(), self.usage_panel.wanted_width()])
        lay.addWidget(split, 1)
        self.status = QLabel("Scanning …")
        self.status.setWordWrap(True)  # NOTE: a long roots line must not set the window's minimum width
        lay.addWidget(self.status)
        self.timer = QTimer(self)
        self.timer.setInterval(POLL_MS)
        self.timer.timeout.connect(self.poll)
        self.timer.start()
        self._update_buttons()
        QTimer.singleShot(0, self.poll)

    # ------------------------------------------------------------------ layout
    def _button(self, text: str, slot, tip: str = "") -> QPushButton:
        b = QPushButton(text)
        b.clicked.connect(slot)
        b.setToolTip(tip)
        return b

    def _build_buttons(self) -> QVBoxLayout:
        # NOTE: two rows (where checkpoints come from / what to do with the selection): one row of ten
        # buttons set the window's minimum width to 1374 px in split view (issue 14: must fit 1280x720)
        rows = QVBoxLayout()
        row = QHBoxLayout()
        rows.addLayout(row)
        row.addWidget(self._button("Open folder…", self.openFolderRequested.emit, "Open a checkpoint folder (Ctrl+O)"))
        recent = self._button("Recent", lambda: None, "Checkpoints opened recently")
        self.recent_menu = QMenu(recent)
        self.recent_menu.aboutToShow.connect(self._fill_recent)
        recent.setMenu(self.recent_menu)
        row.addWidget(recent)
        add = self._button("Add root", lambda: None, "Watch another folder of runs, or a storage URL")
        add_menu = QMenu(add)
        add_menu.addAction("Folder…", self.add_root_dialog)
        add_menu.addAction("URL (s3://, gs://, …)…", self.add_url_dialog)
        add.setMenu(add_menu)
        row.addWidget(add)
        self.remove_root_button = self._button("Remove root", self.remove_selected_root,
                                               "Stop watching the root chosen in Disk usage")
        row.addWidget(self.remove_root_button)
        row.addWidget(self._button("Run the demo", self.demoRequested.emit,
                                   "Train a tiny FSDP model on 2 CPU ranks; its checkpoints appear here"))
        row.addStretch(1)
        self.watch_button = self._button("Watch plan…", self.watch_dialog, "What `shardscope watch` would export and "
                                         "remove under the selected runs (or every root), and what a watch did")
        row.addWidget(self.watch_button)
        self.prune_button = self._button("Prune…", self.prune_dialog, "Remove checkpoints of the selected runs (or "
                                         "of every root) by rules, with a preview")
        row.addWidget(self.prune_button)
        row = QHBoxLayout()
        rows.addLayout(row)
        self.open_button = self._button("Open", self.open_selected, "Browse the selected checkpoint")
        self.export_button = self._button("Export…", self.export_selected, "Consolidate the selected checkpoint")
        self.folder_button = self._button("Show in folder", self.show_selected_in_folder)
        self.compare_button = self._button("Compare", self.compare_selected, "Select two checkpoints to compare")
        for b in (self.open_button, self.export_button, self.folder_button, self.compare_button):
            row.addWidget(b)
        row.addStretch(1)
        self.filter = QLineEdit()
        self.filter.setPlaceholderText("Filter runs and checkpoints")
        self.filter.setClearButtonEnabled(True)
        self.filter.textChanged.connect(self.proxy.setFilterFixedString)
        self.filter.setMaximumWidth(240)
        row.addWidget(self.filter, 1)
        return rows

    def _build_tree(self) -> QTreeView:
        self.tree = QTreeView()
        self.tree.setModel(self.proxy)
        self.tree.setSortingEnabled(True)
        self.tree.sortByColumn(0, Qt.SortOrder.AscendingOrder)
        self.tree.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.tree.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.tree.setUniformRowHeights(True)
        self.tree.setAlternatingRowColors(True)
        self.tree.setIndentation(16)  # NOTE: two levels only; Fusion's 20 px cost the name column 40 px at 1280x720
        self.tree.setItemDelegateForColumn(SIZE_COLUMN, SizeBarDelegate(
            lambda i: self.model.bar_fraction(self.proxy.mapToSource(i)), self.tree))
        header = self.tree.header()
        # NOTE: widths from the font, the name column first: stretched into what fixed widths (970 px) left, it
        # was 90 px at 1280x720 and every checkpoint read "step_0…"; the source column, last, takes the rest
        header.setStretchLastSection(True)
        fm = self.tree.fontMetrics()
        pad = fm.averageCharWidth() + 4  # as in DiskUsagePanel.wanted_width
        indent = self.tree.indentation()
        name = pad + max(indent + fm.horizontalAdvance(NAME_SAMPLE),
                         2 * indent + fm.horizontalAdvance(CHECKPOINT_SAMPLE))
        header.setMinimumSectionSize(fm.horizontalAdvance("0000") + pad)
        for col, sample in enumerate((None, *COLUMN_SAMPLES)):
            header.setSectionResizeMode(col, QHeaderView.ResizeMode.Interactive)
            header.resizeSection(col, name if sample is None else max(
                fm.horizontalAdvance(sample), fm.horizontalAdvance(self.model.headerData(col, Qt.Orientation.Horizontal)
                                                                   or "")) + pad)
        self.tree.selectionModel().selectionChanged.connect(lambda *_: self._update_buttons())
        # NOTE: activated, not doubleClicked: Enter opens the selected checkpoint too (keyboard-only use)
        self.tree.activated.connect(lambda _i: self.open_selected())
        self.tree.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.tree.customContextMenuRequested.connect(self._context_menu)
        self.proxy.rowsInserted.connect(self._expand_new)
        return self.tree

    def _build_usage(self) -> QWidget:
        self.usage_panel = panel = DiskUsagePanel()
        panel.rootChanged.connect(self._fill_usage)
        panel.runActivated.connect(self._reveal_run)
        self.usage, self.usage_table = panel.usage, panel.usage_table
        self.root_box, self.rules_label = panel.root_box, panel.rules_label
        return panel

    def _fill_recent(self) -> None:
        self.recent_menu.clear()
        paths = self.recent()
        for p in paths:
            self.recent_menu.addAction(p, lambda p=p: self.openRequested.emit(p))
        if not paths:
            self.recent_menu.addAction("(none yet)").setEnabled(False)

    # ------------------------------------------------------------------ roots
    def roots(self) -> list[str]:
        out = [self.default_root] if self.default_root else []
        return out + [r for r in self.user_roots if r not in out]

    def add_root(self, path: str) -> None:
        if not is_url(path):
            path = os.path.abspath(os.path.expanduser(path))
        if path not in self.roots():
            self.user_roots.append(path)
            self.rootsChanged.emit(list(self.user_roots))
        self._show_root = path  # Disk usage turns to the root just added (on the next fill)
        self.poll(force=True)

    def add_root_dialog(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Add a folder of runs or checkpoints to the Library")
        if path:
            self.add_root(path)

    def add_url_dialog(self) -> None:
        url, ok = QInputDialog.getText(self, "Add a storage URL to the Library",
                                       "URL of a folder of runs or checkpoints (listed in one request per poll; "
                                       "credentials and endpoint from the environment, e.g. AWS_ENDPOINT_URL):",
                                       text="s3://")
        if ok and "://" in url and url.strip() not in ("s3://", ""):
            self.add_root(url.strip())

    def remove_selected_root(self) -> None:
        root = self.root_box.currentData()
        if root in self.user_roots:
            self.user_roots.remove(root)
            self.rootsChanged.emit(list(self.user_roots))
            self.poll(force=True)

    # ------------------------------------------------------------------ polling
    def poll(self, force: bool = False) -> None:
        """Start a scan in a worker (one at a time); skipped while the Library is hidden."""
        if self._worker is not None:
            self._stale = self._stale or force
            return
        if not force and not self.isVisible() and self.snapshot is not None:
            return
        self._started = time.monotonic()
        self._worker = run_in_background(take_snapshot, self.roots(), self.rules, owner=self, on_result=self._apply,
                                         on_error=self._failed, on_finished=self._done)

    def _done(self) -> None:
        self._worker = None
        # a slow (network) file system is polled less often: at most a fifth of the time is spent scanning
        self.timer.setInterval(max(POLL_MS, int(5000 * (time.monotonic() - self._started))))
        if self._stale:
            self._stale = False
            self.poll(force=True)

    def _failed(self, message: str) -> None:
        self.status.setText(f"<span style='color:#d62728'>Scan failed: {message}</span>")

    def _apply(self, snap: LibrarySnapshot) -> None:
        self.snapshot = snap
        self.model.set_snapshot(snap)
        cks = snap.listing.checkpoints
        counts = {s: sum(1 for c in cks if c.state == s) for s in ("incomplete", "writing", "unreadable")}
        extra = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        missing = f" · missing: {', '.join(snap.missing)}" if snap.missing else ""
        left = f" · {count(len(snap.listing.leftovers), 'interrupted prune')} to finish (Prune…)" \
            if snap.listing.leftovers else ""
        self.status.setText(f"{count(len(cks), 'checkpoint')} in {count(len(snap.listing.runs), 'run')}, "
                            f"{human_bytes(snap.listing.bytes)}{f' ({extra})' if extra else ''} · roots: "
                            f"{', '.join(self.roots())}{missing}{left} · updated {time.strftime('%H:%M:%S')}")
        self.empty_hint.setVisible(not cks)
        self.empty_hint.setText("<b>No checkpoints yet.</b> Run the demo to train a tiny model whose checkpoints "
                                "appear here as they are written, add a folder of runs with Add root…, or open "
                                "one checkpoint folder with Open folder….")
        self._fill_roots()
        self._update_buttons()
        self.refreshed.emit()

    def _expand_new(self, parent: QModelIndex, first: int, last: int) -> None:
        if not parent.isValid():
            for row in range(first, last + 1):
                self.tree.expand(self.proxy.index(row, 0))

    def _fill_roots(self) -> None:
        current = self._show_root or self.root_box.currentData()
        self._show_root = None
        self.usage_panel.set_roots(self.roots(), current)
        self._fill_usage()

    def _fill_usage(self) -> None:
        self.remove_root_button.setEnabled(self.root_box.currentData() in self.user_roots)
        self.usage_panel.fill(self.snapshot, self.rules)

    def _reveal_run(self, run: RunRecord) -> None:
        """Show a run of the disk-usage table in the tree."""
        row = next((i for i, r in enumerate(self.model.runs) if r.path == run.path), -1)
        if row >= 0:
            proxy_index = self.proxy.mapFromSource(self.model.index(row, 0))
            self.tree.expand(proxy_index)
            self.tree.setCurrentIndex(proxy_index)
            self.tree.scrollTo(proxy_index)

    # ------------------------------------------------------------------ selection and actions
    def selected_checkpoints(self) -> list[CheckpointRecord]:
        out = []
        for i in self.tree.selectionModel().selectedRows(0):
            rec = self.model.record(self.proxy.mapToSource(i))
            if isinstance(rec, CheckpointRecord):
                out.append(rec)
        return out

    def start_folder(self) -> str:
        """Where a folder dialog starts: the selected checkpoint's run folder, else the root Disk usage shows, else
        the first local root (NOTE: Open folder… started in the last checkpoint opened, however unrelated)."""
        selected = [c.run for c in self.selected_checkpoints() if not is_url(c.run)]
        roots = [r for r in (self.root_box.currentData(), *self.roots()) if r and not is_url(r)]
        return next((p for p in (*selected, *roots) if os.path.isdir(p)), str(Path.home()))

    def select_paths(self, paths: list[str]) -> None:
        """Select these checkpoints (tests and the window's Compare use it)."""
        sel = self.tree.selectionModel()
        sel.clearSelection()
        for r, run in enumerate(self.model.runs):
            for k, c in enumerate(run.checkpoints):
                if c.path in paths:
                    idx = self.proxy.mapFromSource(self.model.index(k, 0, self.model.index(r, 0)))
                    self.tree.expand(idx.parent())
                    sel.select(idx, sel.SelectionFlag.Select | sel.SelectionFlag.Rows)

    def _update_buttons(self) -> None:
        sel = self.selected_checkpoints()
        one = sel[0] if len(sel) == 1 else None
        ready = one is not None and one.state in OPENABLE
        self.open_button.setEnabled(ready and not one.is_file)
        self.export_button.setEnabled(ready and not one.is_file)
        self.folder_button.setEnabled(one is not None and not is_url(one.path))
        self.compare_button.setEnabled(len(sel) == 2 and all(c.state in OPENABLE for c in sel))
        if one is not None and not ready:
            self.open_button.setToolTip(why_not_opened(one))
        elif one is not None and one.is_file:
            self.open_button.setToolTip("A consolidated file: Compare it with another checkpoint")
        else:
            self.open_button.setToolTip("Browse the selected checkpoint")

    def _context_menu(self, pos) -> None:
        menu = QMenu(self)
        for button in (self.open_button, self.export_button, self.folder_button, self.compare_button):
            menu.addAction(button.text(), button.click).setEnabled(button.isEnabled())
        paths = [c.path for c in self.selected_checkpoints()]
        menu.addAction("Copy path", lambda: QGuiApplication.clipboard().setText("\n".join(paths))).setEnabled(
            bool(paths))
        runs = sorted({c.run for c in self.selected_checkpoints()})
        menu.addAction("Drift of the run…", lambda: self.drift_window(runs[0])).setEnabled(len(runs) == 1)
        two = self.selected_runs()
        menu.addAction("Bisect the two runs…", lambda: self.bisectRequested.emit(*two)).setEnabled(len(two) == 2)
        menu.addAction("Average…", lambda: self.averageRequested.emit(paths)).setEnabled(len(paths) >= 2)
        menu.addAction("Watch plan…", self.watch_dialog)
        menu.addAction("Prune…", self.prune_dialog)
        menu.exec(self.tree.viewport().mapToGlobal(pos))

    def drift_window(self, run: str) -> DriftView:
        """The Drift view of one run in a window of its own (computed in the background)."""
        view = DriftView(self)
        view.setWindowFlag(Qt.WindowType.Window)
        view.setWindowTitle(f"Drift: {run}")
        view.resize(1280, 720)
        view.compareRequested.connect(self.compareTensorRequested)
        view.show()
        view.load([run])
        return view

    def open_selected(self) -> None:
        sel = self.selected_checkpoints()
        if len(sel) == 1 and sel[0].state in OPENABLE and not sel[0].is_file:
            self.openRequested.emit(sel[0].path)
        elif len(sel) == 1:
            self.status.setText(why_not_opened(sel[0]))

    def export_selected(self) -> None:
        sel = self.selected_checkpoints()
        if len(sel) == 1 and sel[0].state in OPENABLE:
            self.exportRequested.emit(sel[0].path)

    def show_selected_in_folder(self) -> None:
        sel = self.selected_checkpoints()
        if sel:
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(Path(sel[0].path).parent)))

    def compare_selected(self) -> bool:
        """Compare the two selected checkpoints (the older one as A). False when two are not selected."""
        sel = self.selected_checkpoints()
        if len(sel) != 2 or not all(c.state in OPENABLE for c in sel):
            return False
        a, b = sorted(sel, key=lambda c: (c.step if c.step is not None else -1, c.mtime))
        self.compareRequested.emit(a.path, b.path)
        return True

    def known_paths(self) -> list[str]:
        """Complete checkpoints, newest first (the Compare pickers offer them)."""
        cks = self.snapshot.listing.checkpoints if self.snapshot else []
        return [c.path for c in sorted(cks, key=lambda c: -c.mtime) if c.state in OPENABLE]

    def prune_dialog(self) -> None:
        if self.snapshot is None:
            return
        # NOTE: over the selected runs only, as Watch plan…: it planned over every root, so a user who selected one
        # run and clicked Move to the trash removed other runs' checkpoints
        dlg = PruneDialog(self.snapshot.listing, self.rules, self, runs=self.selected_runs() or None)
        dlg.rulesChanged.connect(self._set_rules)
        dlg.pruned.connect(lambda: self.poll(force=True))

        def rescanned() -> None:  # the preview follows the Library's scans (after a removal, while a run writes)
            if self.snapshot is not None:
                dlg.set_listing(self.snapshot.listing)

        self.refreshed.connect(rescanned)
        try:
            dlg.exec()
        finally:
            self.refreshed.disconnect(rescanned)
            dlg.deleteLater()

    def selected_runs(self) -> list[str]:
        """The runs of the selected rows (a run row or its checkpoints), by path."""
        runs: list[str] = []
        for i in self.tree.selectionModel().selectedRows(0):
            rec = self.model.record(self.proxy.mapToSource(i))
            path = rec.run if isinstance(rec, CheckpointRecord) else rec.path if isinstance(rec, RunRecord) else None
            if path and path not in runs:
                runs.append(path)
        return runs

    def watch_roots(self) -> list[str]:
        """The runs of the selected rows, else every root."""
        return self.selected_runs() or self.roots()

    def watch_dialog(self) -> WatchPlanDialog:
        """Show the watch plan for the selected runs or the roots (modeless: the Library goes on polling)."""
        dlg = WatchPlanDialog(self.watch_roots(), self.rules, parent=self)
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dlg.show()
        return dlg

    def _set_rules(self, rules: Rules) -> None:
        self.rules = rules
        self.poll(force=True)

    def shutdown(self) -> None:
        self.timer.stop()
        if self._worker is not None:
            self._worker.quit()

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.poll()
