"""``shardscope drift``: every tensor through a run's checkpoints (norm, relative change, NaN/Inf)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardscope.backend.errors import EXIT_OK, EXIT_PROBLEMS
from shardscope.backend.text import escape_name

from .output import TerminalProgress, add_command
from .storage_options import add_storage_options, apply_to_fsspec, storage_options


def register(sub: Any) -> None:
    sp = add_command(sub, "drift", run, "Every tensor through a run's checkpoints in step order: its L2 norm, its "
                     "relative change since the previous checkpoint (float64), its NaN/Inf count (optimizer "
                     "moments also zeros and negatives), and the first checkpoint and tensor holding a non-finite "
                     "value. Each checkpoint is read once. Exit 0 all finite, 1 a non-finite value found, "
                     "2 cannot read.")
    sp.add_argument("paths", nargs="+", metavar="RUN|CKPT", help="a run folder, or checkpoints (paths or URLs)")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.add_argument("--all", action="store_true", help="list every tensor (default: the 40 that changed most)")
    add_storage_options(sp)


def run(args: argparse.Namespace) -> int:
    from shardscope.backend.compare.drift import drift
    from shardscope.backend.compare.series import checkpoint_series

    apply_to_fsspec(args, args.paths)
    with TerminalProgress(enabled=not args.json) as progress:
        series = checkpoint_series(args.paths, progress)
        result = drift(series, storage_options(args), progress)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print_result(result, args.all)
    return EXIT_PROBLEMS if result.first_nonfinite else EXIT_OK


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def print_result(result: Any, everything: bool) -> None:
    """A table: per tensor the relative change at every step (the tensors that changed most first)."""
    steps = result.steps
    print(f"{len(steps)} checkpoints, steps {', '.join(map(str, steps))}; {len(result.tensors)} tensors")
    if result.first_nonfinite:
        step, fqn = result.first_nonfinite
        print(f"first non-finite value: step {step}, {escape_name(fqn)}")
    top = sorted(result.tensors.items(), key=lambda kv: -max((v for v in kv[1].rel_change if v is not None),
                                                              default=0.0))
    shown = top if everything else top[:40]
    if not shown:
        return
    names = [escape_name(k) for k, _ in shown]
    width = max(len(n) for n in names)
    print(f"  {'relative change':<{width}}  " + " ".join(f"{s:>9}" for s in steps))
    for name, (_, d) in zip(names, shown):
        cells = [_fmt(v) + ("!" if n else "") for v, n in zip(d.rel_change, d.nonfinite)]
        print(f"  {name:<{width}}  " + " ".join(f"{c:>9}" for c in cells))
    if len(top) > len(shown):
        print(f"  ... {len(top) - len(shown)} more (--all); '!' marks NaN/Inf")
