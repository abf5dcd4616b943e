"""The Library's tree model: runs -> checkpoints, an adapter over a backend listing, with its columns and roles."""

from __future__ import annotations

import re
import time
from typing import Any

from PySide6.QtCore import QAbstractItemModel, QModelIndex, QPersistentModelIndex, Qt
from PySide6.QtGui import QColor

from ..backend.library.records import CheckpointRecord, RunRecord
from ..backend.library.snapshot import LibrarySnapshot
from ..backend.runs.follow import LOSS_LABEL
from ..backend.text import human_bytes, ranks_text

NAME_SAMPLE = "run-20261126-133538"  # a run's name as `shardscope train` makes it: shown whole at 1280x720
COLUMNS = ("checkpoint", "step", "modified", "size", "ranks", "kind", "format", "state", "loss", "lineage")
# what a header says where the column's key is not enough, and its tooltip: the loss is the mean over the ranks'
# losses at the step, as the Training header shows it (step_metrics, follow.RunFollower.progress). NOTE: short:
# "loss (mean of ranks)" took ~140 px and pushed `source / exports` off-screen at 1280x720
HEADERS = {"loss": "mean loss", "lineage": "source / exports"}
HEADER_TIPS = {"loss": f"{LOSS_LABEL} at the checkpoint's step, as the Training header shows it",
               "lineage": "an export's source (and whether it changed since), or a checkpoint's exports"}
SIZE_COLUMN = COLUMNS.index("size")
ObjectRole = Qt.ItemDataRole.UserRole
SortRole = Qt.ItemDataRole.UserRole + 1
# a checkpoint's seal beside its state (backend/checkpoint/seal.seal_state: the file system's word, no byte read)
SEAL_TEXT = {"sealed": " · sealed", "damaged": " · damaged", "modified": " · sealed, modified since"}
STATE_COLORS = {"complete": "#2ca02c", "incomplete": "#d62728", "writing": "#ff7f0e", "unreadable": "#9467bd",
                "running": "#ff7f0e", "failed": "#d62728", "finished": "#2ca02c", "queued": "#1f77b4",
                "starting": "#ff7f0e"}


def natural(name: str) -> str:
    """A sort key as text (Qt compares it): numbers zero-padded, so checkpoint-500 sorts before checkpoint-1000."""
    return re.sub(r"\d+", lambda m: m.group().zfill(20), name.lower())


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "?"


def lineage_tooltip(c: CheckpointRecord) -> str:
    """An export's source (path, step, run, and whether it changed since), or a checkpoint's exports."""
    lines = []
    if c.lineage is not None:
        lin = c.lineage
        lines.append(f"exported from {lin.source}" + (f" (step {lin.step})" if lin.step is not None else ""))
        if lin.run:
            lines.append(f"run: {lin.run}")
        if c.source_warning:
            lines.append(f"\u26a0 {c.source_warning} since this export was written")
    if c.exports:
        lines.append("exports:")
        lines.extend(f"  {p}" for p in c.exports)
    return "\n".join(lines)


class LibraryModel(QAbstractItemModel):
    """Runs -> checkpoints: an adapter over the runs of a backend ``Listing`` (which stays the source of truth).

    Updates are incremental (insert/remove/changed rows), so a poll every two seconds keeps the selection,
    the expanded runs and the scroll position."""

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.runs: list[RunRecord] = []
        self.metric: dict[str, float] = {}
        # NOTE: a checkpoint's index carries a stable integer id of its run (never a Python pointer, which Qt
        # would hold without a reference, and never the run's row, which moves when runs come and go).
        self._ids: dict[str, int] = {}
        self._max_ckpt = 1
        self._max_run = 1

    # ------------------------------------------------------------------ structure
    def _run_id(self, run: RunRecord) -> int:
        return self._ids.setdefault(run.path, len(self._ids) + 1)

    def _run_row(self, run_id: int) -> int:
        for i, r in enumerate(self.runs):
            if self._ids.get(r.path) == run_id:
                return i
        return -1

    def index(self, row: int, column: int, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> QModelIndex:
        if not self.hasIndex(row, column, parent):
            return QModelIndex()
        if not parent.isValid():
            return self.createIndex(row, column, 0)
        if parent.internalId() == 0:
            return self.createIndex(row, column, self._run_id(self.runs[parent.row()]))
        return QModelIndex()

    def parent(self, index: QModelIndex | QPersistentModelIndex | None = None) -> Any:  # type: ignore[override]
        if index is None:
            return super().parent()
        if not index.isValid() or index.internalId() == 0:
            return QModelIndex()
        row = self._run_row(index.internalId())
        return self.createIndex(row, 0, 0) if row >= 0 else QModelIndex()

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:
        if not parent.isValid():
            return len(self.runs)
        if parent.internalId() == 0 and parent.column() == 0:
            return len(self.runs[parent.row()].checkpoints)
        return 0

    def columnCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:
        return len(COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return HEADERS.get(COLUMNS[section], COLUMNS[section])
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.ToolTipRole:
            return HEADER_TIPS.get(COLUMNS[section])
        return None

    def record(self, index: QModelIndex | QPersistentModelIndex) -> RunRecord | CheckpointRecord | None:
        if not index.isValid():
            return None
        if index.internalId() == 0:
            return self.runs[index.row()] if index.row() < len(self.runs) else None
        row = self._run_row(index.internalId())
        if row < 0 or index.row() >= len(self.runs[row].checkpoints):
            return None
        return self.runs[row].checkpoints[index.row()]

    def bar_fraction(self, index: QModelIndex | QPersistentModelIndex) -> float:
        rec = self.record(index)
        if isinstance(rec, RunRecord):
            return rec.bytes / self._max_run
        return rec.bytes / self._max_ckpt if rec is not None else 0.0

    # ------------------------------------------------------------------ data
    def data(self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        rec = self.record(index)
        if rec is None:
            return None
        if role == ObjectRole:
            return rec
        col = COLUMNS[index.column()]
        if isinstance(rec, RunRecord):
            return self._run_data(rec, col, role)
        return self._checkpoint_data(rec, col, role)

    def _run_data(self, run: RunRecord, col: str, role: int) -> Any:
        newest = max((c.mtime for c in run.checkpoints), default=0.0)
        if role == Qt.ItemDataRole.DisplayRole:
            state = ("running" if run.running else run.state or "") if run.kind == "shardscope" else ""
            # NOTE: a run without checkpoints (failed before its first save) showed "?" and "0 B": it has neither
            some = bool(run.checkpoints)
            return {"checkpoint": run.name, "step": f"{len(run.checkpoints)} ckpt" if some else "no ckpt",
                    "modified": _when(newest) if some else "", "size": human_bytes(run.bytes) if some else "",
                    "state": state,
                    "format": "run" if run.kind == "shardscope" else "folder"}.get(col)
        if role == SortRole:
            return {"checkpoint": natural(run.name), "step": len(run.checkpoints), "modified": newest,
                    "size": run.bytes}.get(col, "")
        if role == Qt.ItemDataRole.ToolTipRole:
            return run.path
        if role == Qt.ItemDataRole.ForegroundRole and col == "state":
            return QColor(STATE_COLORS.get("running" if run.running else run.state or "", "#777777"))
        return self._align(col, role)

    def _checkpoint_data(self, c: CheckpointRecord, col: str, role: int) -> Any:
        loss = self.metric.get(c.path)
        if role == Qt.ItemDataRole.DisplayRole:
            return {"checkpoint": c.name, "step": "" if c.step is None else str(c.step), "modified": _when(c.mtime),
                    "size": human_bytes(c.bytes), "ranks": ranks_text(c.ranks), "kind": c.kind, "format": c.format,
                    "state": c.state + SEAL_TEXT.get(c.seal, ""), "loss": "" if loss is None else f"{loss:.4f}",
                    "lineage": c.lineage_text()}[col]
        if role == SortRole:
            return {"checkpoint": natural(c.name), "step": -1 if c.step is None else c.step, "modified": c.mtime,
                    "size": c.bytes, "ranks": len(c.ranks), "kind": c.kind, "format": c.format, "state": c.state,
                    "loss": float("inf") if loss is None else loss, "lineage": c.lineage_text()}[col]
        if role == Qt.ItemDataRole.ToolTipRole:
            if col == "lineage" and (c.lineage is not None or c.exports):
                return lineage_tooltip(c)
            return c.path + (f"\n{c.state}: {c.reason}" if c.reason else "") + (f"\n{c.unusable}" if c.unusable else "")
        if role == Qt.ItemDataRole.ForegroundRole and col == "state":
            return QColor(STATE_COLORS.get("incomplete" if c.unusable else c.state, "#777777"))
        if role == Qt.ItemDataRole.ForegroundRole and col == "lineage" and c.source_warning:
            return QColor(STATE_COLORS["writing"])
        return self._align(col, role)

    @staticmethod
    def _align(col: str, role: int) -> Any:
        if role == Qt.ItemDataRole.TextAlignmentRole and col in ("step", "size", "loss"):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None

    # ------------------------------------------------------------------ updates
    def set_snapshot(self, snap: LibrarySnapshot) -> None:
        """Bring the rows in line with a new listing: remove what went, insert what came, refresh the rest."""
        self.metric = dict(snap.metric)
        new_runs = sorted(snap.listing.runs, key=lambda r: r.path)
        self._max_ckpt = max((c.bytes for r in new_runs for c in r.checkpoints), default=1) or 1
        self._max_run = max((r.bytes for r in new_runs), default=1) or 1
        wanted = {r.path for r in new_runs}
        for i in reversed(range(len(self.runs))):
            if self.runs[i].path not in wanted:
                self.beginRemoveRows(QModelIndex(), i, i)
                del self.runs[i]
                self.endRemoveRows()
        for i, run in enumerate(new_runs):
            if i < len(self.runs) and self.runs[i].path == run.path:
                self._sync_run(i, run)
            else:
                self.beginInsertRows(QModelIndex(), i, i)
                # a copy: the rows are synced in place later, and the snapshot's listing stays as it was
                self.runs.insert(i, RunRecord(run.path, run.kind, run.state, list(run.checkpoints)))
                self.endInsertRows()
        if self.runs:
            self.dataChanged.emit(self.index(0, 0), self.index(len(self.runs) - 1, len(COLUMNS) - 1))

    def _sync_run(self, row: int, new: RunRecord) -> None:
        old = self.runs[row]
        parent = self.index(row, 0)
        wanted = [c.path for c in new.checkpoints]
        keep = set(wanted)
        for i in reversed(range(len(old.checkpoints))):
            if old.checkpoints[i].path not in keep:
                self.beginRemoveRows(parent, i, i)
                del old.checkpoints[i]
                self.endRemoveRows()
        by_path = {c.path: c for c in new.checkpoints}
        for i, path in enumerate(wanted):
            if i < len(old.checkpoints) and old.checkpoints[i].path == path:
                old.checkpoints[i] = by_path[path]
            elif path in {c.path for c in old.checkpoints[i:]}:  # reordered (rare): move it here
                j = next(k for k in range(i, len(old.checkpoints)) if old.checkpoints[k].path == path)
                self.beginMoveRows(parent, j, j, parent, i)
                old.checkpoints.insert(i, old.checkpoints.pop(j))
                self.endMoveRows()
                old.checkpoints[i] = by_path[path]
            else:
                self.beginInsertRows(parent, i, i)
                old.checkpoints.insert(i, by_path[path])
                self.endInsertRows()
        old.kind, old.state = new.kind, new.state
        if old.checkpoints:
            self.dataChanged.emit(self.index(0, 0, parent), self.index(len(old.checkpoints) - 1, len(COLUMNS) - 1,
                                                                        parent))
