"""``watch``: follow the runs under some roots; export each resumable checkpoint that becomes complete (model
weights, the layout rules ``export`` uses, verified, atomic) and then thin the run by prune's rules, removing a
checkpoint only once its export is verified.

Crash-safe by construction: an export comes into existence only by :class:`..export.atomic.AtomicOutput`'s
rename after its verification, so a final file that exists is a verified export; what was done is recorded per
run in ``<exports>/.shardscope-watch.json`` (see :class:`WatchState`), written atomically before an export starts
(``exporting``) and after it is committed (``done``). A watch killed at any moment and started again finds each
export either absent (done again, the killed one's temporary removed) or present (recorded as done, never done
twice); a removal is prune's own crash-safe one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..atomic_file import write_atomic
from ..errors import Cancelled, ShardscopeError
from ..export import ExportResult, export, plan_export, writer
from ..export.atomic import clean_leftovers
from ..export.destination import EXPORTS_FOLDER
from ..export.layouts import find_model_folder, recognise_layout
from ..filenames import SMALL_TMP_SUFFIX, WATCH_STATE, is_url, within
from ..format import count, human_bytes
from ..formats import RESUMABLE, open_checkpoint
from ..progress import Progress
from ..runs.rundir import ACTIVE_STATES, default_runs_root, read_config, run_state
from .prune import Decision, Plan, Rules, execute, make_plan
from .records import CheckpointRecord, Listing, RunRecord
from .scan import is_shardscope_run, scan

STATE_VERSION = 1
EXPORTING, DONE = "exporting", "done"


def identity(c: CheckpointRecord) -> dict[str, float]:
    """What says a checkpoint is the one an export was made from: its bytes on disk and its newest file's time."""
    return {"bytes": c.bytes, "mtime": c.mtime}


class WatchState:
    """``<exports>/.shardscope-watch.json``: ``{"version": 1, "exports": {checkpoint path: {"identity": {"bytes",
    "mtime"}, "export": path, "state": "exporting"|"done", "format", "step", "tensors", "bytes", "time"
    [, "removed": time]}}}``. An entry is trusted only while its export file exists and the checkpoint's identity
    is the one recorded."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, WATCH_STATE)
        try:
            with open(self.path, encoding="utf-8") as f:
                value = json.load(f)
        except (OSError, ValueError):
            value = {}
        exports = value.get("exports") if isinstance(value, dict) else None
        self.entries: dict[str, dict[str, Any]] = {
            k: v for k, v in (exports or {}).items()
            if isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("export"), str)}
        # a watch killed while writing this file left its temporary (``.<name>.<random>.tmp``): we hold the lock
        for name in os.listdir(folder):
            if name.startswith(f".{WATCH_STATE}.") and name.endswith(SMALL_TMP_SUFFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))

    def save(self) -> None:
        """Write the whole record atomically."""
        write_atomic(self.path, json.dumps({"version": STATE_VERSION, "exports": self.entries}, indent=1))

    def verified(self, c: CheckpointRecord) -> dict[str, Any] | None:
        """The entry of ``c``'s verified export, when it is done, of this very checkpoint, and still there."""
        e = self.entries.get(c.path)
        if e and e.get("state") == DONE and e.get("identity") == identity(c) and os.path.isfile(e["export"]):
            return e
        return None


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


def live_resume_points(run_dirs: list[str]) -> dict[str, str]:
    """Real path of each checkpoint a live run resumed from (its config.json's ``resume``) -> that run."""
    out: dict[str, str] = {}
    for d in run_dirs:
        if is_shardscope_run(d) and run_state(d) in ACTIVE_STATES:
            resume = read_config(d).get("resume")
            if isinstance(resume, str) and resume:
                out[os.path.realpath(resume)] = d
    return out


def model_prefixes(ckpt: Any) -> list[str]:
    """The first key parts (below a wrapper key) that hold the model's weights, as ``export``'s layout rules judge
    them: what a torch export of a watch selects, so that it is weights (a safetensors export selects them itself)
    and never counts as resumable training state."""
    layout = recognise_layout(ckpt)
    out = set()
    for fqn in [t.fqn for t in ckpt.tensors] + [o.fqn for o in ckpt.objects]:
        if layout.is_model(fqn):
            out.add(layout.wrapper + fqn[len(layout.wrapper):].split(".", 1)[0])
    return sorted(out)


def rules_text(rules: Rules) -> str:
    """The rules in the command line's words, for the ``removed`` lines."""
    parts = [f"keep-last {rules.keep_last}" if rules.keep_last else "",
             f"keep-every {rules.keep_every}" if rules.keep_every else "",
             f"keep-best {rules.keep_best} ({rules.mode}, top {rules.top})" if rules.keep_best else "",
             *(f"keep {g}" for g in rules.keep)]
    return ", ".join(p for p in parts if p)


@dataclass(slots=True)
class PassReport:
    """What one pass did."""

    exported: int = 0
    removed: int = 0
    failed: int = 0


class Watcher:
    """One pass at a time over the roots (``run_pass``); ``stop()`` (from a signal handler) cancels an export in
    flight through its :class:`Progress` and ends the pass."""

    def __init__(self, roots: list[str], fmt: str, rules: Rules | None = None, export_to: str | None = None,
                 delete: bool = False, log: Callable[[str], None] = print) -> None:
        self.roots = list(roots)
        self.writer = writer(fmt)  # ExportError for a name no plan writer is registered under
        self.rules = rules
        self.export_to = os.path.abspath(export_to) if export_to else None
        self.delete = delete
        self.log = log
        self.progress = Progress()
        self.stopping = False
        self.stopped_by = ""  # the signal's name
        self.passes = 0
        self._said: set[str] = set()  # lines about waiting or keeping, said once while they stay true

    def stop(self, why: str = "a signal") -> None:
        """End the watch: an export in flight is cancelled (its temporary removed), no new work starts."""
        self.stopped_by = self.stopped_by or why
        self.stopping = True
        self.progress.cancel()

    def _say(self, line: str, said: set[str]) -> None:
        said.add(line)
        if line not in self._said:
            self.log(line)

    def exports_folder(self, run: RunRecord) -> str:
        """``RUN/exports``, or ``DIR/<run name>`` with ``--export-to DIR``."""
        if self.export_to:
            return os.path.join(self.export_to, run.name)
        return f"{run.path.rstrip('/')}/{EXPORTS_FOLDER}" if is_url(run.path) else \
            os.path.join(run.path, EXPORTS_FOLDER)

    def export_path(self, folder: str, c: CheckpointRecord) -> str:
        return f"{folder}/{c.name}{self.writer.suffixes[0]}" if is_url(folder) else \
            os.path.join(folder, c.name + self.writer.suffixes[0])

    def run_pass(self) -> PassReport:
        """Export what became complete and apply the rules, run by run."""
        report = PassReport()
        listing = scan(self.roots, missing_ok=self.passes > 0)  # a root missing at the start is an error
        self.passes += 1
        said: set[str] = set()
        runs_dir = default_runs_root()
        others = [str(runs_dir / n) for n in os.listdir(runs_dir)] if runs_dir.is_dir() else []
        resumed = live_resume_points([r.path for r in listing.runs if r.kind == "shardscope"
                                      and not is_url(r.path)] + others)
        for run in listing.runs:
            if self.stopping:
                break
            if not any(c.kind == RESUMABLE for c in run.checkpoints):
                continue  # nothing to export (weights files, exports themselves, are never exported again)
            if is_url(run.path):
                self._plan_only(run, listing, said)
            else:
                self._watch_run(run, listing, resumed, report, said)
        self._said = said
        return report

    # ------------------------------------------------------------------ one run
    def _watch_run(self, run: RunRecord, listing: Listing, resumed: dict[str, str], report: PassReport,
                   said: set[str]) -> None:
        folder = self.exports_folder(run)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            report.failed += 1
            self.log(f"FAILED {run.path}: cannot make {folder} ({exc.strerror or exc}); nothing exported")
            return
        with run_lock(folder) as mine:
            if not mine:
                self._say(f"skipped {run.path}: another watch is working on it ({folder} is locked)", said)
                return
            clean_leftovers(folder)  # a killed watch's export temporary, even when nothing is exported here again
            state = WatchState(folder)
            for c in run.checkpoints:
                if c.kind == RESUMABLE and not self.stopping:
                    self._export_one(c, folder, state, report, said)
            if self.rules and not self.stopping:
                self._prune(run, listing, state, resumed, report, said)

    def _export_one(self, c: CheckpointRecord, folder: str, state: WatchState, report: PassReport,
                    said: set[str]) -> None:
        if c.state == "writing":
            self._say(f"waiting: {c.path} is being written", said)
            return
        if c.state != "complete":
            self._say(f"kept {c.path}: {c.state} ({c.reason}); not exported", said)
            return
        if state.verified(c):
            return
        dst = self.export_path(folder, c)
        entry = state.entries.get(c.path)
        ours = bool(entry) and entry["export"] == dst
        force = False
        if os.path.lexists(dst):
            if ours and entry.get("identity") == identity(c):
                # NOTE: the file exists only by AtomicOutput's rename, which follows its verification: a watch
                # killed between that rename and recording it left a verified export; it is not made twice
                self._done(c, state, entry, report, "verified before a restart")
                return
            if not ours:
                report.failed += 1
                self.log(f"FAILED export of {c.path}: {dst} exists and this watch did not write it; move it away")
                return
            force = True  # our export of an earlier checkpoint under this name (it was saved again)
        entry = None  # this export's own entry, once recorded
        try:
            src, _ = find_model_folder(c.path)
            ckpt = open_checkpoint(src)
            only = None if self.writer.weights_only else model_prefixes(ckpt)
            plan = plan_export(ckpt, self.writer.name, only=only)
            entry = state.entries[c.path] = {
                "identity": identity(c), "export": dst, "state": EXPORTING, "format": self.writer.name,
                "step": c.step, "tensors": len(plan.items), "bytes": plan.total_bytes, "time": time.time()}
            state.save()
            result = export(plan, dst, force=force, verify=True, progress=self.progress)
        except (Cancelled, KeyboardInterrupt) as exc:  # the export's own signal handler took the signal
            self.stop("SIGINT" if isinstance(exc, KeyboardInterrupt) else
                      next((w.strip(";,") for w in str(exc).split() if w.startswith("SIG")), "a signal"))
            if entry and entry["state"] == EXPORTING and os.path.isfile(dst):  # the signal came after the rename
                self._done(c, state, entry, report, "verified")
            else:
                self.log(f"cancelled: the export of {c.path} (nothing of it was left)")
            return
        except (ShardscopeError, OSError) as exc:
            report.failed += 1
            self.log(f"FAILED export of {c.path}: {exc}; the checkpoint is kept")
            return
        if result.verified is not True:
            report.failed += 1
            self.log(f"FAILED export of {c.path}: {result.summary()}")
            return
        self._done(c, state, entry, report, "verified", result)

    def _done(self, c: CheckpointRecord, state: WatchState, entry: dict[str, Any], report: PassReport, how: str,
              result: ExportResult | None = None) -> None:
        entry["state"] = DONE
        state.save()
        report.exported += 1
        tensors, size = (result.tensors, result.bytes) if result else (entry.get("tensors", 0), entry.get("bytes", 0))
        self.log(f"exported {c.path} -> {entry['export']} ({how}, {count(tensors, 'tensor')}, "
                 f"{human_bytes(size)})")

    # ------------------------------------------------------------------ the rules
    def _decisions(self, run: RunRecord, listing: Listing) -> Plan:
        own = Listing(listing.roots, [run], [x for x in listing.leftovers if within(x.path, run.path)])
        return make_plan(own, self.rules, running_ok=True)

    def _prune(self, run: RunRecord, listing: Listing, state: WatchState, resumed: dict[str, str],
               report: PassReport, said: set[str]) -> None:
        plan = self._decisions(run, listing)
        todo: list[Decision] = []
        for d in plan.decisions:
            c = d.checkpoint
            if c.kind != RESUMABLE or c.state != "complete":
                continue  # weights are never pruned by watch; the others had their line (waiting, not exported)
            if d.remove:
                live = resumed.get(os.path.realpath(c.path))
                if live:
                    d.remove, d.reasons = False, [f"a live run resumed from it ({live})"]
                elif not state.verified(c):
                    d.remove, d.reasons = False, ["its export is not verified"]
            if d.remove:
                todo.append(d)
            else:
                self._say(f"kept {c.path}: {'; '.join(d.reasons)}", said)
        if not todo and not plan.leftovers:
            return
        result = execute(Plan(plan.roots, plan.rules, todo, plan.leftovers, running_ok=True), delete=self.delete)
        rules = rules_text(self.rules)
        for o in result.leftovers:
            self.log(f"finished an interrupted removal: {o.path} {o.result}" if o.result != "failed" else
                     f"FAILED {o.path}: {o.message}")
        for o in result.outcomes:
            if o.result in ("trashed", "deleted"):
                report.removed += 1
                entry = state.entries.get(o.path)
                if entry:
                    entry["removed"] = time.time()
                self.log(f"removed {o.path} ({rules}){' to the trash' if o.result == 'trashed' else ''}")
            elif o.result == "skipped":
                self._say(f"kept {o.path}: {o.message}", said)
            else:
                report.failed += 1
                self.log(f"FAILED removing {o.path}: {o.message}")
        if result.outcomes:
            state.save()

    def _plan_only(self, run: RunRecord, listing: Listing, said: set[str]) -> None:
        """A run on object storage: what a watch would do, nothing done (as ``prune`` on a URL)."""
        folder = self.exports_folder(run)
        for c in run.checkpoints:
            if c.kind == RESUMABLE and c.state == "complete":
                self._say(f"plan (URL, nothing done): export {c.path} -> {self.export_path(folder, c)}", said)
        if self.rules:
            for d in self._decisions(run, listing).decisions:
                if d.checkpoint.kind == RESUMABLE:
                    self._say(f"plan (URL, nothing done): {d.action} {d.checkpoint.path}: {'; '.join(d.reasons)}",
                              said)


__all__ = ["PassReport", "WatchState", "Watcher", "identity", "live_resume_points", "model_prefixes", "rules_text"]
