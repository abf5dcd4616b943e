"""``shardscope export``: consolidate a sharded checkpoint into .pt or safetensors, streaming, verified."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

from shardscope.backend.errors import EXIT_OK, EXIT_PROBLEMS

from .output import TerminalProgress, add_command, sigterm_interrupts
from .storage_options import add_storage_options, storage_options


class ExportFormats:
    """The --format choices: the names the backend's writer registry writes, asked for only when argparse checks
    a given --format or prints help. NOTE: importing the registry imports the writers (numpy, ~0.15 s); every
    command builds this parser, and none but export needs them. ``extra``: names a command writes apart from
    an export plan (average's ``dcp``)."""

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self.extra = extra

    def _names(self) -> tuple[str, ...]:
        from shardscope.backend.export import export_formats

        return export_formats() + self.extra

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()


def register(sub: Any) -> None:
    sp = add_command(sub, "export", run, "Consolidate a sharded checkpoint into one .pt or safetensors file "
                     "(or an HF-style sharded safetensors folder), streaming, verified.")
    sp.add_argument("src", help="checkpoint folder")
    sp.add_argument("dst", help="output: X.safetensors, X.pt/.pth/.bin, or a folder with --max-shard-size")
    # NOTE: with a metavar, argparse reads the choices only to check a value or to print help
    sp.add_argument("--format", choices=ExportFormats(), metavar="FORMAT",
                    help="one of %(choices)s; default: from the destination's name")
    sp.add_argument("--hf", action="store_true", help="a Hugging Face model folder that from_pretrained loads: "
                    "torchtitan, Megatron-Core or HF names renamed and transformed exactly (rotary permutation, fused "
                    "QKV and gate/up split, vocabulary padding removed), every shape checked against --config (the "
                    "HF config.json of the model); same as --format hf")
    sp.add_argument("--only", action="append", metavar="PREFIX",
                    help="export entries under this prefix (repeatable); safetensors default: the model weights of "
                    "the recognised layout (torch DCP, Lightning, torchtitan, accelerate FSDP, Megatron)")
    sp.add_argument("--exclude", action="append", metavar="PREFIX", help="leave out entries under this prefix "
                    "(repeatable)")
    sp.add_argument("--rename", action="append", metavar="REGEX=REPLACEMENT",
                    help="rename keys (repeatable, applied in order, checked for collisions), e.g. "
                    "'^tok_embeddings\\.=model.embed_tokens.'")
    sp.add_argument("--strip-prefix", metavar="PREFIX", help="remove this from every key (default for safetensors: "
                    "the layout's container, e.g. 'model.'; wrapper key parts such as torch.compile's '_orig_mod.' "
                    "are removed too; give '' to keep every key as stored)")
    sp.add_argument("--config", metavar="CONFIG_JSON", help="copy this config.json next to a sharded export, so "
                    "from_pretrained loads the folder as it is; with --hf, the model's HF config")
    sp.add_argument("--record-source", action="store_true", help="write the source path into the output's metadata")
    sp.add_argument("--dtype", help="cast floating-point tensors: bf16, fp16 or fp32")
    sp.add_argument("--max-shard-size", metavar="SIZE", help="sharded safetensors, e.g. 5GB or 500MB")
    sp.add_argument("--no-verify", action="store_true", help="skip the full re-read of the output (bytes copied by the "
                    "kernel are still re-read: that is where their stored CRC32 is checked)")
    sp.add_argument("--force", action="store_true", help="overwrite the destination")
    add_storage_options(sp)


def run(args: argparse.Namespace) -> int:
    with sigterm_interrupts():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from shardscope.backend.export import ExportError, check_request, export, parse_shard_size, plan_export
    from shardscope.backend.formats import model_folder, open_checkpoint

    options = {"only": args.only, "strip_prefix": args.strip_prefix, "dtype": args.dtype,
               "max_shard_size": parse_shard_size(args.max_shard_size), "exclude": args.exclude,
               "rename": args.rename, "config": args.config, "record_source": args.record_source}
    if args.hf and args.format not in (None, "hf"):
        raise ExportError(f"--hf writes a Hugging Face model folder, not {args.format}; give one of them.")
    writer = check_request(args.dst, "hf" if args.hf else args.format, **options)  # before anything is read
    src, note = model_folder(args.src)  # what inspect opens (an HF Trainer checkpoint's model folder)
    ckpt = open_checkpoint(src, storage_options(args))  # any checkpoint the window opens
    plan = plan_export(ckpt, writer.name, **options)
    with TerminalProgress(unit="bytes") as progress:
        result = export(plan, args.dst, force=args.force, verify=not args.no_verify, progress=progress,
                        storage_options=storage_options(args))
    print("\n".join(([note] if note else []) + [result.summary()]))
    return EXIT_PROBLEMS if result.verified is False else EXIT_OK
