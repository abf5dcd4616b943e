"""``shardscope bisect``: the first step at which two runs that should agree part."""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardscope.backend.errors import EXIT_OK, EXIT_PROBLEMS
from shardscope.backend.text import escape_name

from .output import TerminalProgress, add_command
from .storage_options import add_storage_options, apply_to_fsspec, storage_options


def register(sub: Any) -> None:
    sp = add_command(sub, "bisect", run, "The first step at which two runs that should agree (a rerun with the "
                     "same seed, a resumed copy, the same recipe on other hardware) differ, by a binary search "
                     "over the steps both hold (at most ceil(log2 N)+1 checkpoint pairs compared); then the "
                     "entries that differ there, most changed first, and whether weights or optimizer moments "
                     "parted first. Exit 0 nothing differs, 1 they part, 2 they cannot be compared.")
    sp.add_argument("a", help="a run folder, or a folder of checkpoints (path or URL)")
    sp.add_argument("b", help="the same for the other run")
    sp.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: any difference)")
    sp.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    add_storage_options(sp)


def run(args: argparse.Namespace) -> int:
    from shardscope.backend.compare.bisect import run_bisect

    apply_to_fsspec(args, [args.a, args.b])
    with TerminalProgress(enabled=not args.json) as progress:
        result = run_bisect(args.a, args.b, args.rtol, args.atol, storage_options(args), progress)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print_result(result)
    return EXIT_OK if result.first_step is None else EXIT_PROBLEMS


def print_result(result: Any) -> None:
    """Which steps were compared, the first that differs and its entries."""
    print(f"{len(result.steps)} steps in both; compared {len(result.compared)}: "
          f"{', '.join(map(str, result.compared))}")
    if result.by_digest:
        print(f"{result.by_digest} tensor pairs by their sealed digests (equal, not read)")
    if result.first_step is None:
        print("no difference at any step compared")
        return
    print(f"first step that differs: {result.first_step} ({result.parted_first} parted first)")
    print(f"  A: {escape_name(result.paths[0])}\n  B: {escape_name(result.paths[1])}")
    for c in result.changes[:50]:
        stats = f"rel L2 {c.rel_l2:.3g}, max|a-b| {c.max_abs_diff:.3g}" if c.rel_l2 is not None else c.detail
        print(f"  {escape_name(c.fqn)}: {c.kind}, {stats}")
    for side, names in (("A", result.only_a), ("B", result.only_b)):
        for n in names[:20]:
            print(f"  only in {side}: {escape_name(n)}")
    if len(result.changes) > 50:
        print(f"  ... {len(result.changes) - 50} more (--json)")
