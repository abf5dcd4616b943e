"""Subcommands beyond inspect/verify/show: gui, export, train, demo. Each registers itself here."""

from __future__ import annotations

import argparse
from collections.abc import Callable

COMMANDS: list[Callable] = []


def command(func: Callable) -> Callable:
    COMMANDS.append(func)
    return func


@command
def _gui(add: Callable) -> None:
    sp = add("gui", run_gui, "Open the checkpoint browser window (optionally on PATH).")
    sp.add_argument("path", nargs="?", help="checkpoint folder or run directory to open")
    sp.add_argument("--select", metavar="FQN", help="select this tensor (or module prefix) after loading")
    sp.add_argument("--screenshot", metavar="FILE.png", help="render the window to a PNG after loading, then exit")
    sp.add_argument("--size", metavar="WxH", default=None, help="window size, e.g. 1400x900")


def run_gui(args: argparse.Namespace) -> int:
    from shardscope.app.main_window import run

    return run(args)


@command
def _export(add: Callable) -> None:
    sp = add("export", run_export, "Consolidate a sharded checkpoint into one .pt or safetensors file "
             "(or an HF-style sharded safetensors folder), streaming, verified.")
    sp.add_argument("src", help="checkpoint folder")
    sp.add_argument("dst", help="output: X.safetensors, X.pt/.pth/.bin, or a folder with --max-shard-size")
    sp.add_argument("--format", choices=("safetensors", "torch"), help="default: from the destination's name")
    sp.add_argument("--only", action="append", metavar="PREFIX",
                    help="export entries under this prefix (repeatable); safetensors default: model.* if present")
    sp.add_argument("--strip-prefix", metavar="PREFIX", help="remove this from every key, e.g. 'model.'")
    sp.add_argument("--dtype", help="cast floating-point tensors: bf16, fp16 or fp32")
    sp.add_argument("--max-shard-size", metavar="SIZE", help="sharded safetensors, e.g. 5GB or 500MB")
    sp.add_argument("--no-verify", action="store_true", help="skip re-reading the output to compare")
    sp.add_argument("--force", action="store_true", help="overwrite the destination")


def run_export(args: argparse.Namespace) -> int:
    from shardscope.app.cli import TerminalProgress
    from shardscope.backend.checkpoint import open_checkpoint
    from shardscope.backend.export import ExportError, export, format_for, plan_export
    from shardscope.backend.format import parse_size

    try:
        limit = parse_size(args.max_shard_size) if args.max_shard_size else None
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    ckpt = open_checkpoint(args.src)
    fmt = format_for(args.dst, args.format, limit)
    if limit and fmt != "safetensors":
        raise ExportError("--max-shard-size makes sharded safetensors; it does not apply to torch files.")
    plan = plan_export(ckpt, fmt, only=args.only, strip_prefix=args.strip_prefix, dtype=args.dtype,
                       max_shard_size=limit)
    with TerminalProgress(unit="bytes") as progress:
        result = export(plan, args.dst, force=args.force, verify=not args.no_verify, progress=progress)
    print(result.summary())
    return 1 if result.verified is False else 0
