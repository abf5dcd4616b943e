"""Watch plan…: what ``shardscope watch`` would do now under the selected runs (or the Library's roots) with an
export format and keep rules, and what a watch did (its record of exports, verifications and removals), per
checkpoint. The plan is the backend's :func:`plan_watch`, the decisions a pass takes, computed in a worker;
nothing is written."""

from __future__ import annotations

import os
import shlex
import time
from typing import Any

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, Qt, QTimer
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
)

from ..backend.export import export_formats
from ..backend.library.prune import Decision, Rules
from ..backend.library.watch import (
    BLOCKED,
    EXPORT,
    RECOVERED,
    VERIFIED,
    WAITING,
    ExportStep,
    WatchPlan,
    plan_watch,
    rules_text,
)
from ..backend.text import count
from .export_model import ConfigField
from .form_wheel import wheel_only_when_focused
from .prune_dialog import plan_table, rule_check, rule_spin
from .rows_table import RowsTableModel
from .workers import Rerun, run_in_background

EXPORT_WORDS = {EXPORT: "will export", VERIFIED: "exported", RECOVERED: "exported (to record)", WAITING: "waiting",
                BLOCKED: "fails: name taken"}


def _when(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if isinstance(t, int | float) and t > 0 else "?"


def did_text(record: dict[str, Any] | None) -> str:
    """What a watch's record says it did with a checkpoint, in a few words."""
    if not record:
        return ""
    if record.get("state") == "done":
        out = f"exported {_when(record.get('time'))}, verified"
    else:
        out = f"export started {_when(record.get('time'))}, not finished"
    if "removed" in record:
        out += f"; removed {_when(record['removed'])}"
    return out


class WatchRow:
    """One row: a checkpoint's export decision and keep/remove (``step``), or a checkpoint a watch removed."""

    __slots__ = ("decision", "path", "record", "run", "step")

    def __init__(self, run: str, path: str, step: ExportStep | None, decision: Decision | None,
                 record: dict[str, Any] | None) -> None:
        self.run, self.path, self.step, self.decision, self.record = run, path, step, decision, record


def rows_of(plan: WatchPlan) -> list[WatchRow]:
    """The table's rows: each run's resumable checkpoints, then those its watch removed earlier."""
    out = []
    for rp in plan.runs:
        decided = {d.checkpoint.path: d for d in rp.decisions}
        out += [WatchRow(rp.run.path, s.checkpoint.path, s, decided.get(s.checkpoint.path), s.record)
                for s in rp.exports]
        out += [WatchRow(rp.run.path, path, None, None, entry) for path, entry in sorted(rp.removed.items())]
    return out


class WatchPlanModel(RowsTableModel):
    """The plan, one row per checkpoint (an adapter over the plan's export steps and decisions)."""

    HEADERS = ("run", "checkpoint", "step", "export", "export to", "then", "why", "done by a watch")

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.rows: list[WatchRow] = []

    def set_plan(self, plan: WatchPlan | None) -> None:
        self.beginResetModel()
        self.rows = rows_of(plan) if plan is not None else []
        self.endResetModel()

    def rows_list(self) -> list:
        return self.rows

    def _cells(self, r: WatchRow) -> tuple[str, ...]:
        s, d = r.step, r.decision
        c = s.checkpoint if s is not None else None
        step = "" if c is None or c.step is None else str(c.step)
        if s is None:  # removed by a watch earlier
            return (os.path.basename(r.run), os.path.basename(r.path), "", "exported",
                    os.path.basename(str((r.record or {}).get("export", ""))), "removed", "", did_text(r.record))
        export = EXPORT_WORDS.get(s.action, s.action)
        then = "" if d is None else ("remove once exported" if d.remove and s.will_export else d.action)
        why = "; ".join(d.reasons) if d is not None else s.why
        return (os.path.basename(r.run), c.name, step, export, os.path.basename(s.export), then, why,
                did_text(r.record))

    def data(self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        r = self.rows[index.row()]
        col = index.column()
        if role == Qt.ItemDataRole.DisplayRole:
            return self._cells(r)[col]
        if role == Qt.ItemDataRole.ForegroundRole:
            if col == 5 and r.decision is not None:
                return QColor("#d62728" if r.decision.remove else "#2ca02c")
            if col == 3 and r.step is not None and r.step.action == BLOCKED:
                return QColor("#d62728")
            if r.step is None:
                return QColor("#808080")
        if role == Qt.ItemDataRole.ToolTipRole:
            lines = [r.path]
            if r.step is not None:
                lines += [r.step.text(), *([f"{r.decision.action}: {'; '.join(r.decision.reasons)}"]
                                           if r.decision is not None else [])]
            if r.record:
                lines.append(f"watch record: {did_text(r.record)}")
            return "\n".join(lines)
        if role == Qt.ItemDataRole.UserRole:
            return r
        return None


class WatchPlanDialog(QDialog):
    """The watch plan for some roots, with the export format and rules as ``watch`` takes them."""

    def __init__(self, roots: list[str], rules: Rules | None = None, fmt: str = "safetensors", parent=None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Watch plan")
        self.resize(1100, 600)
        self.roots = list(roots)
        self.plan: WatchPlan | None = None
        self._plans = Rerun(lambda done: run_in_background(
            plan_watch, self.roots, self.format.currentText(), self.rules(), config=self.config(), owner=self,
            on_result=self._show, on_error=lambda m: self._show(None, m), on_finished=done))
        rules = rules or Rules(keep_last=3)
        lay = QVBoxLayout(self)
        lay.addLayout(self._build_form(rules, fmt))
        self.command = QLabel()
        self.command.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.command.setWordWrap(True)
        lay.addWidget(self.command)
        self.model = WatchPlanModel(self)
        self.table = plan_table(self.model, (80, 110, 45, 85, 170, 150, 230))
        lay.addWidget(self.table, 1)
        self.summary = QLabel("Planning …")
        self.summary.setWordWrap(True)
        lay.addWidget(self.summary)
        row = QHBoxLayout()
        row.addStretch(1)
        self.close_button = QPushButton("Close")
        self.close_button.clicked.connect(self.reject)
        row.addWidget(self.close_button)
        lay.addLayout(row)
        self.debounce = QTimer(self)
        self.debounce.setSingleShot(True)
        self.debounce.setInterval(150)
        self.debounce.timeout.connect(self.update_plan)
        wheel_only_when_focused(self)
        self.update_plan()

    def _build_form(self, rules: Rules, fmt: str) -> QGridLayout:
        g = QGridLayout()
        self.format = QComboBox()
        self.format.addItems(list(export_formats()))
        self.format.setCurrentText(fmt)
        self.format.currentIndexChanged.connect(self._changed)
        g.addWidget(QLabel("Export to"), 0, 0)
        g.addWidget(self.format, 0, 1)
        g.addWidget(QLabel("RUN/exports/<checkpoint name>, verified and atomic, once a checkpoint is complete"),
                    0, 2, 1, 3)

        def check(text: str, on: bool) -> QCheckBox:
            return rule_check(text, on, self._changed)

        def spin(value: int) -> QSpinBox:
            return rule_spin(value, self._changed)

        self.last_on, self.last_n = check("Keep the last", rules.keep_last is not None), spin(rules.keep_last or 3)
        g.addWidget(self.last_on, 1, 0)
        g.addWidget(self.last_n, 1, 1)
        g.addWidget(QLabel("resumable checkpoints of each run"), 1, 2)
        self.every_on, self.every_k = check("Keep every", rules.keep_every is not None), spin(rules.keep_every or 1000)
        g.addWidget(self.every_on, 2, 0)
        g.addWidget(self.every_k, 2, 1)
        g.addWidget(QLabel("steps"), 2, 2)
        self.glob_on = check("Keep names matching", bool(rules.keep))
        self.globs = QLineEdit(", ".join(rules.keep))
        self.globs.setPlaceholderText("e.g. *final*")
        self.globs.textChanged.connect(self._changed)
        g.addWidget(self.glob_on, 3, 0)
        g.addWidget(self.globs, 3, 1, 1, 2)
        note = QLabel("A checkpoint is removed only once its export is verified; never the newest resumable one, a "
                      "pinned one, one being written nor one a live run resumed from. Without a rule a watch only "
                      "exports.")
        note.setWordWrap(True)
        g.addWidget(note, 4, 0, 1, 5)
        self.config_field = ConfigField()  # a Hugging Face model export's config.json (watch --config)
        self.config_field.edit.textChanged.connect(self._changed)
        g.addWidget(QLabel("HF config"), 5, 0)
        g.addWidget(self.config_field, 5, 1, 1, 3)
        g.setColumnStretch(4, 1)
        return g

    def rules(self) -> Rules | None:
        """The rules as set; None when no rule is on (a watch then exports only)."""
        rules = Rules(keep_last=self.last_n.value() if self.last_on.isChecked() else None,
                      keep_every=self.every_k.value() if self.every_on.isChecked() else None,
                      keep=tuple(g.strip() for g in self.globs.text().split(",") if g.strip())
                      if self.glob_on.isChecked() else ())
        return rules if rules.has_keep_rule() else None

    def config(self) -> str | None:
        """The config.json of a Hugging Face model export (None for another format, or none given)."""
        hf = self.format.currentText() == "hf"
        return (self.config_field.edit.text().strip() or None) if hf else None

    def command_line(self) -> str:
        """The ``shardscope watch`` command whose plan this is."""
        rules = self.rules()
        words = ["shardscope", "watch", *self.roots, "--export", self.format.currentText()]
        config = self.config()
        words += ["--config", config] if config else []
        if rules is not None:
            words += ["--keep-last", str(rules.keep_last)] if rules.keep_last else []
            words += ["--keep-every", str(rules.keep_every)] if rules.keep_every else []
            for g in rules.keep:
                words += ["--keep", g]
        return shlex.join(words)

    def _changed(self, *_: object) -> None:
        self.debounce.start()

    def update_plan(self) -> None:
        """Plan in a worker (one at a time; a change meanwhile plans again after it)."""
        self.config_field.setEnabled(self.format.currentText() == "hf")
        self.command.setText(f"<code>{self.command_line()} --dry-run</code> prints this plan; without "
                             "<code>--dry-run</code> it is done.")
        self._plans.ask()

    @property
    def planning(self) -> bool:
        """A plan is being made (its result not shown yet)."""
        return self._plans.worker is not None

    def _show(self, plan: WatchPlan | None, error: str = "") -> None:
        self.plan = plan
        self.model.set_plan(plan)
        if plan is None:
            self.summary.setText(f"<span style='color:#d62728'>{error}</span>")
            return
        done = sum(r.recorded for r in plan.runs)
        removed = sum(len(r.removed) for r in plan.runs)
        urls = " <b>On URLs a watch only plans.</b>" if any(r.plan_only for r in plan.runs) else ""
        rules = f"rules: {rules_text(plan.rules)}" if plan.rules else "no rule: exports only"
        self.summary.setText(
            f"<b>A watch would export {count(len(plan.to_export), 'checkpoint')} to {plan.format} and remove "
            f"{count(len(plan.to_remove), 'checkpoint')}</b> ({rules}). Done by a watch so far: "
            f"{count(done, 'verified export')}, {count(removed, 'checkpoint')} removed.{urls}")


__all__ = ["WatchPlanDialog", "WatchPlanModel", "did_text", "rows_of"]
