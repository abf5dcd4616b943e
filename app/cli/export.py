"""``shardscope export``: consolidate a sharded checkpoint into .pt or safetensors, streaming, verified."""

from __future__ import annotations

import argparse
from typing import Any

from shardscope.backend.errors import EXIT_OK, EXIT_PROBLEMS

from .output import TerminalProgress, add_command


def register(sub: Any) -> None:
    sp = add_command(sub, "export", run, "Consolidate a sharded checkpoint into one .pt or safetensors file "
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


def run(args: argparse.Namespace) -> int:
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
    return EXIT_PROBLEMS if result.verified is False else EXIT_OK
