"""The ranks view (balance, files, heat map), the value inspector and the health panel."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)
from shardscope.backend.checkpoint.model import Checkpoint, Problem, TensorEntry
from shardscope.backend.format import human_bytes

from .palette import rank_color


def _plot_widget() -> pg.PlotWidget:
    w = pg.PlotWidget()
    pal = QGuiApplication.palette()
    w.setBackground(pal.base().color())
    for axis in ("left", "bottom"):
        w.getAxis(axis).setTextPen(pal.text().color())
        w.getAxis(axis).setPen(pal.mid().color())
    return w


class RanksView(QWidget):
    """Per-rank bytes and chunk counts (balance), per-file sizes, tensors × ranks heat map."""

    rankClicked = Signal(object)  # int, or None to clear

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        self.note = QLabel("Ranks are <b>writer</b> ranks: DCP writes a replicated tensor once, so a "
                           "rank here wrote a chunk; other ranks may have held the same values.")
        self.note.setWordWrap(True)
        layout.addWidget(self.note)
        split = QSplitter(Qt.Orientation.Horizontal)
        self.bars = _plot_widget()
        self.bars.setLabel("left", "MiB written")
        self.bars.setLabel("bottom", "rank (click to highlight)")
        self.bars.scene().sigMouseClicked.connect(self._clicked)
        split.addWidget(self.bars)
        self.heat = _plot_widget()
        self.heat.setLabel("bottom", "rank")
        self.heat.setLabel("left", "tensor")
        self.heat_image = pg.ImageItem()
        self.heat.addItem(self.heat_image)
        split.addWidget(self.heat)
        self.files = QTableWidget(0, 3)
        self.files.setHorizontalHeaderLabels(["file", "rank", "size"])
        self.files.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.files.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        split.addWidget(self.files)
        layout.addWidget(split)
        self.ranks: list[int] = []
        self.bar_heights: list[float] = []
        self.selected_rank: int | None = None

    def set_checkpoint(self, ckpt: Checkpoint, balance: list, heat: tuple[list[int], np.ndarray]) -> None:
        self.bars.clear()
        ranks = [b for b in balance if b.rank >= 0] or balance
        self.ranks = [b.rank for b in ranks]
        self.bar_heights = [b.bytes / 2**20 for b in ranks]
        brushes = [rank_color(r) for r in self.ranks]
        self.bars.addItem(pg.BarGraphItem(x=list(range(len(ranks))), height=self.bar_heights, width=0.8,
                                          brushes=brushes))
        for i, b in enumerate(ranks):
            t = pg.TextItem(f"{b.chunks} ch", anchor=(0.5, 1), color=QGuiApplication.palette().text().color())
            t.setPos(i, self.bar_heights[i])
            self.bars.addItem(t)
        ax = self.bars.getAxis("bottom")
        step = max(1, len(ranks) // 16)
        ax.setTicks([[(i, str(r)) for i, r in enumerate(self.ranks) if i % step == 0]])
        hr, mat = heat
        if mat.size:
            self.heat_image.setImage(mat.T.astype(np.float64), autoLevels=True)
            self.heat_image.setColorMap(pg.colormap.get("viridis"))
            self.heat.getAxis("bottom").setTicks([[(i + 0.5, str(r)) for i, r in enumerate(hr)
                                                   if i % max(1, len(hr) // 16) == 0]])
        files = ckpt.data_files
        self.files.setRowCount(len(files))
        for i, f in enumerate(files):
            for j, v in enumerate((f.name, "" if f.rank is None else str(f.rank),
                                   "MISSING" if f.bytes is None else human_bytes(f.bytes))):
                self.files.setItem(i, j, QTableWidgetItem(v))

    def _clicked(self, event: Any) -> None:
        vb = self.bars.getPlotItem().vb
        pos = vb.mapSceneToView(event.scenePos())
        i = round(pos.x())
        if 0 <= i < len(self.ranks) and 0 <= pos.y() <= max(self.bar_heights or [0]) * 1.1:
            rank = self.ranks[i]
            self.select_rank(None if rank == self.selected_rank else rank)

    def select_rank(self, rank: int | None) -> None:
        self.selected_rank = rank
        self.rankClicked.emit(rank)


class InspectorView(QWidget):
    """Statistics and histogram of the selected tensor's values, and its raw chunk table."""

    loadRequested = Signal()
    cancelRequested = Signal()

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        top = QHBoxLayout()
        self.title = QLabel("No tensor selected")
        self.title.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
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
        ll.addWidget(self.stats)
        self.hist = _plot_widget()
        self.hist.setLabel("bottom", "value")
        self.hist.setLabel("left", "count")
        ll.addWidget(self.hist, 1)
        split.addWidget(left)
        self.chunks = QTableWidget(0, 6)
        self.chunks.setHorizontalHeaderLabels(["offsets", "sizes", "rank", "file", "byte offset", "length"])
        self.chunks.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.chunks.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.chunks.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        split.addWidget(self.chunks)
        layout.addWidget(split, 1)
        self.last_stats: Any = None

    def set_tensor(self, entry: TensorEntry | None) -> None:
        self.last_stats = None
        self.hist.clear()
        self.stats.setText("")
        if entry is None:
            self.title.setText("No tensor selected")
            self.chunks.setRowCount(0)
            self.load_button.setEnabled(False)
            return
        self.load_button.setEnabled(True)
        self.title.setText(f"<b>{entry.fqn}</b> — {entry.dtype} {list(entry.shape)}, {human_bytes(entry.nbytes)}")
        chunks = entry.chunks
        self.chunks.setRowCount(len(chunks))
        for i, c in enumerate(chunks):
            vals = (str(list(c.offsets)), str(list(c.sizes)), "" if c.rank is None else str(c.rank), c.file,
                    f"{c.offset}", f"{c.length}")
            for j, v in enumerate(vals):
                item = QTableWidgetItem(v)
                if j == 2:
                    item.setBackground(rank_color(c.rank))
                self.chunks.setItem(i, j, item)

    def set_busy(self, busy: bool) -> None:
        self.progress.setVisible(busy)
        self.cancel_button.setVisible(busy)
        self.load_button.setVisible(not busy)
        if busy:
            self.progress.setRange(0, 0)

    def set_progress(self, done: int, total: int, _msg: str) -> None:
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(done)

    def set_stats(self, stats: Any) -> None:
        self.last_stats = stats
        self.hist.clear()
        if stats.min is None:
            self.stats.setText(f"No finite values. NaN {stats.nan:,}, Inf {stats.inf:,} of {stats.numel:,}.")
            return
        self.stats.setText(
            f"<table><tr><td>min</td><td>{stats.min:.6g}</td><td>&nbsp;max</td><td>{stats.max:.6g}</td></tr>"
            f"<tr><td>mean</td><td>{stats.mean:.6g}</td><td>&nbsp;std</td><td>{stats.std:.6g}</td></tr>"
            f"<tr><td>NaN</td><td>{stats.nan:,}</td><td>&nbsp;Inf</td><td>{stats.inf:,}</td></tr>"
            f"<tr><td>zeros</td><td>{stats.zeros:,}</td><td>&nbsp;elements</td><td>{stats.numel:,}</td></tr></table>")
        if stats.hist_counts:
            self.hist.plot(stats.hist_edges, stats.hist_counts, stepMode="center", fillLevel=0,
                           brush=(78, 121, 167, 160), pen=pg.mkPen("#4e79a7"))

    def show_message(self, text: str) -> None:
        self.stats.setText(text)

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


MAX_LISTED = 2000


class HealthPanel(QListWidget):
    """The problems from verify; clicking one selects its tensor."""

    problemActivated = Signal(str)

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.itemClicked.connect(self._clicked)
        self.problems: list[Problem] = []

    def set_problems_pending(self) -> None:
        self.clear()
        self.problems = []
        self.addItem(QListWidgetItem("Checking files and layout …"))

    def set_problems(self, problems: list[Problem]) -> None:
        self.clear()
        self.problems = list(problems)
        if not problems:
            item = QListWidgetItem("✔ Healthy: every file present and long enough, every tensor tiled exactly.")
            self.addItem(item)
            return
        for p in problems[:MAX_LISTED]:
            item = QListWidgetItem(f"[{p.kind}] {p.message}")
            item.setData(Qt.ItemDataRole.UserRole, p.fqn)
            item.setToolTip(p.message)
            self.addItem(item)
        if len(problems) > MAX_LISTED:
            self.addItem(QListWidgetItem(f"… and {len(problems) - MAX_LISTED:,} more (`shardscope verify --json` "
                                         "lists them all)"))

    def _clicked(self, item: QListWidgetItem) -> None:
        fqn = item.data(Qt.ItemDataRole.UserRole)
        if fqn:
            self.problemActivated.emit(fqn)
