"""The Training panel's Checkpoints tab: the followed run's checkpoints as they are written, to open (double-click
or Enter), to resume from, or two to compare."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QListWidget, QListWidgetItem, QPushButton, QVBoxLayout, QWidget


class RunCheckpoints(QWidget):
    """The list (a checkpoint's path in its ``UserRole``) and the Resume and Compare buttons; the panel decides
    what the buttons do and when they are enabled."""

    opened = Signal(str)  # a checkpoint's path, activated in the list

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        cl = QVBoxLayout(self)
        self.list = QListWidget()
        # NOTE: itemActivated (double-click or Enter), not itemDoubleClicked: the keyboard opens a checkpoint too
        self.list.itemActivated.connect(lambda it: self.opened.emit(it.data(Qt.ItemDataRole.UserRole)))
        cl.addWidget(QLabel("Double-click a checkpoint (or press Enter) to open it in the browser."))
        cl.addWidget(self.list, 1)
        self.list.setSelectionMode(QListWidget.SelectionMode.ExtendedSelection)
        row = QHBoxLayout()
        self.resume_button = QPushButton("Resume from selected")
        self.resume_button.setToolTip("Resume this run from the selected checkpoint (once the run has ended)")
        self.resume_button.setEnabled(False)
        self.compare_button = QPushButton("Compare two selected")
        self.compare_button.setToolTip("Compare the two selected checkpoints (Ctrl+click to select two)")
        self.compare_button.setEnabled(False)
        row.addWidget(self.resume_button)
        row.addWidget(self.compare_button)
        cl.addLayout(row)

    def add(self, paths: list[Path], run_dir: Path) -> None:
        """List the checkpoints not listed yet, by their path under ``run_dir`` (else by name)."""
        names = [self.list.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.list.count())]
        for p in paths:
            if str(p) not in names:
                item = QListWidgetItem(str(p.relative_to(run_dir)) if p.is_relative_to(run_dir) else p.name)
                item.setData(Qt.ItemDataRole.UserRole, str(p))
                self.list.addItem(item)
