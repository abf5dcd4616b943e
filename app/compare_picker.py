"""View › Compare… with nothing selected in the Library: two pickers (A and B), each an editable list of
checkpoints with a Browse… button."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QPushButton,
    QWidget,
)


class ComparePicker(QDialog):
    """Pick A and B among ``paths`` (``defaults``: the two shown first); OK calls ``compare(a, b)``."""

    def __init__(self, paths: list[str], defaults: list[str], compare: Callable[[str, str], object],
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Compare two checkpoints")
        form = QFormLayout(self)
        self.boxes: list[QComboBox] = []
        for label, default in zip("AB", defaults, strict=True):
            box = QComboBox()
            box.setEditable(True)
            box.addItems(paths)
            box.setCurrentText(default)
            box.setMinimumWidth(480)
            browse = QPushButton("Browse…")
            browse.clicked.connect(lambda _c=False, b=box: self._browse_into(b))
            row = QHBoxLayout()
            row.addWidget(box, 1)
            row.addWidget(browse)
            form.addRow(label, row)
            self.boxes.append(box)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)
        boxes = self.boxes
        # NOTE: OK with A or B empty closed the picker and compared nothing, without a word: it waits for both
        self.ok_button = buttons.button(QDialogButtonBox.StandardButton.Ok)
        self.ok_button.setToolTip("Compare A with B (both must name a checkpoint)")
        for box in boxes:
            box.currentTextChanged.connect(lambda _t: self._update_ok())
        self._update_ok()

        def accepted() -> None:
            if boxes[0].currentText() and boxes[1].currentText():
                compare(boxes[0].currentText(), boxes[1].currentText())

        self.accepted.connect(accepted)

    def _update_ok(self) -> None:
        self.ok_button.setEnabled(all(box.currentText().strip() for box in self.boxes))

    def showEvent(self, event) -> None:
        """A arrives with the focus and its text selected: typing replaces the proposal (it used to append to
        it, making ``…/step_000030/tmp/nu/bigrun/…``)."""
        super().showEvent(event)
        self.boxes[0].setFocus()
        self.boxes[0].lineEdit().selectAll()

    def _browse_into(self, box: QComboBox) -> None:
        # the file dialogs open over the window (this picker's parent)
        window = self.parentWidget()
        path, _ = QFileDialog.getOpenFileName(window, "A consolidated file (or cancel to pick a folder)", "",
                                              "Checkpoints (*.pt *.pth *.bin *.safetensors);;All files (*)")
        if not path:
            path = QFileDialog.getExistingDirectory(window, "A checkpoint folder")
        if path:
            box.setCurrentText(path)
