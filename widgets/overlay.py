"""Progress that floats over a view instead of taking a row in its layout, so nothing under the
pointer moves when a background job starts or ends."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QProgressBar, QPushButton, QWidget


class ProgressOverlay(QFrame):
    """A small bar pinned over the bottom edge of another widget: message, progress, Cancel."""

    cancelRequested = Signal()

    def __init__(self, parent: QWidget) -> None:
        super().__init__(parent)
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setAutoFillBackground(True)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(6, 3, 6, 3)
        self.label = QLabel("")
        self.bar = QProgressBar()
        self.bar.setTextVisible(False)
        self.bar.setMaximumHeight(self.fontMetrics().height())
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancelRequested)
        layout.addWidget(self.label)
        layout.addWidget(self.bar, 1)
        layout.addWidget(self.cancel_button)
        self.setAttribute(Qt.WidgetAttribute.WA_TransparentForMouseEvents, False)
        self.hide()

    def start(self, message: str, cancellable: bool) -> None:
        self.label.setText(message)
        self.bar.setRange(0, 0)
        self.cancel_button.setVisible(cancellable)
        self.show()
        self.raise_()

    def set_progress(self, done: int, total: int, message: str) -> None:
        # NOTE: totals can pass 2**31 (bytes); the bar works in permille so its int stays small
        self.bar.setRange(0, 1000 if total > 0 else 0)
        if total > 0:
            self.bar.setValue(int(1000 * min(done, total) / total))
        if message:
            self.label.setText(message[-60:])

    def finish(self) -> None:
        self.hide()

    def place(self, left: int, bottom: int, width: int) -> None:
        """Pin the overlay's bottom edge at ``bottom`` (parent coordinates), ``width`` wide."""
        h = self.sizeHint().height()
        self.setGeometry(left, bottom - h, width, h)

