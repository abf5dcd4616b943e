"""Find every checkpoint under some roots, cheaply: names and ``stat`` only, plus a few header bytes.

A listing never reads a whole ``.metadata`` (writer ranks come from file names, bytes from
``st_blocks``), never follows a symlink, and never descends into a checkpoint's own files.
Checkpoints are grouped by run: a Shardscope run directory (``config.json`` + ``status.json``),
else the folder that holds them (the one above a ``checkpoints/`` folder). The walk itself is
:mod:`.walk`'s, over a local disk here (:class:`LocalTree`) or a URL (:mod:`.remote_scan`).
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..checkpoint.manifest import UNSEALED, seal_state
from ..errors import ShardscopeError
from ..filenames import LINEAGE_FILE_SUFFIX, MANIFEST_NAME, WATCH_STATE, is_url, step_from_name
from ..formats import Format
from ..formats.base import Facts
from ..lineage import MISSING, REMOVED, Lineage, read_lineage
from ..progress import Progress
from ..runs.rundir import run_state
from .names import WRITING_SECONDS
from .probe_cache import ProbeCache
from .records import CheckpointRecord, Listing, RunRecord, order_key
from .remote_scan import list_url
from .walk import FileFacts, FolderFacts, Walker


def disk_bytes(st: os.stat_result) -> int:
    """Bytes a file takes on disk (``st_blocks``); the size where a file system reports no blocks."""
    blocks = getattr(st, "st_blocks", None)
    if blocks is None or (blocks == 0 and st.st_size > 0):
        return st.st_size
    return blocks * 512


def is_shardscope_run(path: str) -> bool:
    """A run directory Shardscope launched (see :mod:`..runs.rundir`): config.json and status.json."""
    return os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "status.json"))


class LocalTree:
    """A local disk as the walk lists it: ``os.scandir``, no symlinks followed; files keep their ``DirEntry``
    (stat only when needed), and checkpoints are probed by a few header bytes."""

    sep = os.sep

    def __init__(self, probes: ProbeCache | None = None) -> None:
        self.probes = probes
        self.odd: set[str] = set()  # folders listed with an entry neither file nor folder (a symlink, a fifo)

    def list(self, path: str) -> tuple[dict[str, os.DirEntry], list[str]] | None:
        files: dict[str, os.DirEntry] = {}
        dirs: list[str] = []
        try:
            with os.scandir(path) as it:
                for e in it:  # one pass: the type comes with the listing (d_type), no stat
                    if e.is_file(follow_symlinks=False):
                        files[e.name] = e
                    elif e.is_dir(follow_symlinks=False):
                        dirs.append(e.name)
                    else:
                        self.odd.add(path)
        except OSError:
            return None
        return files, dirs

    def url(self, path: str) -> str:
        return path

    def is_run(self, path: str) -> bool:
        return is_shardscope_run(path)

    def run_state(self, path: str) -> str | None:
        return run_state(path)

    def file_facts(self, path: str, info: os.DirEntry | os.stat_result, fmt: Format) -> FileFacts | None:
        st = info.stat(follow_symlinks=False) if isinstance(info, os.DirEntry) else info
        facts = self.probe(path, fmt, {os.path.basename(path): st}, lambda: fmt.probe_file(path, st.st_size))
        if facts is None:
            return None
        return FileFacts(facts.format, facts.state, facts.reason, disk_bytes(st), st.st_mtime, facts.kind,
                         facts.pinned)

    def folder_facts(self, path: str, fmt: Format, files: dict[str, Any], dirs: builtins.list[str]) -> FolderFacts:
        f = self.probe(path, fmt, None if dirs else files, lambda: fmt.probe_folder(path, set(files), dirs))
        if f is None:  # a folder probe always answers
            raise AssertionError(f"{path}: the {fmt.name} probe gave no facts")
        step = step_from_name(os.path.basename(path))
        return FolderFacts(f.format, f.state, f.reason, f.ranks, step if step is not None else f.step, f.kind,
                           f.pinned)

    def probe(self, path: str, fmt: Format, files: dict[str, Any] | None, read: Callable[[], Facts | None]
              ) -> Facts | None:
        """``read()`` (a format's probe of ``files``), or what it returned for the same files at an earlier listing;
        ``files`` None: not cached (see :mod:`.probe_cache`)."""
        probes = self.probes
        if probes is None or files is None or not fmt.probe_reads_own_files:
            return read()
        key = probes.key(fmt.name, files)
        if key is not None and (hit := probes.get(path, key)) is not None:
            return hit
        facts = read()
        if key is not None and facts is not None and facts.state != "unreadable":  # a read error may pass
            probes.put(path, key, facts)
        return facts

    def lineage(self, sidecar: str) -> Lineage | None:
        """The sidecar's lineage; a missing source that a watch removed by its rules (the watch record beside the
        export says so, for this export) is ``removed by watch``, not missing: that is the design."""
        found = read_lineage(sidecar)
        if found is None or found.state != MISSING:
            return found
        export = sidecar[:-len(LINEAGE_FILE_SUFFIX)]
        entry = read_watch_record(os.path.dirname(export)).get(found.source)
        if entry and entry["export"] == export and "removed" in entry:
            return dataclasses.replace(found, state=REMOVED)
        return found

    def seal_state(self, path: str, is_folder: bool, files: dict[str, Any] | None = None) -> str:
        if files is not None and MANIFEST_NAME not in files and path not in self.odd:
            return UNSEALED  # the folder as listed has no manifest: nothing to open (10,000 failed opens saved)
        return seal_state(path, is_folder)

    def usage(self, path: str, files: dict[str, os.DirEntry], dirs: builtins.list[str]) -> tuple[int, float, int]:
        """Bytes on disk, newest mtime and file count of a checkpoint folder (its subfolders too; no symlinks)."""
        total, count = 0, 0
        try:
            newest = os.lstat(path).st_mtime
        except OSError:
            newest = 0.0
        for e in files.values():
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            total += disk_bytes(st)
            if st.st_mtime > newest:
                newest = st.st_mtime
            count += 1
        for d in dirs:
            sub = os.path.join(path, d)
            listed = self.list(sub)
            if listed is None:
                continue
            t, n, c = self.usage(sub, *listed)
            total, newest, count = total + t, max(newest, n), count + c
        return total, newest, count


def read_watch_record(folder: str) -> dict[str, dict[str, Any]]:
    """The entries of the watch record in an exports folder (``.shardscope-watch.json``, see
    :class:`.watch.WatchState`): checkpoint path -> its entry (a dict naming its ``export``); {} for none."""
    try:
        if is_url(folder):  # a plan on object storage: no record is read there
            raise OSError
        with open(os.path.join(folder, WATCH_STATE), encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError, RecursionError):
        value = {}
    exports = value.get("exports") if isinstance(value, dict) else None
    return {k: v for k, v in (exports or {}).items()
            if isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("export"), str)}


def link_exports(checkpoints: list[CheckpointRecord]) -> None:
    """Give each checkpoint the exports (found in the same scan) whose lineage names it as their source."""
    by_path = {c.path: c for c in checkpoints}
    for c in checkpoints:
        src = by_path.get(c.lineage.source) if c.lineage is not None else None
        if src is not None and src is not c:
            src.exports.append(c.path)


def resolve_root(root: str | os.PathLike) -> str:
    """The absolute, symlink-free path of a root (what every checkpoint path starts with)."""
    return os.path.realpath(os.path.abspath(os.path.expanduser(str(root))))


def scan(roots: Iterable[str | os.PathLike], now: float | None = None, writing_seconds: float = WRITING_SECONDS,
         progress: Progress | None = None, missing_ok: bool = False) -> Listing:
    """Every checkpoint under ``roots``, grouped by run (a missing root is an error unless ``missing_ok``).

    A checkpoint is ``writing`` when one of its files changed within ``writing_seconds``, or when it
    is the newest checkpoint of a running Shardscope run and not yet complete."""
    now = time.time() if now is None else now
    walkers: list[Walker] = []
    unreachable: list[str] = []
    resolved = []
    for root in roots:
        if is_url(str(root)):
            try:
                tree = list_url(str(root))
            except ShardscopeError as exc:
                if not missing_ok:
                    raise
                unreachable.append(str(exc))
            else:
                walkers.append(Walker(tree, now, writing_seconds, progress))
                walkers[-1].walk(tree.root)
            resolved.append(str(root).rstrip("/"))
            continue
        path = resolve_root(root)
        if not os.path.exists(path):
            if missing_ok:
                continue
            raise ShardscopeError(f"{root}: no such file or folder.")
        if path not in resolved:
            resolved.append(path)
            probes = ProbeCache.for_root(path)
            walkers.append(Walker(LocalTree(probes), now, writing_seconds, progress))
            if os.path.isfile(path):
                walkers[-1].walk_file(path, os.lstat(path))
            else:
                walkers[-1].walk(path)
            if probes is not None:
                probes.save()
    run_states = {p: s for w in walkers for p, s in w.run_states.items()}
    seen: set[str] = set()
    runs: dict[str, RunRecord] = {}
    for rec in (c for w in walkers for c in w.found):
        if rec.path in seen:  # overlapping roots
            continue
        seen.add(rec.path)
        run = runs.get(rec.run)
        if run is None:
            shardscope = rec.run in run_states
            run = runs[rec.run] = RunRecord(rec.run, "shardscope" if shardscope else "folder",
                                            run_states[rec.run] if shardscope else None)
        run.checkpoints.append(rec)
    for path, state in run_states.items():  # a run that has no checkpoint yet is listed too
        if path not in runs:
            runs[path] = RunRecord(path, "shardscope", state)
    link_exports([c for r in runs.values() for c in r.checkpoints])
    for run in runs.values():
        run.checkpoints.sort(key=order_key)
        if run.running and run.checkpoints and run.checkpoints[-1].state == "incomplete":
            last = run.checkpoints[-1]
            last.state, last.reason = "writing", "the run is running and this save has not finished"
    ordered = sorted(runs.values(), key=lambda r: r.path)
    leftovers = {x for w in walkers for x in w.leftovers}
    strays = sorted({x for w in walkers for x in w.strays})
    return Listing(resolved, ordered, sorted(leftovers, key=lambda x: x.path), strays, unreachable)
