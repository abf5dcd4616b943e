"""What a ``watch`` decides, before it does anything: each resumable checkpoint's export (:class:`ExportStep`), a
run's decisions (:class:`RunPlan`) and a pass's (:class:`WatchPlan`); the decisions themselves are taken in
:mod:`.watch`, by the code a pass runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..filenames import is_url
from ..text import count
from .prune import Decision, Rules, rules_text
from .records import CheckpointRecord, Leftover, RunRecord

# what a watch does with a checkpoint's export (the one decision both a pass and a plan take)
EXPORT = "export"  # to be exported now
VERIFIED = "verified"  # its verified export exists (done by an earlier pass)
RECOVERED = "verified before a restart"  # the export exists, a watch was killed before recording it
WAITING = "waiting"  # being written
NOT_EXPORTED = "not exported"  # incomplete or unreadable: never exported
BLOCKED = "blocked"  # the export's name is taken by a file this watch did not write
EXISTS = "exists"  # on a URL: something lies at the export's name (a plan there reads no watch record)
ADOPTED = "adopted"  # an export made elsewhere (the Export dialog) whose lineage names this very checkpoint

URL_PLANS_ONLY = ("watch acts on local (or mounted network) folders only: on URLs it only plans (object stores have "
                  "no atomic rename); nothing was exported or removed")


@dataclass(slots=True)
class ExportStep:
    """What a watch does with one resumable checkpoint's export, why, and what its record says a watch did."""

    checkpoint: CheckpointRecord
    action: str  # EXPORT, VERIFIED, RECOVERED, WAITING, NOT_EXPORTED, BLOCKED
    export: str  # the export's path ("" when it is never exported)
    why: str = ""
    force: bool = False  # an earlier export of this watch under this name (the checkpoint was saved again)
    record: dict[str, Any] | None = None  # the watch state's entry for this checkpoint (what a watch did)

    @property
    def will_export(self) -> bool:
        """True when a pass exports it now (or records the export a killed watch left)."""
        return self.action in (EXPORT, RECOVERED, ADOPTED)

    def text(self) -> str:
        """The action in the log's words."""
        c = self.checkpoint
        return {EXPORT: f"export {c.path} -> {self.export}", VERIFIED: f"exported {c.path} -> {self.export} "
                "(verified earlier)", RECOVERED: f"record {c.path} -> {self.export} (verified before a restart)",
                WAITING: f"wait: {c.path} is being written", NOT_EXPORTED: f"not exported {c.path}: {self.why}",
                BLOCKED: f"FAILS export of {c.path}: {self.why}",
                EXISTS: f"not exported {c.path}: {self.why}", ADOPTED: f"adopt {c.path} -> {self.export} "
                f"({self.why})"}[self.action]

    def to_json(self) -> dict[str, Any]:
        c = self.checkpoint
        return {"path": c.path, "step": c.step, "state": c.state, "export_action": self.action,
                "export": self.export or None, "why": self.why, "record": self.record}



@dataclass(slots=True)
class RunPlan:
    """A watch's decisions for one run: each resumable checkpoint's export, then the rules' keep or remove (a
    checkpoint is removed only once its export is verified), and what the run's watch record says was done."""

    run: RunRecord
    exports_folder: str
    exports: list[ExportStep]
    decisions: list[Decision]  # complete resumable checkpoints only; empty without rules
    leftovers: list[Leftover] = field(default_factory=list)  # interrupted removals the pass finishes
    removed: dict[str, dict[str, Any]] = field(default_factory=dict)  # record entries of checkpoints now gone
    strays: list[tuple[str, str]] = field(default_factory=list)  # a prune's name, no prune record: kept, and why
    recorded: int = 0  # verified exports the run's watch record holds (of checkpoints removed since too)

    @property
    def plan_only(self) -> bool:
        """True for a run on object storage: a watch only plans there."""
        return is_url(self.run.path)

    @property
    def remove(self) -> list[Decision]:
        return [d for d in self.decisions if d.remove]

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run.path, "exports_folder": self.exports_folder, "plan_only": self.plan_only,
                "exports": [s.to_json() for s in self.exports], "checkpoints": [d.to_json() for d in self.decisions],
                "leftovers": [x.original for x in self.leftovers], "removed_earlier": self.removed,
                "kept_unrecorded": [path for path, _ in self.strays], "verified_exports": self.recorded}


@dataclass(slots=True)
class WatchPlan:
    """What one ``watch`` pass would do under some roots, run by run (computed by :meth:`Watcher.plan`, the
    decisions a pass takes; nothing written)."""

    roots: list[str]
    format: str
    rules: Rules | None
    runs: list[RunPlan]

    @property
    def to_export(self) -> list[ExportStep]:
        return [s for r in self.runs for s in r.exports if s.will_export]

    @property
    def to_remove(self) -> list[Decision]:
        return [d for r in self.runs for d in r.remove]

    def lines(self) -> list[str]:
        """The plan in the log's words, one line per checkpoint and action."""
        out = []
        for r in self.runs:
            out.append(f"{r.run.path}: exports in {r.exports_folder}" +
                       (" (a URL: plan only)" if r.plan_only else ""))
            out += [f"  {s.text()}" for s in r.exports]
            out += [f"  finish an interrupted removal: {x.original}" for x in r.leftovers]
            out += [f"  kept {path}: {why}" for path, why in r.strays]
            for d in r.decisions:
                when = " after its export is verified" if d.remove else ""
                out.append(f"  {d.action} {d.checkpoint.path}{when}: {'; '.join(d.reasons)}")
        rules = f", rules: {rules_text(self.rules)}" if self.rules else ", no rules: nothing is removed"
        out.append(f"plan: export {count(len(self.to_export), 'checkpoint')} to {self.format}, remove "
                   f"{count(len(self.to_remove), 'checkpoint')}{rules}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"roots": list(self.roots), "format": self.format,
                "rules": rules_text(self.rules) if self.rules else None, "runs": [r.to_json() for r in self.runs],
                "export": len(self.to_export), "remove": len(self.to_remove)}



__all__ = ["ADOPTED", "BLOCKED", "EXISTS", "EXPORT", "NOT_EXPORTED", "RECOVERED", "URL_PLANS_ONLY", "VERIFIED",
           "WAITING", "ExportStep", "RunPlan", "WatchPlan"]
