"""The Compare view: the differences between two checkpoints as a table with a bar per entry, and
for the selected tensor the two shard maps side by side and a histogram of the difference."""

from __future__ import annotations

import html
import math
from typing import Any

import pyqtgraph as pg
from PySide6.QtCore import (
    QAbstractTableModel,
    QEvent,
    QModelIndex,
    QObject,
    QPersistentModelIndex,
    QRectF,
    QSettings,
    QSortFilterProxyModel,
    Qt,
    Signal,
)
from PySide6.QtGui import QColor, QPainter
from PySide6.QtWidgets import (
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QTableView,
    QVBoxLayout,
    QWidget,
)
from shardscope.backend.compare import diff, open_source
from shardscope.backend.compare.diff import Change, DiffResult, difference_histogram

from .plot_style import themed_plot
from .shard_map import ShardMapView
from .workers import Worker, run_in_background

COLUMNS = ("entry", "kind", "max |a−b|", "rel. L2", "changed")
WIDTHS_KEY = "compare/column_widths"
SortRole = Qt.ItemDataRole.UserRole + 1


class DiffModel(QAbstractTableModel):
    """Rows: changed entries, then entries only in A or only in B (an adapter over DiffResult)."""

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.rows: list[Change] = []
        self.max_rel = 0.0

    def set_result(self, result: DiffResult | None) -> None:
        self.beginResetModel()
        self.rows = []
        if result is not None:
            self.rows = list(result.changed) + [Change(f, "only in A") for f in result.only_a] + \
                [Change(f, "only in B") for f in result.only_b]
        finite = [c.rel_l2 for c in self.rows if c.rel_l2 is not None and math.isfinite(c.rel_l2)]
        self.max_rel = max(finite, default=0.0)
        self.endResetModel()

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[section]
        return None

    def data(self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        c = self.rows[index.row()]
        col = index.column()
        if role == Qt.ItemDataRole.DisplayRole:
            if col == 0:
                return c.fqn
            if col == 1:
                return c.kind
            if c.rel_l2 is None:
                return c.detail if col == 2 else ""
            return (None, None, f"{c.max_abs_diff:.4g}", f"{c.rel_l2:.4g}", f"{100 * c.frac_changed:.2f} %")[col]
        if role == SortRole:
            if col in (0, 1):
                return c.fqn if col == 0 else c.kind
            v = (None, None, c.max_abs_diff, c.rel_l2, c.frac_changed)[col]
            return -1.0 if v is None else float(v)
        if role == Qt.ItemDataRole.UserRole:
            return c
        if role == Qt.ItemDataRole.ToolTipRole and col == 0:
            return c.fqn  # the full name; the cell elides in the middle (exp_avg vs exp_avg_sq stay apart)
        if role == Qt.ItemDataRole.TextAlignmentRole and col >= 2:
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None


def renamed_hint(only_a: list[str], only_b: list[str]) -> str:
    """When no entry pairs up by name because one side's names are the other's under a prefix (a checkpoint
    and its own safetensors export, which drops ``model.`` by default), say so; else ""."""
    for longer, shorter, side in ((only_a, only_b, "B"), (only_b, only_a, "A")):
        if not shorter:
            continue
        names, first = set(longer), shorter[0]
        prefixes = {n[: -len(first)] for n in longer if n.endswith("." + first)}
        for prefix in sorted(prefixes, key=len):
            if all(prefix + k in names for k in shorter):
                return (f"{side}'s entries are the other side's without the prefix “{prefix}” (Export drops the "
                        "model's container by default), so none could be paired by name and no values were compared.")
    return ""


class BarDelegate(QStyledItemDelegate):
    """A bar behind the relative change, scaled to the largest in the table."""

    def __init__(self, model: DiffModel, parent=None) -> None:
        super().__init__(parent)
        self.model = model

    def paint(self, painter: QPainter, option: QStyleOptionViewItem,
              index: QModelIndex | QPersistentModelIndex) -> None:
        c: Change | None = index.data(Qt.ItemDataRole.UserRole)
        if c is not None and c.rel_l2 is not None and self.model.max_rel > 0:
            v = c.rel_l2 if math.isfinite(c.rel_l2) else self.model.max_rel
            frac = min(1.0, v / self.model.max_rel)
            r = QRectF(option.rect)
            r.setWidth(max(1.0, r.width() * frac))
            painter.fillRect(r, QColor(214, 39, 40, 70))
        super().paint(painter, option, index)


class CompareView(QWidget):
    finished = Signal(object)  # DiffResult, or None on error
    detailDone = Signal()  # the selected entry's shard maps and difference histogram are shown

    def __init__(self, path_a: str, path_b: str, parent=None) -> None:
        super().__init__(parent)
        self.path_a, self.path_b = path_a, path_b
        self.result: DiffResult | None = None
        self.sources: tuple[Any, Any] | None = None
        self._worker: Worker | None = None
        self._detail_worker: Worker | None = None
        layout = QVBoxLayout(self)
        top = QHBoxLayout()
        self.header = QLabel(f"<b>A</b> {path_a}<br><b>B</b> {path_b}")
        self.header.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.header.setToolTip(f"A {path_a}\nB {path_b}")
        # NOTE: long paths and error lines are clipped or wrapped; their one-line width used to become the
        # window's minimum width (a truncated file's message pushed the window past a 1280 px screen)
        self.header.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        top.addWidget(self.header, 1)
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(220)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel)
        top.addWidget(self.progress)
        top.addWidget(self.cancel_button)
        layout.addLayout(top)
        self.summary = QLabel("Comparing …")
        self.summary.setWordWrap(True)
        self.summary.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        layout.addWidget(self.summary)
        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(self._build_table())
        split.addWidget(self._build_detail())
        split.setStretchFactor(0, 1)
        split.setStretchFactor(1, 1)
        layout.addWidget(split, 1)

    def _build_table(self) -> QTableView:
        """The changes, one row per entry: names elided in the middle, widths the user set remembered."""
        self.model = DiffModel(self)
        self.proxy = QSortFilterProxyModel(self)
        self.proxy.setSourceModel(self.model)
        self.proxy.setSortRole(SortRole)
        self.table = QTableView()
        self.table.setModel(self.proxy)
        self.table.setSortingEnabled(True)
        self.table.setSelectionBehavior(QTableView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QTableView.SelectionMode.SingleSelection)
        self.table.verticalHeader().hide()
        self.table.setWordWrap(False)
        self.table.verticalHeader().setDefaultSectionSize(self.table.fontMetrics().height() + 6)
        self.table.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.Interactive)  # the user sets widths; remembered
        header.setStretchLastSection(True)
        self._restoring = False
        self._restore_widths()
        self.table.installEventFilter(self)
        # NOTE: only a column the user drags counts; the stretching last one follows the window
        header.sectionResized.connect(lambda col, *_a: col != len(COLUMNS) - 1 and self._save_widths())
        self.table.setItemDelegateForColumn(3, BarDelegate(self.model, self))
        self.table.selectionModel().currentRowChanged.connect(self._row_changed)
        return self.table

    def _build_detail(self) -> QSplitter:
        """The selected entry: both shard maps, the histogram of a − b, a line of numbers."""
        right = QSplitter(Qt.Orientation.Vertical)
        maps = QWidget()
        ml = QHBoxLayout(maps)
        ml.setContentsMargins(0, 0, 0, 0)
        self.map_a, self.map_b = ShardMapView(), ShardMapView()
        for label, m in (("A", self.map_a), ("B", self.map_b)):
            box = QVBoxLayout()
            box.addWidget(QLabel(f"<b>{label}</b> layout"))
            box.addWidget(m, 1)
            ml.addLayout(box)
        right.addWidget(maps)
        self.hist = themed_plot()
        self.hist.setTitle("a − b")
        self.hist.setLabel("bottom", "a − b")
        self.hist.setLabel("left", "count")
        self.hist.hide()  # shown with a difference histogram only: no empty axes
        right.addWidget(self.hist)
        self.detail = QLabel("Select an entry to see both layouts and, for changed values, a histogram of a − b.")
        self.detail.setWordWrap(True)
        right.addWidget(self.detail)
        right.setSizes([400, 300, 40])
        return right

    def start(self) -> None:
        def work(progress=None):
            a, b = open_source(self.path_a), open_source(self.path_b)
            return a, b, diff(a, b, progress)

        self._worker = run_in_background(work, owner=self, on_result=self._done, on_error=self._failed,
                                         on_progress=self._on_progress, on_cancelled=lambda: self._failed("Cancelled."))

    def _on_progress(self, done: int, total: int, msg: str) -> None:
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(done)
        self.progress.setFormat(f"%p%  {msg[-40:]}")

    def _done(self, out) -> None:
        a, b, result = out
        self.sources, self.result = (a, b), result
        self.progress.hide()
        self.cancel_button.hide()
        self.model.set_result(result)
        self._restore_widths()  # NOTE: a model reset gives the header its default section sizes again
        self.table.sortByColumn(3, Qt.SortOrder.DescendingOrder)  # the biggest relative change first
        layout_only = sum(c.kind == "layout" for c in result.changed)
        verdict = "<span style='color:#2ca02c'>no differences in values</span>" if not result.differs else \
            "<span style='color:#d62728'>differences found</span>"
        self.summary.setText(f"{verdict}: {len(result.only_a)} only in A, {len(result.only_b)} only in B, "
                             f"{len(result.changed) - layout_only} changed, {layout_only} with another layout only, "
                             f"{result.unchanged} unchanged")
        if not (result.changed or result.only_a or result.only_b):
            self.detail.setText(f"Nothing to list: both hold the same {result.unchanged} entries, each with the same "
                                "dtype, shape and values (every element compared).")
        hint = renamed_hint(result.only_a, result.only_b) if not (result.changed or result.unchanged) else ""
        if hint:
            self.summary.setText(self.summary.text() + "<br>" + html.escape(hint))
        self.finished.emit(result)

    def _failed(self, message: str) -> None:
        self.progress.hide()
        self.cancel_button.hide()
        self.summary.setText(f"<span style='color:#d62728'>{html.escape(message)}</span>")
        self.finished.emit(None)

    def cancel(self) -> None:
        if self._worker is not None:
            self._worker.quit()

    def _row_changed(self, current: QModelIndex, _prev: QModelIndex) -> None:
        if not current.isValid() or self.sources is None:
            return
        c: Change = self.proxy.mapToSource(current).data(Qt.ItemDataRole.UserRole)
        a, b = self.sources
        for src, view in ((a, self.map_a), (b, self.map_b)):
            ck = getattr(src, "ckpt", None)
            if ck is not None and ck.has_tensor(c.fqn):
                view.show_tensors(ck, [ck.tensor(c.fqn)])
            else:
                view.clear_map("not in this checkpoint" if ck is not None else "a consolidated file: one piece")
        self.hist.clear()
        self.hist.hide()
        self.detail.setText("")
        if self._detail_worker is not None:
            self._detail_worker.quit()
            self._detail_worker = None
        if c.kind != "values" or c.rel_l2 is None:
            self.detailDone.emit()
            return
        # NOTE: `w` in the last slot is read when it runs (queued, on this thread), after it was assigned
        w = run_in_background(difference_histogram, a, b, c.fqn, owner=self, on_result=self._show_hist,
                              on_error=self.detail.setText, on_finished=lambda: self._detail_finished(w))
        self._detail_worker = w

    def detail_pending(self) -> bool:
        """A difference histogram is being computed (``detailDone`` follows)."""
        return self._detail_worker is not None

    def _detail_finished(self, worker: Worker) -> None:
        if self._detail_worker is worker:
            self._detail_worker = None
            self.detailDone.emit()

    def _show_hist(self, d) -> None:
        if d.counts:
            self.hist.show()
            self.hist.plot(d.edges, d.counts, stepMode="center", fillLevel=0, brush=(214, 39, 40, 120),
                           pen=pg.mkPen("#d62728"))
        self.detail.setText(f"{d.fqn}: {d.nonzero:,} of {d.numel:,} elements differ")

    # ------------------------------------------------------------------ column widths (remembered)
    def _saved_widths(self) -> list | None:
        widths = QSettings("Shardscope", "Shardscope").value(WIDTHS_KEY)
        ok = isinstance(widths, list) and len(widths) == len(COLUMNS) and all(str(w).isdigit() for w in widths)
        return widths if ok else None

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if watched is self.table and event.type() == QEvent.Type.Resize and self._saved_widths() is None:
            self._restore_widths()  # until the user sets widths, the names take what the numbers leave
        return super().eventFilter(watched, event)

    def _restore_widths(self) -> None:
        """The widths the user last set (QSettings), else widths from the font."""
        widths = self._saved_widths()
        fm = self.table.fontMetrics()
        if widths is None:
            extra = 2 * fm.averageCharWidth() + 8
            numbers = [fm.horizontalAdvance(t) + extra for t in ("only in A", "0.0001234", "0.0001234", "100.00 %")]
            # NOTE: from the table's own width: its viewport is resized only after the table's resize event
            chrome = 2 * self.table.frameWidth() + self.table.verticalScrollBar().sizeHint().width() + 2
            # the stretching last section never goes below the header's default section size
            numbers[-1] = max(numbers[-1], self.table.horizontalHeader().defaultSectionSize())
            room = self.table.width() - chrome - sum(numbers)
            widths = [max(fm.averageCharWidth() * 30, room), *numbers]  # the names get what is left
        self._restoring = True
        for col, w in enumerate(widths[:-1]):  # the last one stretches
            self.table.setColumnWidth(col, int(w))
        self._restoring = False

    def _save_widths(self) -> None:
        if self._restoring:
            return
        QSettings("Shardscope", "Shardscope").setValue(
            WIDTHS_KEY, [self.table.columnWidth(c) for c in range(len(COLUMNS))])

    def select(self, fqn: str) -> bool:
        for row in range(self.proxy.rowCount()):
            idx = self.proxy.index(row, 0)
            if idx.data() == fqn:
                self.table.setCurrentIndex(idx)
                self.table.scrollTo(idx)
                return True
        return False

    def shutdown(self) -> None:
        self.cancel()
        if self.sources is not None:
            for s in self.sources:
                s.close()
