"""``watch``: follow the runs under some roots; export each resumable checkpoint that becomes complete (model
weights, the layout rules ``export`` uses, verified, atomic) and then thin the run by prune's rules, removing a
checkpoint only once its export is verified.

Crash-safe by construction: an export comes into existence only by :class:`..export.atomic.AtomicOutput`'s
rename after its verification, so a final file that exists is a verified export; what was done is recorded per
run in ``<exports>/.shardscope-watch.json`` (:class:`.watch_record.WatchState`), written atomically before an
export starts (``exporting``) and after it is committed (``done``). A watch killed at any moment and started
again finds each export either absent (done again, the killed one's temporary removed) or present (recorded as
done, never done twice); a removal is prune's own crash-safe one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import Cancelled, ShardscopeError
from ..export import ExportPlan, ExportResult, check_request, export, plan_export
from ..export.atomic import clean_leftovers
from ..export.destination import EXPORTS_FOLDER, export_suffix
from ..filenames import is_url, within
from ..formats import RESUMABLE, model_folder, open_checkpoint
from ..progress import Progress
from ..runs.rundir import ACTIVE_STATES, default_runs_root, read_config, run_state
from ..text import count, human_bytes
from .prune import Decision, Plan, Rules, execute, make_plan, rules_text
from .records import CheckpointRecord, Listing, RunRecord, order_key
from .scan import is_shardscope_run, scan
from .watch_exports import holds_the_plan, model_prefixes
from .watch_plan import (
    ADOPTED,
    BLOCKED,
    EXISTS,
    EXPORT,
    NOT_EXPORTED,
    RECOVERED,
    URL_PLANS_ONLY,
    VERIFIED,
    WAITING,
    ExportStep,
    RunPlan,
    WatchPlan,
)
from .watch_record import DONE, EXPORTING, WatchState, identity, made_from, run_lock


def live_resume_points(run_dirs: list[str]) -> dict[str, str]:
    """Real path of each checkpoint a live run resumed from (its config.json's ``resume``) -> that run."""
    out: dict[str, str] = {}
    for d in run_dirs:
        if is_shardscope_run(d) and run_state(d) in ACTIVE_STATES:
            resume = read_config(d).get("resume")
            if isinstance(resume, str) and resume:
                out[os.path.realpath(resume)] = d
    return out


def export_step(c: CheckpointRecord, dst: str, state: WatchState, listed: set[str] | None = None) -> ExportStep:
    """The export decision for a resumable checkpoint whose export goes to ``dst`` (nothing written). ``listed``:
    on a URL, the paths the listing found (what lies at ``dst``)."""
    record = state.entries.get(c.path)
    if c.state == "writing":
        return ExportStep(c, WAITING, "", "being written", record=record)
    if c.state != "complete":
        return ExportStep(c, NOT_EXPORTED, "", f"{c.state} ({c.reason})", record=record)
    done = None if is_url(dst) else state.verified(c, dst)
    if done:
        return ExportStep(c, VERIFIED, dst, "its export is verified", record=record)
    if is_url(dst) and listed is not None and dst in listed:
        return ExportStep(c, EXISTS, dst, f"{dst} exists (on a URL the watch's record is not read)", record=record)
    ours = record is not None and bool(record) and record["export"] == dst
    if not is_url(dst) and os.path.lexists(dst):
        same = ours and record is not None and record.get("identity") == identity(c)
        if not ours and not made_from(dst, c):  # the Export dialog's export of this very checkpoint
            return ExportStep(c, ADOPTED, dst, "its lineage names this checkpoint as it is now", record=record)
        why = made_from(dst, c, as_it_is=same) if ours else "this watch did not write it"
        if not why and same:
            # NOTE: the file exists only by AtomicOutput's rename, which follows its verification: a watch
            # killed between that rename and recording it left a verified export; it is not made twice
            return ExportStep(c, RECOVERED, dst, "verified before a restart", record=record)
        if why:  # never replaced: no record of Shardscope's own proves it is this checkpoint's export
            return ExportStep(c, BLOCKED, dst, f"{dst} exists and is not proven its export ({why}); move it away",
                              record=record)
        return ExportStep(c, EXPORT, dst, "saved again since its export", force=True, record=record)
    return ExportStep(c, EXPORT, dst, "complete, not exported yet", record=record)


@dataclass(slots=True)
class PassReport:
    """What one pass did."""

    exported: int = 0
    removed: int = 0
    failed: int = 0


class Watcher:
    """One pass at a time over the roots (``run_pass``); ``stop()`` (from a signal handler) cancels an export in
    flight through its :class:`Progress` and ends the pass. ``plan()`` takes a pass's decisions and does nothing."""

    def __init__(self, roots: list[str], fmt: str, rules: Rules | None = None, export_to: str | None = None,
                 delete: bool = False, log: Callable[[str], None] = print, config: str | None = None) -> None:
        self.roots = list(roots)
        # ExportError for a name no plan writer is registered under, or a config the format does not take
        self.writer = check_request(None, fmt, config=config)
        self.config = config  # a Hugging Face model export's config.json (the model's, for every checkpoint)
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
        name = c.name + export_suffix(self.writer)
        return f"{folder}/{name}" if is_url(folder) else os.path.join(folder, name)

    # ------------------------------------------------------------------ the decisions (a pass and a plan)
    def _listing(self, progress: Progress | None = None) -> tuple[Listing, dict[str, str]]:
        """The runs under the roots and the checkpoints live runs resumed from."""
        listing = scan(self.roots, missing_ok=self.passes > 0, progress=progress)  # missing at the start: an error
        runs_dir = default_runs_root()
        others = [str(runs_dir / n) for n in os.listdir(runs_dir)] if runs_dir.is_dir() else []
        resumed = live_resume_points([r.path for r in listing.runs if r.kind == "shardscope"
                                      and not is_url(r.path)] + others)
        return listing, resumed

    def removals(self, run: RunRecord, listing: Listing, resumed: dict[str, str],
                 unverified: Callable[[CheckpointRecord], str]) -> tuple[list[Decision], Plan | None]:
        """The rules' keep or remove for the run's complete resumable checkpoints: never one a live run resumed
        from, nor one whose export is ``unverified`` (the reason, kept in its decision); and the plan that holds
        the run's interrupted removals (None without rules)."""
        if not self.rules:
            return [], None
        own = Listing(listing.roots, [run], [x for x in listing.leftovers if within(x.path, run.path)],
                      [x for x in listing.strays if within(x[0], run.path)])
        plan = make_plan(own, self.rules, running_ok=True)
        out = []
        for d in plan.decisions:
            c = d.checkpoint
            if c.kind != RESUMABLE or c.state != "complete":
                continue  # weights are never pruned by watch; the others had their line (waiting, not exported)
            if d.remove:
                live = None if is_url(c.path) else resumed.get(os.path.realpath(c.path))
                if live:
                    d.remove, d.reasons = False, [f"a live run resumed from it ({live})"]
                elif why := unverified(c):
                    d.remove, d.reasons = False, [why]
            out.append(d)
        readable = [d for d in out if not unverified(d.checkpoint) and not d.checkpoint.unusable]
        newest = max(readable, key=lambda d: order_key(d.checkpoint), default=None)
        if newest and newest.remove:  # a newer checkpoint failed its export: it may not be readable
            newest.remove, newest.reasons = False, ["the newest resumable checkpoint of its run whose export is "
                                                    "verified (a newer one's is not)"]
        return out, plan

    def plan_run(self, run: RunRecord, listing: Listing, resumed: dict[str, str], state: WatchState) -> RunPlan:
        """What a pass does with one run, as it would do it (a removal assumes the exports before it succeed)."""
        folder = self.exports_folder(run)
        listed = {x.path for x in listing.checkpoints} if is_url(folder) else None
        steps = [export_step(c, self.export_path(folder, c), state, listed) for c in run.checkpoints
                 if c.kind == RESUMABLE]
        will = {s.checkpoint.path for s in steps if s.will_export}
        decisions, plan = self.removals(run, listing, resumed, lambda c: "" if c.path in will else
                                        state.unverified(c, self.export_path(folder, c)))
        listed = {c.path for c in run.checkpoints}
        gone = {k: v for k, v in state.entries.items() if k not in listed and "removed" in v}
        recorded = sum(1 for v in state.entries.values() if v.get("state") == DONE)
        return RunPlan(run, folder, steps, decisions, plan.leftovers if plan else [], gone,
                       plan.strays if plan else [], recorded)

    def plan(self, progress: Progress | None = None) -> WatchPlan:
        """What one pass would do now, run by run; nothing is written, made or removed (any roots: URLs too)."""
        listing, resumed = self._listing(progress)
        runs = []
        for run in listing.runs:
            if not any(c.kind == RESUMABLE for c in run.checkpoints):
                continue  # nothing to export (weights files, exports themselves, are never exported again)
            runs.append(self.plan_run(run, listing, resumed, WatchState(self.exports_folder(run))))
        return WatchPlan(list(listing.roots), self.writer.name, self.rules, runs)

    # ------------------------------------------------------------------ a pass
    def run_pass(self) -> PassReport:
        """Export what became complete and apply the rules, run by run (local folders only)."""
        remote = next((r for r in self.roots if is_url(r)), None)
        if remote:
            raise ShardscopeError(f"{remote}: {URL_PLANS_ONLY}.")
        report = PassReport()
        listing, resumed = self._listing()
        self.passes += 1
        said: set[str] = set()
        for run in listing.runs:
            if self.stopping:
                break
            if any(c.kind == RESUMABLE for c in run.checkpoints):
                self._watch_run(run, listing, resumed, report, said)
        self._said = said
        return report

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
            state.remove_temporaries()
            for c in run.checkpoints:
                if c.kind == RESUMABLE and not self.stopping:
                    self._export_one(export_step(c, self.export_path(folder, c), state), state, report, said)
            if self.rules and not self.stopping:
                decisions, plan = self.removals(run, listing, resumed,
                                                lambda c: state.unverified(c, self.export_path(folder, c)))
                self._prune(decisions, plan, state, report, said)

    def _export_one(self, step: ExportStep, state: WatchState, report: PassReport, said: set[str]) -> None:
        c, dst = step.checkpoint, step.export
        if step.action == WAITING:
            self._say(f"waiting: {c.path} is being written", said)
            return
        if step.action == NOT_EXPORTED:
            self._say(f"kept {c.path}: {step.why}; not exported", said)
            return
        if step.action == VERIFIED:
            return
        if step.action == RECOVERED:
            self._done(c, state, state.entries[c.path], report, RECOVERED)
            return
        if step.action == BLOCKED:
            report.failed += 1
            self.log(f"FAILED export of {c.path}: {step.why}")
            return
        if step.action == ADOPTED:
            self._adopt(step, state, report)
            return
        entry = None  # this export's own entry, once recorded
        try:
            plan = self._plan(c)
            entry = self._record(c, dst, plan, state)
            result = export(plan, dst, force=step.force, verify=True, progress=self.progress)
        except (Cancelled, KeyboardInterrupt) as exc:  # the export's own signal handler took the signal
            self.stop("SIGINT" if isinstance(exc, KeyboardInterrupt) else
                      next((w.strip(";,") for w in str(exc).split() if w.startswith("SIG")), "a signal"))
            if entry and entry["state"] == EXPORTING and os.path.exists(dst):  # the signal came after the rename
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

    def _plan(self, c: CheckpointRecord) -> ExportPlan:
        """The plan of a checkpoint's export: the model's weights, by ``export``'s layout rules."""
        src, _ = model_folder(c.path)
        ckpt = open_checkpoint(src)
        only = None if self.writer.weights_only else model_prefixes(ckpt)
        return plan_export(ckpt, self.writer.name, only=only, config=self.config)

    def _record(self, c: CheckpointRecord, dst: str, plan: ExportPlan, state: WatchState) -> dict[str, Any]:
        """Record (atomically) that the export of ``c`` to ``dst`` is being made: ``exporting`` until it is done."""
        entry = state.entries[c.path] = {
            "identity": identity(c), "export": dst, "state": EXPORTING, "format": self.writer.name, "step": c.step,
            "tensors": len(plan.items), "bytes": plan.total_bytes, "time": time.time()}
        state.save()
        return entry

    def _adopt(self, step: ExportStep, state: WatchState, report: PassReport) -> None:
        """Take an export the Export dialog made of this very checkpoint for the watch's own, once it holds every
        tensor the watch's export would (names, dtypes, shapes); else the pass fails on it, as on any other."""
        c, dst = step.checkpoint, step.export
        try:
            plan = self._plan(c)
        except (ShardscopeError, OSError) as exc:
            report.failed += 1
            self.log(f"FAILED export of {c.path}: {exc}; the checkpoint is kept")
            return
        why = holds_the_plan(dst, plan)
        if why:
            report.failed += 1
            self.log(f"FAILED export of {c.path}: {dst} exists and is not this watch's export of it ({why}); "
                     "move it away")
            return
        self._done(c, state, self._record(c, dst, plan, state), report, "adopted: its lineage names "
                   "this checkpoint")

    def _done(self, c: CheckpointRecord, state: WatchState, entry: dict[str, Any], report: PassReport, how: str,
              result: ExportResult | None = None) -> None:
        entry["state"] = DONE
        state.save()
        report.exported += 1
        tensors, size = (result.tensors, result.bytes) if result else (entry.get("tensors", 0), entry.get("bytes", 0))
        self.log(f"exported {c.path} -> {entry['export']} ({how}, {count(tensors, 'tensor')}, "
                 f"{human_bytes(size)})")

    def _prune(self, decisions: list[Decision], plan: Plan | None, state: WatchState, report: PassReport,
               said: set[str]) -> None:
        todo = [d for d in decisions if d.remove]
        for d in decisions:
            if not d.remove:
                self._say(f"kept {d.checkpoint.path}: {'; '.join(d.reasons)}", said)
        for path, why in plan.strays if plan else []:
            self._say(f"kept {path}: {why}", said)
        if not todo and not (plan and plan.leftovers):
            return
        assert self.rules is not None and plan is not None
        result = execute(Plan(self.roots, self.rules, todo, plan.leftovers, running_ok=True), delete=self.delete)
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


def plan_watch(roots: list[str], fmt: str, rules: Rules | None = None, export_to: str | None = None,
               progress: Progress | None = None, config: str | None = None) -> WatchPlan:
    """What ``shardscope watch`` would do now under ``roots`` (``watch --dry-run``, the Library's Watch plan):
    the decisions of a pass, computed by the same code, with nothing written."""
    return Watcher(roots, fmt, rules, export_to=export_to, log=lambda _line: None, config=config).plan(progress)


__all__ = ["BLOCKED", "EXISTS", "EXPORT", "NOT_EXPORTED", "RECOVERED", "URL_PLANS_ONLY", "VERIFIED", "WAITING",
           "ExportStep", "PassReport", "RunPlan", "WatchPlan", "WatchState", "Watcher", "export_step", "identity",
           "live_resume_points", "model_prefixes", "plan_watch", "rules_text"]
