"""Checkpoints under an fsspec URL (``s3://bucket/runs``, ``gs://...``): one recursive listing of the
prefix, then the same classification by names as on a local disk. No object is opened except a Shardscope
run's ``status.json``; sizes are the objects' sizes, times their last-modified stamps."""

from __future__ import annotations

import datetime as dt
import json
import posixpath
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, ShardscopeError
from .records import (
    CHECKPOINT_HOLDERS,
    RUN_SKIP_DIRS,
    SKIP_DIRS,
    CheckpointRecord,
    classify_folder,
    folder_state,
    is_checkpoint_file,
    step_from_name,
)


def _mtime(info: dict[str, Any]) -> float:
    for key in ("mtime", "LastModified", "last_modified", "updated", "timeCreated", "created"):
        v = info.get(key)
        if isinstance(v, int | float):
            return float(v)
        if isinstance(v, dt.datetime):
            return v.timestamp()
        if isinstance(v, str):
            try:
                return dt.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


@dataclass
class RemoteTree:
    """A prefix's objects as folders: files (name -> size, mtime) and subfolders per folder."""

    root: str
    files: dict[str, dict[str, tuple[int, float]]] = field(default_factory=dict)
    dirs: dict[str, set[str]] = field(default_factory=dict)

    def add(self, key: str, size: int, mtime: float) -> None:
        """Record object ``key`` (size, mtime) and register each folder above it up to the root."""
        parent, name = posixpath.split(key.rstrip("/"))
        self.files.setdefault(parent, {})[name] = (size, mtime)
        while len(parent) > len(self.root):
            up, sub = posixpath.split(parent)
            self.dirs.setdefault(up, set()).add(sub)
            parent = up

    def usage(self, folder: str) -> tuple[int, float, int]:
        """Bytes, newest time and object count of everything under ``folder``."""
        total, newest, count = 0, 0.0, 0
        for size, mtime in self.files.get(folder, {}).values():
            total, newest, count = total + size, max(newest, mtime), count + 1
        for sub in self.dirs.get(folder, ()):
            t, n, c = self.usage(f"{folder}/{sub}")
            total, newest, count = total + t, max(newest, n), count + c
        return total, newest, count


def list_url(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, RemoteTree]:
    """The filesystem and the tree of objects under ``url`` (one recursive listing)."""
    from ..checkpoint.remote import call, fs_for  # imports numpy: only when a URL is listed

    fs, root = fs_for(url, storage_options)
    root = root.rstrip("/")
    found = call(url, fs.find, root, withdirs=False, detail=True, doing="cannot list it")
    if not found and not call(url, fs.exists, root):
        raise ShardscopeError(f"{url}: no such file or folder.")
    tree = RemoteTree(root)
    for key, info in found.items():
        tree.add(key, int(info.get("size") or 0), _mtime(info))
    return fs, tree


def _run_state(fs: Any, path: str) -> str | None:
    from ..checkpoint.remote import call

    try:
        status = json.loads(call(path, fs.cat_file, f"{path}/status.json"))
    except (CheckpointError, ValueError):  # missing or half-written: the state is unknown
        return None
    state = status.get("state") if isinstance(status, dict) else None
    return state if isinstance(state, str) else None


class RemoteScanner:
    """Walks a :class:`RemoteTree` as the local scanner walks a disk; records carry URLs."""

    def __init__(self, fs: Any, tree: RemoteTree) -> None:
        self.fs, self.tree = fs, tree
        self.found: list[CheckpointRecord] = []
        self.run_states: dict[str, str | None] = {}  # URL of a Shardscope run -> its state

    def url(self, path: str) -> str:
        """The full URL (with protocol) of bucket path ``path``."""
        return self.fs.unstrip_protocol(path)

    def default_run(self, path: str) -> str:
        """URL of the run a checkpoint at ``path`` belongs to: its parent, skipping a "checkpoints"-like folder."""
        parent = posixpath.dirname(path)
        if posixpath.basename(parent).lower() in CHECKPOINT_HOLDERS and len(parent) > len(self.tree.root):
            parent = posixpath.dirname(parent)
        return self.url(parent)

    def walk(self, path: str, run: str | None = None, depth: int = 0) -> None:
        """Collect checkpoints under ``path`` into ``found``, tracking the run folder; stops inside a checkpoint."""
        files = self.tree.files.get(path, {})
        subs = sorted(self.tree.dirs.get(path, ()))
        fmt = classify_folder(posixpath.basename(path), files, subs)
        if fmt is not None:
            self.found.append(self.folder(path, fmt, set(files), subs, run))
            return
        if "config.json" in files and "status.json" in files:
            run = self.url(path)
            self.run_states[run] = _run_state(self.fs, path)
        for name, (size, mtime) in files.items():
            if is_checkpoint_file(name):
                full = f"{path}/{name}"
                state = "complete" if size else "incomplete"
                self.found.append(CheckpointRecord(
                    self.url(full), run or self.default_run(full), step_from_name(name),
                    "safetensors" if name.endswith(".safetensors") else "torch", [], size, mtime, state,
                    "" if size else "an empty object", True, 1))
        for sub in subs:
            if not sub.startswith(".") and sub not in SKIP_DIRS and depth < 24 and \
                    not (run == self.url(path) and sub in RUN_SKIP_DIRS):
                self.walk(f"{path}/{sub}", run, depth + 1)

    def folder(self, path: str, fmt: str, names: set[str], subs: list[str], run: str | None) -> CheckpointRecord:
        """A record for checkpoint folder ``path``: size, newest mtime and state from its listing (no reads)."""
        total, newest, count = self.tree.usage(path)
        state, reason, ranks = folder_state(path, fmt, names, subs, probe=False)
        return CheckpointRecord(self.url(path), run or self.default_run(path),
                                step_from_name(posixpath.basename(path)), fmt, ranks, total, newest, state, reason,
                                False, count)
