"""``shardscope seal PATH``: write the checkpoint's content manifest (files and tensors by SHA-256, see
backend/checkpoint/manifest.py); ``--sign KEY`` signs it as an OpenSSF model-signing bundle."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from shardscope.backend.errors import EXIT_OK
from shardscope.backend.text import count, escape_name

from .output import TerminalProgress, add_command


def register(sub: Any) -> None:
    sp = add_command(sub, "seal", run, "Write a checkpoint's content manifest: the SHA-256 of every file and of "
                     "every tensor's values (the same in any layout), checked by verify, diff and every output.")
    sp.add_argument("path")
    sp.add_argument("--sign", metavar="KEY", help="also sign it with this elliptic-curve private key (PEM) as an "
                    "OpenSSF model-signing bundle (no network)")
    sp.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from shardscope.backend.checkpoint.seal import seal, sign
    from shardscope.backend.checkpoint.verify import verify
    from shardscope.backend.formats import format_named, open_checkpoint

    ckpt = open_checkpoint(args.path, use_cache=False)
    with TerminalProgress(enabled=not args.json, unit="bytes") as progress:
        path, manifest = seal(ckpt, verify(ckpt), progress, format_named(ckpt.format).integrity_manifest)
    bundle = sign(ckpt.path, args.sign) if args.sign else None
    if args.json:
        json.dump({"path": ckpt.path, "manifest": path, "signature": bundle, "files": len(manifest.files),
                   "tensors": len(manifest.tensors), "objects": len(manifest.objects)}, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(f"{escape_name(path)}: {count(len(manifest.files), 'file')}, {count(len(manifest.tensors), 'tensor')}, "
              f"{count(len(manifest.objects), 'other entry', 'other entries')} sealed")
        if bundle:
            print(f"{escape_name(bundle)}: signed (model-signing bundle)")
    return EXIT_OK
