"""What a listing finds: checkpoints (:class:`CheckpointRecord`), runs, leftovers of interrupted prunes (their
:class:`~.prune_record.Leftover` is the prune record's)."""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint.manifest import DAMAGED
from ..formats.base import RESUMABLE
from ..lineage import CHANGED, MISSING, Lineage
from ..runs.rundir import ACTIVE_STATES
from .prune_record import Leftover


@dataclass(slots=True)
class CheckpointRecord:
    """One checkpoint found on disk (a folder, or a consolidated file)."""

    path: str
    run: str
    step: int | None
    format: str  # a format's name (see backend/formats; dcp-safetensors: a DCP variant), empty, megatron, mixed
    ranks: list[int]
    bytes: int  # on disk (st_blocks), all files of the checkpoint
    mtime: float  # the newest file's modification time
    state: str  # complete, incomplete, writing, unreadable
    reason: str = ""  # why it is not complete, in a sentence
    is_file: bool = False
    files: int = 0
    # resumable (training state: optimizer or trainer state beside the weights) or weights, as the format's probe
    # says (a torch file or DCP folder by the optimizer keys its pickle names; a file not read: weights)
    kind: str = RESUMABLE
    # why no prune may remove it whatever its rules, in words (its framework's resume pointer names it: see
    # formats.base.Facts.pinned); empty when nothing pins it
    pinned: str = ""
    # an export's lineage sidecar: the checkpoint it was made from, and whether that changed since (see lineage)
    lineage: Lineage | None = None
    # the exports under the same roots whose sidecar names this checkpoint (their paths; set by the scan)
    exports: list[str] = field(default_factory=list)
    # its content manifest by the file system's word (checkpoint.seal.seal_state): sealed, unsealed, damaged,
    # modified; empty where the listing does not look (a URL)
    seal: str = ""

    @property
    def name(self) -> str:
        """The checkpoint's folder or file name (last part of its path)."""
        return os.path.basename(self.path)

    @property
    def source_warning(self) -> str:
        """``source changed`` or ``source missing`` for an export whose source is not as the export read it."""
        if self.lineage is None:
            return ""
        return {CHANGED: "source changed", MISSING: "source missing"}.get(self.lineage.state, "")

    @property
    def unusable(self) -> str:
        """Why no one may resume from it though it may look complete, in words (unreadable, or damaged: its files
        differ from its manifest in number or size); empty when nothing says so."""
        if self.state == "unreadable":
            return f"unreadable ({self.reason})"
        return "damaged (its files differ from its manifest)" if self.seal == DAMAGED else ""

    def lineage_text(self) -> str:
        """One short line: ``from <source>`` for an export (with its warning), ``exported to <name>`` (or ``N
        exports``) for a checkpoint that has exports; empty otherwise."""
        parts = []
        if self.lineage is not None:
            parts.append(f"from {os.path.basename(self.lineage.source.rstrip('/'))}")
            if self.source_warning:
                parts.append(f"\u26a0 {self.source_warning}")
        if len(self.exports) == 1:
            parts.append(f"exported to {os.path.basename(self.exports[0])}")
        elif self.exports:
            parts.append(f"{len(self.exports)} exports")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict (path, run, step, format, ranks, bytes, mtime, state, pinned); an
        export with a lineage sidecar adds its source (``source``, ``source_changed``, ``source_missing``, ...),
        a checkpoint that has exports adds ``exports``."""
        out: dict[str, Any] = {
            "path": self.path, "run": self.run, "step": self.step, "format": self.format, "kind": self.kind,
            "ranks": list(self.ranks), "bytes": self.bytes, "mtime": self.mtime, "state": self.state,
            "pinned": self.pinned, "seal": self.seal or None}
        if self.lineage is not None:
            out.update(self.lineage.to_json())
        if self.exports:
            out["exports"] = list(self.exports)
        return out


@dataclass(slots=True)
class RunRecord:
    """The checkpoints of one run, newest last."""

    path: str
    kind: str  # "shardscope" (a run directory) or "folder"
    state: str | None = None  # a Shardscope run's state (status.json, corrected for a dead launcher)
    checkpoints: list[CheckpointRecord] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The folder's name; with its parent for Lightning's ``version_N`` (``my-exp/version_0``)."""
        base = os.path.basename(self.path.rstrip(os.sep)) or self.path
        if re.fullmatch(r"version_\d+", base):
            return f"{os.path.basename(os.path.dirname(self.path))}/{base}"
        return base

    @property
    def running(self) -> bool:
        """True while the run is still active (its state is one of the active states)."""
        return self.state in ACTIVE_STATES

    @property
    def bytes(self) -> int:
        """Total bytes of the run's checkpoints."""
        return sum(c.bytes for c in self.checkpoints)

    def to_json(self) -> dict[str, Any]:
        """The run as a JSON-ready dict: path, name, bytes and its checkpoints' paths."""
        return {"path": self.path, "name": self.name, "bytes": self.bytes,
                "checkpoints": [c.path for c in self.checkpoints]}


@dataclass(slots=True)
class Listing:
    """What a scan found under ``roots``: runs with their checkpoints, leftovers of interrupted prunes."""

    roots: list[str]
    runs: list[RunRecord]
    leftovers: list[Leftover] = field(default_factory=list)
    # entries with a prune's name that no record of a Shardscope prune proves: (path, why it is kept)
    strays: list[tuple[str, str]] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)  # with missing_ok: why a root could not be listed

    @property
    def checkpoints(self) -> list[CheckpointRecord]:
        """Every checkpoint of every run, in run order."""
        return [c for r in self.runs for c in r.checkpoints]

    @property
    def bytes(self) -> int:
        """Total bytes of all runs' checkpoints."""
        return sum(r.bytes for r in self.runs)

    def of_runs(self, runs: Collection[str]) -> Listing:
        """The part of the listing in these runs (by path): their checkpoints and interrupted prunes."""
        inside = tuple(os.path.join(r, "") for r in runs)
        return Listing(list(self.roots), [r for r in self.runs if r.path in runs],
                       [lo for lo in self.leftovers if lo.original.startswith(inside)],
                       [s for s in self.strays if s[0].startswith(inside)], list(self.unreachable))

    def find(self, path: str) -> CheckpointRecord | None:
        """The checkpoint at exactly ``path``, or None."""
        return next((c for c in self.checkpoints if c.path == path), None)

    def to_json(self) -> dict[str, Any]:
        """The listing as a JSON-ready dict: roots, runs and checkpoints."""
        return {"roots": list(self.roots), "runs": [r.to_json() for r in self.runs],
                "checkpoints": [c.to_json() for c in self.checkpoints]}


def order_key(c: CheckpointRecord) -> tuple[int, float]:
    """Newest last: by step where the name states one, then by time."""
    return (c.step if c.step is not None else -1, c.mtime)
