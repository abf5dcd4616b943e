"""``shardscope verify``: health of a checkpoint; ``--deep`` reads every byte and checks stored CRC32s."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from shardscope.backend.errors import EXIT_OK, EXIT_PROBLEMS
from shardscope.backend.text import count, escape_name

from .output import TerminalProgress, add_command, print_problems
from .storage_options import add_storage_options, storage_options

DEEP_NOTE = " (deep: every item read; CRC32 checked where the format stores one)"


def register(sub: Any) -> None:
    sp = add_command(sub, "verify", run, "Check a checkpoint's health (exit 0 healthy, 1 problems, 2 unreadable).")
    add_storage_options(sp)
    sp.add_argument("path")
    sp.add_argument("--deep", action="store_true", help="read every item, check CRC32, dtype and shape")
    sp.add_argument("--signature", metavar="PUBLIC_KEY", help="also check the checkpoint's model-signing bundle "
                    "(seal --sign) with this elliptic-curve public key (PEM)")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--no-cache", action="store_true", help="do not use the metadata cache (as the global --no-cache)")


def run(args: argparse.Namespace) -> int:
    from shardscope.backend.checkpoint.seal import check_signature
    from shardscope.backend.formats import open_checkpoint
    from shardscope.backend.formats.registry import verify_sealed

    ckpt = open_checkpoint(args.path, storage_options(args), use_cache=not args.no_cache)
    with TerminalProgress(enabled=args.deep and not args.json) as progress, \
            TerminalProgress(enabled=not args.json, unit="bytes") as hashing:
        # whenever there is a manifest: every file's SHA-256 (--deep: every tensor's digest too)
        problems, sealed = verify_sealed(ckpt, args.deep, progress, hashing)
    if args.signature:
        bad = check_signature(ckpt.path, args.signature)
        problems += [bad] if bad else []
    if args.json:
        json.dump({"path": ckpt.path, "deep": args.deep, "healthy": not problems,
                   "seal": {"state": sealed.state, "manifest": sealed.manifest, "files_checked": sealed.files_checked,
                            "tensors_checked": sealed.tensors_checked,
                            "integrity_checked": sealed.integrity_checked,
                            "signature": None if not args.signature else "bad" if bad else "verified"},
                   "problems": [p.to_json() for p in problems]}, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(f"{escape_name(ckpt.path)}: {count(len(ckpt.tensors), 'tensor')}, "
              f"{count(len(ckpt.chunk_table), 'chunk')}, {count(len(ckpt.data_files), 'file')}"
              f"{DEEP_NOTE if args.deep else ''}")
        print(f"  seal       {sealed.summary()}")
        if args.signature and not bad:
            print("  signature  verified (model-signing bundle)")
        print_problems(problems)
    return EXIT_PROBLEMS if problems else EXIT_OK
