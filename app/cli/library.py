"""``shardscope ls`` (every checkpoint under some roots, by run) and ``shardscope prune`` (rules, a plan,
then a crash-safe removal to the trash or for good)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from shardscope.backend.errors import EXIT_OK, EXIT_PROBLEMS
from shardscope.backend.text import count, escape_name, human_bytes, ranks_text

from .output import TerminalProgress, add_command, err
from .storage_options import add_storage_options, apply_to_fsspec


def register(sub: Any) -> None:
    sp = add_command(sub, "ls", run_ls, "List every checkpoint under ROOTs, by run: step, state, format, writer "
                     "ranks, size on disk. Exit 0, or 2 when a root does not exist.")
    sp.add_argument("roots", nargs="+", metavar="ROOT")
    sp.add_argument("--json", action="store_true", help='print {"roots", "runs", "checkpoints"}')
    add_storage_options(sp)
    sp = add_command(sub, "prune", run_prune, "Remove checkpoints no rule keeps (keep if any rule keeps). Prints "
                     "the plan; --yes acts (to the desktop trash; --delete: for good).")
    sp.add_argument("roots", nargs="+", metavar="ROOT")
    add_keep_rules(sp)
    sp.add_argument("--min-age", metavar="AGE", help="keep checkpoints newer than AGE (90s, 30m, 2h, 7d)")
    sp.add_argument("--incomplete", action="store_true",
                    help="also remove leftovers of failed saves (older than --min-age)")
    sp.add_argument("--weights", action="store_true",
                    help="also apply the rules to weights files (exports: safetensors, HF folders, torch files "
                    "without optimizer state), counted among weights files; without it they are kept")
    sp.add_argument("--yes", action="store_true", help="act on the plan (default: only print it)")
    sp.add_argument("--delete", action="store_true", help="delete for good instead of moving to the trash")
    sp.add_argument("--json", action="store_true")
    add_storage_options(sp)


def add_keep_rules(sp: Any) -> None:
    """The keep rules ``prune`` and ``watch`` share (see ``backend.library.Rules``)."""
    sp.add_argument("--keep-last", type=int, metavar="N", help="keep the N newest complete resumable checkpoints of "
                    "each run (prune --weights: also the N newest weights files)")
    sp.add_argument("--keep-every", type=int, metavar="K", help="keep checkpoints whose step is divisible by K")
    sp.add_argument("--keep-best", metavar="METRIC", help="keep the best --top N by METRIC at the checkpoint's "
                    "step (the run's metrics/rank_N.jsonl, Lightning's metrics.csv, TensorBoard event files or "
                    "HF's trainer_state.json); checkpoints without a value are kept")
    sp.add_argument("--mode", choices=("min", "max"), default="min", help="for --keep-best (default: min)")
    sp.add_argument("--top", type=int, default=1, metavar="N", help="for --keep-best (default: 1)")
    sp.add_argument("--keep", action="append", default=[], metavar="GLOB", help="keep names or paths matching GLOB")


def _finish_leftovers(listing: Any) -> list:
    """Finish the interrupted prunes the listing's prune records prove; name what has a prune's name and no record
    (kept)."""
    for path, why in listing.strays:
        print(f"shardscope: kept {escape_name(path)}: {why}", file=sys.stderr)
    if not listing.leftovers:
        return []
    from shardscope.backend.library import finish_leftovers

    done = finish_leftovers(listing.leftovers)
    for o in done:
        if o.result == "failed":
            err(o.message)
        else:
            print(f"shardscope: finished an interrupted prune: {escape_name(o.path)} {o.result}", file=sys.stderr)
    listing.leftovers = []
    return done


def _scan(args: argparse.Namespace, quiet: bool) -> Any:
    from shardscope.backend.library import scan

    roots = args.roots
    apply_to_fsspec(args, roots)
    with TerminalProgress(enabled=not quiet) as progress:
        return scan(roots, progress=progress)


def run_ls(args: argparse.Namespace) -> int:
    listing = _scan(args, args.json)
    _finish_leftovers(listing)
    if args.json:
        # one string from the C encoder, one write: json.dump's pure-Python encoder made a write per token
        # (half a million for 10,000 checkpoints, most of the command's time after the walk)
        sys.stdout.write(json.dumps(listing.to_json()) + "\n")
        return EXIT_OK
    lines = []
    minutes: dict[int, str] = {}  # strftime once per distinct minute, not once per checkpoint
    for run in listing.runs:
        kind = f"Shardscope run, {run.state or 'state unknown'}" if run.kind == "shardscope" else "folder"
        lines.append(f"{escape_name(run.path)}  ({kind})  {count(len(run.checkpoints), 'checkpoint')}, "
                     f"{human_bytes(run.bytes)}")
        if run.checkpoints:
            lines.append(f"  {'STEP':>8}  {'STATE':<10}  {'KIND':<9}  {'FORMAT':<15}  {'RANKS':<7}  {'SIZE':>10}  "
                         f"{'MODIFIED':<16}  CHECKPOINT")
        for c in run.checkpoints:
            if c.mtime:
                minute = int(c.mtime // 60)
                when = minutes.get(minute)
                if when is None:
                    when = minutes[minute] = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.mtime))
            else:
                when = "?"
            note = f"  ({c.reason})" if c.reason and c.state != "complete" else ""
            link = c.lineage_text().replace("\u26a0 ", "! ")  # plain text: terminals need not speak UTF-8
            note += f"  [{escape_name(link)}]" if link else ""
            note += {"sealed": "  [sealed]", "modified": "  [sealed, modified since: verify checks it]",
                     "damaged": f"  [{c.unusable}]"}.get(c.seal, "")
            lines.append(f"  {'-' if c.step is None else c.step:>8}  {c.state:<10}  {c.kind:<9}  {c.format:<15}  "
                         f"{ranks_text(c.ranks):<7}  {human_bytes(c.bytes):>10}  {when:<16}  "
                         f"{escape_name(c.name)}{note}")
    cks = listing.checkpoints
    counts = ", ".join(f"{sum(1 for c in cks if c.state == s)} {s}" for s in ("complete", "incomplete", "writing",
                                                                               "unreadable"))
    lines.append(f"total: {count(len(cks), 'checkpoint')} in {count(len(listing.runs), 'run')}, "
                 f"{human_bytes(listing.bytes)} on disk ({counts})")
    sys.stdout.write("\n".join(lines) + "\n")
    return EXIT_OK


def rules_of(args: argparse.Namespace) -> Any:
    """The checked ``Rules`` of a command line (``watch`` has no --min-age, --incomplete nor --weights)."""
    from shardscope.backend.library import Rules, parse_age

    min_age = getattr(args, "min_age", None)
    rules = Rules(keep_last=args.keep_last, keep_every=args.keep_every, keep_best=args.keep_best, mode=args.mode,
                  top=args.top, keep=tuple(args.keep), min_age=parse_age(min_age) if min_age else None,
                  incomplete=getattr(args, "incomplete", False), weights=getattr(args, "weights", False))
    rules.check()
    return rules


def print_plan(plan: Any) -> None:
    """Every checkpoint, keep or remove, and the rule that keeps it (or why it goes)."""
    by_run: dict[str, list] = {}
    for d in plan.decisions:
        by_run.setdefault(d.checkpoint.run, []).append(d)
    for run, decisions in by_run.items():
        print(escape_name(run))
        for d in decisions:
            c = d.checkpoint
            also = f" (with its lineage sidecar {escape_name(os.path.basename(d.sidecar))})" \
                if d.remove and d.sidecar else ""
            print(f"  {d.action.upper():<6}  {'-' if c.step is None else c.step:>8}  {human_bytes(c.bytes):>10}  "
                  f"{c.state:<10}  {c.kind:<9}  {escape_name(c.name):<28}  {'; '.join(d.reasons)}{also}")
    for path, why in plan.strays:
        print(f"  KEEP    {escape_name(path)}: {why}")
    print(f"plan: remove {len(plan.remove):,} of {count(len(plan.decisions), 'checkpoint')}, "
          f"freeing {human_bytes(plan.bytes_freed)}")


def run_prune(args: argparse.Namespace) -> int:
    from shardscope.backend.library import execute, make_plan

    rules = rules_of(args)
    listing = _scan(args, args.json)
    plan = make_plan(listing, rules)
    if not args.json:
        print_plan(plan)
    if not args.yes:
        if args.json:
            json.dump({**plan.to_json(), "acted": False}, sys.stdout)
            sys.stdout.write("\n")
        elif plan.remove:
            how = "delete them for good" if args.delete else "move them to the trash (--delete: for good)"
            print(f"nothing removed yet: run again with --yes to {how}.")
        return EXIT_OK
    with TerminalProgress(enabled=not args.json) as progress:
        result = execute(plan, delete=args.delete, progress=progress)
    if args.json:
        json.dump({**plan.to_json(), "acted": True, "result": result.to_json()}, sys.stdout)
        sys.stdout.write("\n")
    else:
        for line in result.summary().splitlines():
            print(escape_name(line))
    return EXIT_PROBLEMS if result.failed else EXIT_OK
