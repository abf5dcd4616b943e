"""``shardscope average``: the mean or EMA of several checkpoints' model weights, exported and verified."""

from __future__ import annotations

import argparse
from typing import Any

from shardscope.backend.errors import EXIT_OK, EXIT_PROBLEMS

from .export import ExportFormats
from .output import TerminalProgress, add_command, sigterm_interrupts
from .storage_options import add_storage_options, storage_options


def register(sub: Any) -> None:
    sp = add_command(sub, "average", run, "The uniform or weighted mean of the model weights of several "
                     "checkpoints, or their exponential moving average in step order, accumulated in float64 and "
                     "rounded once; integer and bool tensors must be equal in every input. Written like export "
                     "(safetensors, .pt, an HF folder with --hf) or as a DCP checkpoint (--format dcp), streaming, "
                     "verified, with a lineage sidecar "
                     "listing every source and its weight. Exit 0 written and verified, 1 verification failed, "
                     "2 bad input (checkpoints of different models, unequal integer tensors).")
    sp.add_argument("paths", nargs="+", metavar="CKPT... OUT", help="two or more checkpoints, then the output")
    sp.add_argument("--weights", metavar="W1,W2,...", help="one weight per checkpoint, in the order given "
                    "(the mean divides by their sum)")
    sp.add_argument("--ema", type=float, metavar="BETA", help="exponential moving average in step order: "
                    "e_0 = W_0, e_i = BETA*e_(i-1) + (1-BETA)*W_i")
    sp.add_argument("--format", choices=ExportFormats(extra=("dcp",)), metavar="FORMAT",
                    help="one of %(choices)s; default: from the output's name")
    sp.add_argument("--ranks", type=int, default=1, help="--format dcp: as if saved by M ranks (row-wise chunks)")
    sp.add_argument("--prefix", help="--format dcp: nest every key under this, e.g. 'model' for "
                    "dcp.load({'model': model.state_dict()})")
    sp.add_argument("--hf", action="store_true", help="an HF-style folder of safetensors shards with its index")
    sp.add_argument("--dtype", help="output floating-point dtype: bf16, fp16 or fp32 (default: as stored)")
    sp.add_argument("--no-verify", action="store_true", help="skip the re-read of the output")
    sp.add_argument("--force", action="store_true", help="overwrite the output")
    add_storage_options(sp)


def _weights(text: str | None) -> list[float] | None:
    from shardscope.backend.export import ExportError

    if text is None:
        return None
    try:
        return [float(w) for w in text.split(",")]
    except ValueError:
        raise ExportError(f"--weights {text!r}: give numbers separated by commas, e.g. 1,2,1.") from None


def run(args: argparse.Namespace) -> int:
    with sigterm_interrupts():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from shardscope.backend.compare.averaging import average_checkpoints
    from shardscope.backend.export import ExportError

    if len(args.paths) < 3:
        raise ExportError("give at least two checkpoints and the output.")
    *inputs, dst = args.paths
    with TerminalProgress(unit="bytes") as progress:
        recipe, result = average_checkpoints(
            inputs, dst, args.format, _weights(args.weights), args.ema, args.dtype, args.hf, args.ranks,
            args.prefix, args.force, not args.no_verify, progress, storage_options(args))
    shares = ", ".join(f"{w:.4g}" for w in recipe.effective())
    print(f"{recipe.method} of {len(recipe.weights)} checkpoints (weights {shares})\n{result.summary()}")
    return EXIT_PROBLEMS if result.verified is False else EXIT_OK
