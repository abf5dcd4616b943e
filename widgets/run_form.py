"""The "New run" form: what to train, where (this machine or SLURM), checked before anything starts,
with what is wrong said next to the field."""

from __future__ import annotations

import shlex

from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from ..backend.errors import ShardscopeError
from ..backend.runs import slurm
from ..backend.runs.launcher import SCRIPT_CONTRACT, RunConfig
from ..backend.runs.slurm import Partition, SlurmOptions
from ..backend.text import count

LOCAL, SLURM = "this machine", "SLURM"


def slurm_partitions(progress=None) -> list | str:
    """Partitions from sinfo, or why SLURM cannot be used here (runs on the pool)."""
    if not slurm.available():
        return "sbatch/sinfo are not on PATH on this machine"
    try:
        return slurm.partitions()
    except ShardscopeError as exc:
        return str(exc)


def _spin(lo: int, hi: int, value: int, suffix: str = "") -> QSpinBox:
    w = QSpinBox()
    w.setRange(lo, hi)
    w.setValue(value)
    if suffix:
        w.setSuffix(suffix)
    return w


class RunForm(QGroupBox):
    """Fields for a :class:`RunConfig`; ``errors`` maps a config field to the label under its widget."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("New run", parent)
        self.form = QFormLayout(self)
        self.errors: dict[str, QLabel] = {}
        self.on = QComboBox()
        self.on.addItems([LOCAL, SLURM])
        self.on_note = QLabel("Looking for SLURM (sinfo) …")
        self.on_note.setWordWrap(True)
        self.strategy = QComboBox()
        self.strategy.addItems(["fsdp", "ddp"])
        self.nproc = _spin(1, 64, 2)
        self.device = QComboBox()
        self.device.addItems(["auto", "cpu", "cuda"])
        # NOTE: the range starts at 0 so that 0 can be typed and refused with a message; a spin box whose
        # minimum is 1 silently puts the old value back, which is how "Steps = 0" used to start 200 steps
        self.steps = _spin(0, 10_000_000, 200)
        self.ckpt_every = _spin(0, 1_000_000, 50)
        self.width_ = _spin(8, 8192, 64)
        self.depth = _spin(1, 256, 2)
        self.heads = _spin(1, 128, 4)
        self.batch = _spin(1, 4096, 8)
        self.lr = QDoubleSpinBox()
        self.lr.setDecimals(5)
        self.lr.setRange(1e-6, 1.0)
        self.lr.setValue(3e-3)
        self.script = QLineEdit()
        self.script.setPlaceholderText("optional: your own script (uses the same launcher)")
        self.script.setToolTip(SCRIPT_CONTRACT)
        self.script_args = QLineEdit()
        self.script_args.setPlaceholderText("arguments for the script")
        self.nodes = _spin(1, 4096, 1)
        self.partition = QComboBox()
        self.gpus = _spin(0, 64, 0)
        self.gpus.setSpecialValueText("none")
        self.time_limit = QLineEdit()
        self.time_limit.setPlaceholderText("partition default, e.g. 2:00:00")
        self.stall = _spin(5, 86400, 60, " s")
        self.stall.setToolTip("Flag a rank as stalled when it reports no new step for this long (recorded in the "
                              "run's config.json: following the run later uses its own value)")
        self.slurm_rows: list[QWidget] = []
        for label, field, w in (("Run on", "on", self.on), ("", None, self.on_note), ("Nodes", None, self.nodes),
                                ("Partition", None, self.partition), ("GPUs / node", None, self.gpus),
                                ("Time limit", None, self.time_limit), ("Strategy", "strategy", self.strategy),
                                ("Processes", "nproc", self.nproc), ("Device", None, self.device),
                                ("Steps", "steps", self.steps),
                                ("Checkpoint every", "checkpoint_every", self.ckpt_every),
                                ("Width", None, self.width_), ("Depth", None, self.depth), ("Heads", None, self.heads),
                                ("Batch / rank", None, self.batch), ("Learning rate", None, self.lr),
                                ("Script", "script", self.script), ("Script args", None, self.script_args),
                                ("Resume from", "resume", None), ("Stalled after", None, self.stall)):
            self._add_row(label, field, w)
        self.slurm_rows = [self.nodes, self.partition, self.gpus, self.time_limit]
        buttons = QHBoxLayout()
        self.start_button = QPushButton("Start")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        buttons.addWidget(self.start_button)
        buttons.addWidget(self.stop_button)
        self.form.addRow(buttons)
        self.on.currentTextChanged.connect(lambda _t: self._on_changed())
        self.script.textChanged.connect(lambda _t: self._on_changed())
        self._on_changed()

    def _add_row(self, label: str, field: str | None, w: QWidget | None) -> None:
        box = QWidget()
        v = QVBoxLayout(box)
        v.setContentsMargins(0, 0, 0, 0)
        v.setSpacing(1)
        if w is not None:
            v.addWidget(w)
        if field:
            err = QLabel()
            err.setWordWrap(True)
            err.setStyleSheet("color: #d62728")
            err.hide()
            v.addWidget(err)
            self.errors[field] = err
            if w is not None:  # an edit answers the message: it goes until the next Start checks again
                changed = w.textChanged if isinstance(w, QLineEdit) else \
                    w.currentTextChanged if isinstance(w, QComboBox) else w.valueChanged
                changed.connect(lambda *_a, err=err: err.hide())
        self.form.addRow(label, box)
        if w is None:
            self.form.setRowVisible(box, False)
            self._resume_row = box

    def _on_changed(self) -> None:
        slurm = self.on.currentText() == SLURM
        for w in self.slurm_rows:
            self.form.setRowVisible(w.parentWidget(), slurm)
        builtin = not self.script.text().strip()
        for w in (self.strategy, self.steps, self.ckpt_every, self.width_, self.depth, self.heads, self.batch,
                  self.lr):
            w.setEnabled(builtin)
        self.script_args.setEnabled(not builtin)

    def set_slurm(self, parts: list[Partition] | None, why: str = "") -> None:
        """Partitions from sinfo, or None with the reason SLURM cannot be used here."""
        item = self.on.model().item(1)
        if parts is None:
            item.setEnabled(False)
            item.setToolTip(why)
            self.on.setCurrentIndex(0)
            self.on_note.setText("SLURM: not available here (hover for why)")
            self.on_note.setToolTip(why)
            return
        item.setEnabled(True)
        self.partition.clear()
        for p in parts:
            self.partition.addItem(f"{p.name}{' (default)' if p.default else ''} — {count(p.nodes, 'node')}", p.name)
        self.on_note.setText(f"SLURM: {count(len(parts), 'partition')}")

    def config(self) -> RunConfig:
        """The run this form describes (paths as typed; see RunConfig.resolved)."""
        model = {"width": self.width_.value(), "depth": self.depth.value(), "heads": self.heads.value(),
                 "batch_size": self.batch.value(), "lr": self.lr.value()}
        script = self.script.text().strip() or None
        on = "slurm" if self.on.currentText() == SLURM else "local"
        opts = SlurmOptions(nodes=self.nodes.value(), gpus_per_node=self.gpus.value() or None,
                            partition=self.partition.currentData() or None,
                            time=self.time_limit.text().strip() or None) if on == "slurm" else None
        return RunConfig(strategy=self.strategy.currentText(), nproc=self.nproc.value(), steps=self.steps.value(),
                         checkpoint_every=self.ckpt_every.value(),
                         device=None if self.device.currentText() == "auto" else self.device.currentText(),
                         script=script, script_args=shlex.split(self.script_args.text()) if script else [],
                         model={} if script else model, on=on, slurm=opts, stall_seconds=float(self.stall.value()))

    def show_config(self, config: RunConfig) -> None:
        """Show the run ``config`` describes (the demo's 30 steps, not the form's 200, while the demo runs)."""
        self.strategy.setCurrentText(config.strategy)
        self.nproc.setValue(config.nproc)
        self.steps.setValue(config.steps)
        self.ckpt_every.setValue(config.checkpoint_every)
        self.device.setCurrentText(config.device or "auto")
        for field, name in ((self.width_, "width"), (self.depth, "depth"), (self.heads, "heads"),
                            (self.batch, "batch_size"), (self.lr, "lr")):
            if name in config.model:
                field.setValue(config.model[name])

    def show_problems(self, problems: dict[str, str]) -> None:
        """Say what is wrong next to each field (and hide old messages)."""
        for field, label in self.errors.items():
            text = problems.get(field, "")
            label.setText(text)
            label.setVisible(bool(text))
            if field == "resume":
                self.form.setRowVisible(self._resume_row, bool(text))

