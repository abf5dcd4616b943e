"""Prune…: the rules of ``shardscope prune`` with a live preview of what goes and the space it frees; then it
acts as the CLI does (to the desktop trash, or for good), in a worker, with progress and a summary."""

from __future__ import annotations

import html
import os
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, Qt, QTimer, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QTableView,
    QVBoxLayout,
)

from ..backend.errors import ShardscopeError
from ..backend.library.prune import Plan, PruneResult, Rules, execute, make_plan, parse_age
from ..backend.library.records import Listing
from ..backend.text import count, human_bytes
from .form_wheel import wheel_only_when_focused
from .rows_table import RowsTableModel
from .workers import Rerun, Worker, run_in_background


def plan_rules(listing: Listing, rules: Rules, progress: Any = None) -> Plan:
    """The plan (a worker function: ``--keep-best`` reads metric files)."""
    return make_plan(listing, rules)


def rule_check(text: str, on: bool, changed: Any) -> QCheckBox:
    """A rule's check box (Prune…, Watch plan…)."""
    box = QCheckBox(text)
    box.setChecked(on)
    box.toggled.connect(changed)
    return box


def rule_spin(value: int, changed: Any, hi: int = 10**9) -> QSpinBox:
    """A rule's number (Prune…, Watch plan…)."""
    s = QSpinBox()
    s.setRange(1, hi)
    s.setValue(max(1, value))
    s.valueChanged.connect(changed)
    s.setMaximumWidth(110)
    return s


def plan_table(model: RowsTableModel, widths: tuple[int, ...]) -> QTableView:
    """A plan's table: one row per checkpoint, whole rows selected, the last column stretched."""
    table = QTableView()
    table.setModel(model)
    table.verticalHeader().hide()
    table.verticalHeader().setDefaultSectionSize(table.fontMetrics().height() + 6)
    table.setWordWrap(False)
    table.setSelectionBehavior(QTableView.SelectionBehavior.SelectRows)
    header = table.horizontalHeader()
    header.setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
    header.setStretchLastSection(True)
    for col, width in enumerate(widths):
        header.resizeSection(col, width)
    return table


def scope_text(runs: list[str] | None) -> str:
    """What the plan covers, in a line above the rules."""
    if not runs:
        return ("Plans over <b>every run</b> under the Library's roots (select runs or checkpoints in the Library "
                "to prune only those runs).")
    names = ", ".join(html.escape(os.path.basename(r.rstrip("/")) or r) for r in runs)
    return f"Plans over the selected {'run' if len(runs) == 1 else 'runs'} only: <b>{names}</b>."


class PlanModel(RowsTableModel):
    """One row per checkpoint: keep or remove, and why (an adapter over the plan's decisions)."""

    HEADERS = ("action", "run", "checkpoint", "step", "size", "state", "why")

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.plan: Plan | None = None

    def set_plan(self, plan: Plan | None) -> None:
        self.beginResetModel()
        self.plan = plan
        self.endResetModel()

    def rows_list(self) -> list:
        return self.plan.decisions if self.plan is not None else []

    def data(self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or self.plan is None:
            return None
        d = self.plan.decisions[index.row()]
        c = d.checkpoint
        if role == Qt.ItemDataRole.DisplayRole:
            return (d.action, c.run.rsplit("/", 1)[-1], c.name, "" if c.step is None else str(c.step),
                    human_bytes(c.bytes), c.state, "; ".join(d.reasons))[index.column()]
        if role == Qt.ItemDataRole.ForegroundRole and index.column() == 0:
            return QColor("#d62728" if d.remove else "#2ca02c")
        if role == Qt.ItemDataRole.ToolTipRole:
            return f"{c.path}\n" + "\n".join(d.reasons)
        if role == Qt.ItemDataRole.UserRole:
            return d
        return None


class PruneDialog(QDialog):
    rulesChanged = Signal(object)  # Rules, when the user changed them
    pruned = Signal(object)  # PruneResult

    def __init__(self, listing: Listing, rules: Rules, parent=None, runs: list[str] | None = None) -> None:
        """``runs``: plan over these runs only (the Library's selection); None: every run of ``listing``."""
        super().__init__(parent)
        self.setWindowTitle("Prune checkpoints")
        self.resize(980, 640)
        self.runs = runs
        self.listing = listing.of_runs(runs) if runs else listing
        self.plan: Plan | None = None
        self.result: PruneResult | None = None
        self._plans = Rerun(self._start_plan)
        self._act_worker: Worker | None = None
        self._plan_listing: Listing | None = None  # the listing the plan in progress (or shown) was made from
        self._acted_on: Listing | None = None  # the listing of the last removal: its plan is spent
        self.current_rules: Rules | None = None
        lay = QVBoxLayout(self)
        self.scope = QLabel(scope_text(runs))
        self.scope.setWordWrap(True)
        lay.addWidget(self.scope)
        lay.addLayout(self._build_rules(rules))
        self.model = PlanModel(self)
        self.table = plan_table(self.model, (60, 150, 200, 60, 80, 80))
        lay.addWidget(self.table, 1)
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        lay.addWidget(self.summary)
        row = QHBoxLayout()
        self.progress = QProgressBar()
        self.progress.setVisible(False)
        row.addWidget(self.progress, 1)
        row.addStretch(0)
        self.act_button = QPushButton("Move to the trash")
        self.act_button.clicked.connect(self.act)
        self.close_button = QPushButton("Close")
        self.close_button.clicked.connect(self.reject)
        row.addWidget(self.act_button)
        row.addWidget(self.close_button)
        lay.addLayout(row)
        self.debounce = QTimer(self)
        self.debounce.setSingleShot(True)
        self.debounce.setInterval(150)
        self.debounce.timeout.connect(self.update_preview)
        wheel_only_when_focused(self)
        self.update_preview()

    # ------------------------------------------------------------------ rules
    def _build_rules(self, rules: Rules) -> QGridLayout:
        """The rule rows, as the CLI's options (NOTE: one grid row per rule; kept in one piece so the form reads
        top to bottom like ``shardscope prune --help``)."""
        g = QGridLayout()

        def check(text: str, on: bool) -> QCheckBox:
            return rule_check(text, on, self._changed)

        def spin(value: int, hi: int = 10**9) -> QSpinBox:
            return rule_spin(value, self._changed, hi)

        self.last_on, self.last_n = check("Keep the last", rules.keep_last is not None), spin(rules.keep_last or 3)
        g.addWidget(self.last_on, 0, 0)
        g.addWidget(self.last_n, 0, 1)
        g.addWidget(QLabel("resumable checkpoints of each run"), 0, 2, 1, 3)
        self.every_on, self.every_k = check("Keep every", rules.keep_every is not None), spin(rules.keep_every or 1000)
        g.addWidget(self.every_on, 1, 0)
        g.addWidget(self.every_k, 1, 1)
        g.addWidget(QLabel("steps (step divisible by it)"), 1, 2, 1, 3)
        self.best_on, self.best_top = check("Keep the best", rules.keep_best is not None), spin(rules.top, 10**6)
        self.best_metric = QLineEdit(rules.keep_best or "loss")
        self.best_metric.textChanged.connect(self._changed)
        self.best_mode = QComboBox()
        self.best_mode.addItems(["min", "max"])
        self.best_mode.setCurrentText(rules.mode)
        self.best_mode.currentIndexChanged.connect(self._changed)
        g.addWidget(self.best_on, 2, 0)
        g.addWidget(self.best_top, 2, 1)
        g.addWidget(QLabel("by"), 2, 2)
        g.addWidget(self.best_metric, 2, 3)
        g.addWidget(self.best_mode, 2, 4)
        self.glob_on = check("Keep names matching", bool(rules.keep))
        self.globs = QLineEdit(", ".join(rules.keep))
        self.globs.setPlaceholderText("e.g. *final*, step_*0000")
        self.globs.textChanged.connect(self._changed)
        g.addWidget(self.glob_on, 3, 0)
        g.addWidget(self.globs, 3, 1, 1, 4)
        self.age_on = check("Keep newer than", rules.min_age is not None)
        self.age = QLineEdit(f"{rules.min_age / 3600:g}h" if rules.min_age else "2h")
        self.age.textChanged.connect(self._changed)
        self.age.setMaximumWidth(110)
        self.best_metric.setMaximumWidth(220)
        g.addWidget(self.age_on, 4, 0)
        g.addWidget(self.age, 4, 1)
        g.addWidget(QLabel("(90s, 30m, 2h, 7d)"), 4, 2, 1, 3)
        self.incomplete = check("Also remove leftovers of failed saves (incomplete, older than the age above)",
                                rules.incomplete)
        g.addWidget(self.incomplete, 5, 0, 1, 6)
        self.weights = check("Also apply the rules to weights files (exports), counted among weights files",
                             rules.weights)
        g.addWidget(self.weights, 6, 0, 1, 6)
        self.delete = check("Delete for good (default: to the desktop trash)", False)
        g.addWidget(self.delete, 7, 0, 1, 6)
        note = QLabel("Never removed: the newest resumable checkpoint of a run, a running run's checkpoints, anything "
                      "being written. A checkpoint is kept if any rule keeps it; weights files count apart from "
                      "resumable checkpoints and go only when asked.")
        note.setWordWrap(True)
        g.addWidget(note, 8, 0, 1, 6)
        g.setColumnStretch(5, 1)
        return g

    def rules(self) -> Rules:
        """The rules as set (raises ShardscopeError for a bad age)."""
        age_needed = self.age_on.isChecked() or self.incomplete.isChecked()
        return Rules(keep_last=self.last_n.value() if self.last_on.isChecked() else None,
                     keep_every=self.every_k.value() if self.every_on.isChecked() else None,
                     keep_best=(self.best_metric.text().strip() or None) if self.best_on.isChecked() else None,
                     mode=self.best_mode.currentText(), top=self.best_top.value(),
                     keep=tuple(g.strip() for g in self.globs.text().split(",") if g.strip())
                     if self.glob_on.isChecked() else (),
                     min_age=parse_age(self.age.text()) if age_needed and self.age_on.isChecked() else None,
                     incomplete=self.incomplete.isChecked(), weights=self.weights.isChecked())

    def _changed(self, *_: object) -> None:
        self.act_button.setText("Delete for good" if self.delete.isChecked() else "Move to the trash")
        self.debounce.start()

    # ------------------------------------------------------------------ preview
    def set_listing(self, listing: Listing) -> None:
        """A newer scan of the Library: plan again on what exists now. NOTE: the dialog used to keep the listing
        it was opened with, so after a removal it listed the checkpoints already in the trash as "remove", with
        their bytes, and Move to the trash stayed disabled for good."""
        if self.runs:
            listing = listing.of_runs(self.runs)
        # an unchanged scan (the Library polls every 2 s) plans nothing: the table keeps its scroll and selection
        if listing == self.listing or self._act_worker is not None:
            return
        self.listing = listing
        self.update_preview()

    def update_preview(self) -> None:
        """Plan the current rules in a worker; the table and the summary follow."""
        try:
            rules = self.rules()
            rules.check()
        except ShardscopeError as exc:
            self._show_plan(None, str(exc))
            return
        self.current_rules = rules
        self._plans.ask()

    def _start_plan(self, done: Callable[[], None]) -> Worker | None:
        """Plan the rules the fields show now (a run asked for while another ran starts after it: the fields may
        have changed since, even to rules that do not hold, which are then shown as such and planned not)."""
        try:
            rules = self.rules()
            rules.check()
        except ShardscopeError as exc:
            self._show_plan(None, str(exc))
            return None
        self.current_rules = rules
        self._plan_listing = self.listing
        return run_in_background(plan_rules, self.listing, rules, owner=self, on_result=self._show_plan,
                                 on_error=lambda m: self._show_plan(None, m), on_finished=done)

    def _show_plan(self, plan: Plan | None, error: str = "") -> None:
        self.plan = plan
        self.model.set_plan(plan)
        if plan is None:
            self.summary.setText(f"<span style='color:#d62728'>{error}</span>")
        else:
            left = f" Also finishes {count(len(plan.leftovers), 'interrupted prune')}." if plan.leftovers else ""
            done = f"{self._result_html()}<br>" if self.result is not None else ""  # the last removal stays in view
            self.summary.setText(f"{done}<b>Removes {len(plan.remove):,} of "
                                 f"{count(len(plan.decisions), 'checkpoint')}, frees {human_bytes(plan.bytes_freed)}."
                                 f"</b>{left}")
        fresh = self._plan_listing is not None and self._plan_listing is not self._acted_on
        self.act_button.setEnabled(self._act_worker is None and fresh and plan is not None and
                                   bool(plan.remove or plan.leftovers))

    # ------------------------------------------------------------------ acting
    def act(self) -> None:
        plan = self.plan
        if plan is None or self._act_worker is not None:
            return
        delete = self.delete.isChecked()
        if delete and QMessageBox.question(
                self, "Delete for good", f"Delete {count(len(plan.remove), 'checkpoint')} "
                f"({human_bytes(plan.bytes_freed)}) "
                "for good? They do not go to the trash.") != QMessageBox.StandardButton.Yes:
            return
        self.start_removal(delete)

    def start_removal(self, delete: bool) -> Worker:
        """Carry out the plan shown (tests call this directly; the button asks first for --delete)."""
        assert self.plan is not None
        self._acted_on = self._plan_listing
        self.act_button.setEnabled(False)
        self.progress.setVisible(True)
        self.progress.setRange(0, max(1, len(self.plan.remove)))
        self._act_worker = run_in_background(
            execute, self.plan, delete, owner=self, on_result=self._acted, on_error=self._act_failed,
            on_progress=lambda d, _t, _m: self.progress.setValue(d),
            on_cancelled=lambda: self._act_failed("Stopped. What was removed before is gone; everything else is "
                                                  "untouched."))
        self.close_button.setText("Stop")
        return self._act_worker

    def _acted(self, result: PruneResult) -> None:
        self.result = result
        self._act_worker = None
        self.progress.setVisible(False)
        self.close_button.setText("Close")
        self.summary.setText(self._result_html())
        self.pruned.emit(result)

    def _result_html(self) -> str:
        assert self.result is not None
        color = "#d62728" if self.result.failed else "#2ca02c"
        return f"<span style='color:{color}'>{self.result.summary().replace(chr(10), '<br>')}</span>"

    def _act_failed(self, message: str) -> None:
        self._act_worker = None
        self.progress.setVisible(False)
        self.close_button.setText("Close")
        self.summary.setText(f"<span style='color:#d62728'>{message}</span>")
        self.pruned.emit(None)

    def reject(self) -> None:
        if self._act_worker is not None:  # Stop: ends after the checkpoint being removed (whole or gone)
            self._act_worker.quit()
            return
        super().reject()

    def done(self, code: int) -> None:
        if self.current_rules is not None:
            self.rulesChanged.emit(self.current_rules)  # the Library's disk-usage view follows the last rules
        super().done(code)
