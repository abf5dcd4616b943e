"""One open checkpoint: summary header, tensor tree, shard map, ranks, inspector and health."""

from __future__ import annotations

from PySide6.QtCore import QItemSelectionModel, QModelIndex, Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMenu,
    QProgressBar,
    QSplitter,
    QTabWidget,
    QTreeView,
    QVBoxLayout,
    QWidget,
)
from shardscope.backend.checkpoint.browse import BrowseData, analyse, load_tree, value_stats
from shardscope.backend.checkpoint.model import TensorEntry
from shardscope.backend.checkpoint.tree import TreeNode
from shardscope.backend.format import human_bytes

from .panels import HealthPanel, InspectorView, RanksView
from .shard_map import ShardMapView, grid_shape, legend_html
from .tensor_tree import NodeRole, RankFilterProxy, TensorTreeModel, TextFilterProxy
from .workers import Worker, run_in_background

AUTO_LOAD_BYTES = 64 << 20


class CheckpointView(QWidget):
    treeReady = Signal(object)  # BrowseData with the tree only
    loaded = Signal(object)  # BrowseData, analysis done
    failed = Signal(str)
    statsReady = Signal(object)
    selectionChanged = Signal(str)
    exportRequested = Signal(str)  # a prefix ("" for everything)

    def __init__(self, path: str, parent=None) -> None:
        super().__init__(parent)
        self.path = path
        self.data: BrowseData | None = None
        self._stats_worker: Worker | None = None
        self._load_worker: Worker | None = None
        self._selected: TreeNode | None = None

        layout = QVBoxLayout(self)
        self.header = QLabel(f"Opening {path} …")
        self.header.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.header.setWordWrap(True)
        layout.addWidget(self.header)
        self.load_progress = QProgressBar()
        self.load_progress.setRange(0, 0)
        layout.addWidget(self.load_progress)

        self.main_split = QSplitter(Qt.Orientation.Horizontal)
        left = QWidget()
        ll = QVBoxLayout(left)
        ll.setContentsMargins(0, 0, 0, 0)
        fl = QHBoxLayout()
        self.filter_edit = QLineEdit()
        self.filter_edit.setPlaceholderText("Filter entries (Ctrl+F)")
        self.filter_edit.setClearButtonEnabled(True)
        self.filter_mode = QComboBox()
        self.filter_mode.addItems(list(TextFilterProxy.MODES))
        fl.addWidget(self.filter_edit, 1)
        fl.addWidget(self.filter_mode)
        ll.addLayout(fl)
        self.rank_label = QLabel("")
        self.rank_label.hide()
        ll.addWidget(self.rank_label)

        self.model = TensorTreeModel(parent=self)
        self.rank_proxy = RankFilterProxy(self)
        self.rank_proxy.setSourceModel(self.model)
        self.proxy = TextFilterProxy(self)
        self.proxy.setSourceModel(self.rank_proxy)
        self.tree = QTreeView()
        self.tree.setModel(self.proxy)
        self.tree.setSortingEnabled(True)
        self.tree.sortByColumn(-1, Qt.SortOrder.AscendingOrder)
        self.tree.setUniformRowHeights(True)  # NOTE: keeps 100k-row trees fast
        self.tree.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.tree.customContextMenuRequested.connect(self._context_menu)
        self.tree.selectionModel().currentChanged.connect(self._current_changed)
        ll.addWidget(self.tree, 1)
        self.main_split.addWidget(left)

        self.right_split = QSplitter(Qt.Orientation.Vertical)
        map_box = QWidget()
        ml = QVBoxLayout(map_box)
        ml.setContentsMargins(0, 0, 0, 0)
        self.map_caption = QLabel("")
        self.map_caption.setWordWrap(True)
        ml.addWidget(self.map_caption)
        self.map = ShardMapView()
        ml.addWidget(self.map, 1)
        self.right_split.addWidget(map_box)
        self.tabs = QTabWidget()
        self.inspector = InspectorView()
        self.ranks = RanksView()
        self.health = HealthPanel()
        self.tabs.addTab(self.inspector, "Inspector")
        self.tabs.addTab(self.ranks, "Ranks")
        self.tabs.addTab(self.health, "Health")
        self.right_split.addWidget(self.tabs)
        self.right_split.setSizes([420, 300])
        self.main_split.addWidget(self.right_split)
        self.main_split.setSizes([430, 900])
        layout.addWidget(self.main_split, 1)

        self._filter_timer = QTimer(self)
        self._filter_timer.setSingleShot(True)
        self._filter_timer.setInterval(150)
        self._filter_timer.timeout.connect(self._apply_filter)
        self.filter_edit.textChanged.connect(lambda _t: self._filter_timer.start())
        self.filter_mode.currentIndexChanged.connect(lambda _i: self._apply_filter())
        self.ranks.rankClicked.connect(self.set_rank_filter)
        self.health.problemActivated.connect(self.select_path)
        self.inspector.loadRequested.connect(self.load_values)
        self.inspector.cancelRequested.connect(self.cancel_values)
        self.inspector.set_tensor(None)
        self.map.clear_map("Opening …")

    # ------------------------------------------------------------------ loading
    def load(self) -> None:
        self.load_progress.show()
        self._load_worker = run_in_background(
            load_tree, self.path, on_result=self._on_tree, on_error=self._on_failed,
            on_progress=self._on_load_progress)

    def _on_load_progress(self, done: int, total: int, message: str) -> None:
        self.load_progress.setRange(0, total)
        self.load_progress.setValue(done)
        self.load_progress.setFormat(message)

    def _on_tree(self, data: BrowseData) -> None:
        """The tree goes up as soon as the metadata is read; the analysis follows in the background."""
        self.data = data
        ck = data.ckpt
        kind = {"dcp": "PyTorch DCP", "lightning": "Lightning/Fabric (DCP + meta.pt)"}.get(ck.format, ck.format)
        ranks = ck.ranks
        self.header.setText(
            f"<b>{ck.path}</b><br>{kind} · DCP version {ck.version or '?'} · {len(ck.tensors):,} tensors · "
            f"{len(ck.chunk_table):,} chunks · {len(ranks)} writer ranks · {human_bytes(ck.total_bytes)}"
            + (f" · save id <tt>{ck.save_id}</tt>" if ck.save_id else ""))
        self.model.set_root(data.tree, {})
        self.tree.setColumnWidth(0, 220)
        for col, width in zip(range(1, 6), (70, 90, 75, 55, 60), strict=True):
            self.tree.setColumnWidth(col, width)
        if data.tree.children and len(data.tree.children) <= 4:
            for r in range(self.proxy.rowCount()):
                self.tree.expand(self.proxy.index(r, 0))
        self.map.clear_map("Select a tensor or a module to see how it is sharded.")
        self.health.set_problems_pending()
        self.treeReady.emit(data)
        self._load_worker = run_in_background(analyse, data, on_result=self._on_loaded, on_error=self._on_failed,
                                              on_progress=self._on_load_progress)

    def _on_loaded(self, data: BrowseData) -> None:
        self.load_progress.hide()
        ck = data.ckpt
        self.model.set_values(data.values or {})
        self.ranks.set_checkpoint(ck, data.balance, data.heat)
        self.health.set_problems(data.problems)
        self.tabs.setTabText(2, "Health ✔" if not data.problems else f"Health ({len(data.problems)})")
        self.loaded.emit(data)

    def _on_failed(self, message: str) -> None:
        self.load_progress.hide()
        self.header.setText(f"<b>Cannot open {self.path}</b><br>{message}")
        self.map.clear_map("This folder could not be opened.")
        self.failed.emit(message)

    # ------------------------------------------------------------------ selection
    def _current_changed(self, current: QModelIndex, _previous: QModelIndex) -> None:
        node: TreeNode | None = current.data(NodeRole) if current.isValid() else None
        self._selected = node
        self.cancel_values()
        if node is None or self.data is None:
            return
        ck = self.data.ckpt
        legend = legend_html(ck.ranks)
        if isinstance(node.entry, TensorEntry):
            e = node.entry
            rows, cols = grid_shape(e.shape)
            self.map_caption.setText(f"<b>{e.fqn}</b> drawn as {rows} × {cols}, {e.chunk_count} chunks "
                                     f"(wheel: zoom, drag: pan, double-click: fit)<br>{legend}")
            self.map.show_tensors(ck, [node.entry])
            self.inspector.set_tensor(node.entry)
            if node.entry.nbytes <= AUTO_LOAD_BYTES:
                self.load_values()
        else:
            tensors = list(node.iter_tensors())
            self.map_caption.setText(f"<b>{node.path or 'all'}</b>: {len(tensors)} tensors stacked, each scaled to the "
                                     f"same width<br>{legend}")
            self.map.show_tensors(ck, tensors)
            self.inspector.set_tensor(None)
            if node.entry is not None:
                value = (self.data.values or {}).get(node.path, "(loading)")
                self.inspector.title.setText(f"<b>{node.path}</b> = {value}")
        if self.ranks.selected_rank is not None:
            self.map.set_highlight_rank(self.ranks.selected_rank)
        self.selectionChanged.emit(node.path)

    def select_path(self, path: str) -> bool:
        src = self.model.index_for_path(path)
        if not src.isValid():
            return False
        idx = self.proxy.mapFromSource(self.rank_proxy.mapFromSource(src))
        if not idx.isValid():
            self.set_rank_filter(None)
            self.filter_edit.clear()
            self._apply_filter()
            idx = self.proxy.mapFromSource(self.rank_proxy.mapFromSource(src))
        self.tree.scrollTo(idx)
        self.tree.selectionModel().setCurrentIndex(
            idx, QItemSelectionModel.SelectionFlag.ClearAndSelect | QItemSelectionModel.SelectionFlag.Rows)
        return True

    def selected_node(self) -> TreeNode | None:
        return self._selected

    # ------------------------------------------------------------------ values
    def load_values(self) -> None:
        node = self._selected
        if self.data is None or node is None or not isinstance(node.entry, TensorEntry):
            return
        self.cancel_values()
        self.inspector.set_busy(True)
        fqn = node.entry.fqn
        w = run_in_background(value_stats, self.data.ckpt, fqn, on_progress=self.inspector.set_progress)
        w.signals.returned.connect(lambda st, f=fqn: self._on_stats(f, st))
        w.signals.errored.connect(lambda msg: self.inspector.show_message(f"<span style='color:#d62728'>{msg}</span>"))
        w.signals.cancelled.connect(lambda: self.inspector.show_message("Cancelled."))
        w.signals.finished.connect(lambda wk=w: self._stats_done(wk))
        self._stats_worker = w

    def _on_stats(self, fqn: str, stats) -> None:
        if self._selected is not None and self._selected.path == fqn:
            self.inspector.set_stats(stats)
            self.statsReady.emit(stats)

    def _stats_done(self, worker: Worker) -> None:
        if self._stats_worker is worker:
            self._stats_worker = None
            self.inspector.set_busy(False)

    def cancel_values(self) -> None:
        if self._stats_worker is not None:
            self._stats_worker.quit()
            self._stats_worker = None
        self.inspector.set_busy(False)

    # ------------------------------------------------------------------ filters
    def _apply_filter(self) -> None:
        ok = self.proxy.set_filter(self.filter_edit.text(), self.filter_mode.currentText())
        self.filter_edit.setStyleSheet("" if ok else "QLineEdit { background: #f8d7da; }")
        if self.filter_edit.text():
            self.tree.expandAll() if self.proxy.rowCount() < 50 else None

    def set_rank_filter(self, rank: int | None) -> None:
        self.rank_proxy.set_rank(rank)
        self.ranks.selected_rank = rank
        self.map.set_highlight_rank(rank)
        self.rank_label.setVisible(rank is not None)
        self.rank_label.setText(f"Showing entries with chunks written by rank {rank} (click the bar again to clear)")

    def focus_filter(self) -> None:
        self.filter_edit.setFocus()
        self.filter_edit.selectAll()

    def _context_menu(self, pos) -> None:
        idx = self.tree.indexAt(pos)
        node: TreeNode | None = idx.data(NodeRole) if idx.isValid() else None
        menu = QMenu(self)
        prefix = node.path if node is not None else ""
        menu.addAction("Export this subtree…" if prefix else "Export…",
                       lambda: self.exportRequested.emit(prefix))
        if node is not None:
            menu.addAction("Copy name", lambda: QGuiApplication.clipboard().setText(node.path))
        menu.exec(self.tree.viewport().mapToGlobal(pos))

    def shutdown(self) -> None:
        self.cancel_values()
        if self._load_worker is not None:
            self._load_worker.quit()
