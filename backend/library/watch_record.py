"""A watch's record of what it did for a run, ``<exports>/.shardscope-watch.json`` (:class:`WatchState`), and the
proof a removal needs: an entry is trusted only when its export is the path this watch writes for that checkpoint
and the export there was made from this very checkpoint (its lineage sidecar names it, with the identity it has
now). NOTE: the record's export path was trusted if any file existed there: a stale or forged record naming
``/etc/hostname`` let ``watch --delete`` remove a checkpoint that was never exported."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from typing import Any

from ..atomic_file import write_atomic
from ..filenames import SMALL_TMP_SUFFIX, WATCH_STATE, lineage_sidecar, within
from ..lineage import CHANGED, SAME, compare, read_sidecar
from .records import CheckpointRecord
from .scan import read_watch_record

STATE_VERSION = 1
EXPORTING, DONE = "exporting", "done"


def identity(c: CheckpointRecord) -> dict[str, float]:
    """What says a checkpoint is the one an export was made from: its bytes on disk and its newest file's time."""
    return {"bytes": c.bytes, "mtime": c.mtime}


def made_from(export_path: str, c: CheckpointRecord, as_it_is: bool = True) -> str:
    """Why the export at ``export_path`` is not proven to be made from checkpoint ``c`` (its lineage sidecar names
    ``c``, or a folder inside it; ``as_it_is``: with its present identity); empty when it is."""
    doc = read_sidecar(lineage_sidecar(export_path, False))
    if doc is None:
        return f"{export_path} has no lineage sidecar of Shardscope's saying what it was made from"
    source = doc["source"]["path"]
    if not within(os.path.realpath(source), os.path.realpath(c.path)):
        return f"{export_path} was made from {source}, not from this checkpoint"
    state = compare(doc).state if as_it_is else SAME
    if state == CHANGED:
        return f"{export_path} was made from this checkpoint as it was before (it changed since)"
    return "" if state == SAME else f"{export_path}: its source cannot be compared with this checkpoint ({state})"


class WatchState:
    """``<exports>/.shardscope-watch.json``: ``{"version": 1, "exports": {checkpoint path: {"identity": {"bytes",
    "mtime"}, "export": path, "state": "exporting"|"done", "format", "step", "tensors", "bytes", "time"
    [, "removed": time]}}}``. An entry is trusted only by :meth:`unverified`: its export is the one this watch
    writes for the checkpoint, is there, and was made from the checkpoint as it is now."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, WATCH_STATE)
        self.entries: dict[str, dict[str, Any]] = read_watch_record(folder)  # a plan on a URL reads none

    def remove_temporaries(self) -> None:
        """Remove what a watch killed while writing this file left (``.<name>.<random>.tmp``): only while we hold
        the run's lock (reading the record for a plan writes nothing)."""
        folder = os.path.dirname(self.path)
        for name in os.listdir(folder):
            if name.startswith(f".{WATCH_STATE}.") and name.endswith(SMALL_TMP_SUFFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))

    def save(self) -> None:
        """Write the whole record atomically."""
        write_atomic(self.path, json.dumps({"version": STATE_VERSION, "exports": self.entries}, indent=1))

    def unverified(self, c: CheckpointRecord, export_path: str) -> str:
        """Why ``c`` has no verified export at ``export_path`` (the path this watch writes for it); empty when
        its entry is done, of this very checkpoint, and the export there is proven made from it."""
        e = self.entries.get(c.path)
        if not e or e.get("state") != DONE:
            return "its export is not verified"
        if e["export"] != export_path:
            return f"its record names the export {e['export']}, not {export_path} (the export this watch writes)"
        if e.get("identity") != identity(c):
            return "saved again since its export"
        if not os.path.exists(export_path):  # a file, or a folder (a Hugging Face model)
            return f"its export {export_path} is missing"
        return made_from(export_path, c)

    def verified(self, c: CheckpointRecord, export_path: str) -> dict[str, Any] | None:
        """The entry of ``c``'s verified export at ``export_path`` (see :meth:`unverified`), else None."""
        return None if self.unverified(c, export_path) else self.entries[c.path]


@contextlib.contextmanager
def run_lock(folder: str) -> Iterator[bool]:
    """Hold a run's exports folder (a flock on the folder itself): True when no other watch works on it."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the flock


__all__ = ["DONE", "EXPORTING", "STATE_VERSION", "WatchState", "identity", "made_from", "run_lock"]
