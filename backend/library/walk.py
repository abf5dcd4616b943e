"""The one walk of a library root, over a :class:`Tree`: a local disk (:class:`.scan.LocalTree`, ``os.scandir``)
or the objects under a URL (:class:`.remote_scan.RemoteTree`, one fsspec listing). Both therefore find the
same things: checkpoint folders and files, step folders of parts (one composite checkpoint), Shardscope run
directories, leftovers of interrupted prunes, down to the same depth. The walk never descends into a
checkpoint's own files, nor into hidden or skipped folders."""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import Any, Protocol

from ..checkpoint.manifest import DAMAGED, MODIFIED, SEALED, UNSEALED
from ..filenames import LINEAGE_FILE_SUFFIX, MP_RANK_RE, step_from_name
from ..formats import RESUMABLE, WEIGHTS, Format, detect_file, detect_folder, megatron
from ..lineage import Lineage
from ..progress import Progress
from .names import CHECKPOINT_HOLDERS, MAX_DEPTH, RUN_SKIP_DIRS, SKIP_DIRS, WRITING_SECONDS
from .prune_record import PRUNE_PREFIX, Leftover, leftovers_in
from .records import CheckpointRecord

MARKED_COMPLETE = frozenset({"dcp", "dcp-safetensors"})  # formats whose save writes a last file that makes it whole

RUN_FILES = ("config.json", "status.json")  # a Shardscope run directory (see runs.rundir)


@dataclass(frozen=True, slots=True)
class FileFacts:
    """A consolidated checkpoint file as its tree sees it."""

    format: str
    state: str
    reason: str
    bytes: int
    mtime: float
    kind: str = ""  # resumable or weights (see formats.base)
    pinned: str = ""  # why no prune may remove it (see formats.base.Facts)


@dataclass(frozen=True, slots=True)
class FolderFacts:
    """A checkpoint folder as its tree sees it."""

    format: str
    state: str
    reason: str
    ranks: list[int]
    step: int | None
    kind: str = ""
    pinned: str = ""  # why no prune may remove it (see formats.base.Facts)


class Tree(Protocol):
    """Where a walk lists folders: paths are the tree's own (a local path, a bucket key); records carry
    :meth:`url` of them. ``files`` maps a folder's file names to whatever the tree needs to look at them."""

    sep: str

    def list(self, path: str) -> tuple[dict[str, Any], list[str]] | None:
        """(files by name, subfolder names) of a folder; None when it cannot be listed."""

    def url(self, path: str) -> str:
        """The path a record carries."""

    def is_run(self, path: str) -> bool:
        """True for a Shardscope run directory (config.json and status.json)."""

    def run_state(self, path: str) -> str | None:
        """A Shardscope run's state, read-only."""

    def file_facts(self, path: str, info: Any, fmt: Format) -> FileFacts | None:
        """A single-file checkpoint's state and kind (its format's probe); None when it is not a checkpoint."""

    def folder_facts(self, path: str, fmt: Format, files: dict[str, Any], dirs: builtins.list[str]) -> FolderFacts:
        """A checkpoint folder's state, ranks, kind and step (its format's probe; the format made precise)."""

    def usage(self, path: str, files: dict[str, Any], dirs: builtins.list[str]) -> tuple[int, float, int]:
        """Bytes, newest modification time and file count of everything in a folder."""

    def lineage(self, sidecar: str) -> Lineage | None:
        """The lineage an export's sidecar at ``sidecar`` records, its source compared with now; None for none."""

    def seal_state(self, path: str, is_folder: bool, files: dict[str, Any] | None = None) -> str:
        """The checkpoint's seal by its manifest and the file system (checkpoint.seal.seal_state); '' unlooked.
        ``files``: a folder's files as listed (no manifest among them: nothing to read)."""


def join(tree: Tree, path: str, name: str) -> str:
    """``path/name`` in the tree's own separator."""
    return f"{path.rstrip(tree.sep)}{tree.sep}{name}"


def split(tree: Tree, path: str) -> tuple[str, str]:
    """(parent, name) of a path in the tree."""
    parent, _, name = path.rstrip(tree.sep).rpartition(tree.sep)
    return parent or tree.sep, name


def composite_seal(own: str, parts: list[str]) -> str:
    """A step folder's seal: its own manifest's when it has one, else its parts' together (any damaged: damaged;
    all sealed: sealed; any modified: modified)."""
    if own != UNSEALED or not parts:
        return own
    return next((s for s in (DAMAGED, MODIFIED) if s in parts), SEALED if set(parts) == {SEALED} else own)


class Walker:
    """Collects what a walk of a :class:`Tree` finds: ``found`` checkpoints, ``run_states`` (every Shardscope
    run directory's URL and state), ``leftovers`` of interrupted prunes."""

    def __init__(self, tree: Tree, now: float, writing_seconds: float = WRITING_SECONDS,
                 progress: Progress | None = None) -> None:
        self.tree = tree
        self.now = now
        self.writing_seconds = writing_seconds
        self.progress = progress
        self.found: list[CheckpointRecord] = []
        self.run_states: dict[str, str | None] = {}
        self.leftovers: list[Leftover] = []
        self.strays: list[tuple[str, str]] = []  # entries with a prune's name no prune record proves: kept

    def walk_file(self, path: str, info: Any) -> None:
        """A root that is a file: a record when it is a consolidated checkpoint."""
        fmt = detect_file(split(self.tree, path)[1])
        if fmt is not None:
            self.add_file(path, info, None, fmt, sidecar=True)

    def walk(self, path: str, depth: int = 0, run: str | None = None, sidecar: bool = False) -> None:
        """Collect checkpoints under ``path``; ``run``: the URL of the Shardscope run it lies in."""
        if self.progress is not None:
            self.progress.check()
        tree = self.tree
        name = split(tree, path)[1]
        listed = tree.list(path)
        if listed is None:
            step = step_from_name(name)
            if step is not None:
                self.found.append(CheckpointRecord(tree.url(path), run or self.default_run(path), step, "?", [], 0,
                                                   0.0, "unreadable", "the folder cannot be listed"))
            return
        files, dirs = listed
        fmt = detect_folder(name, files, dirs)
        if fmt is not None:
            self.add_folder(path, fmt, files, dirs, run, sidecar)
            return
        if not files and not dirs and step_from_name(name) is not None:
            self.add(CheckpointRecord(tree.url(path), run or self.default_run(path), step_from_name(name), "empty",
                                      [], 0, self.tree.usage(path, files, dirs)[1], "incomplete",
                                      "an empty folder: a save that never wrote a file", kind=RESUMABLE))
            return
        if all(n in files for n in RUN_FILES):
            run = self.add_run(path)
        mark = len(self.found)
        self.walk_contents(path, files, dirs, depth, run)
        step = step_from_name(name)
        children = self.found[mark:]
        here = tree.url(path)
        levels = here.count(tree.sep)
        if step is not None and run != here and children and all(
                step_from_name(c.name) is None and c.path.count(tree.sep) - levels <= 2 for c in children):
            # a step folder of parts (model.pt + optim.pt, Megatron's mp_rank_NN/, model/ + optim/ DCP folders)
            del self.found[mark:]
            self.found.append(self.composite(path, step, children, files, dirs, run))

    def walk_contents(self, path: str, files: dict[str, Any], dirs: list[str], depth: int, run: str | None) -> None:
        """Consolidated files in a folder that is not a checkpoint, then its subfolders; leftovers of prunes."""
        tree = self.tree
        for name, info in files.items():
            fmt = detect_file(name)
            if fmt is not None:
                self.add_file(join(tree, path, name), info, run, fmt, sidecar=name + LINEAGE_FILE_SUFFIX in files)
        for d in dirs:
            if not d.startswith(".") and d not in SKIP_DIRS and depth < MAX_DEPTH and \
                    not (run == tree.url(path) and d in RUN_SKIP_DIRS):
                self.walk(join(tree, path, d), depth + 1, run, d + LINEAGE_FILE_SUFFIX in files)
        pruned = [n for n in [*dirs, *files] if n.startswith(PRUNE_PREFIX)]
        if pruned:
            proven, strays = leftovers_in(tree.url(path), pruned)
            self.leftovers += proven
            self.strays += strays

    def add_run(self, path: str) -> str:
        """Record a Shardscope run directory; its URL."""
        url = self.tree.url(path)
        if url not in self.run_states:
            self.run_states[url] = self.tree.run_state(path)
        return url

    def add_file(self, path: str, info: Any, run: str | None, fmt: Format, sidecar: bool = False) -> None:
        """A consolidated file; ``sidecar``: a lineage sidecar lies beside it."""
        facts = self.tree.file_facts(path, info, fmt)
        if facts is not None:
            rec = CheckpointRecord(self.tree.url(path), run or self.default_run(path),
                                   step_from_name(split(self.tree, path)[1]), facts.format, [], facts.bytes,
                                   facts.mtime, facts.state, facts.reason, True, 1, facts.kind, facts.pinned)
            if sidecar:
                self.add_lineage(rec, path + LINEAGE_FILE_SUFFIX)
            rec.seal = self.tree.seal_state(path, False)
            self.add(rec)

    def add_folder(self, path: str, fmt: Format, files: dict[str, Any], dirs: list[str], run: str | None,
                   sidecar: bool = False) -> None:
        """A checkpoint folder; ``sidecar``: a lineage sidecar lies beside it."""
        total, newest, count = self.tree.usage(path, files, dirs)
        f = self.tree.folder_facts(path, fmt, files, dirs)
        rec = CheckpointRecord(self.tree.url(path), run or self.default_run(path), f.step, f.format, f.ranks,
                               total, newest, f.state, f.reason, False, count, f.kind, f.pinned)
        if sidecar:
            self.add_lineage(rec, path.rstrip(self.tree.sep) + LINEAGE_FILE_SUFFIX)
        rec.seal = self.tree.seal_state(path, True, files)
        self.add(rec)

    def add_lineage(self, rec: CheckpointRecord, sidecar: str) -> None:
        """An export's sidecar (format-neutral: any checkpoint may have one): its source, and its step when the
        export's name states none."""
        rec.lineage = self.tree.lineage(sidecar)
        if rec.lineage is not None and rec.step is None:
            rec.step = rec.lineage.step

    def composite(self, path: str, step: int, parts: list[CheckpointRecord], files: dict[str, Any],
                  dirs: list[str], run: str | None) -> CheckpointRecord:
        """One checkpoint made of the checkpoints found inside a step folder."""
        total, newest, count = self.tree.usage(path, files, dirs)
        mp_ranks = {int(m.group(1)) for d in dirs if (m := MP_RANK_RE.match(d))}
        formats = {c.format for c in parts}
        # Megatron-LM's legacy torch layout (iter_N/mp_rank_NN/model_optim_rng.pt) is listed under the megatron
        # format's name; its dist layout (torch_dist: DCP + common.pt) is a folder formats.megatron detects
        fmt = megatron.FORMAT.name if mp_ranks else formats.pop() if len(formats) == 1 else "mixed"
        ranks = sorted(set().union(mp_ranks, *(c.ranks for c in parts)))
        state = next((s for s in ("writing", "incomplete", "unreadable") if any(c.state == s for c in parts)),
                     "complete")
        here = self.tree.url(path)
        reason = next((f"{c.path[len(here) + 1:]}: {c.reason}" for c in parts if c.state == state and c.reason), "")
        kind = RESUMABLE if any(c.kind == RESUMABLE for c in parts) else WEIGHTS
        pinned = next((c.pinned for c in parts if c.pinned), "")
        rec = CheckpointRecord(here, run or self.default_run(path), step, fmt, ranks, total, newest, state, reason,
                               False, count, kind, pinned)
        rec.seal = composite_seal(self.tree.seal_state(path, True), [c.seal for c in parts])
        self.mark_writing(rec)
        return rec

    def default_run(self, path: str) -> str:
        """URL of the run a checkpoint at ``path`` belongs to: the folder holding it, or the one above a
        ``checkpoints/`` folder (recorded as a Shardscope run when it is one)."""
        parent, _ = split(self.tree, path)
        holder, name = split(self.tree, parent)
        if name.lower() in CHECKPOINT_HOLDERS:
            if self.tree.is_run(holder):
                return self.add_run(holder)
            return self.tree.url(holder)
        return self.tree.url(parent)

    def add(self, rec: CheckpointRecord) -> None:
        self.mark_writing(rec)
        self.found.append(rec)

    def mark_writing(self, rec: CheckpointRecord) -> None:
        """A checkpoint whose files changed within ``writing_seconds`` reads "writing", unless its format says
        it is whole: a DCP save's coordinator writes ``.metadata`` last, so a complete DCP folder copied or
        just finished is not being written (it read "writing" for seconds and prune called an older step
        the newest resumable)."""
        age = self.now - rec.mtime
        if rec.state == "complete" and rec.format in MARKED_COMPLETE:
            return
        if -60 < age < self.writing_seconds and rec.state != "unreadable":
            rec.state, rec.reason = "writing", f"files changed {max(age, 0):.0f} s ago"
