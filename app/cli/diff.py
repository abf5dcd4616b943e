"""``shardscope diff``: what changed between two checkpoints, entry by entry."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from shardscope.backend.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_PROBLEMS
from shardscope.backend.text import escape_name

from .output import TerminalProgress, add_command, err
from .storage_options import add_storage_options, storage_options


def register(sub: Any) -> None:
    sp = add_command(sub, "diff", run, "Compare two checkpoints (DCP folders, .pt or .safetensors files, HF index "
                     "folders; paths or URLs) by value. Names are paired as stored, or without a side's container "
                     "prefix (model., state_dict.) when that pairs more. Exit 0 no differences in values, "
                     "1 differences found, 2 cannot read (also when some entries could not be read: the rest "
                     "is still compared and printed).")
    sp.add_argument("a")
    sp.add_argument("b")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.add_argument("--all", action="store_true", help="list every changed entry (default: the first 50)")
    sp.add_argument("--exact-names", action="store_true",
                    help="pair entries only by their names as stored (no container prefix removed)")
    sp.add_argument("--only-weights", action="store_true",
                    help="compare only the entries export takes as the model's weights on each side (no optimizer "
                         "or trainer state): a checkpoint and a faithful export of it report no difference")
    add_storage_options(sp)


def run(args: argparse.Namespace) -> int:
    from shardscope.backend.compare import diff
    from shardscope.backend.formats import open_source

    options = storage_options(args)
    with open_source(args.a, options) as a, open_source(args.b, options) as b, \
            TerminalProgress(enabled=not args.json) as progress:
        result = diff(a, b, progress, exact_names=args.exact_names, only_weights=args.only_weights)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print_result(result, args.all)
    if result.unreadable:
        n = len(result.unreadable)
        err(f"{n} of {n + result.unchanged + len(result.changed)} paired entries could not be read and the rest "
            f"was compared; the first: {result.unreadable[0].detail.rstrip('.')}.")
        return EXIT_BAD_INPUT
    return EXIT_PROBLEMS if result.differs else EXIT_OK


def print_result(result: Any, everything: bool) -> None:
    """The text report: both names, the pairing, counts, then the entries (unreadable ones first)."""
    print(f"A: {escape_name(result.a)}\nB: {escape_name(result.b)}")
    p = result.pairing
    print(f"pairing: {p.describe()}" + ("; --exact-names pairs names as stored" if p.renamed else ""))
    layout_only = sum(1 for c in result.changed if c.kind == "layout")  # as the Compare view splits them
    print(f"{len(result.only_a)} only in A, {len(result.only_b)} only in B, {len(result.changed) - layout_only} "
          f"changed, " + (f"{layout_only} layout only (same values), " if layout_only else "") +
          f"{result.unchanged} unchanged" + (f", {len(result.unreadable)} unreadable" if result.unreadable else ""))
    if result.left_out:
        print(f"model weights only: {result.left_out[0]} entries of A and {result.left_out[1]} of B left out "
              "(training state)")
    if result.by_digest:
        print(f"{result.by_digest} identical (same digests in both manifests; not read)")
    if p.hint:
        print(f"note: {p.hint}")
    unreadable = [(f"unreadable in {c.side}", c.detail) for c in result.unreadable]
    for label, lines in (("", unreadable), ("only in A", result.only_a), ("only in B", result.only_b)):
        for line in lines[: None if everything else 20]:
            print(f"  {line[0]}: {escape_name(line[1])}" if isinstance(line, tuple) else
                  f"  {label}: {escape_name(line)}")
        if len(lines) > 20 and not everything:
            roots = Counter(str(n).split(".", 1)[0] for n in lines) if label else None
            by_root = f"; all {len(lines)} by first key part: " + ", ".join(
                f"{escape_name(r)} {k}" for r, k in roots.most_common(8)) if roots else ""
            print(f"  ... {len(lines) - 20} more {label or 'unreadable'} (--all){by_root}")
    shown = result.changed if everything else result.changed[:50]
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
