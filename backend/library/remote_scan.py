"""Checkpoints under an fsspec URL (``s3://bucket/runs``, ``gs://...``): one recursive listing of the
prefix (:class:`RemoteTree`), walked by :mod:`.walk` as a local disk is. No object is opened except a
Shardscope run's ``status.json`` and the exports' small lineage sidecars (in one batch); sizes are the
objects' sizes, times their last-modified stamps."""

from __future__ import annotations

import builtins
import datetime as dt
import json
import logging
import posixpath
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, ShardscopeError
from ..filenames import LINEAGE_FILE_SUFFIX, step_from_name
from ..formats import Format
from ..lineage import MAX_SIDECAR_BYTES, Lineage, compare, parse_sidecar
from ..runs.rundir import state_of
from .walk import RUN_FILES, FileFacts, FolderFacts

log = logging.getLogger(__name__)
# a sidecar's bytes by (URL, size, time): the Library lists a URL root on every poll; an unchanged sidecar is not
# read again
_sidecar_memo: dict[tuple[str, int, float], bytes] = {}


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
    """A prefix's objects as folders (files: name -> (size, mtime); subfolders), as :class:`.walk.Tree`
    lists them; paths are the bucket's keys, records carry full URLs."""

    fs: Any
    root: str
    files: dict[str, dict[str, tuple[int, float]]] = field(default_factory=dict)
    dirs: dict[str, set[str]] = field(default_factory=dict)
    sidecars: dict[str, Any] | None = None  # every lineage sidecar's bytes by path, read at the first need
    sep = "/"

    def add(self, key: str, size: int, mtime: float) -> None:
        """Record object ``key`` (size, mtime) and register each folder above it up to the root."""
        parent, name = posixpath.split(key.rstrip("/"))
        self.files.setdefault(parent, {})[name] = (size, mtime)
        while len(parent) > len(self.root):
            up, sub = posixpath.split(parent)
            self.dirs.setdefault(up, set()).add(sub)
            parent = up

    def list(self, path: str) -> tuple[dict[str, tuple[int, float]], list[str]]:
        return self.files.get(path, {}), sorted(self.dirs.get(path, ()))

    def url(self, path: str) -> str:
        """The full URL (with protocol) of bucket path ``path``."""
        return self.fs.unstrip_protocol(path)

    def is_run(self, path: str) -> bool:
        return all(n in self.files.get(path, {}) for n in RUN_FILES)

    def run_state(self, path: str) -> str | None:
        from ..checkpoint.remote import call  # imports numpy: only when a URL is listed

        try:
            status = json.loads(call(path, self.fs.cat_file, f"{path}/status.json"))
        except (CheckpointError, ValueError):  # missing or half-written: the state is unknown
            return None
        return state_of(status, local=False) if isinstance(status, dict) else None

    def file_facts(self, path: str, info: tuple[int, float], fmt: Format) -> FileFacts | None:
        size, mtime = info
        f = fmt.probe_file(path, size, local=False)  # names only: an object's bytes cost a request
        return None if f is None else FileFacts(f.format, f.state, f.reason, size, mtime, f.kind, f.pinned)

    def folder_facts(self, path: str, fmt: Format, files: dict[str, Any], dirs: builtins.list[str]) -> FolderFacts:
        f = fmt.probe_folder(path, set(files), dirs, local=False)
        return FolderFacts(f.format, f.state, f.reason, f.ranks, step_from_name(posixpath.basename(path)), f.kind,
                           f.pinned)

    def seal_state(self, path: str, is_folder: bool, files: dict[str, Any] | None = None) -> str:
        return ""  # a URL's manifest is not read by a listing (verify reads it)

    def lineage(self, sidecar: str) -> Lineage | None:
        """The lineage in an export's sidecar object. NOTE: every sidecar under the root is read at the first
        call, in one batch (fsspec's ``cat`` of a list: concurrent GETs, one per sidecar, in one round), and
        remembered by size and time (a poll reads only new or changed ones); a listing without exports reads
        none. Its source is not compared: it names the writer's local path."""
        if self.sidecars is None:
            self.sidecars = self._read_sidecars()
        raw = self.sidecars.get(sidecar)
        doc = parse_sidecar(raw) if isinstance(raw, bytes) else None
        return None if doc is None else compare(doc, check_source=False)

    def _read_sidecars(self) -> dict[str, Any]:
        from ..checkpoint.remote import call  # imports numpy: only when a URL is listed

        keys = {f"{parent}/{name}": (self.url(f"{parent}/{name}"), size, mtime)
                for parent, files in self.files.items() for name, (size, mtime) in files.items()
                if name.endswith(LINEAGE_FILE_SUFFIX) and size <= MAX_SIDECAR_BYTES}
        out = {p: _sidecar_memo[k] for p, k in keys.items() if k in _sidecar_memo}
        paths = [p for p in keys if p not in out]
        if not paths:
            return out
        try:
            got = call(self.url(self.root), self.fs.cat, paths, on_error="omit", doing="cannot read its exports' "
                       "lineage sidecars")
        except CheckpointError as exc:  # the listing goes on: its exports show no source
            log.info("%s", exc)
            return out
        if len(_sidecar_memo) > 4096:
            _sidecar_memo.clear()
        for k, v in (got.items() if isinstance(got, dict) else ()):
            path = k.split("://", 1)[-1]
            if path in keys and isinstance(v, bytes):
                out[path] = _sidecar_memo[keys[path]] = v
        return out

    def usage(self, folder: str, files: dict[str, Any] | None = None, dirs: Any = None) -> tuple[int, float, int]:
        """Bytes, newest time and object count of everything under ``folder``."""
        total, newest, count = 0, 0.0, 0
        for size, mtime in self.files.get(folder, {}).values():
            total, newest, count = total + size, max(newest, mtime), count + 1
        for sub in self.dirs.get(folder, ()):
            t, n, c = self.usage(f"{folder}/{sub}")
            total, newest, count = total + t, max(newest, n), count + c
        return total, newest, count


def list_url(url: str, storage_options: dict[str, Any] | None = None) -> RemoteTree:
    """The tree of objects under ``url`` (one recursive listing)."""
    from ..checkpoint.remote import call, fs_for  # imports numpy: only when a URL is listed

    fs, root = fs_for(url, storage_options)
    root = root.rstrip("/")
    found = call(url, fs.find, root, withdirs=False, detail=True, doing="cannot list it")
    if not found and not call(url, fs.exists, root):
        raise ShardscopeError(f"{url}: no such file or folder.")
    tree = RemoteTree(fs, root)
    for key, info in found.items():
        tree.add(key, int(info.get("size") or 0), _mtime(info))
    return tree
