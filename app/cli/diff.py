"""``shardscope diff``: what changed between two checkpoints, entry by entry."""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardscope.backend.errors import EXIT_OK, EXIT_PROBLEMS
from shardscope.backend.format import escape_name

from .output import TerminalProgress, add_command
from .storage_options import add_storage_options, storage_options


def register(sub: Any) -> None:
    sp = add_command(sub, "diff", run, "Compare two checkpoints (DCP folders, .pt or .safetensors files, HF index "
                     "folders; paths or URLs) by value. "
                     "Exit 0 no differences in values, 1 differences found, 2 cannot read.")
    sp.add_argument("a")
    sp.add_argument("b")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.add_argument("--all", action="store_true", help="list every changed entry (default: the first 50)")
    add_storage_options(sp)


def run(args: argparse.Namespace) -> int:
    from shardscope.backend.compare import diff, open_source

    options = storage_options(args)
    with open_source(args.a, options) as a, open_source(args.b, options) as b, \
            TerminalProgress(enabled=not args.json) as progress:
        result = diff(a, b, progress)
    code = EXIT_PROBLEMS if result.differs else EXIT_OK
    if args.json:
        print(json.dumps(result.to_json()))
        return code
    print(f"A: {escape_name(result.a)}\nB: {escape_name(result.b)}")
    print(f"{len(result.only_a)} only in A, {len(result.only_b)} only in B, {len(result.changed)} changed, "
          f"{result.unchanged} unchanged")
    for label, names in (("only in A", result.only_a), ("only in B", result.only_b)):
        for n in names[: None if args.all else 20]:
            print(f"  {label}: {escape_name(n)}")
    shown = result.changed if args.all else result.changed[:50]
    if shown:
        names = [escape_name(c.fqn) for c in shown]
        width = max(len(n) for n in names)
        print(f"  {'entry':<{width}}  {'kind':<7} {'max|a-b|':>11} {'rel L2':>10} {'changed':>8}")
        for name, c in zip(names, shown):
            stats = (f"{c.max_abs_diff:>11.4g} {c.rel_l2:>10.3g} {100 * c.frac_changed:>7.2f}%"
                     if c.rel_l2 is not None else f"{c.detail:>31}")
            print(f"  {name:<{width}}  {c.kind:<7} {stats}")
    if len(result.changed) > len(shown):
        print(f"  ... {len(result.changed) - len(shown)} more (--all)")
    if any(c.kind == "layout" for c in result.changed) and not result.differs:
        print("only the layout differs (other ranks or chunks); the values are the same")
    return code
