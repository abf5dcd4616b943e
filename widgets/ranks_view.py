"""The Ranks tab: what each writer rank wrote (bars of bytes and chunks), the data files, and a tensors × ranks
heat map of bytes written."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QHBoxLayout,
    QLabel,
    QSizePolicy,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from ..backend.checkpoint.model import Checkpoint
from ..backend.text import byte_unit, count, human_bytes, natural_key
from .palette import rank_color
from .plot_style import CategoryAxis, themed_plot

DOMINANCE = 20.0  # the largest rank writes this many times the median: switch to a log scale
LABELLED_BARS = 32  # chunk counts written on the bars up to this many ranks (else: hover)
NAME_CHARS = 26  # tensor names on the heat map's axis are elided to this many characters


@dataclass
class RankData:
    """What the ranks view draws, in plain numbers (tests and hover read this)."""

    ranks: list[int] = field(default_factory=list)  # writer ranks, in column order
    bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    chunks: np.ndarray = field(default_factory=lambda: np.zeros(0))
    tensors: list[str] = field(default_factory=list)  # heat-map rows
    heat: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # tensors x ranks, bytes

    def dominated(self) -> bool:
        """One rank writes far more than a typical one (a linear scale would hide the rest)."""
        nonzero = self.bytes[self.bytes > 0]
        return nonzero.size > 1 and float(nonzero.max()) > DOMINANCE * float(np.median(nonzero))

    def bar_text(self, i: int) -> str:
        total = float(self.bytes.sum()) or 1.0
        return (f"rank {self.ranks[i]}: {human_bytes(int(self.bytes[i]))} in {count(int(self.chunks[i]), 'chunk')} "
                f"({100 * self.bytes[i] / total:.1f} % of all tensor bytes)")

    def cell_text(self, row: int, col: int) -> str:
        return f"{self.tensors[row]} · rank {self.ranks[col]}: {human_bytes(int(self.heat[row, col]))}"


def log2_bytes(v: float) -> str:
    """A log2 axis tick as bytes: 10 -> "1 KiB", 15 -> "32 KiB" (empty between whole powers)."""
    if abs(v - round(v)) > 1e-6:
        return ""
    return human_bytes(2 ** round(v)).replace(".0 ", " ")


WRITER_RANKS = ("<b>Writer</b> ranks (DCP writes a replicated tensor once). Click a bar to filter the tree; "
                "hover for exact values.")


class RanksView(QWidget):
    """Per-rank bytes and chunk counts (balance), per-file sizes, and a tensors × ranks heat map with a
    colour scale. Legible from 2 to 512+ ranks: labels only where they fit, exact values on hover
    (one handler per plot, no per-item tooltips), a log scale when one rank dominates."""

    rankClicked = Signal(object)  # int, or None to clear

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        top = QHBoxLayout()
        # One line that says what the ranks are, and then what is under the pointer (exact values).
        self.note_text = WRITER_RANKS
        self.hover = QLabel(self.note_text)
        self.hover.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.hover.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        # NOTE: two lines, wrapped, at a fixed height: on one line the note was cut under "log scale" at 1280 px
        # ("hover for exact v"); fixed, so the plots never move when the hover text changes
        self.hover.setWordWrap(True)
        self.hover.setFixedHeight(2 * self.fontMetrics().lineSpacing() + 2)
        top.addWidget(self.hover, 1)
        self.log_box = QCheckBox("log scale")
        self.log_box.setToolTip("Bytes on a logarithmic scale (on by itself when one rank writes over "
                                f"{DOMINANCE:.0f}× the median)")
        self.log_box.toggled.connect(lambda _on: self._draw())
        top.addWidget(self.log_box)
        layout.addLayout(top)
        self.bar_axis = CategoryAxis("bottom")
        self.bars = themed_plot(bottom=self.bar_axis)
        self.bars.setLabel("bottom", "writer rank")
        self.bars.setMouseEnabled(x=True, y=False)
        self.bars.scene().sigMouseClicked.connect(self._clicked)
        self.bars.scene().sigMouseMoved.connect(self._hover_bars)
        self.heat_x = CategoryAxis("bottom")
        self.heat_y = CategoryAxis("left")
        self.heat = themed_plot(bottom=self.heat_x, left=self.heat_y)
        self.heat.setLabel("bottom", "writer rank")
        self.heat.getPlotItem().invertY(True)  # first tensor at the top, as in the tree
        self.heat_image = pg.ImageItem()
        self.heat.addItem(self.heat_image)
        self.heat_bar = pg.ColorBarItem(colorMap=pg.colormap.get("viridis"), interactive=False, width=14)
        self.heat_bar.setImageItem(self.heat_image, insert_in=self.heat.getPlotItem())
        self.heat_bar.axis.enableAutoSIPrefix(False)
        self.heat_bar.axis.tickStrings = self._colour_ticks  # bytes with units, never "x1e6"
        self.heat.scene().sigMouseMoved.connect(self._hover_heat)
        self.files = QTableWidget(0, 3)
        self.files.setHorizontalHeaderLabels(["file", "rank", "size"])
        self.files.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.files.verticalHeader().hide()
        self.files.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 6)
        left = QSplitter(Qt.Orientation.Vertical)
        left.addWidget(self.bars)
        left.addWidget(self.files)
        left.setSizes([300, 160])
        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(left)
        split.addWidget(self.heat)
        split.setSizes([500, 600])
        layout.addWidget(split, 1)
        self.bars.getPlotItem().vb.sigResized.connect(lambda _vb: self._fit_bars())
        self.data = RankData()
        self.bar_labels: list[pg.TextItem] = []
        self._bar_span = (0.0, 1.0)
        self.selected_rank: int | None = None
        self._unit = (1.0, "B")

    @property
    def ranks(self) -> list[int]:
        return self.data.ranks

    def set_checkpoint(self, ckpt: Checkpoint, balance: list, heat: tuple[list[int], np.ndarray]) -> None:
        per_rank = {b.rank: b for b in balance if b.rank >= 0}
        hr, mat = heat
        ranks = list(hr) if mat.size else sorted(per_rank)
        self.data = RankData(
            ranks, np.array([per_rank[r].bytes if r in per_rank else 0 for r in ranks], np.float64),
            np.array([per_rank[r].chunks if r in per_rank else 0 for r in ranks], np.int64),
            [t.fqn for t in ckpt.tensors], np.asarray(mat, np.float64))
        self.log_box.blockSignals(True)
        self.log_box.setChecked(self.data.dominated())
        self.log_box.blockSignals(False)
        # NOTE: a consolidated file (or an HF folder) records no writer ranks: no bars or heat map to draw
        ranked = bool(ckpt.ranks)
        for w in (self.bars, self.heat, self.log_box):
            w.setVisible(ranked)
        files = len(ckpt.data_files)
        hold = "holds" if files == 1 else "hold"
        self.note_text = WRITER_RANKS if ranked else (
            f"<b>No writer ranks recorded</b>: {count(files, 'file')}, listed below, {hold} every tensor whole "
            "(not sharded across ranks).")
        self.hover.setText(self.note_text)
        self._draw()
        self._fill_files(ckpt)

    def _draw(self) -> None:
        self._draw_bars()
        self._draw_heat()

    def _scaled(self, values: np.ndarray, floor: float) -> np.ndarray:
        """Bytes as drawn: in the chosen unit, or log2(bytes) (zeros at ``floor``); base 2 so that the
        log ticks read 1 KiB, 32 KiB, 1 MiB."""
        if self.log_box.isChecked():
            return np.where(values > 0, np.log2(np.maximum(values, 1)), floor)
        return values / self._unit[0]

    def _draw_bars(self) -> None:
        d = self.data
        self.bars.clear()
        n = len(d.ranks)
        fm = self.fontMetrics()
        self.bar_axis.set_categories(n, lambda i: str(d.ranks[i]),
                                     fm.horizontalAdvance(str(max(d.ranks, default=0))) + 14)
        if not n:
            return
        log = self.log_box.isChecked()
        self._unit = byte_unit(float(d.bytes.max()))
        floor = math.floor(math.log2(max(1.0, float(d.bytes[d.bytes > 0].min(initial=1))))) - 1 if log else 0.0
        heights = self._scaled(d.bytes, floor) - floor
        self.bars.addItem(pg.BarGraphItem(x=np.arange(n), height=heights, y0=floor, width=0.8 if n <= 64 else 1.0,
                                          brushes=[rank_color(r) for r in d.ranks], pen=None if n > 64 else "k"))
        top = float((heights + floor).max()) if n else 1.0
        span = max(top - floor, 1e-9)
        left = self.bars.getAxis("left")
        if log:
            left.setLabel("bytes (log)")
            left.tickStrings = lambda values, _s, _sp: [log2_bytes(v) for v in values]
        else:
            left.setLabel(f"{self._unit[1]} written")
            left.tickStrings = lambda values, s, sp: pg.AxisItem.tickStrings(left, values, s, sp)
        left.picture = None
        self.bar_labels = []
        if n <= LABELLED_BARS:
            color = QGuiApplication.palette().text().color()
            for i in range(n):
                t = pg.TextItem(f"{int(d.chunks[i]):,} ch", anchor=(0.5, 1), color=color)
                t.setPos(i, float(heights[i] + floor))
                self.bars.addItem(t)
                self.bar_labels.append(t)
        self._bar_span = (floor, span)
        self._fit_bars()
        self.bars.setXRange(-0.6, n - 0.4, padding=0)

    def _fit_bars(self) -> None:
        """Y range with room above the tallest bar for its chunk-count label, in pixels (never cut off);
        the labels say "241 ch", or "241", or nothing (then hover) as the bars' width allows."""
        floor, span = self._bar_span
        vb = self.bars.getPlotItem().vb
        plot_px = max(1.0, vb.height())
        label_px = self.fontMetrics().height() + 12 if self.bar_labels else 4
        frac = min(0.5, label_px / plot_px)
        self.bars.setYRange(floor, floor + span / (1 - frac), padding=0)
        bar_px = vb.width() / max(1, len(self.data.ranks) + 0.2)
        fm = self.fontMetrics()
        for chunks, label in zip(self.data.chunks, self.bar_labels):
            fits = [t for t in (f"{int(chunks):,} ch", f"{int(chunks):,}") if fm.horizontalAdvance(t) + 6 <= bar_px]
            label.setVisible(bool(fits))
            if fits:
                label.setText(fits[0])

    def _draw_heat(self) -> None:
        d = self.data
        if not d.heat.size:
            self.heat_image.clear()
            return
        rows, cols = d.heat.shape
        fm = self.fontMetrics()
        self.heat_x.set_categories(cols, lambda i: str(d.ranks[i]),
                                   fm.horizontalAdvance(str(max(d.ranks, default=0))) + 14)
        # NOTE: elided on the left: the end of a dotted name (layer number, weight) is what tells rows apart
        short = [fm.elidedText(name, Qt.TextElideMode.ElideLeft, fm.averageCharWidth() * NAME_CHARS)
                 for name in d.tensors]
        self.heat_y.set_categories(rows, lambda i: short[i], fm.lineSpacing() + 2)
        self.heat_y.setWidth(fm.averageCharWidth() * NAME_CHARS + 12)
        log = self.log_box.isChecked()
        nonzero = d.heat[d.heat > 0]
        floor = math.log2(float(nonzero.min())) - 1 if (log and nonzero.size) else 0.0
        img = self._scaled(d.heat, floor)
        self.heat_image.setImage(img.T, autoLevels=False)  # NOTE: ImageItem is column-major: x = rank
        self.heat_image.setRect(-0.5, -0.5, cols, rows)  # cell (row, col) centred on whole numbers
        lo, hi = (floor, float(img.max())) if log else (0.0, float(img.max()))
        self.heat_bar.setLevels((lo, hi if hi > lo else lo + 1))
        self.heat_bar.axis.setLabel("bytes (log)" if log else f"{self._unit[1]} written")
        self.heat.setXRange(-0.5, cols - 0.5, padding=0)
        self.heat.setYRange(-0.5, rows - 0.5, padding=0)

    def _colour_ticks(self, values, _scale, _spacing) -> list[str]:
        if self.log_box.isChecked():
            return [log2_bytes(v) for v in values]
        return [f"{v:g}" for v in values]

    def _fill_files(self, ckpt: Checkpoint) -> None:
        files = sorted(ckpt.data_files, key=lambda f: natural_key(f.name))
        self.files.setRowCount(len(files))
        for i, f in enumerate(files):
            for j, v in enumerate((f.name, "" if f.rank is None else str(f.rank),
                                   "MISSING" if f.bytes is None else human_bytes(f.bytes))):
                item = QTableWidgetItem(v)
                if j:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.files.setItem(i, j, item)
        self.files.resizeColumnsToContents()

    # ------------------------------------------------------------------ hover and click
    def bar_at(self, scene_pos) -> int | None:
        """The column (index into ``ranks``) under a scene position of the bar plot."""
        pos = self.bars.getPlotItem().vb.mapSceneToView(scene_pos)
        i = round(pos.x())
        return i if 0 <= i < len(self.data.ranks) and abs(pos.x() - i) <= 0.5 else None

    def cell_at(self, scene_pos) -> tuple[int, int] | None:
        """(tensor row, rank column) of the heat-map cell under a scene position."""
        pos = self.heat.getPlotItem().vb.mapSceneToView(scene_pos)
        row, col = round(pos.y()), round(pos.x())
        rows, cols = self.data.heat.shape if self.data.heat.size else (0, 0)
        return (row, col) if 0 <= row < rows and 0 <= col < cols else None

    def _show_hover(self, text: str, plot: pg.PlotWidget, scene_pos) -> None:
        self.hover.setText(text or self.note_text)
        if text:
            QToolTip.showText(plot.mapToGlobal(plot.mapFromScene(scene_pos)), text, plot)
        else:
            QToolTip.hideText()

    def _hover_bars(self, scene_pos) -> None:
        i = self.bar_at(scene_pos)
        self._show_hover("" if i is None else self.data.bar_text(i), self.bars, scene_pos)

    def _hover_heat(self, scene_pos) -> None:
        cell = self.cell_at(scene_pos)
        self._show_hover("" if cell is None else self.data.cell_text(*cell), self.heat, scene_pos)

    def _clicked(self, event: Any) -> None:
        i = self.bar_at(event.scenePos())
        if i is not None:
            rank = self.data.ranks[i]
            self.select_rank(None if rank == self.selected_rank else rank)

    def select_rank(self, rank: int | None) -> None:
        self.selected_rank = rank
        self.rankClicked.emit(rank)
