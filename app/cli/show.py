"""``shardscope show``: one tensor's chunk table and value statistics, or a non-tensor entry's value."""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardscope.backend.errors import EXIT_OK, CheckpointError
from shardscope.backend.text import count, escape_name, human_bytes, ranks_text

from .output import add_command
from .storage_options import add_storage_options, storage_options


def register(sub: Any) -> None:
    sp = add_command(sub, "show", run, "Show one tensor: shape, dtype, chunk table and value statistics.")
    add_storage_options(sp)
    sp.add_argument("path")
    sp.add_argument("fqn")
    sp.add_argument("--no-values", action="store_true", help="only the chunk table, read no values")
    sp.add_argument("--json", action="store_true",
                    help="print the entry (chunk table and statistics, or the value) as one JSON line instead")
    sp.add_argument("--no-cache", action="store_true", help="do not use the metadata cache (as the global --no-cache)")


def run(args: argparse.Namespace) -> int:
    from shardscope.backend.checkpoint.chunks import ChunkReader
    from shardscope.backend.formats import open_checkpoint

    ckpt = open_checkpoint(args.path, storage_options(args), use_cache=not args.no_cache)
    if not ckpt.has_tensor(args.fqn):
        obj = next((o for o in ckpt.objects if o.fqn == args.fqn), None)
        if obj is None:
            close = [escape_name(t.fqn) for t in ckpt.tensors if args.fqn in t.fqn][:5]
            hint = f"Did you mean: {', '.join(close)}?" if close else "List them with `shardscope inspect --tensors`."
            raise CheckpointError(f"{escape_name(ckpt.path)}: no entry named {escape_name(args.fqn)!r}.",
                                  path=ckpt.path, hint=hint)
        with ChunkReader(ckpt) as reader:
            _show_object(ckpt, obj, reader.read_object(obj), args.json)
        return EXIT_OK
    entry = ckpt.tensor(args.fqn)
    if not args.json:
        _print_tensor(ckpt, entry)
    if args.no_values:
        stats = None
    else:
        from shardscope.backend.checkpoint.values import tensor_stats

        with ChunkReader(ckpt) as reader:
            stats = tensor_stats(reader.read_tensor(entry))
    if args.json:  # NOTE: the JSON line alone on stdout, so that a script can parse it whole
        print(json.dumps({"tensor": entry.to_json(), "stats": stats.to_json() if stats is not None else None}))
    elif stats is not None:
        _print_stats(stats)
    return EXIT_OK


def _show_object(ckpt: Any, obj: Any, value: Any, as_json: bool) -> None:
    from shardscope.backend.checkpoint.values import small_value_repr

    text = small_value_repr(value, 2000)
    if as_json:
        print(json.dumps({"object": {"fqn": obj.fqn, "file": obj.file, "offset": obj.offset, "length": obj.length,
                                     "type": type(value).__name__, "value": text}}))
        return
    if obj.inline:  # a consolidated file's entry, read with the file (a torch pickle, a safetensors header)
        print(f"{escape_name(obj.fqn)}  (non-tensor entry of {escape_name(ckpt.path)})")
    else:
        print(f"{escape_name(obj.fqn)}  (non-tensor entry in {escape_name(obj.file)}, "
              f"bytes {obj.offset}..{obj.offset + obj.length})")
    print(f"  value  {escape_name(text)}")


def _print_tensor(ckpt: Any, entry: Any) -> None:
    """The table ``show`` prints for a tensor, before its values are read."""
    from shardscope.backend.checkpoint.layout import coverage

    cov = coverage(ckpt, entry)
    print(escape_name(entry.fqn))
    print(f"  dtype   {entry.dtype}\n  shape   {list(entry.shape)}\n  bytes   {human_bytes(entry.nbytes)}")
    writers = f"from {count(len(entry.ranks), 'rank')} ({ranks_text(entry.ranks)})" if entry.ranks else \
        "from no writer rank"
    print(f"  chunks  {entry.chunk_count} {writers}; "
          f"{'tile the tensor exactly' if cov.exact else 'DO NOT tile the tensor (see verify)'}")
    print(f"  {'offsets':<16} {'sizes':<16} {'rank':>4}  {'file':<16} {'byte offset':>12} {'length':>10}")
    for c in entry.chunks:
        print(f"  {list(c.offsets)!s:<16} {list(c.sizes)!s:<16} {c.rank if c.rank is not None else '-':>4}  "
              f"{escape_name(c.file):<16} {c.offset:>12} {c.length:>10}")


def _print_stats(st: Any) -> None:
    print("  values")
    if st.min is None:
        print("    no finite values")
    else:
        print(f"    min {st.min:.6g}  max {st.max:.6g}  mean {st.mean:.6g}  std {st.std:.6g}")
    print(f"    NaN {st.nan}  Inf {st.inf}  zeros {st.zeros}  of {st.numel}")
