"""One open checkpoint: summary header, tensor tree, shard map, ranks, inspector and health."""

from __future__ import annotations

from PySide6.QtCore import QEvent, QItemSelectionModel, QModelIndex, QObject, Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMenu,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QTabWidget,
    QToolButton,
    QTreeView,
    QVBoxLayout,
    QWidget,
)

from ..backend.checkpoint.browse import BrowseData
from ..backend.checkpoint.model import Problem, TensorEntry
from ..backend.checkpoint.tree import TreeNode
from ..backend.compare.browse_file import analyse_any, load_any, stats_any, verify_contents_any
from ..backend.formats import format_named, label_of
from ..backend.text import count, human_bytes, rich_name
from .health_panel import CHECKSUMS_WHERE_STORED, HealthPanel
from .inspector_view import InspectorView
from .map_caption import NOTHING_SHARDED, map_caption
from .overlay import ProgressOverlay
from .ranks_view import RanksView
from .shard_map import ShardMapView
from .tensor_tree import (
    NameDelegate,
    NodeRole,
    RankFilterProxy,
    TensorTreeModel,
    TextFilterProxy,
    fit_name_column,
    size_columns,
    tree_room,
)
from .workers import Worker, run_in_background

AUTO_LOAD_BYTES = 64 << 20
TREE_SHARE = 0.46  # of the view's width, for the tree (unless the user's layout was saved)
DETAIL_DELAY_MS = 60  # the map and the Inspector follow the selection once it rests this long (key repeat: 30 ms)
ROOM_DEPTH = 8  # the depth of names the first layout keeps room for (a model's optimizer state: 8 levels)


class CheckpointView(QWidget):
    treeReady = Signal(object)  # BrowseData with the tree only
    loaded = Signal(object)  # BrowseData, analysis done
    failed = Signal(str)
    openCancelled = Signal()  # Cancel while the metadata was read: nothing was opened
    statsReady = Signal(object)
    valuesDone = Signal()  # a values load ended (statistics shown, an error, or cancelled)
    contentsVerified = Signal(object)  # list[Problem] from "Verify contents", or None if it did not finish
    healthChanged = Signal()  # the Health tab's list changed (the analysis, Verify contents, a read that failed)
    exportRequested = Signal(str)  # a prefix ("" for everything)

    def __init__(self, path: str, parent=None) -> None:
        super().__init__(parent)
        self.path = path
        self.data: BrowseData | None = None
        self._stats_worker: Worker | None = None
        self._load_worker: Worker | None = None
        self._verify_worker: Worker | None = None
        self.verified_problems: list | None = None  # the findings of the last finished Verify contents
        self.seal_summary = ""  # what its check against the checkpoint's manifest proved, in a line
        self.read_problems: list[Problem] = []  # CRC32 failures the Inspector's reads found (since Verify contents)
        self._selected: TreeNode | None = None

        layout = QVBoxLayout(self)
        # NOTE: the header keeps a fixed two-line height (no word wrap), so nothing below it moves
        # when "Opening …" becomes the summary; the full text is in its tooltip.
        self.header = QLabel()
        self.header.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.header.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self.header.setFixedHeight(2 * self.fontMetrics().lineSpacing() + 4)
        self._set_header(f"<b>{rich_name(path)}</b><br>Opening …")
        layout.addWidget(self.header)

        self.main_split = QSplitter(Qt.Orientation.Horizontal)
        self.main_split.addWidget(self._build_tree_side())
        self.main_split.addWidget(self._build_detail_side())
        self.main_split.setStretchFactor(0, 2)
        self.main_split.setStretchFactor(1, 3)
        self.layout_restored = False  # the window restored the user's splitter positions
        self._depth = 0  # the deepest entry's level in the tree (its names need that much indentation)
        layout.addWidget(self.main_split, 1)

        self._detail_timer = QTimer(self)
        self._detail_timer.setSingleShot(True)
        self._detail_timer.setInterval(DETAIL_DELAY_MS)
        self._detail_timer.timeout.connect(self.show_selected_now)
        self.detail_draws = 0  # how many times the selection's map and Inspector were drawn (tests count them)
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
        # Progress floats over the bottom of the tree (never in the layout, so nothing moves).
        self.progress = ProgressOverlay(self)
        self.progress.cancelRequested.connect(self._cancel_background)
        self.tree.installEventFilter(self)
        self.tree.viewport().installEventFilter(self)
        self.filter_edit.installEventFilter(self)

    def _build_tree_side(self) -> QWidget:
        """The filter row and the tensor tree."""
        left = QWidget()
        ll = QVBoxLayout(left)
        ll.setContentsMargins(0, 0, 0, 0)
        fl = QHBoxLayout()
        self.filter_edit = QLineEdit()
        self.filter_edit.setPlaceholderText("Filter entries (Ctrl+F)")
        self.filter_edit.setClearButtonEnabled(True)
        self.filter_mode = QComboBox()
        self.filter_mode.addItems(list(TextFilterProxy.MODES))
        # The rank filter shows as a chip in the filter row (not a banner above the tree: nothing moves).
        self.rank_chip = QToolButton()
        self.rank_chip.setToolTip("Only entries with chunks written by this rank; click to show all")
        self.rank_chip.setFixedHeight(self.filter_edit.sizeHint().height())
        self.rank_chip.clicked.connect(lambda: self.set_rank_filter(None))
        self.rank_chip.hide()
        fl.addWidget(self.filter_edit, 1)
        fl.addWidget(self.rank_chip)
        fl.addWidget(self.filter_mode)
        ll.addLayout(fl)

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
        self.tree.setIndentation(max(12, self.fontMetrics().averageCharWidth() * 2))  # deep names keep room
        self.tree.setItemDelegateForColumn(0, NameDelegate(self.tree))
        self.tree.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.tree.customContextMenuRequested.connect(self._context_menu)
        self.tree.selectionModel().currentChanged.connect(self._current_changed)
        size_columns(self.tree)  # from the font: known before any entry, so the first layout can make room
        ll.addWidget(self.tree, 1)
        return left

    def _build_detail_side(self) -> QWidget:
        """The shard map above the Inspector, Ranks and Health tabs."""
        self.right_split = QSplitter(Qt.Orientation.Vertical)
        map_box = QWidget()
        ml = QVBoxLayout(map_box)
        ml.setContentsMargins(0, 0, 0, 0)
        self.map_caption = QLabel("")
        self.map_caption.setWordWrap(True)
        # NOTE: a long tensor name cannot wrap; it used to become the window's minimum width
        self.map_caption.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        # room for three lines (a name line that may wrap, the legend): a long name must not push the map down
        self.map_caption.setMinimumHeight(3 * self.map_caption.fontMetrics().lineSpacing() + 2)
        self.map_caption.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
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
        self.verify_button = QPushButton("Verify contents")
        self.verify_button.setToolTip("Read every stored item once and check its CRC32 (Ctrl+Shift+V); "
                                      "findings go to the Health tab")
        self.verify_button.setEnabled(False)
        self.verify_button.clicked.connect(self.verify_contents)
        self.tabs.setCornerWidget(self.verify_button)
        self.right_split.addWidget(self.tabs)
        return self.right_split

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if watched is self.filter_edit and event.type() == QEvent.Type.KeyPress and \
                event.key() in (Qt.Key.Key_Down, Qt.Key.Key_Return, Qt.Key.Key_Enter):
            self._focus_results()
            return True
        if watched is self.tree and event.type() in (QEvent.Type.Resize, QEvent.Type.Move, QEvent.Type.Show):
            self._place_progress()
        elif watched is self.tree.viewport() and event.type() == QEvent.Type.Resize:
            fit_name_column(self.tree, self._depth)  # NOTE: the viewport's size is final only here (scroll bars)
        return super().eventFilter(watched, event)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        if not self.layout_restored and self.width() > 400:
            # NOTE: sizes only mean something once the view has its real width (first resize)
            self.layout_restored = True
            # NOTE: 46 %, and at least what every column and names 8 levels deep (the demo's optimizer state) need
            # while the detail side keeps its least width: at 1024 px 46 % cut the ranks column off
            total = self.main_split.width() - self.main_split.handleWidth()
            tree = min(max(int(total * TREE_SHARE), tree_room(self.tree, ROOM_DEPTH)), self._tree_side_most(total))
            self.main_split.setSizes([tree, total - tree])
            self.right_split.setSizes([int(self.height() * 0.5), int(self.height() * 0.5)])
        self._place_progress()

    def _tree_side_most(self, total: int) -> int:
        """The most the tree side may take of ``total``: the detail side keeps its least width."""
        return max(0, total - self.main_split.widget(1).minimumSizeHint().width())

    def make_tree_room(self) -> None:
        """Widen the tree side if its columns and deepest names do not fit (a layout saved at another window
        size, a checkpoint deeper than the first layout planned for), as far as the detail side allows; a
        tree that fits is never moved."""
        sizes = self.main_split.sizes()
        total = sum(sizes)
        if total <= 0:
            return
        need = min(tree_room(self.tree, self._depth), self._tree_side_most(total))
        if sizes[0] < need:
            self.main_split.setSizes([need, total - need])

    def _place_progress(self) -> None:
        top_left = self.tree.mapTo(self, self.tree.rect().bottomLeft())
        self.progress.place(top_left.x(), top_left.y(), self.tree.width())

    def _set_header(self, text: str) -> None:
        self.header.setText(text)
        self.header.setToolTip(text.replace("<br>", "\n").replace("<b>", "").replace("</b>", ""))

    # ------------------------------------------------------------------ loading
    def load(self) -> None:
        # NOTE: cancellable: a large .metadata loads in a helper process for seconds; Cancel (and closing the
        # tab) ends that process, as it could not be stopped before
        self.progress.start("reading metadata", cancellable=True)
        self._load_worker = run_in_background(
            load_any, self.path, owner=self, on_result=self._on_tree, on_error=self._on_failed,
            on_progress=self.progress.set_progress, on_cancelled=self._on_open_cancelled)

    def _on_open_cancelled(self) -> None:
        self._load_worker = None
        self.progress.finish()
        self._set_header(f"<b>{rich_name(self.path)}</b><br>Opening cancelled: nothing was read. "
                         "File › Reload opens it again.")
        self.map.clear_map("Opening was cancelled.")
        self.openCancelled.emit()

    def opening(self) -> bool:
        """The checkpoint's metadata is being read (the tree is not shown yet)."""
        return self._load_worker is not None and self.data is None

    def _on_tree(self, data: BrowseData) -> None:
        """The tree goes up as soon as the metadata is read; the analysis follows in the background."""
        self.data = data
        ck = data.ckpt
        self.progress.start("analysing", cancellable=False)  # the analysis is quick and is not cancelled
        self._set_header(summary_html(ck, self.path))
        self.model.set_root(data.tree, {})
        self._depth = max((e.fqn.count(".") for e in (*ck.tensors, *ck.objects)), default=0)
        size_columns(self.tree)
        self.make_tree_room()
        fit_name_column(self.tree, self._depth)
        if data.tree.children and len(data.tree.children) <= 4:
            for r in range(self.proxy.rowCount()):
                self.tree.expand(self.proxy.index(r, 0))
        self.map.clear_map("Select a tensor or a module to see how it is sharded.")
        self.health.set_problems_pending()
        self.treeReady.emit(data)
        self._load_worker = run_in_background(analyse_any, data, owner=self, on_result=self._on_loaded,
                                              on_error=self._on_failed, on_progress=self.progress.set_progress)

    def _on_loaded(self, data: BrowseData) -> None:
        self.progress.finish()
        ck = data.ckpt
        self.model.set_values(data.values or {})
        self.ranks.set_checkpoint(ck, data.balance, data.heat)
        self._show_problems(data.problems or [])
        self.verify_button.setEnabled(True)
        self.loaded.emit(data)

    def problems(self) -> tuple[list[Problem] | None, bool]:
        """What Health lists now (None before the analysis) and whether Verify contents read every byte: its
        findings (else the quick check's), and every failure a read found since."""
        base = self.verified_problems if self.verified_problems is not None else \
            self.data.problems if self.data is not None else None
        if base is None:
            return None, False
        return with_found(base, self.read_problems), self.verified_problems is not None

    def _show_problems(self, problems: list, deep: bool = False) -> None:
        problems = with_found(problems, self.read_problems)
        try:
            checksums = format_named(self.data.ckpt.format).checksums if self.data is not None else ""
        except KeyError:
            checksums = CHECKSUMS_WHERE_STORED
        seal = self.seal_summary if deep else self.data.seal if self.data is not None else ""
        self.health.set_problems(problems, deep=deep, checksums=checksums, seal=seal)
        self.tabs.setTabText(2, "Health ✔" if not problems else f"Health ({len(problems):,})")
        self.healthChanged.emit()

    def _on_failed(self, message: str) -> None:
        self.progress.finish()
        self._set_header(f"<b>Cannot open {rich_name(self.path)}</b><br>{rich_name(message)}")
        self.map.clear_map("This checkpoint could not be opened.")
        self.failed.emit(message)

    # ------------------------------------------------------------------ selection
    def _current_changed(self, current: QModelIndex, _previous: QModelIndex) -> None:
        sel = self.tree.selectionModel()
        if current.isValid() and not sel.isSelected(current):
            # NOTE: Qt makes the first row current, unselected, when the tree gets the focus (Tab, the window
            # activated): the map and the inspector showed that entry while no row of the tree was highlighted
            sel.select(current, QItemSelectionModel.SelectionFlag.ClearAndSelect |
                       QItemSelectionModel.SelectionFlag.Rows)
        node: TreeNode | None = current.data(NodeRole) if current.isValid() else None
        self._selected = node
        self.cancel_values()
        if node is None or self.data is None:
            self._detail_timer.stop()
            return
        self.map_caption.setText(map_caption(self.data.ckpt, node, list(node.iter_tensors())))
        # NOTE: the map, the chunk table and the values follow once the selection rests: drawn for every row an
        # arrow key passed, a 512-rank module cost about 200 ms a step (the key repeat fell behind)
        self._detail_timer.start()

    def show_selected_now(self) -> None:
        """Draw the map, the Inspector and the values of the selected entry now (not when the timer ends)."""
        self._detail_timer.stop()
        node = self._selected
        if node is None or self.data is None:
            return
        ck = self.data.ckpt
        tensors = list(node.iter_tensors())
        self.detail_draws += 1
        if isinstance(node.entry, TensorEntry):
            self.map.show_tensors(ck, [node.entry])
            self.inspector.set_tensor(node.entry)
            if node.entry.nbytes <= AUTO_LOAD_BYTES:
                self.load_values()
        else:
            if tensors:
                self.map.show_tensors(ck, tensors)
            else:
                self.map.clear_map(NOTHING_SHARDED)
            self.inspector.set_tensor(None)
            if node.entry is not None:
                value = (self.data.values or {}).get(node.path, "(loading)")
                self.inspector.title.set_title(node.path, f" = {value}")
        if self.ranks.selected_rank is not None:
            self.map.set_highlight_rank(self.ranks.selected_rank)

    def detail_pending(self) -> bool:
        """The selection moved and its map and Inspector are not drawn yet."""
        return self._detail_timer.isActive()

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
        self.show_selected_now()  # a selection asked for by name is shown at once
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
        # NOTE: `w` in the last slot is read when it runs (queued, on this thread), after it was assigned
        w = run_in_background(
            stats_any, self.data, fqn, owner=self, on_progress=self.inspector.set_progress,
            on_result=lambda st: self._on_stats(fqn, st),
            on_error=lambda msg: self.inspector.show_message(f"<span style='color:#d62728'>{msg}</span>"),
            on_cancelled=lambda: self.inspector.show_message("Cancelled."), on_finished=lambda: self._stats_done(w))
        self._stats_worker = w

    def values_pending(self) -> bool:
        """A values load is running (``valuesDone`` follows)."""
        return self._stats_worker is not None

    def _on_stats(self, fqn: str, stats) -> None:
        if isinstance(stats, Problem):  # the bytes fail their CRC32: the checkpoint is damaged, Health says so
            self.inspector.show_message(f"<span style='color:#d62728'>{rich_name(stats.message)}</span>")
            self.read_problems = with_found(self.read_problems, [stats])
            problems, deep = self.problems()
            if problems is not None:  # else the analysis, when it ends, lists it
                self._show_problems(problems, deep)
            return
        if self._selected is not None and self._selected.path == fqn:
            self.inspector.set_stats(stats)
            self.statsReady.emit(stats)

    def _stats_done(self, worker: Worker) -> None:
        if self._stats_worker is worker:
            self._stats_worker = None
            self.inspector.set_busy(False)
            self.valuesDone.emit()

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
        self.rank_chip.setVisible(rank is not None)
        self.rank_chip.setText(f"rank {rank} ✕")

    def show_tab(self, name: str) -> None:
        """Bring the Inspector, Ranks or Health tab to the front (by its name, any case)."""
        for i in range(self.tabs.count()):
            if self.tabs.tabText(i).lower().startswith(name.lower()):
                self.tabs.setCurrentIndex(i)

    def _focus_results(self) -> None:
        """Down or Enter in the filter box goes on to the matches (the first entry selected unless one is), so
        the tree is reached from Ctrl+F without the mouse; it used to do nothing."""
        self._filter_timer.stop()
        self._apply_filter()  # what was typed so far, not what the timer would filter 150 ms later
        if not self.tree.currentIndex().isValid() and self.proxy.rowCount():
            first = self.proxy.index(0, 0)
            while self.proxy.rowCount(first):  # down the first branch to its first entry
                first = self.proxy.index(0, 0, first)
            self.tree.scrollTo(first)
            self.tree.selectionModel().setCurrentIndex(
                first, QItemSelectionModel.SelectionFlag.ClearAndSelect | QItemSelectionModel.SelectionFlag.Rows)
        self.tree.setFocus()

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

    # ------------------------------------------------------------------ verify contents
    def verify_contents(self) -> None:
        """Read every stored item once with its CRC32 checked (in the background, with cancel);
        the findings replace the Health tab's list."""
        if self.data is None or self._verify_worker is not None:
            return
        self.verify_button.setEnabled(False)
        self.health.set_problems_pending("Reading every stored item and checking its CRC32 …")
        self.tabs.setCurrentWidget(self.health)
        self.progress.start("verifying contents", cancellable=True)
        self._verify_worker = run_in_background(
            verify_contents_any, self.data.ckpt, owner=self, on_progress=self.progress.set_progress,
            on_result=self._on_verified, on_error=lambda msg: self._verify_ended(f"Verify contents stopped: {msg}"),
            on_cancelled=lambda: self._verify_ended("Verify contents cancelled: nothing was concluded."))

    def _on_verified(self, found: tuple[list, str]) -> None:
        problems, seal = found
        self._verify_worker = None
        self.progress.finish()
        self.verify_button.setEnabled(True)
        self.verified_problems = problems
        self.seal_summary = seal
        self.read_problems = []  # every byte was read again: what a read found before is among its findings
        self._show_problems(problems, deep=True)
        self.contentsVerified.emit(problems)

    def _verify_ended(self, message: str) -> None:
        self._verify_worker = None
        self.progress.finish()
        self.verify_button.setEnabled(True)
        self.health.set_problems(with_found((self.data.problems if self.data else None) or [], self.read_problems),
                                 note=message)
        self.contentsVerified.emit(None)

    def _cancel_background(self) -> None:
        if self._verify_worker is not None:
            self._verify_worker.quit()
        if self.opening():
            self._load_worker.quit()

    def shutdown(self) -> None:
        self._detail_timer.stop()
        self.cancel_values()
        self._cancel_background()
        if self._load_worker is not None:
            self._load_worker.quit()


def with_found(problems: list[Problem], found: list[Problem]) -> list[Problem]:
    """``problems`` and those of ``found`` not already among them (the same kind for the same entry)."""
    known = {(p.kind, p.fqn) for p in problems}
    return list(problems) + [p for p in found if (p.kind, p.fqn) not in known]


def summary_html(ck, path: str | None = None) -> str:
    """The header's two lines: the path opened, then format, version (only when the file records one),
    counts and size."""
    kind = label_of(ck.format)
    files = len(ck.data_files)
    n = len(ck.ranks)
    if n:
        ranks = count(n, "writer rank")
    else:
        ranks = "one file, not sharded" if files == 1 else f"{count(files, 'file')}, no writer ranks recorded"
    parts = [kind + (f" (format version {rich_name(ck.version)})" if ck.version else ""),
             count(len(ck.tensors), "tensor"),
             count(len(ck.chunk_table), "chunk"), ranks, human_bytes(ck.total_bytes)]
    if ck.objects:
        parts.insert(2, count(len(ck.objects), "non-tensor entry", "non-tensor entries"))
    if ck.save_id:
        parts.append(f"save id <tt>{rich_name(ck.save_id)}</tt>")
    parts += [f"<i>{rich_name(n)}</i>" for n in ck.notes]  # on the second line: the header keeps two lines
    return f"<b>{rich_name(path or ck.path)}</b><br>" + " · ".join(parts)

