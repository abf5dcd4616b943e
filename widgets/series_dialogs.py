"""Two dialogs over a Library's selection, each computing in the background (cancellable) through the backend:
Bisect (the first step two runs part, :func:`backend.compare.bisect.run_bisect`; a differing tensor compared
there in the Compare view) and Average (the mean, weighted mean or EMA of checkpoints' model weights written and
verified, :func:`backend.compare.averaging.average_checkpoints`)."""

from __future__ import annotations

import os
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from ..backend.compare.averaging import average_checkpoints
from ..backend.compare.bisect import BisectResult, run_bisect
from ..backend.export.destination import export_suffix
from ..backend.export.registry import WRITERS
from ..backend.text import escape_name
from .workers import Worker, run_in_background

TABLE_ROWS = 500  # differing entries listed (most changed first)


class _BackgroundDialog(QDialog):
    """A dialog whose work runs in the background, with a progress bar and a Cancel that stops it."""

    def __init__(self, parent: QWidget | None) -> None:
        super().__init__(parent)
        self.worker: Worker | None = None
        self.status = QLabel("")
        self.status.setTextFormat(Qt.TextFormat.PlainText)  # names from files: never markup
        self.status.setWordWrap(True)
        self.bar = QProgressBar()
        self.bar.setVisible(False)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.cancel)

    def start(self, func: Any, *args: Any, on_result: Any, **kwargs: Any) -> None:
        self.bar.setVisible(True)
        self.bar.setRange(0, 0)
        self.cancel_button.setEnabled(True)
        self.worker = run_in_background(func, *args, owner=self, on_result=on_result, on_error=self._failed,
                                        on_progress=self._progress, on_cancelled=self._cancelled,
                                        on_finished=self._finished, **kwargs)

    def cancel(self) -> None:
        if self.worker is not None:
            self.worker.quit()

    def _progress(self, done: int, total: int, message: str) -> None:
        self.bar.setRange(0, max(total, 1))
        self.bar.setValue(done)
        self.status.setText(escape_name(message))

    def _failed(self, message: Any) -> None:
        self.status.setText(f"failed: {message}")

    def _cancelled(self) -> None:
        self.status.setText("cancelled")

    def _finished(self) -> None:
        self.worker = None
        self.bar.setVisible(False)
        self.cancel_button.setEnabled(False)

    def done(self, result: int) -> None:  # closed: the work is asked to stop
        self.cancel()
        super().done(result)


class BisectDialog(_BackgroundDialog):
    """Bisect two runs; ``compareRequested(A's checkpoint, B's checkpoint, fqn)`` for a differing entry chosen."""

    compareRequested = Signal(str, str, str)

    def __init__(self, run_a: str, run_b: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Bisect: the first step two runs part")
        self.result: BisectResult | None = None
        self.table = QTableWidget(0, 3)
        self.table.setHorizontalHeaderLabels(["entry", "kind", "rel L2"])
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.cellDoubleClicked.connect(lambda row, _col: self.compare_row(row))
        self.compare_button = QPushButton("Compare at this step")
        self.compare_button.setEnabled(False)
        self.compare_button.clicked.connect(lambda: self.compare_row(self.table.currentRow()))
        buttons = QHBoxLayout()
        buttons.addWidget(self.bar, 1)
        buttons.addWidget(self.cancel_button)
        buttons.addWidget(self.compare_button)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel(f"A: {escape_name(run_a)}\nB: {escape_name(run_b)}"))
        layout.addWidget(self.status)
        layout.addWidget(self.table, 1)
        layout.addLayout(buttons)
        self.resize(760, 420)
        self.status.setText("comparing…")
        self.start(run_bisect, run_a, run_b, on_result=self.show_result)

    def show_result(self, result: BisectResult) -> None:
        self.result = result
        steps = f"{len(result.steps)} steps in both; compared {', '.join(map(str, result.compared))}"
        digests = f"; {result.by_digest} tensor pairs equal by their sealed digests" if result.by_digest else ""
        if result.first_step is None:
            self.status.setText(f"No difference at any step compared ({steps}{digests}).")
            return
        self.status.setText(f"First step that differs: {result.first_step} ({result.parted_first} parted "
                            f"first; {steps}{digests}).")
        rows = [(c.fqn, c.kind, f"{c.rel_l2:.3g}" if c.rel_l2 is not None else c.detail) for c in result.changes]
        rows += [(n, "only in A", "") for n in result.only_a] + [(n, "only in B", "") for n in result.only_b]
        self.table.setRowCount(min(len(rows), TABLE_ROWS))
        for r, row in enumerate(rows[:TABLE_ROWS]):
            for c, text in enumerate(row):
                self.table.setItem(r, c, QTableWidgetItem(escape_name(text)))
        self.table.resizeColumnToContents(0)
        self.table.setCurrentCell(0, 0)
        self.compare_button.setEnabled(bool(result.changes))

    def compare_row(self, row: int) -> None:
        """Ask to compare the two checkpoints of the first differing step, that row's entry selected."""
        if self.result is None or self.result.paths is None or not 0 <= row < len(self.result.changes):
            return
        self.compareRequested.emit(*self.result.paths, self.result.changes[row].fqn)


# the output's name suffix per format, as the export registry names it (a DCP checkpoint is a folder: none)
FORMATS = {name: export_suffix(WRITERS[name]) for name in ("safetensors", "torch", "dcp")}


class AverageDialog(_BackgroundDialog):
    """Average the checkpoints given (the mean, weighted mean or EMA) into an output chosen here."""

    def __init__(self, paths: list[str], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(f"Average {len(paths)} checkpoints")
        self.paths = list(paths)
        self.result: Any = None
        inputs = QListWidget()
        inputs.addItems([escape_name(p) for p in self.paths])
        inputs.setMaximumHeight(80)
        self.method = QComboBox()
        self.method.addItems(["mean", "weighted", "EMA (in step order)"])
        self.weights = QLineEdit(",".join("1" for _ in paths))
        self.beta = QDoubleSpinBox()
        self.beta.setRange(0.0, 0.9999)
        self.beta.setDecimals(4)
        self.beta.setValue(0.9)
        self.format = QComboBox()
        self.format.addItems(list(FORMATS))
        self.dst = QLineEdit(os.path.join(os.path.dirname(self.paths[0].rstrip("/")), "average.safetensors"))
        browse = QPushButton("…")
        browse.clicked.connect(self._browse)
        where = QHBoxLayout()
        where.addWidget(self.dst, 1)
        where.addWidget(browse)
        form = QFormLayout()
        form.addRow("Checkpoints", inputs)
        form.addRow("Method", self.method)
        form.addRow("Weights", self.weights)
        form.addRow("EMA beta", self.beta)
        form.addRow("Format", self.format)
        form.addRow("Output", where)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        self.run_button = self.buttons.addButton("Average", QDialogButtonBox.ButtonRole.ActionRole)
        self.run_button.clicked.connect(self.run)
        self.buttons.rejected.connect(self.reject)
        self.buttons.addButton(self.cancel_button, QDialogButtonBox.ButtonRole.ActionRole)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.status, 1)
        layout.addWidget(self.bar)
        layout.addWidget(self.buttons)
        self.method.currentIndexChanged.connect(self._method_changed)
        self.format.currentTextChanged.connect(self._format_changed)
        self._method_changed()
        self.resize(720, 460)

    def _method_changed(self) -> None:
        self.weights.setEnabled(self.method.currentIndex() == 1)
        self.beta.setEnabled(self.method.currentIndex() == 2)

    def _format_changed(self, fmt: str) -> None:
        """The output's name follows the format's suffix (a DCP checkpoint is a folder)."""
        stem = self.dst.text()
        for suffix in FORMATS.values():
            if suffix and stem.endswith(suffix):
                stem = stem[:-len(suffix)]
        self.dst.setText(stem + FORMATS[fmt])

    def _browse(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Average into", self.dst.text())
        if path:
            self.dst.setText(path)

    def run(self) -> None:
        """Average in the background with the choices made; the result (or why not) in the status line."""
        weights = None
        if self.method.currentIndex() == 1:
            try:
                weights = [float(w) for w in self.weights.text().split(",")]
            except ValueError:
                self.status.setText("Weights: give numbers separated by commas, e.g. 1,2,1.")
                return
        ema = self.beta.value() if self.method.currentIndex() == 2 else None
        self.run_button.setEnabled(False)
        self.status.setText("averaging…")
        self.start(average_checkpoints, self.paths, self.dst.text(), self.format.currentText(), weights, ema,
                   on_result=self._written)

    def _written(self, out: Any) -> None:
        recipe, self.result = out
        shares = ", ".join(f"{w:.4g}" for w in recipe.effective())
        self.status.setText(f"{recipe.method} (weights {shares}): {self.result.summary()}")

    def _finished(self) -> None:
        super()._finished()
        self.run_button.setEnabled(True)


__all__ = ["AverageDialog", "BisectDialog"]
