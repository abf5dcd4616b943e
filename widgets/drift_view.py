"""The Drift view: a run's tensors x steps heat map of relative change since the previous checkpoint (log colour
scale, its legend beside it), the first non-finite value marked, modules collapsible (rows grouped by the
first parts of their names, each cell the largest change in the module), a click on a cell asking to compare
that tensor between the two checkpoints. The drift is computed off the GUI thread (backend.compare.drift)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QSpinBox, QVBoxLayout, QWidget

from ..backend.compare.drift import DriftResult, module_rows, run_drift
from .plot_style import CategoryAxis, themed_plot
from .workers import Worker, run_in_background

FLOOR = 1e-12  # relative changes below this (and exact zeros) are drawn at it


class DriftView(QWidget):
    """Heat map of a :class:`DriftResult`. ``compareRequested(path_before, path_after, fqn)``: a cell was
    clicked (the Compare view opens that tensor between the two checkpoints)."""

    compareRequested = Signal(str, str, str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.result: DriftResult | None = None
        self.worker: Worker | None = None  # the drift being computed
        self.rows: list[list[int]] = []
        self.labels: list[str] = []
        self.status = QLabel("")
        self.depth = QSpinBox()
        self.depth.setRange(0, 8)
        self.depth.setPrefix("modules: depth ")
        self.depth.setSpecialValueText("every tensor")
        self.depth.setToolTip("Collapse tensors into modules by the first parts of their names (0: every tensor)")
        self.depth.valueChanged.connect(self._draw)
        self.x_axis = CategoryAxis("bottom")
        self.y_axis = CategoryAxis("left")
        self.plot = themed_plot(bottom=self.x_axis, left=self.y_axis)
        self.plot.setLabel("bottom", "step")
        self.plot.getPlotItem().invertY(True)  # first tensor at the top
        self.image = pg.ImageItem()
        self.plot.addItem(self.image)
        self.bar = pg.ColorBarItem(colorMap=pg.colormap.get("viridis"), interactive=False, width=14,
                                   label="relative change (log10)")
        self.bar.setImageItem(self.image, insert_in=self.plot.getPlotItem())
        self.bar.axis.tickStrings = lambda values, scale, spacing: [f"1e{v:g}" for v in values]
        self.marker = pg.ScatterPlotItem(symbol="s", size=14, pen=pg.mkPen("r", width=2), brush=None)
        self.plot.addItem(self.marker)
        self.plot.scene().sigMouseMoved.connect(self._hover)
        self.plot.scene().sigMouseClicked.connect(self._clicked)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setToolTip("Stop reading the checkpoints (after the tensor being read)")
        self.cancel_button.setVisible(False)
        self.cancel_button.clicked.connect(self.cancel)
        top = QHBoxLayout()
        top.addWidget(self.status, 1)
        top.addWidget(self.cancel_button)
        top.addWidget(self.depth)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.plot, 1)

    def load(self, paths: list[str]) -> None:
        """Compute the drift of a run (or checkpoints) in the background, then draw it."""
        self.cancel()
        self.status.setText("reading the checkpoints…")
        self.cancel_button.setVisible(True)
        self.worker = run_in_background(run_drift, list(paths), owner=self, on_result=self.show_result,
                                        on_error=self._failed, on_progress=self._progress,
                                        on_cancelled=self._cancelled, on_finished=self._finished)

    def cancel(self) -> None:
        """Ask the drift being computed to stop (at its next tensor); the view stays usable."""
        if self.worker is not None:
            self.worker.quit()

    def _cancelled(self) -> None:
        self.status.setText("cancelled: nothing drawn (\"Drift of the run…\" in the Library reads it again)")

    def _finished(self) -> None:
        self.worker = None
        self.cancel_button.setVisible(False)

    def _progress(self, done: int, total: int, message: str) -> None:
        self.status.setText(f"reading the checkpoints… {done}/{total}")

    def _failed(self, message: Any) -> None:
        self.status.setText(f"drift failed: {message}")

    def show_result(self, result: DriftResult) -> None:
        """Draw a computed drift (the steps across, the tensors or modules down)."""
        self.result = result
        self._draw()

    def _cells(self) -> np.ndarray:
        """log10 of the relative change, rows x steps (NaN where there is none), grouped by module."""
        assert self.result is not None
        names = list(self.result.tensors)
        self.labels, self.rows = module_rows(names, self.depth.value())
        raw = np.array([[np.nan if v is None else v for v in self.result.tensors[n].rel_change] for n in names],
                       dtype=np.float64).reshape(len(names), len(self.result.steps))
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a module with no change at a step: NaN
            grouped = np.array([np.nanmax(raw[r], axis=0) if len(r) > 1 else raw[r[0]] for r in self.rows])
            return np.log10(np.maximum(grouped, FLOOR))

    def _draw(self) -> None:
        if self.result is None:
            return
        cells = self._cells().reshape(len(self.rows), len(self.result.steps))
        finite = cells[np.isfinite(cells)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (-6.0, 0.0)
        hi = hi if hi > lo else lo + 1.0
        self.image.setImage(cells.T, autoLevels=False)  # NOTE: ImageItem is column-major: x = step
        self.bar.setLevels((lo, hi))
        steps, labels = self.result.steps, self.labels
        fm = self.fontMetrics()
        self.x_axis.set_categories(len(steps), lambda i: str(steps[i]) if 0 <= i < len(steps) else "",
                                   fm.horizontalAdvance("0000000") + 8)
        self.y_axis.set_categories(len(labels), lambda i: _short(labels[i]) if 0 <= i < len(labels) else "",
                                   fm.height() + 2)
        self.y_axis.setWidth(min(320, max(fm.horizontalAdvance(_short(n)) for n in labels) + 12) if labels else 40)
        self.image.setRect(-0.5, -0.5, len(steps), len(labels))
        self.plot.setRange(xRange=(-0.5, len(steps) - 0.5), yRange=(-0.5, len(labels) - 0.5), padding=0)
        self.marker.setData([], [])
        first = self.result.first_nonfinite
        text = f"{len(self.result.tensors)} tensors, {len(steps)} checkpoints"
        if first is not None:
            at = list(self.result.tensors).index(first[1])
            row = next(r for r, idx in enumerate(self.rows) if at in idx)
            self.marker.setData([steps.index(first[0])], [row])
            text += f"; first non-finite value: step {first[0]}, {first[1]} (marked)"
        self.status.setText(text)

    def _cell_at(self, pos: Any) -> tuple[int, int] | None:
        if self.result is None or not self.plot.sceneBoundingRect().contains(pos):
            return None
        p = self.plot.getPlotItem().vb.mapSceneToView(pos)
        col, row = round(p.x()), round(p.y())
        if 0 <= col < len(self.result.steps) and 0 <= row < len(self.rows):
            return row, col
        return None

    def _hover(self, pos: Any) -> None:
        cell = self._cell_at(pos)
        if cell is None or self.result is None:
            self.plot.setToolTip("")
            return
        row, col = cell
        fqn = list(self.result.tensors)[self.rows[row][0]]
        d = self.result.tensors[fqn]
        v = d.rel_change[col]
        change = "-" if v is None else f"{v:.4g}"
        self.plot.setToolTip(f"{self.labels[row]}\nstep {self.result.steps[col]}: relative change {change}, "
                             f"norm {d.norm[col] if d.norm[col] is not None else '-'}, "
                             f"non-finite {d.nonfinite[col] if d.nonfinite[col] is not None else '-'}")

    def _clicked(self, event: Any) -> None:
        cell = self._cell_at(event.scenePos())
        if cell is None or self.result is None or cell[1] == 0 or len(self.rows[cell[0]]) != 1:
            return
        row, col = cell
        fqn = list(self.result.tensors)[self.rows[row][0]]
        self.compareRequested.emit(self.result.paths[col - 1], self.result.paths[col], fqn)


def _short(name: str, limit: int = 48) -> str:
    """A row label no wider than ``limit`` characters: the end of the name, which tells tensors apart."""
    return name if len(name) <= limit else "…" + name[-(limit - 1):]

