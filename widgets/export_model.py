"""The Export dialog's Hugging Face model parts: the architecture the weights' names say (recognised once, in a
worker), the plan's architecture and transforms in words, and the field that picks the model's config.json."""

from __future__ import annotations

import html
from typing import Any

from PySide6.QtWidgets import QFileDialog, QHBoxLayout, QLabel, QLineEdit, QPushButton, QWidget

from ..backend.checkpoint.model import Checkpoint
from ..backend.export.hf_model import describe_architecture
from ..backend.export.layouts import model_keys
from .workers import Worker, run_in_background


def model_architecture(ckpt: Checkpoint, progress: Any = None) -> str:
    """The architecture the weights' names say (a worker function: it reads every tensor's name), in the dialog's
    words (no command-line flag)."""
    found = describe_architecture(model_keys(ckpt), export="the export")
    return f"Recognised: {found}" if found else ("The weights' names are in no scheme the Hugging Face export knows "
                                                 "(torchtitan, Megatron-Core, Hugging Face names).")


def model_summary(model: dict) -> str:
    """A Hugging Face model plan's architecture and the transforms it applies (``ExportPlan.model``), rich text."""
    steps = "".join(f"<br>&nbsp;&nbsp;• {html.escape(t)}" for t in model.get("applied") or ["none: names only"])
    return (f"<br>architecture: <b>{html.escape(model['architecture'])}</b> (model_type "
            f"{html.escape(model['model_type'])})<br>transforms:{steps}")


class ArchitectureLine(QLabel):
    """The recognised architecture, shown while a Hugging Face model is the chosen output."""

    def __init__(self, ckpt: Checkpoint) -> None:
        super().__init__("")
        self.ckpt = ckpt
        self.setWordWrap(True)
        self.hide()
        self._worker: Worker | None = None

    def show_for(self, model: bool) -> None:
        self.setVisible(model)
        if model and self._worker is None:  # recognised once, never on the GUI thread
            self.setText("Recognising the architecture …")
            self._worker = run_in_background(model_architecture, self.ckpt, owner=self, on_result=self.setText,
                                             on_error=self.setText)


class ConfigField(QWidget):
    """A config.json path typed or chosen (one widget: enabled and locked with its Browse button)."""

    def __init__(self) -> None:
        super().__init__()
        box = QHBoxLayout(self)
        box.setContentsMargins(0, 0, 0, 0)
        self.edit = QLineEdit()
        self.edit.setPlaceholderText("the model's HF config.json, if the checkpoint records none")
        self.edit.setToolTip("A Hugging Face model: its config (head counts, rotary base, norm epsilon are not in "
                             "the weights). Sharded safetensors: copied beside, so from_pretrained loads the folder.")
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        box.addWidget(self.edit, 1)
        box.addWidget(browse)

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "The model's Hugging Face config", self.edit.text(),
                                              "HF config (*.json)")
        if path:
            self.edit.setText(path)
