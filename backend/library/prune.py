"""Pruning by rules: a plan first (every checkpoint keep or remove, and the rule that keeps it), then a
crash-safe removal to the desktop trash (send2trash) or for good.

Rules combine as "keep if any rule keeps it" (Orbax's ``AnyPreservationPolicy``). Never removed: the
newest complete checkpoint of a run, a checkpoint its framework's resume pointer names (``pinned``: Megatron's
``latest_checkpointed_iteration.txt``), any checkpoint of a running run, anything being written, a root
itself, anything outside the roots. Each checkpoint is first renamed out of the way in the same folder
(``.shardscope-prune-<mode>-<name>``, one atomic rename, recorded before it: see :mod:`.prune_record`), then
deleted or trashed; a prune killed half-way leaves every checkpoint whole or gone, and the next ``prune``,
``watch`` or ``ls`` finishes the rest: only what the prune's record proves it moved.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ..atomic_file import fsync_folder
from ..checkpoint.manifest import manifest_beside
from ..errors import ShardscopeError
from ..filenames import is_url, lineage_sidecar
from ..formats.base import RESUMABLE, WEIGHTS
from ..lineage import read_sidecar
from ..progress import Progress
from ..runs.rundir import ACTIVE_STATES, run_state
from ..text import count, human_bytes
from .names import within
from .prune_record import (
    RECORD_SUFFIX,
    Leftover,
    Move,
    hidden_name,
    leftovers_in,
    read_record,
    remove_record,
    same_file,
    write_record,
)
from .records import CheckpointRecord, Listing, RunRecord, order_key
from .scan import is_shardscope_run, resolve_root, scan
from .step_metrics import checkpoint_metrics

PAUSE_ENV = "SHARDSCOPE_TEST_PAUSE_AFTER_RENAME"  # tests: seconds to wait after each rename (to kill us there)
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """``90s``, ``30m``, ``2h``, ``7d``, ``1w`` (or plain seconds) as seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhdw]?)\s*", text.lower())
    if not m:
        raise ShardscopeError(f"--min-age: not an age: {text!r} (use e.g. 90s, 30m, 2h, 7d).")
    return float(m.group(1)) * _AGE_UNITS[m.group(2) or "s"]


def _age_text(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


@dataclass(frozen=True)
class Rules:
    """What to keep. A checkpoint goes only when no rule keeps it and nothing protects it."""

    keep_last: int | None = None  # per run
    keep_every: int | None = None  # steps divisible by K
    keep_best: str | None = None  # a metric name
    mode: str = "min"
    top: int = 1
    keep: tuple[str, ...] = ()  # globs on the name or the path
    min_age: float | None = None  # seconds: newer ones are kept
    incomplete: bool = False  # also remove leftovers of failed saves (older than min_age)
    weights: bool = False  # also apply the rules to weights files (exports), counted among weights files

    def has_keep_rule(self) -> bool:
        """True when any keep rule (last, every, best, glob, min age) is set."""
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_best, self.min_age)) or \
            bool(self.keep)

    def check(self) -> None:
        """Raise ShardscopeError when no rule is given or a value is out of range, before anything is removed."""
        if not self.has_keep_rule() and not self.incomplete:
            raise ShardscopeError("prune: give at least one rule (--keep-last N, --keep-every K, --keep-best "
                                  "METRIC, --keep GLOB, --min-age AGE) or --incomplete; nothing was removed.")
        for name, v in (("--keep-last", self.keep_last), ("--keep-every", self.keep_every), ("--top", self.top)):
            if v is not None and v < 1:
                raise ShardscopeError(f"prune: {name} must be at least 1, not {v}.")
        if self.mode not in ("min", "max"):
            raise ShardscopeError(f"prune: --mode must be min or max, not {self.mode!r}.")


@dataclass(slots=True)
class Decision:
    """What prune does with one checkpoint (remove or keep), and why."""

    checkpoint: CheckpointRecord
    remove: bool
    reasons: list[str]  # what keeps it (rules, protections), or why it goes
    metric: float | None = None

    @property
    def sidecar(self) -> str | None:
        """The export's lineage sidecar that goes with it (removed in the same crash-safe way), when it has one."""
        return sidecar_of(self.checkpoint)

    @property
    def action(self) -> str:
        """The action as shown to the user: "remove" or "keep"."""
        return "remove" if self.remove else "keep"

    def to_json(self) -> dict[str, Any]:
        """The checkpoint, the action and its reasons as a JSON-ready dict."""
        c = self.checkpoint
        return {"path": c.path, "run": c.run, "step": c.step, "kind": c.kind, "bytes": c.bytes, "state": c.state,
                "action": self.action, "reasons": list(self.reasons), "metric": self.metric,
                "sidecar": self.sidecar}


@dataclass(slots=True)
class Plan:
    """A prune plan: a decision per checkpoint under ``roots``, plus interrupted prunes to finish."""

    roots: list[str]
    rules: Rules
    decisions: list[Decision]
    leftovers: list[Leftover] = field(default_factory=list)
    running_ok: bool = False  # a running run's checkpoints follow the rules too (watch: thinning while it trains)
    strays: list[tuple[str, str]] = field(default_factory=list)  # a prune's name, no prune record: kept, and why

    @property
    def remove(self) -> list[Decision]:
        """The decisions that remove their checkpoint."""
        return [d for d in self.decisions if d.remove]

    @property
    def bytes_freed(self) -> int:
        """Bytes the plan frees: the sizes of the checkpoints it removes."""
        return sum(d.checkpoint.bytes for d in self.remove)

    def to_json(self) -> dict[str, Any]:
        """The plan as a JSON-ready dict: every decision, counts, bytes freed and leftovers."""
        return {"roots": list(self.roots), "checkpoints": [d.to_json() for d in self.decisions],
                "remove": len(self.remove), "keep": len(self.decisions) - len(self.remove),
                "bytes_freed": self.bytes_freed, "leftovers": [x.original for x in self.leftovers],
                "kept_unrecorded": [path for path, _ in self.strays]}


def sidecar_of(c: CheckpointRecord) -> str | None:
    """Where the lineage sidecar of an export lies, when the listing found one of ours beside it."""
    return lineage_sidecar(c.path, not c.is_file) if c.lineage is not None else None


def rules_text(rules: Rules) -> str:
    """The rules in the command line's words, for the ``removed`` lines."""
    parts = [f"keep-last {rules.keep_last}" if rules.keep_last else "",
             f"keep-every {rules.keep_every}" if rules.keep_every else "",
             f"keep-best {rules.keep_best} ({rules.mode}, top {rules.top})" if rules.keep_best else "",
             *(f"keep {g}" for g in rules.keep)]
    return ", ".join(p for p in parts if p)


def make_plan(listing: Listing, rules: Rules, now: float | None = None, running_ok: bool = False) -> Plan:
    """Keep or remove for every checkpoint of the listing, with the reasons. ``running_ok``: a running run's
    checkpoints are not kept for that alone (``watch`` thins a run while it trains; what is being written and
    the newest resumable checkpoint stay)."""
    rules.check()
    now = time.time() if now is None else now
    decisions = [d for run in listing.runs for d in _plan_run(run, rules, now, listing.roots, running_ok)]
    return Plan(list(listing.roots), rules, decisions, list(listing.leftovers), running_ok, list(listing.strays))


def _protections(c: CheckpointRecord, run: RunRecord, newest: CheckpointRecord | None, roots: list[str],
                 running_ok: bool) -> list[str]:
    out = []
    if c.path in roots:
        out.append("a root you named")
    if run.running and not running_ok:
        out.append("its run is running")
    if c.state == "writing":
        out.append("being written")
    if c is newest:
        out.append("the newest resumable checkpoint of its run")
    if c.pinned:  # its framework resumes from it (see formats.base.Facts.pinned)
        out.append(f"pinned: {c.pinned}")
    if c.unusable:
        out.append(f"{c.unusable}; check it with `shardscope verify`")
    return out


def _rule_reasons(c: CheckpointRecord, rules: Rules, last: set[str], best: dict[str, float],
                  best_kept: set[str], age: float) -> list[str]:
    out = []
    if c.path in last:
        out.append(f"keep-last {rules.keep_last}" + (" weights files" if c.kind == WEIGHTS else ""))
    if rules.keep_every and c.step is not None and c.step % rules.keep_every == 0:
        out.append(f"keep-every {rules.keep_every}")
    if rules.keep_best:
        if c.path in best_kept:
            out.append(f"keep-best {rules.keep_best} ({rules.mode}, top {rules.top}): {best[c.path]:.6g}")
        elif c.path not in best:  # kept, as Orbax's BestN keeps checkpoints without metrics
            out.append(f"keep-best: no {rules.keep_best} at this step" if best else
                       f"keep-best: the run logs no {rules.keep_best}")
    out.extend(f"keep {g}" for g in rules.keep if fnmatch.fnmatch(c.name, g) or fnmatch.fnmatch(c.path, g))
    if rules.min_age is not None and age < rules.min_age:
        out.append(f"min-age {_age_text(rules.min_age)} (it is {_age_text(age)} old)")
    return out


def _plan_run(run: RunRecord, rules: Rules, now: float, roots: list[str], running_ok: bool) -> list[Decision]:
    """Each kind is counted on its own: a weights file (an export) never takes a resumable checkpoint's place
    in --keep-last or --keep-best, the newest resumable checkpoint always stays, and weights files go only
    with --weights."""
    decided: dict[str, Decision] = {}
    for kind in (RESUMABLE, WEIGHTS):
        members = [c for c in run.checkpoints if c.kind == kind]
        complete = sorted((c for c in members if c.state == "complete" and not c.unusable), key=order_key)
        newest = complete[-1] if complete and kind == RESUMABLE else None
        last = {c.path for c in complete[-rules.keep_last:]} if rules.keep_last else set()
        best: dict[str, float] = {}
        best_kept: set[str] = set()
        if rules.keep_best and complete:
            best = {p: v for p, v in checkpoint_metrics(run, rules.keep_best).items()
                    if p in {c.path for c in complete}}
            ranked = sorted(best, key=best.__getitem__, reverse=rules.mode == "max")
            best_kept = set(ranked[:rules.top])
        for c in members:
            decided[c.path] = _decide(c, run, rules, now, roots, newest, last, best, best_kept, running_ok)
    return [decided[c.path] for c in run.checkpoints]


def _decide(c: CheckpointRecord, run: RunRecord, rules: Rules, now: float, roots: list[str],
            newest: CheckpointRecord | None, last: set[str], best: dict[str, float], best_kept: set[str],
            running_ok: bool = False) -> Decision:
    age = max(0.0, now - c.mtime)
    keep = _protections(c, run, newest, roots, running_ok)
    if c.pinned:  # a framework resumes from it (DeepSpeed's latest tag): no rule removes it
        keep.append(f"pinned: {c.pinned}")
    if c.state == "incomplete":
        if not rules.incomplete:
            keep.append(f"incomplete ({c.reason}); --incomplete removes failed saves")
        elif rules.min_age is not None and age < rules.min_age:
            keep.append(f"incomplete but newer than --min-age {_age_text(rules.min_age)}")
        gone = [f"leftover of a failed save: {c.reason}"]
    elif c.state == "complete" and c.kind == WEIGHTS and not rules.weights:
        keep.append("weights file (an export): removed only when the rules apply to weights files")
        gone = []
    elif c.state == "complete":
        if c.step is None:  # e.g. unrelated checkpoints side by side in one folder: no series to order
            keep.append("no step number: the rules cannot place it in a series (remove it by hand)")
        keep += _rule_reasons(c, rules, last, best, best_kept, age)
        if not rules.has_keep_rule():
            keep.append("complete (only --incomplete given)")
        gone = ["no rule keeps it"]
    else:
        gone = []
    return Decision(c, not keep, keep or gone, best.get(c.path))


# ---------------------------------------------------------------------------------------------- acting
@dataclass(slots=True)
class Outcome:
    """What happened to one checkpoint when the plan ran: trashed, deleted, skipped or failed."""

    path: str
    result: str  # trashed, deleted, skipped, failed
    bytes: int = 0
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        """The outcome as a JSON-ready dict (path, result, bytes, message)."""
        return {"path": self.path, "result": self.result, "bytes": self.bytes, "message": self.message}


@dataclass(slots=True)
class PruneResult:
    """What running a prune plan did, checkpoint by checkpoint, in trash or delete mode."""

    mode: str  # trash or delete
    outcomes: list[Outcome] = field(default_factory=list)
    leftovers: list[Outcome] = field(default_factory=list)  # interrupted prunes finished first
    strays: list[tuple[str, str]] = field(default_factory=list)  # a prune's name, no prune record: kept, and why

    @property
    def removed(self) -> list[Outcome]:
        """The outcomes whose checkpoint was trashed or deleted."""
        return [o for o in self.outcomes if o.result in ("trashed", "deleted")]

    @property
    def failed(self) -> list[Outcome]:
        """The outcomes (leftovers included) that failed."""
        return [o for o in self.outcomes + self.leftovers if o.result == "failed"]

    def summary(self) -> str:
        """A few lines for the user: how much was removed and freed, what was skipped, what failed."""
        where = "moved to the trash" if self.mode == "trash" else "deleted"
        lines = [f"{count(len(self.removed), 'checkpoint')} {where}, {human_bytes(sum(o.bytes for o in self.removed))} "
                 "freed" + (" (once the trash is emptied)" if self.mode == "trash" and self.removed else "")]
        lines += [f"finished an interrupted prune: {o.path} {o.result}" for o in self.leftovers
                  if o.result != "failed"]
        lines += [f"kept {path}: {why}" for path, why in self.strays]
        lines += [f"skipped {o.path}: {o.message}" for o in self.outcomes if o.result == "skipped"]
        lines += [f"FAILED {o.path}: {o.message}" for o in self.failed]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON-ready dict: outcomes, leftovers, counts and bytes freed."""
        return {"mode": self.mode, "outcomes": [o.to_json() for o in self.outcomes],
                "leftovers": [o.to_json() for o in self.leftovers],
                "kept_unrecorded": [path for path, _ in self.strays],
                "removed": len(self.removed), "bytes_freed": sum(o.bytes for o in self.removed),
                "failed": len(self.failed)}


def _trash_is_a_rename(path: str) -> bool:
    """True when the user's home trash is on the same device as ``path``, so send2trash moves it by one rename
    (elsewhere it may copy across devices, which is not atomic: then we rename it out of the way first)."""
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    probe = os.path.realpath(data_home)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        return os.lstat(path).st_dev == os.stat(probe).st_dev
    except OSError:
        return False


def _dispose(path: str, mode: str) -> None:
    """Delete ``path`` for good, or move it to the desktop trash."""
    if mode == "trash":
        from send2trash import send2trash

        send2trash(path)
    elif os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def finish_leftovers(leftovers: list[Leftover]) -> list[Outcome]:
    """Finish what interrupted prunes left, as their records prove it (read again now): each entry still the very
    file its prune moved is trashed or deleted as was asked (an export's sidecar or manifest left at its own name
    by a kill between the renames too); anything else is left as it is. A record whose rename never happened is
    only forgotten."""
    out = []
    for x in leftovers:
        read = read_record(x.record)
        if read is None:
            continue  # finished by someone else since the listing
        mode, moves = read
        folder = os.path.dirname(x.record)
        try:
            if not same_file(os.path.join(folder, moves[0].source), moves[0]):
                done = [_finish_move(folder, m, mode, i > 0) for i, m in enumerate(moves)]
                if any(done):
                    out.append(Outcome(x.original, "trashed" if mode == "trash" else "deleted"))
            remove_record(x.record)
        except OSError as exc:
            out.append(Outcome(x.original, "failed", 0, f"cannot finish removing {x.path}: {exc}"))
    return out


def _finish_move(folder: str, move: Move, mode: str, may_be_unmoved: bool) -> bool:
    """Remove what one recorded move left, when it is that very file: at its prune name, or (``may_be_unmoved``:
    the sidecar or manifest, renamed after its export) still at its own name."""
    for name in (move.hidden, move.source) if may_be_unmoved else (move.hidden,):
        path = os.path.join(folder, name)
        if same_file(path, move):
            _dispose(path, mode)
            return True
    return False


def _why_not_now(c: CheckpointRecord, roots: list[str], running_ok: bool = False) -> str | None:
    """Check again right before acting: the plan may be minutes old."""
    if not os.path.lexists(c.path):
        return "no longer there"
    if os.path.islink(c.path):
        return "is a symbolic link"
    real = os.path.realpath(c.path)
    if not any(within(real, r) and real != r for r in roots):
        return "outside the roots"
    if not running_ok and is_shardscope_run(c.run) and run_state(c.run) in ACTIVE_STATES:
        return "its run is running now"
    fresh = scan([c.path]).checkpoints
    now = next((f for f in fresh if f.path == resolve_root(c.path)), None)
    if now is None or now.state != c.state:
        return f"its state changed ({c.state} -> {now.state if now else 'not a checkpoint'})"
    if now.mtime > c.mtime:  # NOTE: a whole DCP folder reads complete however fresh: being written over?
        return "its files changed since the plan was made"
    return None


def _pause_for_tests(hidden: str) -> None:
    pause = os.environ.get(PAUSE_ENV)
    if pause:
        print(f"renamed to {hidden}", file=sys.stderr, flush=True)
        time.sleep(float(pause))


def _move_aside(c: CheckpointRecord, mode: str, companions: list[str]) -> tuple[str, str] | Outcome:
    """Record the moves, then rename the checkpoint (and its export's sidecar and manifest, after it) to its prune
    name: (hidden name, the record), or the failed :class:`Outcome` (left as it was)."""
    parent = os.path.dirname(c.path)
    hidden = os.path.join(parent, hidden_name(mode, c.name))
    if os.path.lexists(hidden):
        earlier, _ = leftovers_in(parent, [os.path.basename(hidden), os.path.basename(hidden) + RECORD_SUFFIX])
        finish_leftovers(earlier)
        if os.path.lexists(hidden):
            return Outcome(c.path, "failed", 0, f"{hidden} is in the way (no record of a Shardscope prune names it)")
    try:  # NOTE: before the rename: only a prune's own record lets a later run finish (or take) what it moved
        record, _ = write_record(parent, mode, [c.name] + [os.path.basename(p) for p in companions])
    except OSError as exc:
        return Outcome(c.path, "failed", 0, f"cannot record the removal ({exc.strerror or exc}); left as it was")
    try:
        os.rename(c.path, hidden)
    except OSError as exc:
        remove_record(record)
        return Outcome(c.path, "failed", 0, f"cannot rename it out of the way ({exc.strerror}); left as it was")
    # NOTE: an export's sidecar and manifest follow it, after it (a kill between the renames leaves the export gone
    # and them at their names: finish_leftovers removes them with the export), never before it (an export
    # without its lineage or its proof)
    for companion in companions:
        _pause_for_tests(hidden)
        with contextlib.suppress(OSError):  # left at its name: the next prune or ls removes it with the leftover
            os.rename(companion, os.path.join(parent, hidden_name(mode, os.path.basename(companion))))
    with contextlib.suppress(OSError):  # the rename is done: a folder that cannot be synced keeps it anyway
        fsync_folder(parent)
    return hidden, record


def remove_one(c: CheckpointRecord, mode: str, roots: list[str], running_ok: bool = False) -> Outcome:
    """Rename the checkpoint out of the way (atomic), then trash or delete the renamed folder."""
    why = _why_not_now(c, roots, running_ok)
    if why:
        return Outcome(c.path, "skipped", 0, why)
    sidecar = sidecar_of(c)
    if sidecar is not None and read_sidecar(sidecar) is None:
        sidecar = None  # gone since the listing, or no longer ours: left as it is
    companions = [p for p in (sidecar, manifest_beside(c.path) if c.is_file else None) if p is not None]
    if mode == "trash" and not companions and _trash_is_a_rename(c.path):
        # NOTE: the trash on this device takes it in one rename (atomic): whole or gone without our own rename
        # first, and the trash entry keeps the checkpoint's name (Restore brings back `step_100`, not a hidden one)
        try:
            _dispose(c.path, mode)
        except OSError as exc:
            return Outcome(c.path, "failed", 0, f"cannot move it to the trash ({exc}); left as it was "
                           "(--delete removes it for good)")
        return Outcome(c.path, "trashed", c.bytes)
    moved = _move_aside(c, mode, companions)
    if isinstance(moved, Outcome):
        return moved
    hidden, record = moved
    _pause_for_tests(hidden)
    try:
        _dispose(hidden, mode)
    except OSError as exc:
        if mode == "trash":
            try:
                os.rename(hidden, c.path)
                for companion in companions:
                    moved_to = os.path.join(os.path.dirname(c.path), hidden_name(mode, os.path.basename(companion)))
                    if os.path.lexists(moved_to):
                        os.rename(moved_to, companion)
                remove_record(record)
                return Outcome(c.path, "failed", 0, f"cannot move it to the trash ({exc}); left as it was "
                               "(--delete removes it for good)")
            except OSError:
                pass
        return Outcome(c.path, "failed", 0, f"stopped half-way ({exc}); the rest is in {hidden}, which the next "
                       "prune removes")
    # the sidecar and manifest, wherever the renames left them, then the record (a failure: the next prune or ls)
    finish_leftovers([Leftover(hidden, c.path, mode, record)])
    return Outcome(c.path, "trashed" if mode == "trash" else "deleted", c.bytes)


def execute(plan: Plan, delete: bool = False, progress: Progress | None = None) -> PruneResult:
    """Carry out a plan: finish interrupted prunes, then remove what the plan removes, one at a time."""
    remote = [r for r in plan.roots if is_url(r)]
    if remote:
        raise ShardscopeError(f"{remote[0]}: pruning acts on local (or mounted network) folders only; object stores "
                              "have no atomic rename. The plan lists what to remove; nothing was removed.")
    result = PruneResult("delete" if delete else "trash", strays=list(plan.strays))
    result.leftovers = finish_leftovers(plan.leftovers)
    todo = plan.remove
    if progress:
        progress.start(len(todo), "removing checkpoints")
    roots = [resolve_root(r) for r in plan.roots]
    for d in todo:
        result.outcomes.append(remove_one(d.checkpoint, result.mode, roots, plan.running_ok))
        if progress:
            progress.advance(1, d.checkpoint.name)
    return result
