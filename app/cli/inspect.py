"""``shardscope inspect``: a checkpoint's summary (format, tensors, ranks, bytes, problems)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from shardscope.backend.errors import EXIT_OK
from shardscope.backend.text import count, escape_name, human_bytes, ranks_text

from .output import add_command, print_problems
from .storage_options import add_storage_options, storage_options

KIND_TEXT = {"resumable": "optimizer state beside the weights: a run can resume from it",
             "weights": "weights only: no optimizer state to resume from"}


def register(sub: Any) -> None:
    sp = add_command(sub, "inspect", run, "Summarise a checkpoint: format, tensors, ranks, bytes, problems.")
    add_storage_options(sp)
    sp.add_argument("path")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.add_argument("--tensors", action="store_true", help="list every tensor")
    sp.add_argument("--no-cache", action="store_true", help="do not use the metadata cache (as the global --no-cache)")


LAZY_TENSORS = "\x00tensors\x00"  # where write_inspect_json puts the tensors it writes itself
WRITE_PIECE = 1 << 20


def architecture(ckpt: Any) -> str | None:
    """The model architecture the weights' names say, in words (None: names of no scheme ``export --hf`` knows)."""
    from shardscope.backend.export.hf_model import describe_architecture
    from shardscope.backend.export.layouts import model_keys

    return describe_architecture(model_keys(ckpt))


def inspect_json(ckpt: Any, problems: list, with_tensors: bool = True) -> dict:
    """The ``--json`` document of ``inspect`` (``with_tensors=False``: a placeholder where the tensors go)."""
    from shardscope.backend.checkpoint.layout import rank_balance
    from shardscope.backend.checkpoint.values import small_value_repr
    from shardscope.backend.export.layouts import checkpoint_kind

    return {
        "path": ckpt.path,
        "format": ckpt.format,
        "kind": checkpoint_kind(ckpt),
        "architecture": architecture(ckpt),
        "version": ckpt.version,
        "save_id": ckpt.save_id,
        "files": [{"name": f.name, "rank": f.rank, "bytes": f.bytes, "kind": f.kind} for f in ckpt.files],
        "tensors": [t.to_json() for t in ckpt.tensors] if with_tensors else LAZY_TENSORS,
        "objects": [o.to_json() for o in ckpt.objects],
        "ranks": [r.to_json() for r in rank_balance(ckpt)],
        "problems": [p.to_json() for p in problems],
        **({"notes": list(ckpt.notes)} if ckpt.notes else {}),
        "lightning_meta": {str(k): v if isinstance(v, (int, float, str, bool, type(None))) else small_value_repr(v)
                           for k, v in lightning_meta(ckpt).items()},
    }


def lightning_meta(ckpt: Any) -> dict:
    """A Lightning/Fabric folder's ``meta.pt`` (epoch, global_step, hparams, ...); {} when absent or
    unreadable (verify reports why)."""
    from shardscope.backend.errors import ShardscopeError
    from shardscope.backend.formats.lightning import trainer_state

    try:
        return trainer_state(ckpt)
    except ShardscopeError:
        return {}


def write_inspect_json(ckpt: Any, problems: list, out: Any) -> None:
    """Exactly the text ``json.dump(inspect_json(ckpt, problems), out)`` writes, made fast for a million chunks:
    json's C encoder for everything but the tensors, which are written from the chunk table's columns (turned
    into Python lists once) as text with json's own separators, in pieces of about 1 MiB. (json.dump to a
    stream runs the pure-Python encoder and makes millions of small writes.)"""
    from shardscope.backend.checkpoint.model import itemsize

    head, tail = json.dumps(inspect_json(ckpt, problems, with_tensors=False)).split(json.dumps(LAZY_TENSORS), 1)
    out.write(head)
    t = ckpt.chunk_table
    dims, starts, files = t.dims.tolist(), t.dim_start.tolist(), t.file.tolist()
    offsets, lengths = t.byte_offset.tolist(), t.length.tolist()
    where = [(json.dumps(f.name), "null" if f.rank is None else str(f.rank)) for f in ckpt.files]
    quoted = json.encoder.encode_basestring_ascii  # what json.dumps does to a str (ensure_ascii), without its call
    dtypes = {d: (json.dumps(d), itemsize(d)) for d in {e.dtype for e in ckpt.tensors}}
    parts, size = ["["], 1
    for i, e in enumerate(ckpt.tensors):
        nd = len(e.shape)
        dtype, item = dtypes[e.dtype]
        chunks = []
        for j in range(e.first_chunk, e.first_chunk + e.chunk_count):
            s, fi = starts[j], files[j]
            d = dims[s:s + 2 * nd]
            name, rank = where[fi] if fi >= 0 else ('""', "null")
            chunks.append(f'{{"offsets": [{", ".join(map(str, d[:nd]))}], "sizes": [{", ".join(map(str, d[nd:]))}], '
                          f'"rank": {rank}, "file": {name}, "offset": {offsets[j]}, "length": {lengths[j]}}}')
        piece = (f'{", " if i else ""}{{"fqn": {quoted(e.fqn)}, "dtype": {dtype}, "shape": '
                 f'[{", ".join(map(str, e.shape))}], "nbytes": {math.prod(e.shape) * item}, '
                 f'"chunks": [{", ".join(chunks)}]}}')
        parts.append(piece)
        size += len(piece)
        if size >= WRITE_PIECE:
            out.write("".join(parts))
            parts, size = [], 0
    parts.append("]")
    out.write("".join(parts))
    out.write(tail)


def run(args: argparse.Namespace) -> int:
    from shardscope.backend.checkpoint.layout import rank_balance
    from shardscope.backend.checkpoint.verify import verify
    from shardscope.backend.export.layouts import checkpoint_kind
    from shardscope.backend.formats import open_checkpoint

    ckpt = open_checkpoint(args.path, storage_options(args), use_cache=not args.no_cache)
    problems = verify(ckpt)
    if args.json:
        write_inspect_json(ckpt, problems, sys.stdout)
        sys.stdout.write("\n")
        return EXIT_OK
    out = sys.stdout
    out.write(f"{escape_name(ckpt.path)}\n")
    version = f"  (format version {escape_name(ckpt.version)})" if ckpt.version else ""
    out.write(f"  format     {ckpt.format}{version}\n")
    for note in ckpt.notes:
        out.write(f"  note       {escape_name(note)}\n")
    kind = checkpoint_kind(ckpt)
    out.write(f"  kind       {kind} ({KIND_TEXT[kind]})\n")
    arch = architecture(ckpt)
    if arch:
        out.write(f"  model      architecture: {escape_name(arch)}\n")
    if ckpt.save_id:
        out.write(f"  save id    {escape_name(ckpt.save_id)}\n")
    out.write(f"  tensors    {len(ckpt.tensors)}  ({human_bytes(ckpt.total_bytes)}, "
              f"{count(len(ckpt.chunk_table), 'chunk')})\n")
    out.write(f"  other      {count(len(ckpt.objects), 'non-tensor entry', 'non-tensor entries')}\n")
    meta = lightning_meta(ckpt)
    if meta:
        from shardscope.backend.checkpoint.values import small_value_repr

        text = ", ".join(f"{escape_name(k)} {escape_name(small_value_repr(v, 60))}" for k, v in list(meta.items())[:8])
        out.write(f"  meta.pt    {text}{' ...' if len(meta) > 8 else ''}\n")
    out.write(f"  files      {count(len(ckpt.data_files), 'data file')}, "
              f"{human_bytes(sum(f.bytes or 0 for f in ckpt.files))} on disk\n")
    balance = rank_balance(ckpt)
    if all(r.rank < 0 for r in balance):
        out.write("  ranks      none (a consolidated file or folder: no rank wrote it)\n")
        balance = []
    else:
        out.write("  ranks      (writer rank: DCP writes a replicated tensor once, so a rank here is the rank\n"
                  "             that wrote a chunk, not every rank that held it)\n")
    for r in balance:
        label = f"rank {r.rank}" if r.rank >= 0 else "no rank"
        noun = "chunk" if r.chunks == 1 else "chunks"
        out.write(f"    {label:<9} {r.chunks:>8} {noun:<6}  {human_bytes(r.bytes):>10}\n")
    if args.tensors:
        out.write("\n")
        names = [escape_name(t.fqn) for t in ckpt.tensors]
        width = max((len(n) for n in names), default=10)
        dwidth = max((len(t.dtype) for t in ckpt.tensors), default=9)  # float8_e4m3fn, complex128
        for name, t in zip(names, ckpt.tensors):
            out.write(f"  {name:<{width}}  {t.dtype:<{dwidth}} {list(t.shape)!s:<18} {human_bytes(t.nbytes):>10}  "
                      f"{count(t.chunk_count, 'chunk')}, ranks {ranks_text(t.ranks)}\n")
    print_problems(problems)
    return EXIT_OK
