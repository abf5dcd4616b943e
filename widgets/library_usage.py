"""The Library's disk-usage side: runs of a root by size with what the prune rules would free (the panel and its
table model), the size bars drawn behind sizes, and the rules in one line."""

from __future__ import annotations

import os
from typing import Any

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, QRectF, Qt, Signal
from PySide6.QtGui import QColor, QPainter
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QHeaderView,
    QLabel,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from ..backend.filenames import is_url
from ..backend.library.prune import Plan, Rules
from ..backend.library.records import RunRecord
from ..backend.library.snapshot import LibrarySnapshot
from ..backend.text import count, human_bytes
from .library_model import NAME_SAMPLE, ObjectRole
from .rows_table import RowsTableModel


class SizeBarDelegate(QStyledItemDelegate):
    """A bar behind the size, scaled to the largest checkpoint (runs: to the largest run)."""

    def __init__(self, fraction, parent=None) -> None:
        super().__init__(parent)
        self.fraction = fraction  # index -> 0..1

    def paint(self, painter: QPainter, option: QStyleOptionViewItem,
              index: QModelIndex | QPersistentModelIndex) -> None:
        frac = max(0.0, min(1.0, self.fraction(index)))
        if frac > 0:
            r = QRectF(option.rect).adjusted(1, 3, -1, -3)
            r.setWidth(max(1.0, r.width() * frac))
            painter.fillRect(r, QColor(31, 119, 180, 60))
        super().paint(painter, option, index)


class DiskUsageModel(RowsTableModel):
    """Runs of one root, largest first, with what the prune rules would free in each."""

    HEADERS = ("run", "ckpts", "size", "rules free")  # NOTE: short, so a run's name has the room (was "checkpoints")
    HEADER_TIPS = ("the run's folder", "checkpoints in the run", "what the run's checkpoints take on disk",
                   "what the prune rules would remove from the run")
    # what each column after the name must show whole
    SAMPLES = ("000", "1023.9 MiB", "1023.9 MiB")

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.rows: list[tuple[RunRecord, int]] = []
        self._max = 1

    def rows_list(self) -> list:
        return self.rows

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.ToolTipRole:
            return self.HEADER_TIPS[section]
        return super().headerData(section, orientation, role)

    def set_rows(self, runs: list[RunRecord], plan: Plan | None) -> None:
        freed: dict[str, int] = {}
        for d in plan.remove if plan is not None else []:
            freed[d.checkpoint.run] = freed.get(d.checkpoint.run, 0) + d.checkpoint.bytes
        self.beginResetModel()
        self.rows = sorted(((r, freed.get(r.path, 0)) for r in runs), key=lambda x: -x[0].bytes)
        self._max = max((r.bytes for r, _ in self.rows), default=1) or 1
        self.endResetModel()

    def fraction(self, index: QModelIndex | QPersistentModelIndex) -> float:
        return self.rows[index.row()][0].bytes / self._max if index.isValid() else 0.0

    def data(self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        run, freed = self.rows[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return (run.name, str(len(run.checkpoints)), human_bytes(run.bytes),
                    human_bytes(freed) if freed else "—")[index.column()]
        if role == Qt.ItemDataRole.ToolTipRole:
            return run.path
        if role == ObjectRole:
            return run
        if role == Qt.ItemDataRole.TextAlignmentRole and index.column() > 0:
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None


class DiskUsagePanel(QWidget):
    """Disk usage by run of the root chosen in its box, and what the prune rules would free there."""

    rootChanged = Signal()  # another root was chosen in the box
    runActivated = Signal(object)  # a RunRecord, activated in the table (double-click or Enter)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        v = QVBoxLayout(self)
        v.setContentsMargins(0, 0, 0, 0)
        v.addWidget(QLabel("<b>Disk usage</b> by run"))
        self.usage = DiskUsageModel(self)
        self.root_box = QComboBox()
        self.root_box.currentIndexChanged.connect(lambda _i: self.rootChanged.emit())
        v.addWidget(self.root_box)
        self.usage_table = QTableView()
        self.usage_table.setModel(self.usage)
        self.usage_table.verticalHeader().hide()
        self.usage_table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.usage_table.setItemDelegateForColumn(2, SizeBarDelegate(self.usage.fraction, self.usage_table))
        self.usage_table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.usage_table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.usage_table.setWordWrap(False)
        self.usage_table.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        self.usage_table.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 6)
        self.usage_table.activated.connect(lambda i: self.runActivated.emit(self.usage.data(i, ObjectRole)))
        v.addWidget(self.usage_table, 1)
        self.rules_label = QLabel()
        self.rules_label.setWordWrap(True)
        v.addWidget(self.rules_label)

    def wanted_width(self) -> int:
        """The width that shows a typical run's whole name beside its numbers (names longer than that elide in
        the middle, keeping the end that tells runs of one day apart; so do all once a scroll bar takes its room)."""
        table = self.usage_table
        fm, header = table.fontMetrics(), table.horizontalHeader()
        pad = fm.averageCharWidth() + 4  # NOTE: the header keeps 2 x PM_HeaderMargin (4), an item 2 x 3
        words = zip(DiskUsageModel.HEADERS, (NAME_SAMPLE, *DiskUsageModel.SAMPLES), strict=True)
        columns = sum(max(header.fontMetrics().horizontalAdvance(h), fm.horizontalAdvance(w)) + pad for h, w in words)
        return columns + 2 * table.frameWidth()

    def set_roots(self, roots: list[str], current: str | None) -> None:
        """Offer ``roots`` in the box, ``current`` chosen (else the first); quietly: the caller fills next."""
        self.root_box.blockSignals(True)
        self.root_box.clear()
        for r in roots:
            self.root_box.addItem(r, r)
        i = self.root_box.findData(current)
        self.root_box.setCurrentIndex(max(i, 0))
        self.root_box.blockSignals(False)

    def fill(self, snap: LibrarySnapshot | None, rules: Rules) -> None:
        """The runs of the chosen root in ``snap``, with what ``rules`` (planned in ``snap.plan``) would free."""
        root = self.root_box.currentData()
        if snap is None or root is None:
            self.usage.set_rows([], None)
            return
        real = root.rstrip("/") if is_url(root) else os.path.realpath(root)
        sep = "/" if is_url(root) else os.sep
        runs = [r for r in snap.listing.runs if any(c.path.startswith(real.rstrip(sep) + sep) or c.path == real
                                                    for c in r.checkpoints)]
        self.usage.set_rows(runs, snap.plan)
        freed = sum(f for _r, f in self.usage.rows)
        self.rules_label.setText(f"{human_bytes(sum(r.bytes for r in runs))} in {count(len(runs), 'run')}. "
                                 "The prune rules "
                                 f"({describe_rules(rules)}) would free {human_bytes(freed)}.")


def describe_rules(rules: Rules) -> str:
    """The prune rules in one line, as the disk-usage table's note says them."""
    parts = []
    if rules.keep_last:
        parts.append(f"keep last {rules.keep_last}")
    if rules.keep_every:
        parts.append(f"every {rules.keep_every} steps")
    if rules.keep_best:
        parts.append(f"best {rules.top} by {rules.keep_best} ({rules.mode})")
    parts += [f"keep {g}" for g in rules.keep]
    if rules.min_age is not None:
        parts.append(f"newer than {rules.min_age / 3600:g} h")
    if rules.incomplete:
        parts.append("remove failed saves")
    return ", ".join(parts) or "none"
