"""The Compare view: the differences between two checkpoints as a table with a bar per entry, and
for the selected tensor the two shard maps side by side and a histogram of the difference."""

from __future__ import annotations

import html
import math
from contextlib import ExitStack
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
    QCheckBox,
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
from shardscope.backend.compare import diff
from shardscope.backend.compare.diff import Change, DiffResult, difference_histogram
from shardscope.backend.formats import open_source
from shardscope.backend.text import count

from .plot_style import themed_plot
from .shard_map import ShardMapView
from .workers import Worker, run_in_background

COLUMNS = ("entry", "kind", "max |a−b|", "rel. L2", "changed")
WIDTHS_KEY = "compare/column_widths"
SortRole = Qt.ItemDataRole.UserRole + 1
DETAIL_HINT = "Select an entry to see both layouts and, for changed values, a histogram of a − b."


class DiffModel(QAbstractTableModel):
    """Rows: changed entries, entries that could not be read, then entries only in A or only in B (an adapter
    over DiffResult)."""

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.rows: list[Change] = []
        self.max_rel = 0.0

    def set_result(self, result: DiffResult | None) -> None:
        self.beginResetModel()
        self.rows = []
        if result is not None:
            self.rows = list(result.changed) + list(result.unreadable) + \
                [Change(f, "only in A", fqn_b="") for f in result.only_a] + \
                [Change(f, "only in B", fqn_a="") for f in result.only_b]
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
            if c.rel_l2 is None:  # the detail spans the number columns (CompareView._span_details)
                return (f"in {c.side}: {c.detail}" if c.kind == "unreadable" else c.detail) if col == 2 else ""
            return (None, None, f"{c.max_abs_diff:.4g}", f"{c.rel_l2:.4g}", f"{100 * c.frac_changed:.2f} %")[col]
        if role == SortRole:
            if col in (0, 1):
                return c.fqn if col == 0 else c.kind
            if c.kind == "unreadable":
                return math.inf  # nothing is known about it: first among the biggest changes
            v = (None, None, c.max_abs_diff, c.rel_l2, c.frac_changed)[col]
            return -1.0 if v is None else float(v)
        if role == Qt.ItemDataRole.UserRole:
            return c
        if role == Qt.ItemDataRole.ToolTipRole:
            return self._tooltip(c, col)
        if role == Qt.ItemDataRole.ForegroundRole and c.kind == "unreadable":
            return QColor("#d62728")
        if role == Qt.ItemDataRole.TextAlignmentRole and col >= 2 and c.rel_l2 is not None:
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None

    @staticmethod
    def _tooltip(c: Change, col: int) -> str | None:
        """The full name (the cell elides in the middle: exp_avg vs exp_avg_sq stay apart), both names when
        they were paired without a container prefix, and the whole reason of an unreadable entry."""
        if col == 0:
            both = c.fqn_a and c.fqn_b and (c.fqn_a != c.fqn or c.fqn_b != c.fqn)
            return f"{c.fqn}\nA: {c.fqn_a}\nB: {c.fqn_b}" if both else c.fqn
        if c.kind == "unreadable":
            return f"cannot be read in {c.side}: {c.detail}"
        return c.detail if c.rel_l2 is None and c.detail else None


def summary_html(result: DiffResult) -> str:
    """The verdict line, the counts, how the names were paired, and what could not be read."""
    layout_only = sum(c.kind == "layout" for c in result.changed)
    verdict = "<span style='color:#2ca02c'>no differences in values</span>" if not result.differs else \
        "<span style='color:#d62728'>differences found</span>"
    if result.unreadable:
        verdict = (f"<span style='color:#d62728'>{len(result.unreadable)} unreadable</span> (the rest compared), "
                   + verdict)
    lines = [f"{verdict}: {len(result.only_a)} only in A, {len(result.only_b)} only in B, "
             f"{len(result.changed) - layout_only} changed, {layout_only} with another layout only, "
             f"{result.unchanged} unchanged"]
    if result.by_digest:
        lines.append(f"{count(result.by_digest, 'tensor')} identical (same digests): both sides are sealed and their "
                     "manifests give each the same SHA-256 of its values, so none of their bytes was read.")
    p = result.pairing
    if p is not None and p.renamed:
        lines.append(html.escape(f"Pairing: {p.describe()}. Tick Exact names to pair the names as stored.",
                                 quote=False))
    if p is not None and p.hint:
        lines.append(html.escape(p.hint, quote=False))
    if result.unreadable:
        first = result.unreadable[0]
        lines.append("<span style='color:#d62728'>" + html.escape(f"{first.fqn} cannot be read in {first.side}: "
                                                                   f"{first.detail}", quote=False) + "</span>")
    return "<br>".join(lines)


class DetailDelegate(QStyledItemDelegate):
    """The detail of a row without numbers (why it cannot be read, both dtypes) elides at its end: its start
    names the file."""

    def initStyleOption(self, option: QStyleOptionViewItem, index: QModelIndex | QPersistentModelIndex) -> None:
        super().initStyleOption(option, index)
        option.textElideMode = Qt.TextElideMode.ElideRight


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
        # NOTE: every histogram worker still running reads through self.sources (a quit one too, until it
        # returns); the sources are closed for a new comparison only when none is left
        self._readers: set[Worker] = set()
        layout = QVBoxLayout(self)
        top = QHBoxLayout()
        self.header = QLabel(f"<b>A</b> {path_a}<br><b>B</b> {path_b}")
        self.header.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.header.setToolTip(f"A {path_a}\nB {path_b}")
        # NOTE: long paths and error lines are clipped or wrapped; their one-line width used to become the
        # window's minimum width (a truncated file's message pushed the window past a 1280 px screen)
        self.header.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        top.addWidget(self.header, 1)
        self.exact_names = QCheckBox("Exact names")
        self.exact_names.setToolTip("Pair entries only by their names as stored. Off: when it pairs more, a side's "
                                    "container prefix (model., state_dict.) is removed first, so a checkpoint "
                                    "pairs with its safetensors export (shardscope diff --exact-names).")
        self.exact_names.toggled.connect(lambda _on: self.start())
        top.addWidget(self.exact_names)
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
        self.table.setItemDelegateForColumn(2, DetailDelegate(self))
        self.table.setItemDelegateForColumn(3, BarDelegate(self.model, self))
        self.table.selectionModel().currentRowChanged.connect(self._row_changed)
        self.proxy.layoutChanged.connect(self._span_details)  # sorting moves rows; spans are the view's
        self.proxy.modelReset.connect(self._span_details)
        return self.table

    def _span_details(self) -> None:
        """A row without numbers (dtype, shape, unreadable: why) shows its detail across the number columns."""
        self.table.clearSpans()
        for row in range(self.proxy.rowCount()):
            c: Change = self.proxy.index(row, 0).data(Qt.ItemDataRole.UserRole)
            if c.rel_l2 is None and c.detail:
                self.table.setSpan(row, 2, 1, len(COLUMNS) - 2)

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
        self.detail = QLabel(DETAIL_HINT)
        self.detail.setWordWrap(True)
        right.addWidget(self.detail)
        right.setSizes([400, 300, 40])
        return right

    def start(self) -> None:
        """Compare (again, after "Exact names" was toggled) in the background; ``finished`` follows."""
        self._close_sources()
        self.model.set_result(None)
        self.exact_names.setEnabled(False)  # one comparison at a time; enabled again when it ends
        for w in (self.progress, self.cancel_button):
            w.show()
        self.progress.setRange(0, 0)
        self.summary.setText("Comparing …")
        self.hist.hide()
        self.detail.setText(DETAIL_HINT)
        for m in (self.map_a, self.map_b):
            m.clear_map("")
        exact = self.exact_names.isChecked()

        def work(progress=None):
            with ExitStack() as opened:  # closed unless the comparison is returned with them
                a = opened.enter_context(open_source(self.path_a))
                b = opened.enter_context(open_source(self.path_b))
                result = diff(a, b, progress, exact_names=exact)
                opened.pop_all()
                return a, b, result

        self._worker = run_in_background(work, owner=self, on_result=self._done, on_error=self._failed,
                                         on_progress=self._on_progress, on_cancelled=lambda: self._failed("Cancelled."))

    def _on_progress(self, done: int, total: int, msg: str) -> None:
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(done)
        # NOTE: the bar holds the percentage only; what is being compared goes in the line below, which wraps (in
        # the 220 px bar it was clipped)
        self.progress.setFormat("%p%")
        said = f"Comparing … {done:,} of {count(total, 'pair')}" if total else "Comparing …"
        self.summary.setText(html.escape(f"{said}: {msg}" if done and msg else said, quote=False))

    def _done(self, out) -> None:
        a, b, result = out
        self.sources, self.result = (a, b), result
        self.progress.hide()
        self.cancel_button.hide()
        self._worker = None
        self._allow_restart()
        self.model.set_result(result)
        self._restore_widths()  # NOTE: a model reset gives the header its default section sizes again
        self.table.sortByColumn(3, Qt.SortOrder.DescendingOrder)  # the biggest relative change first
        self.summary.setText(summary_html(result))
        if not (result.changed or result.only_a or result.only_b or result.unreadable):
            same = count(result.unchanged, "entry", "entries")
            how = "every element compared" if not result.by_digest else \
                "identical (same digests)" if result.by_digest == result.unchanged else \
                f"{result.by_digest:,} identical (same digests), every element of the others compared"
            self.detail.setText(f"Nothing to list: both hold the same {same}, each with the same "
                                f"dtype, shape and values ({how}).")
        self.finished.emit(result)

    def _failed(self, message: str) -> None:
        self.progress.hide()
        self.cancel_button.hide()
        self._worker = None
        self._allow_restart()
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
        for src, view, name in ((a, self.map_a, c.fqn_a), (b, self.map_b, c.fqn_b)):
            ck = getattr(src, "ckpt", None)
            if ck is not None and name and ck.has_tensor(name):
                view.show_tensors(ck, [ck.tensor(name)])
            else:
                view.clear_map("not in this checkpoint" if ck is not None else "a consolidated file: one piece")
        self.hist.clear()
        self.hist.hide()
        self.detail.setText(f"{c.fqn} cannot be read in {c.side}: {c.detail}" if c.kind == "unreadable" else "")
        if self._detail_worker is not None:
            self._detail_worker.quit()
            self._detail_worker = None
        if c.kind != "values" or c.rel_l2 is None:
            self.detailDone.emit()
            return
        # NOTE: `w` in the last slot is read when it runs (queued, on this thread), after it was assigned
        w = run_in_background(difference_histogram, a, b, c.fqn_a, fqn_b=c.fqn_b, owner=self,
                              on_result=self._show_hist, on_error=self.detail.setText,
                              on_finished=lambda: self._detail_finished(w))
        self._detail_worker = w
        self._readers.add(w)
        self.exact_names.setEnabled(False)

    def detail_pending(self) -> bool:
        """A difference histogram is being computed (``detailDone`` follows)."""
        return self._detail_worker is not None

    def _allow_restart(self) -> None:
        """"Exact names" compares again once nothing reads through the current sources."""
        self.exact_names.setEnabled(not self._readers and self._worker is None)

    def _detail_finished(self, worker: Worker) -> None:
        self._readers.discard(worker)
        self._allow_restart()
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
            numbers = [fm.horizontalAdvance(t) + extra for t in ("unreadable", "0.0001234", "0.0001234", "100.00 %")]
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

    def _close_sources(self) -> None:
        if self.sources is not None:
            for s in self.sources:
                s.close()
            self.sources = None

    def shutdown(self) -> None:
        self.cancel()
        self._close_sources()
