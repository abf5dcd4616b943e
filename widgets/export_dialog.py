"""The Export dialog: the CLI's export options, a preview of keys and size (planned in a worker as the fields
change), progress with cancel."""

from __future__ import annotations

import html
import os
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QStringListModel, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListView,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)
from shardscope.backend.checkpoint.model import Checkpoint
from shardscope.backend.export import (
    WRITERS,
    ExportError,
    ExportPlan,
    ExportResult,
    Writer,
    check_request,
    export,
    export_formats,
    parse_shard_size,
    plan_export,
)
from shardscope.backend.export.dcp_writer import import_file, reshard
from shardscope.backend.export.destination import (
    check_destination,
    default_export_path,
    export_suffix,
    missing_folders,
    write_into_new_folders,
)
from shardscope.backend.filenames import SAFETENSORS_SUFFIX, is_safetensors_file
from shardscope.backend.text import count, human_bytes

from .export_model import ArchitectureLine, ConfigField, model_summary
from .form_wheel import wheel_only_when_focused
from .workers import Rerun, Worker, run_in_background

FROM_THE_NAME = "from the name"  # the Format entry that is no writer: the backend picks one from the destination
PLAN_DELAY_MS = 150  # typing plans once it pauses this long


def plan_preview(ckpt: Checkpoint, writer: Writer, kw: dict[str, Any],
                 progress: Any = None) -> tuple[ExportPlan | None, list[str]]:
    """The plan and the preview's lines (a worker function: at 300k entries planning takes seconds). Resharding
    (a writer without ``write``) has no plan: every entry is rewritten."""
    if writer.write is None:
        return None, ([f"{t.fqn}    {t.dtype} {list(t.shape)}" for t in ckpt.tensors]
                      + [f"{o.fqn}    (non-tensor, copied byte for byte)" for o in ckpt.objects])
    plan = plan_export(ckpt, writer.name, **kw)
    return plan, ([f"{it.key}    {it.dtype} {list(it.shape)}" for it in plan.items]
                  + [f"{key}    (non-tensor)" for key, _ in plan.objects])


class ExportDialog(QDialog):
    finished_export = Signal(object)  # ExportResult, or None when cancelled/failed
    openRequested = Signal(str)  # Open pressed after an export: the written checkpoint, to open in the window

    def __init__(self, ckpt: Checkpoint, prefix: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Export" + (f" {prefix}" if prefix else ""))
        self.resize(720, 620)
        self.ckpt = ckpt
        self.plan: ExportPlan | None = None
        self.result: ExportResult | None = None
        self._worker: Worker | None = None
        # NOTE: the fields' version: each edit counts one; a plan is shown only if made from the version the fields
        # are at (a plan still running when a key was typed is dropped, never shown for the new fields)
        self._fields_version = 0
        self._shown_version = -1
        self._plans = Rerun(self._start_plan)
        self._plan_delay = QTimer(self)
        self._plan_delay.setSingleShot(True)
        self._plan_delay.setInterval(PLAN_DELAY_MS)
        self._plan_delay.timeout.connect(self._plans.ask)

        layout = QVBoxLayout(self)
        layout.addLayout(self._build_form(ckpt, prefix))

        self.model_line = ArchitectureLine(ckpt)  # Hugging Face model output: the architecture the names say
        layout.addWidget(self.model_line)
        self.summary = QLabel("")
        self.summary.setWordWrap(True)
        layout.addWidget(self.summary)
        self.keys = QStringListModel(self)  # NOTE: a list model, not per-row widgets: 100k keys stay fast
        self.preview = QListView()
        self.preview.setModel(self.keys)
        self.preview.setUniformItemSizes(True)
        layout.addWidget(self.preview, 1)
        self.progress = QProgressBar()
        self.progress.hide()
        layout.addWidget(self.progress)
        self.message = QLabel("")
        self.message.setWordWrap(True)
        self.message.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout.addWidget(self.message)

        self.buttons = QDialogButtonBox()
        self.export_button = self.buttons.addButton("Export", QDialogButtonBox.ButtonRole.AcceptRole)
        self.show_button = self.buttons.addButton("Show in folder", QDialogButtonBox.ButtonRole.ActionRole)
        self.show_button.hide()
        self.open_button = self.buttons.addButton("Open", QDialogButtonBox.ButtonRole.ActionRole)
        self.open_button.setToolTip("Open what was written in the window (and close this dialog)")
        self.open_button.hide()
        self.cancel_button = self.buttons.addButton(QDialogButtonBox.StandardButton.Cancel)
        self.close_button = self.buttons.addButton(QDialogButtonBox.StandardButton.Close)
        self.close_button.hide()
        self.export_button.clicked.connect(self.start)
        self.show_button.clicked.connect(self._show_in_folder)
        self.open_button.clicked.connect(self._open_result)
        self.cancel_button.clicked.connect(self._cancel)
        self.close_button.clicked.connect(self.accept)
        layout.addWidget(self.buttons)

        for w in (self.dst, self.shard, self.only, self.exclude, self.strip, self.rename, self.config):
            w.textChanged.connect(self._options_changed)
        self.format.currentIndexChanged.connect(self._propose_destination)
        for c in (self.format, self.dtype):
            c.currentIndexChanged.connect(self._options_changed)
        self.ranks.valueChanged.connect(self._options_changed)
        self.force.toggled.connect(self._options_changed)
        self.make_folders.toggled.connect(self._options_changed)
        wheel_only_when_focused(self)
        self.update_preview(at_once=True)

    def _options_changed(self) -> None:
        """An edited option makes the last export's result line stale: clear it, then preview the new plan."""
        if self.result is not None or self.message.text():
            self.result = None
            self.message.clear()
            self.message.setStyleSheet("")
            self.show_button.hide()
            self.open_button.hide()
        self.update_preview()

    def _build_form(self, ckpt: Checkpoint, prefix: str) -> QFormLayout:
        """The options, as the CLI has them."""
        form = QFormLayout()
        dst_row = QHBoxLayout()
        stem = prefix or os.path.splitext(os.path.basename(ckpt.path.rstrip("/")))[0]
        self._stem = stem
        self.dst = QLineEdit(default_export_path(ckpt.path, stem))
        self._proposed = self.dst.text()  # the destination proposed, replaced when the format changes
        browse = self.browse_button = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        dst_row.addWidget(self.dst, 1)
        dst_row.addWidget(browse)
        form.addRow("Destination", dst_row)
        # NOTE: the CLI refuses a destination whose folder is missing; the dialog offers to make it (the proposed
        # RUN/exports/ often is), and says so before anything is written
        self.make_folders = QCheckBox()
        self.make_folders.setChecked(True)
        keep = self.make_folders.sizePolicy()  # the rows below stay put when the offer comes and goes
        keep.setRetainSizeWhenHidden(True)  # (a form row with its field hidden collapses: a box keeps the room)
        self.make_folders.setSizePolicy(keep)
        offer_row = QWidget()
        offer_box = QHBoxLayout(offer_row)
        offer_box.setContentsMargins(0, 0, 0, 0)
        offer_box.addWidget(self.make_folders)
        form.addRow("", offer_row)
        self.format = QComboBox()
        self.format.addItem(FROM_THE_NAME, None)
        for w in WRITERS.values():
            self.format.addItem(w.label, w.name)
        form.addRow("Format", self.format)
        self.ranks = QSpinBox()
        self.ranks.setRange(1, 65536)
        self.ranks.setValue(max(1, len(ckpt.ranks)))
        self.ranks.setToolTip("DCP (reshard): write it as if saved by this many ranks, even row-wise chunks")
        form.addRow("Ranks (DCP)", self.ranks)
        self.shard = QLineEdit()
        self.shard.setPlaceholderText("e.g. 5GB: sharded safetensors with an index (destination is a folder)")
        form.addRow("Max shard size", self.shard)
        self.only = QLineEdit(prefix)
        self.only.setPlaceholderText("prefixes, comma separated (empty: the format's default)")
        form.addRow("Only", self.only)
        self.exclude = QLineEdit()
        self.exclude.setPlaceholderText("prefixes to leave out, comma separated, e.g. model.lm_head")
        form.addRow("Exclude", self.exclude)
        self.strip = QLineEdit(prefix + "." if prefix and "." not in prefix else "")
        self.strip.setPlaceholderText("empty: the layout's container (model.) for safetensors, so keys load "
                                      "into the module")
        form.addRow("Strip prefix", self.strip)
        self.rename = QLineEdit()
        self.rename.setPlaceholderText("REGEX=REPLACEMENT rules separated by two spaces, applied in order")
        form.addRow("Rename", self.rename)
        self.dtype = QComboBox()
        self.dtype.addItems(["keep", "bf16", "fp16", "fp32"])
        form.addRow("Floating-point dtype", self.dtype)
        self.config_row = ConfigField()
        self.config = self.config_row.edit
        form.addRow("Config", self.config_row)
        self.verify = QCheckBox("Verify: re-read every written tensor and compare its CRC32 with the source bytes")
        self.verify.setChecked(True)
        self.verify.setToolTip("For a URL destination this checks the local staged copy before its upload; the "
                               "upload is checked apart (on S3 by a CRC32 the server checks with every PUT and "
                               "part) and the result says how.")
        form.addRow("", self.verify)
        self.force = QCheckBox("Overwrite the destination if it exists")
        self.force.setToolTip("A file is replaced. A folder gets the new weights (and index); an earlier export's "
                              "weights go, and every other file in it (config.json, tokenizer files) is kept.")
        form.addRow("", self.force)
        return form

    # ------------------------------------------------------------------ options and preview
    def option_fields(self) -> dict[str, QWidget]:
        """The field of each option a writer may take (registry.OPTION_WORDS), ``record_source`` aside."""
        return {"max_shard_size": self.shard, "only": self.only, "exclude": self.exclude, "strip_prefix": self.strip,
                "rename": self.rename, "dtype": self.dtype, "ranks": self.ranks, "config": self.config_row}

    def taken(self) -> frozenset[str]:
        """The options the chosen format takes; from the name: what any export writer takes."""
        name = self.format.currentData()
        if name is not None:
            return WRITERS[name].options
        return frozenset().union(*(WRITERS[n].options for n in export_formats()))

    def options(self) -> tuple[str, Writer, dict]:
        """(destination, writer, plan_export keyword arguments); raises ExportError on bad input. A field the
        chosen format does not take (shown disabled) is not read."""
        dst = self.dst.text().strip()
        if not dst:
            raise ExportError("Choose a destination.")
        if self.resharding:
            return dst, WRITERS[self.format.currentData()], {}
        read = {"max_shard_size": lambda: parse_shard_size(self.shard.text()),
                "only": lambda: [p.strip() for p in self.only.text().split(",") if p.strip()] or None,
                "exclude": lambda: [p.strip() for p in self.exclude.text().split(",") if p.strip()] or None,
                "rename": lambda: [r.strip() for r in self.rename.text().split("  ") if r.strip()] or None,
                "strip_prefix": lambda: self.strip.text() or None,
                "dtype": lambda: None if self.dtype.currentText() == "keep" else self.dtype.currentText(),
                "config": lambda: self.config.text().strip() or None}
        kw = {name: value() for name, value in read.items() if name in self.taken()}
        return dst, check_request(dst, self.format.currentData(), **kw), kw

    @property
    def resharding(self) -> bool:
        """DCP chosen: a whole checkpoint rewritten for a number of ranks (no export plan)."""
        name = self.format.currentData()
        return name is not None and WRITERS[name].write is None

    def _offer_folders(self) -> list[str]:
        """The folders the destination needs that do not exist (outermost first); the offer to make them shows
        while there are some."""
        missing = missing_folders(self.dst.text().strip()) if self.dst.text().strip() else []
        if missing:
            below = f" (and {count(len(missing) - 1, 'folder')} in it)" if len(missing) > 1 else ""
            # NOTE: a long path is cut at its start (a check box's text is its minimum width: it widened the dialog)
            shown = missing[0] if len(missing[0]) <= 60 else "…" + missing[0][-59:]
            self.make_folders.setText(f"Create the missing folder {shown}{below}")
            self.make_folders.setToolTip(f"Creates {missing[0]}{below}; removed again if the export fails")
        self.make_folders.setVisible(bool(missing))
        return missing

    @property
    def planning(self) -> bool:
        """The plan for the fields as they are is not back yet (Export waits for it)."""
        return self._shown_version != self._fields_version

    def update_preview(self, at_once: bool = False) -> None:
        """The fields changed: what the format takes, the folders to offer, at once; the plan in a worker once the
        typing pauses (``at_once``: now). Until it is back the preview is empty and Export disabled."""
        self._offer_folders()
        chosen = self.format.currentData()
        self.model_line.show_for(chosen is not None and WRITERS[chosen].model)
        taken = self.taken()
        for name, field in self.option_fields().items():
            field.setEnabled(name in taken)
        self._fields_version += 1
        self.plan = None
        self.keys.setStringList([])
        self.export_button.setEnabled(False)
        try:
            self.options()
        except ExportError as exc:  # bad input is said at once, with no plan to wait for
            self._show_error(self._fields_version, str(exc))
            return
        self.summary.setText("Planning …")
        if at_once:
            self._plan_delay.stop()
            self._plans.ask()
        else:
            self._plan_delay.start()

    def _propose_destination(self) -> None:
        """A destination still as proposed follows the format: a folder ``<name>-hf`` for a Hugging Face model."""
        if self.dst.text() != self._proposed:  # typed or chosen: kept
            return
        name = self.format.currentData()
        w = WRITERS[name] if name is not None else None
        suffix = export_suffix(w) if w is not None and w.model else SAFETENSORS_SUFFIX
        self._proposed = default_export_path(self.ckpt.path, self._stem, suffix)
        self.dst.setText(self._proposed)

    def _start_plan(self, done: Callable[[], None]) -> Worker | None:
        """Plan the fields as they are now (a plan asked for while another ran starts after it)."""
        version = self._fields_version
        if self._shown_version == version:  # an error already shown for these fields: nothing to plan
            return None
        try:
            _dst, writer, kw = self.options()
        except ExportError as exc:
            self._show_error(version, str(exc))
            return None
        return run_in_background(plan_preview, self.ckpt, writer, kw, owner=self,
                                 on_result=lambda result: self._show_plan(version, writer, *result),
                                 on_error=lambda message: self._show_error(version, message), on_finished=done)

    def _show_error(self, version: int, message: str) -> None:
        if version != self._fields_version:  # the fields changed since: a newer plan is on its way
            return
        self._shown_version = version
        self.plan = None
        self.keys.setStringList([])
        self.summary.setText(f"<span style='color:#d62728'>{html.escape(message)}</span>")
        self.export_button.setEnabled(False)

    def _show_plan(self, version: int, writer: Writer, plan: ExportPlan | None, lines: list[str]) -> None:
        if version != self._fields_version:
            return
        self._shown_version = version
        self.plan = plan
        self.keys.setStringList(lines)
        if plan is None:  # resharding
            ck = self.ckpt
            self.summary.setText(f"<b>DCP</b>: every entry ({count(len(ck.tensors), 'tensor')}, "
                                 f"{human_bytes(ck.total_bytes)}) rewritten as {count(self.ranks.value(), 'rank')} "
                                 "with even row-wise chunks; values unchanged (verified)")
            self.export_button.setEnabled(True)
            return
        shown = [n for n in plan.notes if not (plan.model and n.startswith(("architecture: ", "transforms: ")))]
        notes = model_summary(plan.model) if plan.model else ""
        notes += "".join(f"<br>{html.escape(n)}" for n in shown)
        notes += "".join(f"<br>left out: {html.escape(n)}" for n in plan.left_out)
        if writer.weights_only and plan.objects:
            entries = count(len(plan.objects), "non-tensor entry", "non-tensor entries")
            verb = "goes" if len(plan.objects) == 1 else "go"
            notes += (f"<br>{entries} {verb} into the header's metadata where they are "
                      "scalars or strings; the rest are listed as left out after the export.")
        self.summary.setText(f"<b>{html.escape(writer.label)}</b>: {count(len(plan.items), 'tensor')}, "
                             f"{human_bytes(plan.total_bytes)}"
                             + (f" in shards of at most {human_bytes(plan.max_shard_size)}" if plan.max_shard_size
                                else "") + notes)
        self.export_button.setEnabled(True)

    def _browse(self) -> None:
        if self.resharding or (self.shard.isEnabled() and self.shard.text().strip()):  # a folder is written
            path = QFileDialog.getExistingDirectory(self, "Export into folder", os.path.dirname(self.dst.text()))
        else:
            files = [WRITERS[n] for n in export_formats() if WRITERS[n].output == "file"]
            path, _ = QFileDialog.getSaveFileName(self, "Export to", self.dst.text(), ";;".join(
                f"{w.label} ({' '.join('*' + s for s in w.suffixes)})" for w in files))
        if path:
            self.dst.setText(path)

    # ------------------------------------------------------------------ running
    def start(self) -> None:
        try:
            dst, writer, _kw = self.options()
        except ExportError as exc:
            self.message.setText(str(exc))
            return
        if self.planning or (self.plan is None and not self.resharding):  # Export waits for the current plan
            return
        missing = self._offer_folders()
        if missing and not self.make_folders.isChecked():
            self._failed(f"{missing[-1]}: the destination's folder does not exist; tick \"Create the missing "
                         "folder\" or choose another destination.")
            return
        kind = writer.output_kind(self.plan.max_shard_size if self.plan is not None else None)
        try:  # the writers' own check, in the same words, before a worker starts
            check_destination(dst, kind, self.force.isChecked(), [self.ckpt.path])
        except ExportError as exc:
            self._failed(str(exc))
            return
        self._set_running(True)
        self.message.setText("Exporting …")
        if self.resharding:
            # a single safetensors file is no DCP folder to reshard: it is imported (the same DCP writer)
            job = import_file if is_safetensors_file(self.ckpt.path) else reshard
            # the destination's folder is made when missing (the default, RUN/exports/, often is), and removed
            # again if the export fails
            self._worker = run_in_background(write_into_new_folders, job, self.ckpt.path, dst, self.ranks.value(),
                                             force=self.force.isChecked(), verify=self.verify.isChecked(), owner=self,
                                             on_result=self._done, on_error=self._failed,
                                             on_progress=self._on_progress, on_cancelled=self._cancelled)
        else:
            self._worker = run_in_background(write_into_new_folders, export, self.plan, dst,
                                             force=self.force.isChecked(), verify=self.verify.isChecked(),
                                             owner=self, on_result=self._done,
                                             on_error=self._failed, on_progress=self._on_progress,
                                             on_cancelled=self._cancelled)

    def _on_progress(self, done: int, total: int, msg: str) -> None:
        # NOTE: sizes arrive as Python ints (Signal(object, ...)); QProgressBar holds a 32-bit int, so scale.
        scale = max(1, total // 1_000_000)
        self.progress.setRange(0, max(1, total // scale))
        self.progress.setValue(done // scale)
        self.progress.setFormat(f"%p%  {human_bytes(done)} of {human_bytes(total)}")

    def option_widgets(self) -> list[QWidget]:
        """Every field of the form (all locked while an export runs)."""
        return [self.dst, self.browse_button, self.make_folders, self.format, self.ranks, self.shard, self.only,
                self.exclude, self.strip, self.rename, self.dtype, self.config_row, self.verify, self.force]

    def _set_running(self, running: bool) -> None:
        self.progress.setVisible(running)
        self.export_button.setEnabled(not running)
        if running:
            # NOTE: a finished export swaps Cancel for Close; a second export from the same dialog needs Cancel
            # back (it used to run with only Close, which shut the dialog instead of stopping the export)
            self.cancel_button.show()
            self.close_button.hide()
            self.show_button.hide()
            self.open_button.hide()
        # NOTE: only four fields used to be locked: editing another one mid-export replaced the plan, the
        # preview and the "Exporting …" line, so the result shown no longer matched what was written
        for w in self.option_widgets():
            w.setEnabled(not running)
        if not running:
            self.update_preview()  # re-disables what the chosen format does not use

    def _done(self, result: ExportResult) -> None:
        self.result = result
        self._set_running(False)
        self.message.setText(html.escape(result.summary()).replace("\n", "<br>"))
        self.message.setStyleSheet("" if result.verified is not False else "color: #d62728;")
        ok = result.verified is not False
        self.show_button.setVisible(ok)
        self.open_button.setVisible(ok)
        self.close_button.setVisible(True)
        self.cancel_button.hide()
        self.finished_export.emit(result)

    def _failed(self, message: str) -> None:
        self._set_running(False)
        self.message.setText(f"<span style='color:#d62728'>{html.escape(message)}</span><br>Nothing was "
                             "written to the destination.")
        self.finished_export.emit(None)

    def _cancelled(self) -> None:
        self._set_running(False)
        self.message.setText("Cancelled; nothing was written to the destination.")
        self.finished_export.emit(None)

    def _cancel(self) -> None:
        if self._worker is not None and not self.progress.isHidden():
            self._worker.quit()
        else:
            self.reject()

    def _open_result(self) -> None:
        if self.result is not None:
            self.openRequested.emit(self.result.dst)
            self.accept()

    def _show_in_folder(self) -> None:
        if self.result is not None:
            target = self.result.dst if os.path.isdir(self.result.dst) else os.path.dirname(self.result.dst)
            QDesktopServices.openUrl(QUrl.fromLocalFile(target))

    def done(self, code: int) -> None:
        if self._worker is not None and not self.progress.isHidden():
            self._worker.quit()
        super().done(code)
