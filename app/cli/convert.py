"""``shardscope import`` and ``shardscope reshard``: files to DCP, and DCP to another world size."""

from __future__ import annotations

import argparse
from typing import Any

from shardscope.backend.errors import EXIT_OK, EXIT_PROBLEMS

from .output import TerminalProgress, add_command, sigterm_interrupts
from .storage_options import add_storage_options, folder, storage_options


def register(sub: Any) -> None:
    sp = add_command(sub, "import", run_import, "Turn a .pt or .safetensors file (or an HF folder with an index; "
                     "a path or URL) into a DCP checkpoint that dcp.load reads, streaming, verified.")
    sp.add_argument("file")
    sp.add_argument("dst_dir")
    sp.add_argument("--ranks", type=int, default=1, help="write it as if saved by M ranks (row-wise chunks)")
    sp.add_argument("--prefix", help="nest every key under this, e.g. 'model' for dcp.load({'model': ...})")
    sp.add_argument("--as", dest="as_names", choices=("torchtitan",),
                    help="an HF model folder in this trainer's names, its layouts undone (torchtitan: Llama 3, "
                         "the rotary permutation of q and k inverted), so its own model loads it with dcp.load")
    sp.add_argument("--no-verify", action="store_true")
    sp.add_argument("--force", action="store_true")
    add_storage_options(sp)

    sp = add_command(sub, "reshard", run_reshard, "Rewrite a DCP checkpoint as if saved by M ranks (even row-wise "
                     "chunks, as FSDP2 shards), streaming; values unchanged (verified).")
    sp.add_argument("src")
    sp.add_argument("dst")
    sp.add_argument("--ranks", type=int, required=True)
    sp.add_argument("--no-verify", action="store_true")
    sp.add_argument("--force", action="store_true")
    add_storage_options(sp)


def run_import(args: argparse.Namespace) -> int:
    from shardscope.backend.export.dcp_writer import import_file
    from shardscope.backend.export.hf_import import import_hf

    with sigterm_interrupts(), TerminalProgress(unit="bytes") as progress:
        if args.as_names:
            result = import_hf(args.file, args.dst_dir, args.as_names, args.ranks, args.prefix, args.force,
                               not args.no_verify, progress, storage_options=storage_options(args))
        else:
            result = import_file(args.file, args.dst_dir, args.ranks, args.prefix, args.force, not args.no_verify,
                                 progress, storage_options=storage_options(args))
    print(result.summary())
    return EXIT_PROBLEMS if result.verified is False else EXIT_OK


def run_reshard(args: argparse.Namespace) -> int:
    from shardscope.backend.export.dcp_writer import reshard

    with sigterm_interrupts(), TerminalProgress(unit="bytes") as progress:
        result = reshard(folder(args, args.src), args.dst, args.ranks, args.force, not args.no_verify, progress,
                         storage_options=storage_options(args))
    print(result.summary())
    return EXIT_PROBLEMS if result.verified is False else EXIT_OK
