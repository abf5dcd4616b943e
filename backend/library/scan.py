"""Find every checkpoint under some roots, cheaply: names and ``stat`` only, plus a few header bytes.

A listing never reads a whole ``.metadata`` (writer ranks come from file names, bytes from
``st_blocks``), never follows a symlink, and never descends into a checkpoint's own files.
Checkpoints are grouped by run: a Shardscope run directory (``config.json`` + ``status.json``),
else the folder that holds them (the one above a ``checkpoints/`` folder).
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint.items import MAX_SAFETENSORS_HEADER, ItemFormatError, parse_safetensors_header, zip_records
from ..checkpoint.model import MAX_INDEX
from ..checkpoint.storage import LocalHandles
from ..errors import ShardscopeError
from ..format import ranks_text  # noqa: F401  (re-exported: the Library's column)
from ..procs import pid_alive
from ..progress import Progress
from ..runs.rundir import ACTIVE_STATES, is_zombie, read_status
from .records import (
    CHECKPOINT_HOLDERS,
    RESUMABLE,
    RUN_SKIP_DIRS,
    SKIP_DIRS,
    WEIGHTS,
    CheckpointRecord,
    classify_folder,
    folder_state,
    is_checkpoint_file,
    read_head,
    step_from_name,
)
from .remote_scan import RemoteScanner, list_url

STATES = ("complete", "incomplete", "writing", "unreadable")
WRITING_SECONDS = 5.0  # files changed this recently are still being written
PRUNE_PREFIX = ".shardscope-prune-"  # a checkpoint renamed out of the way by an unfinished prune
URL_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")
MP_RANK_RE = re.compile(r"^mp_rank_(\d+)")  # Megatron-LM's per-model-parallel-rank folders
MAX_DEPTH = 24


OPTIMIZER_MARKS = (b"param_groups", b"optimizer_states")  # any torch optimizer's state_dict; Lightning's key
MAX_KIND_PROBE = 16 << 20  # bytes of a torch file's pickle read to tell its kind


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


@dataclass(frozen=True, slots=True)
class Leftover:
    """A checkpoint an interrupted prune renamed out of the way; the next prune (or ls) finishes it."""

    path: str  # the hidden name
    original: str  # where the checkpoint was
    mode: str  # "trash" or "delete"


@dataclass(slots=True)
class Listing:
    """What a scan found under ``roots``: runs with their checkpoints, leftovers of interrupted prunes."""

    roots: list[str]
    runs: list[RunRecord]
    leftovers: list[Leftover] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)  # with missing_ok: why a root could not be listed

    @property
    def checkpoints(self) -> list[CheckpointRecord]:
        """Every checkpoint of every run, in run order."""
        return [c for r in self.runs for c in r.checkpoints]

    @property
    def bytes(self) -> int:
        """Total bytes of all runs' checkpoints."""
        return sum(r.bytes for r in self.runs)

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


def leftover_of(path: str) -> Leftover | None:
    """The :class:`Leftover` a hidden ``.shardscope-prune-<mode>-<name>`` path stands for."""
    name = os.path.basename(path)
    if not name.startswith(PRUNE_PREFIX):
        return None
    rest = name[len(PRUNE_PREFIX):]
    for mode in ("trash", "delete"):
        if rest.startswith(mode + "-") and len(rest) > len(mode) + 1:
            return Leftover(path, os.path.join(os.path.dirname(path), rest[len(mode) + 1:]), mode)
    return None


# ---------------------------------------------------------------------------------------------- scanning
class _Scanner:
    def __init__(self, now: float, writing_seconds: float, progress: Progress | None) -> None:
        self.now = now
        self.writing_seconds = writing_seconds
        self.progress = progress
        self.found: list[CheckpointRecord] = []
        self.run_dirs: dict[str, str] = {}  # path -> kind
        self.run_states: dict[str, str | None] = {}  # runs under a URL root: their state, read while listing
        self.unreachable: list[str] = []
        self.leftovers: list[Leftover] = []
        self.root = ""

    def scan_root(self, root: str) -> None:
        self.root = root
        if os.path.isfile(root):
            rec = self.file_checkpoint(root, os.lstat(root)) if is_checkpoint_file(os.path.basename(root)) else None
            if rec is not None:
                self.found.append(rec)
            return
        self.walk(root, 0, None)

    def walk(self, path: str, depth: int, run: str | None) -> None:
        if self.progress is not None:
            self.progress.check()
        try:
            with os.scandir(path) as it:
                entries = list(it)
        except OSError:
            if step_from_name(os.path.basename(path)) is not None:
                self.found.append(CheckpointRecord(path, run or self.default_run(path), step_from_name(
                    os.path.basename(path)), "?", [], 0, 0.0, "unreadable", "the folder cannot be listed"))
            return
        files = {e.name: e for e in entries if e.is_file(follow_symlinks=False)}
        dirs = [e for e in entries if e.is_dir(follow_symlinks=False)]
        fmt = classify_folder(os.path.basename(path), files, [d.name for d in dirs])
        if fmt is not None:
            self.found.append(self.folder_checkpoint(path, fmt, files, dirs, run))
            return
        if "config.json" in files and "status.json" in files:
            run = path
            self.run_dirs[path] = "shardscope"
        mark = len(self.found)
        self.walk_contents(path, files, dirs, depth, run)
        step = step_from_name(os.path.basename(path))
        children = self.found[mark:]
        depth_of = path.count(os.sep)
        if step is not None and run != path and children and all(
                step_from_name(c.name) is None and c.path.count(os.sep) - depth_of <= 2 for c in children):
            # a step folder of parts (model.pt + optim.pt, Megatron's mp_rank_NN/, model/ + optim/ DCP folders)
            del self.found[mark:]
            self.found.append(self.composite(path, step, children, files, dirs, run))

    def walk_contents(self, path: str, files: dict[str, os.DirEntry], dirs: list[os.DirEntry], depth: int,
                      run: str | None) -> None:
        """Consolidated files in a folder that is not a checkpoint, then its subfolders; leftovers of prunes."""
        for name, entry in files.items():
            if is_checkpoint_file(name):
                rec = self.file_checkpoint(entry.path, entry.stat(follow_symlinks=False), run)
                if rec is not None:
                    self.found.append(rec)
        for d in dirs:
            leftover = leftover_of(d.path)
            if leftover is not None:
                self.leftovers.append(leftover)
            elif not d.name.startswith(".") and d.name not in SKIP_DIRS and depth < MAX_DEPTH and \
                    not (run == path and d.name in RUN_SKIP_DIRS):
                self.walk(d.path, depth + 1, run)
        for name in files:
            leftover = leftover_of(os.path.join(path, name))
            if leftover is not None:
                self.leftovers.append(leftover)

    def composite(self, path: str, step: int, parts: list[CheckpointRecord], files: dict[str, os.DirEntry],
                  dirs: list[os.DirEntry], run: str | None) -> CheckpointRecord:
        """One checkpoint made of the checkpoints found inside a step folder."""
        total, newest, count = _usage(path, files.values(), dirs)
        mp_ranks = {int(m.group(1)) for d in dirs if (m := MP_RANK_RE.match(d.name))}
        formats = {c.format for c in parts}
        fmt = "megatron" if mp_ranks else formats.pop() if len(formats) == 1 else "mixed"
        ranks = sorted(set().union(mp_ranks, *(c.ranks for c in parts)))
        state = next((s for s in ("writing", "incomplete", "unreadable") if any(c.state == s for c in parts)),
                     "complete")
        reason = next((f"{os.path.relpath(c.path, path)}: {c.reason}" for c in parts if c.state == state and c.reason),
                      "")
        kind = RESUMABLE if any(c.kind == RESUMABLE for c in parts) else WEIGHTS
        rec = CheckpointRecord(path, run or self.default_run(path), step, fmt, ranks, total, newest, state, reason,
                               False, count, kind)
        self.mark_writing(rec)
        return rec

    def scan_url(self, url: str) -> None:
        """Checkpoints under an fsspec URL (one listing; see :mod:`.remote_scan`)."""
        fs, tree = list_url(url)
        remote = RemoteScanner(fs, tree)
        remote.walk(tree.root)
        for rec in remote.found:
            self.mark_writing(rec)
            self.found.append(rec)
        self.run_states.update(remote.run_states)
        self.run_dirs.update(dict.fromkeys(remote.run_states, "shardscope"))

    def default_run(self, ckpt_path: str) -> str:
        """The folder holding a checkpoint, or the one above a ``checkpoints/`` folder."""
        parent = os.path.dirname(ckpt_path)
        if os.path.basename(parent).lower() in CHECKPOINT_HOLDERS:
            above = os.path.dirname(parent)
            if is_shardscope_run(above):
                self.run_dirs[above] = "shardscope"
            return above
        return parent

    def folder_checkpoint(self, path: str, fmt: str, files: dict[str, os.DirEntry], dirs: list[os.DirEntry],
                          run: str | None) -> CheckpointRecord:
        total, newest, count = _usage(path, files.values(), dirs)
        names = set(files)
        state, reason, ranks = folder_state(path, fmt, names, [d.name for d in dirs])
        if fmt == "dcp" and state == "complete":
            fmt = _dcp_serialisation(path, names)
        step = step_from_name(os.path.basename(path))
        if step is None and "trainer_state.json" in names:
            step = _trainer_state_step(os.path.join(path, "trainer_state.json"))
        rec = CheckpointRecord(path, run or self.default_run(path), step, fmt, ranks, total, newest, state,
                               reason, False, count)
        self.mark_writing(rec)
        return rec

    def file_checkpoint(self, path: str, st: os.stat_result, run: str | None = None) -> CheckpointRecord | None:
        state, reason, fmt = file_state(path, st.st_size)
        if fmt is None:
            return None
        kind = torch_file_kind(path, st.st_size) if fmt == "torch" and state == "complete" else ""
        rec = CheckpointRecord(path, run or self.default_run(path), step_from_name(os.path.basename(path)), fmt, [],
                               disk_bytes(st), st.st_mtime, state, reason, True, 1, kind)
        self.mark_writing(rec)
        return rec

    def mark_writing(self, rec: CheckpointRecord) -> None:
        age = self.now - rec.mtime
        if -60 < age < self.writing_seconds and rec.state != "unreadable":
            rec.state, rec.reason = "writing", f"files changed {max(age, 0):.0f} s ago"


def is_shardscope_run(path: str) -> bool:
    """A run directory Shardscope launched (see :mod:`..runs.rundir`): config.json and status.json."""
    return os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "status.json"))


def run_state(path: str) -> str | None:
    """A Shardscope run's state, read-only: an active state whose local torchrun is gone reads "ended"
    (``shardscope train``/the Training panel record the final state; a listing never writes)."""
    status = read_status(path)
    state = status.get("state")
    if state in ACTIVE_STATES and status.get("scheduler") != "slurm" and "pid" in status and \
            (not pid_alive(status.get("pid")) or is_zombie(status.get("pid"))):
        return "ended"
    return state if isinstance(state, str) else None


def is_url(path: str) -> bool:
    """``scheme://...`` other than ``file://`` (as checkpoint.remote decides; here without importing numpy)."""
    m = URL_RE.match(path)
    return bool(m) and m.group(1) != "file"


def within(path: str, root: str) -> bool:
    """True when ``path`` is ``root`` itself or lies inside it (whole path parts, not a string prefix)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def disk_bytes(st: os.stat_result) -> int:
    """Bytes a file takes on disk (``st_blocks``); the size where a file system reports no blocks."""
    blocks = getattr(st, "st_blocks", None)
    if blocks is None or (blocks == 0 and st.st_size > 0):
        return st.st_size
    return blocks * 512


def _usage(path: str, files: Iterable[os.DirEntry], dirs: list[os.DirEntry]) -> tuple[int, float, int]:
    """Bytes on disk, newest mtime and file count of a checkpoint folder (its subfolders too; no symlinks)."""
    total, count = 0, 0
    try:
        newest = os.lstat(path).st_mtime
    except OSError:
        newest = 0.0
    for e in files:
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        total += disk_bytes(st)
        newest = max(newest, st.st_mtime)
        count += 1
    for d in dirs:
        try:
            with os.scandir(d.path) as it:
                sub = list(it)
        except OSError:
            continue
        t, n, c = _usage(d.path, [e for e in sub if e.is_file(follow_symlinks=False)],
                         [e for e in sub if e.is_dir(follow_symlinks=False)])
        total, newest, count = total + t, max(newest, n), count + c
    return total, newest, count


# ---------------------------------------------------------------------------------------------- classification


def _dcp_serialisation(path: str, names: set[str]) -> str:
    """``dcp-safetensors`` when the data files are safetensors (torch's SerializationFormat.SAFETENSORS)."""
    data = sorted(n for n in names if n.endswith(".distcp"))
    if not data:
        return "dcp"
    head = read_head(os.path.join(path, data[0]), 9)
    if head and len(head) == 9 and head[:2] != b"PK" and head[8:9] == b"{":
        return "dcp-safetensors"
    return "dcp"


def file_state(path: str, size: int) -> tuple[str, str, str | None]:
    """(state, reason, format) of a consolidated file; format None when it is not a checkpoint at all."""
    if path.endswith(".safetensors"):
        return (*_safetensors_state(path, size), "safetensors")
    head = read_head(path, 4)
    if head is None:
        return "unreadable", "the file cannot be read", "torch"
    if size == 0:
        return "incomplete", "an empty file", "torch"
    if head[:1] == b"\x80":
        return "complete", "", "torch"  # torch's legacy (pre-zip) format
    if head != b"PK\x03\x04":
        return ("unreadable", "not a torch.save file", "torch") if not path.endswith(".bin") else ("", "", None)
    # torch.save writes no zip comment, so a whole archive ends with its end-of-central-directory record
    tail = read_head(path, 4, -22) if size >= 22 else None
    if tail != b"PK\x05\x06":
        return "incomplete", "truncated: the zip archive has no end record (torch.save did not finish)", "torch"
    return "complete", "", "torch"


def torch_file_kind(path: str, size: int) -> str:
    """``resumable`` when a torch file's pickle names an optimizer's state (``param_groups``, Lightning's
    ``optimizer_states``), else ``weights``: read from the archive's ``data.pkl`` record (at most 16 MiB), or
    the head of a legacy (pre-zip) file. Nothing is unpickled."""
    data = b""
    head = read_head(path, 4)
    if head == b"PK\x03\x04":
        handles = LocalHandles(os.path.dirname(path) or ".")
        base = os.path.basename(path)
        try:
            pkl = zip_records(handles, base, size).get("data.pkl")
            if pkl and pkl[1] <= MAX_KIND_PROBE:
                data = handles.read(base, pkl[0], pkl[1])
        except (ItemFormatError, ShardscopeError):
            data = b""  # not an archive torch maps: its tensors are not readable, so it resumes nothing either
        finally:
            handles.close()
    elif head and head[:1] == b"\x80":
        data = read_head(path, MAX_KIND_PROBE) or b""
    return RESUMABLE if any(mark in data for mark in OPTIMIZER_MARKS) else WEIGHTS


def _safetensors_state(path: str, size: int) -> tuple[str, str]:
    """Whether a safetensors file is whole: its header parsed by the one parser (headers over 1 MiB only
    length-checked, to keep a scan quick), and its data ending within the file."""
    head = read_head(path, 8)
    if head is None:
        return "unreadable", "the file cannot be read"
    if len(head) < 8:
        return "incomplete", "shorter than a safetensors header"
    (n,) = struct.unpack("<Q", head)
    if 8 + n > size:
        return ("incomplete", "truncated inside its header") if n <= MAX_SAFETENSORS_HEADER else \
            ("unreadable", f"header length {n} is implausible")
    if n > 1 << 20:
        return "complete", ""
    try:
        with LocalHandles(os.path.dirname(path) or ".") as handles:
            end = parse_safetensors_header(handles, os.path.basename(path), 0, size, MAX_INDEX).end
    except ItemFormatError as exc:
        return "unreadable", f"the safetensors header does not parse ({exc})"
    except ShardscopeError:
        return "unreadable", "the file cannot be read"
    if end > size:
        return "incomplete", f"truncated: the header needs {end} bytes, the file has {size}"
    return "complete", ""


def _trainer_state_step(path: str) -> int | None:
    try:
        if os.path.getsize(path) > 64 << 20:
            return None
        with open(path, "rb") as f:
            step = json.load(f).get("global_step")
        return int(step) if isinstance(step, int) else None
    except (OSError, ValueError, AttributeError):
        return None


# ---------------------------------------------------------------------------------------------- entry point
def resolve_root(root: str | os.PathLike) -> str:
    """The absolute, symlink-free path of a root (what every checkpoint path starts with)."""
    return os.path.realpath(os.path.abspath(os.path.expanduser(str(root))))


def scan(roots: Iterable[str | os.PathLike], now: float | None = None, writing_seconds: float = WRITING_SECONDS,
         progress: Progress | None = None, missing_ok: bool = False) -> Listing:
    """Every checkpoint under ``roots``, grouped by run (a missing root is an error unless ``missing_ok``).

    A checkpoint is ``writing`` when one of its files changed within ``writing_seconds``, or when it
    is the newest checkpoint of a running Shardscope run and not yet complete."""
    now = time.time() if now is None else now
    scanner = _Scanner(now, writing_seconds, progress)
    resolved = []
    for root in roots:
        if is_url(str(root)):
            try:
                scanner.scan_url(str(root))
            except ShardscopeError as exc:
                if not missing_ok:
                    raise
                scanner.unreachable.append(str(exc))
            resolved.append(str(root).rstrip("/"))
            continue
        path = resolve_root(root)
        if not os.path.exists(path):
            if missing_ok:
                continue
            raise ShardscopeError(f"{root}: no such file or folder.")
        if path not in resolved:
            resolved.append(path)
            scanner.scan_root(path)
    seen: set[str] = set()
    runs: dict[str, RunRecord] = {}
    for rec in scanner.found:
        if rec.path in seen:  # overlapping roots
            continue
        seen.add(rec.path)
        run = runs.get(rec.run)
        if run is None:
            kind = scanner.run_dirs.get(rec.run, "folder")
            state = scanner.run_states[rec.run] if rec.run in scanner.run_states else \
                run_state(rec.run) if kind == "shardscope" else None
            run = runs[rec.run] = RunRecord(rec.run, kind, state)
        run.checkpoints.append(rec)
    for path, kind in scanner.run_dirs.items():  # a run that has no checkpoint yet is listed too
        if path not in runs:
            runs[path] = RunRecord(path, kind, run_state(path))
    for run in runs.values():
        run.checkpoints.sort(key=order_key)
        if run.running and run.checkpoints and run.checkpoints[-1].state == "incomplete":
            last = run.checkpoints[-1]
            last.state, last.reason = "writing", "the run is running and this save has not finished"
    ordered = sorted(runs.values(), key=lambda r: r.path)
    return Listing(resolved, ordered, sorted(set(scanner.leftovers), key=lambda x: x.path), scanner.unreachable)
