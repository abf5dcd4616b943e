"""The Inspector tab: statistics and a histogram of the selected tensor's values, and its raw chunk table."""

from __future__ import annotations

import html
import time
from typing import Any

import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFont, QFontMetrics, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from ..backend.checkpoint.model import TensorEntry
from ..backend.text import escape_name, human_bytes, plain_tooltip, rich_name
from .palette import rank_color
from .plot_style import themed_plot


class TitleLabel(QLabel):
    """The Inspector's title: a bold name and what follows it (dtype, shape, size; or a value). What follows is
    always whole; the name is cut in the middle to the room left, again at every resize, so the title's end is
    never clipped under the buttons beside it. The whole text is in its tooltip."""

    def __init__(self, text: str = "", parent=None) -> None:
        super().__init__(parent)
        self._name, self._rest = "", text
        self.setTextFormat(Qt.TextFormat.RichText)
        self._fit()

    def set_title(self, name: str, rest: str = "") -> None:
        """``name`` (plain, shown bold) and ``rest`` (plain, after it); both escaped here."""
        self._name, self._rest = name, rest
        self.setToolTip(plain_tooltip(name + rest) if name else "")
        self._fit()

    def shown(self) -> tuple[str, str]:
        """(the name as shown, what follows it)."""
        return self._shown_name, self._rest

    def needed_width(self) -> int:
        """The pixels the shown text takes."""
        return self._bold().horizontalAdvance(self._shown_name) + self.fontMetrics().horizontalAdvance(self._rest)

    def _bold(self) -> QFontMetrics:
        font = QFont(self.font())
        font.setBold(True)
        return QFontMetrics(font)

    def _fit(self) -> None:
        room = self.contentsRect().width() - self.fontMetrics().horizontalAdvance(self._rest) - 2
        name = escape_name(self._name)  # a U+202E or newline in a stored name must not reorder or split the title
        self._shown_name = self._bold().elidedText(name, Qt.TextElideMode.ElideMiddle, max(room, 0)) or "…" \
            if name else ""
        self.setText((f"<b>{html.escape(self._shown_name)}</b>" if name else "") + rich_name(self._rest))

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit()


class InspectorView(QWidget):
    """Statistics and histogram of the selected tensor's values, and its raw chunk table."""

    loadRequested = Signal()
    cancelRequested = Signal()

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        top = QHBoxLayout()
        self.title = TitleLabel("No tensor selected")
        self.title.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        # NOTE: a long name (an optimizer key of a transformers model) set the window's minimum width;
        # the title is clipped instead, the full text in its tooltip.
        self.title.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        top.addWidget(self.title, 1)
        self.load_button = QPushButton("Load values")
        self.load_button.clicked.connect(self.loadRequested)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancelRequested)
        self.cancel_button.hide()
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(160)
        self.progress.hide()
        top.addWidget(self.progress)
        top.addWidget(self.load_button)
        top.addWidget(self.cancel_button)
        layout.addLayout(top)
        split = QSplitter(Qt.Orientation.Horizontal)
        left = QWidget()
        ll = QVBoxLayout(left)
        ll.setContentsMargins(0, 0, 0, 0)
        self.stats = QLabel("")
        self.stats.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.stats.setAlignment(Qt.AlignmentFlag.AlignTop)
        # NOTE: an error message (a long path) wraps; its one-line width used to become the window's
        # minimum width (the window grew past the screen). The statistics table keeps its own width.
        self.stats.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self._stats_min = self.fontMetrics().horizontalAdvance("mean -0.00757524  std 1.00421") + 16
        self._fit_stats(wrap=True)
        ll.addWidget(self.stats)
        self.hist = themed_plot()
        self.hist.setLabel("bottom", "value")
        self.hist.setLabel("left", "count")
        self.hist.setMinimumWidth(160)
        self.hist.hide()  # shown with statistics only: no empty axes left from the previous tensor
        ll.addWidget(self.hist, 1)
        self.read_note = QLabel("")
        self.read_note.setStyleSheet("color: palette(mid);")
        ll.addWidget(self.read_note)
        split.addWidget(left)
        self.chunks = QTableWidget(0, 6)
        self.chunks.setHorizontalHeaderLabels(["offsets", "sizes", "rank", "file", "byte offset", "length"])
        self.chunks.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.chunks.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.chunks.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.chunks.verticalHeader().hide()
        self.chunks.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 6)
        split.addWidget(self.chunks)
        split.setStretchFactor(0, 2)
        split.setStretchFactor(1, 3)  # the chunk table's six columns get the larger share
        layout.addWidget(split, 1)
        self.last_stats: Any = None
        self._started = 0.0

    def set_tensor(self, entry: TensorEntry | None) -> None:
        self.last_stats = None
        self.hist.clear()
        self.hist.hide()
        self.show_message("")
        self.read_note.setText("")
        self.load_button.setText("Load values")
        if entry is None:
            self.title.set_title("", "No tensor selected")
            self.chunks.setRowCount(0)
            self.load_button.setEnabled(False)
            return
        self.load_button.setEnabled(True)
        self.title.set_title(entry.fqn, f" — {entry.dtype} {list(entry.shape)}, {human_bytes(entry.nbytes)}")
        chunks = entry.chunks
        # NOTE: emptied first. Refilling rows that still held items replaced them one by one, and each
        # replacement made the shown table re-measure its ResizeToContents columns over every row:
        # 84 s frozen going from one 512-chunk tensor to another (found by tests/soak_driver.py --probe).
        self.chunks.setRowCount(0)
        self.chunks.setRowCount(len(chunks))
        for i, c in enumerate(chunks):
            vals = (str(list(c.offsets)), str(list(c.sizes)), "—" if c.rank is None else str(c.rank), c.file,
                    f"{c.offset}", f"{c.length}")
            for j, v in enumerate(vals):
                item = QTableWidgetItem(v)
                if j == 2:
                    item.setBackground(rank_color(c.rank))
                if j >= 4:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.chunks.setItem(i, j, item)

    def set_busy(self, busy: bool) -> None:
        self.progress.setVisible(busy)
        self.cancel_button.setVisible(busy)
        self.load_button.setVisible(not busy)
        if busy:
            self.progress.setRange(0, 0)
            self._started = time.monotonic()
            if self.last_stats is not None:  # a reload: say so, so the click visibly does something
                self.read_note.setText("Reading the values again from disk …")

    def set_progress(self, done: int, total: int, _msg: str) -> None:
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(done)

    def set_stats(self, stats: Any) -> None:
        again = self.last_stats is not None
        self.last_stats = stats
        self.hist.clear()
        self.load_button.setText("Reload values")
        self.read_note.setText(f"{'Read again' if again else 'Read'} from disk at {time.strftime('%H:%M:%S')} "
                               f"in {time.monotonic() - self._started:.2f} s")
        if stats.min is None:
            self.show_message(f"No finite values. NaN {stats.nan:,}, Inf {stats.inf:,} of {stats.numel:,}.")
            return
        self.stats.setText(
            '<table cellspacing="3">'  # spacing: "mean" and a negative value must not run together
            f"<tr><td>min</td><td>{stats.min:.6g}</td><td>&nbsp;max</td><td>{stats.max:.6g}</td></tr>"
            f"<tr><td>mean</td><td>{stats.mean:.6g}</td><td>&nbsp;std</td><td>{stats.std:.6g}</td></tr>"
            f"<tr><td>NaN</td><td>{stats.nan:,}</td><td>&nbsp;Inf</td><td>{stats.inf:,}</td></tr>"
            f"<tr><td>zeros</td><td>{stats.zeros:,}</td><td>&nbsp;elements</td><td>{stats.numel:,}</td></tr></table>")
        self._fit_stats(wrap=False)
        if stats.hist_counts:
            self.hist.show()
            self.hist.plot(stats.hist_edges, stats.hist_counts, stepMode="center", fillLevel=0,
                           brush=(78, 121, 167, 160), pen=pg.mkPen("#4e79a7"))
            self.hist.getPlotItem().enableAutoRange()

    def show_message(self, text: str) -> None:
        self.stats.setText(text)
        self._fit_stats(wrap=True)

    def _fit_stats(self, wrap: bool) -> None:
        """Messages wrap at any width; the statistics table keeps its natural width (never clipped)."""
        self.stats.setWordWrap(wrap)
        self.stats.setMinimumWidth(self._stats_min if wrap else max(self._stats_min, self.stats.sizeHint().width()))

    def copy_chunks(self) -> str:
        rows = ["\t".join(self.chunks.horizontalHeaderItem(j).text() for j in range(self.chunks.columnCount()))]
        for i in range(self.chunks.rowCount()):
            rows.append("\t".join(self.chunks.item(i, j).text() for j in range(self.chunks.columnCount())))
        text = "\n".join(rows)
        QGuiApplication.clipboard().setText(text)
        return text

    def keyPressEvent(self, event) -> None:
        if event.matches(QKeySequence.StandardKey.Copy):
            self.copy_chunks()
            return
        super().keyPressEvent(event)
