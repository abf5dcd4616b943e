"""safetensors output: one file, or an HF-style sharded folder with ``model.safetensors.index.json``
(and a ``config.json`` when given). Tensors are written in parallel, each into its own byte range."""

from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Any

from ..checkpoint.chunks import ChunkReader
from ..checkpoint.model import SAFETENSORS_CODES
from ..errors import CheckpointError
from ..filenames import HF_CONFIG, HF_WEIGHTS, hf_shard_file
from ..filenames import SAFETENSORS_INDEX as INDEX_NAME
from ..progress import Progress
from .plan import ExportError, ExportItem, ExportPlan
from .source import TensorSource, pwrite_all
from .verify import Expectation


def _json_scalar(value: Any) -> Any:
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, bool | int | float | str) or v is None for v in value):
        return list(value)
    raise TypeError


def header_metadata(plan: ExportPlan, reader: ChunkReader, left_out: list[str]) -> dict[str, str]:
    """The ``__metadata__`` strings: format, producer, scalar non-tensor entries; the source path only
    when asked (people upload these files)."""
    meta = {"format": "pt", "producer": "shardscope"}
    if plan.record_source:
        meta["source"] = plan.ckpt.path
    if plan.ckpt.save_id:
        meta["dcp_save_id"] = plan.ckpt.save_id
    kept: dict[str, Any] = {}
    for key, o in plan.objects:
        try:
            kept[key] = _json_scalar(reader.read_object(o))
        except (TypeError, CheckpointError):
            left_out.append(f"{o.fqn}: not a scalar, string or list of them; safetensors holds only tensors")
    if kept:
        meta["shardscope_objects"] = json.dumps(kept)
    return meta


def build_header(items: list[ExportItem], metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    """The header bytes (length prefix included, padded to 8) and each tensor's data offset."""
    # NOTE: the text json.dumps(header, separators=(",", ":")) gives, written entry by entry (a dict per entry
    # and the encoder's walk over it took 3 s for 300,000 tensors)
    quoted = json.encoder.encode_basestring_ascii
    parts = ['{"__metadata__":' + json.dumps(metadata, separators=(",", ":"))]
    offsets = []
    seen = {"__metadata__"}
    pos = 0
    for it in items:
        code = SAFETENSORS_CODES.get(it.dtype)
        if code is None:
            raise ExportError(f"{it.entry.fqn}: dtype {it.dtype} has no safetensors equivalent; export to .pt "
                              "or leave it out.")
        if it.key in seen:  # a dict would keep the last one: never planned, but never written twice either
            raise ExportError(f"{it.key}: two tensors would have this name in the safetensors header.")
        seen.add(it.key)
        parts.append(f'{quoted(it.key)}:{{"dtype":"{code}","shape":[{",".join(map(str, it.shape))}],'
                     f'"data_offsets":[{pos},{pos + it.nbytes}]}}')
        offsets.append(pos)
        pos += it.nbytes
    raw = (",".join(parts) + "}").encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


def split_shards(items: list[ExportItem], limit: int) -> list[list[ExportItem]]:
    """Consecutive groups of at most ``limit`` bytes (a larger tensor gets a shard of its own)."""
    shards: list[list[ExportItem]] = [[]]
    size = 0
    for it in items:
        if shards[-1] and size + it.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    return shards


def write_file(path: str, items: list[ExportItem], metadata: dict[str, str], source: TensorSource,
               progress: Progress | None) -> list[Expectation]:
    """One safetensors file; returns what the verifier must find in it."""
    head, offsets = build_header(items, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pwrite_all(fd, head, 0)
        os.ftruncate(fd, len(head) + sum(i.nbytes for i in items))
        crcs = source.write_all([(it, fd, len(head) + off) for it, off in zip(items, offsets, strict=True)],
                                progress, path)
    finally:
        os.close(fd)  # fsynced by the atomic output while the verifier reads
    check_header(path, head)
    return [Expectation(path, len(head) + off, it.nbytes, crc, it.key)
            for it, off, crc in zip(items, offsets, crcs, strict=True)]


def check_header(path: str, head: bytes) -> None:
    """The header read back from disk is the one written, and safetensors itself accepts the file."""
    from safetensors import safe_open

    with open(path, "rb") as fh:
        if fh.read(len(head)) != head:
            raise ExportError(f"{path}: the header read back differs from the one written.")
    with safe_open(path, framework="pt"):  # parses the header and checks offsets against the size
        pass


def write_folder(out_path: str, items: list[ExportItem], meta: dict[str, str], source: TensorSource,
                 progress: Progress | None, max_shard_size: int | None) -> tuple[list[str], list[Expectation]]:
    """The tensors into folder ``out_path`` as Hugging Face lays them out: ``model.safetensors`` alone, or (with a
    maximum shard size) ``model-0000i-of-0000n.safetensors`` files and their ``model.safetensors.index.json``.
    Returns the file names and the verifier's expectations."""
    if not max_shard_size:
        return [HF_WEIGHTS], write_file(os.path.join(out_path, HF_WEIGHTS), items, meta, source, progress)
    shards = split_shards(items, max_shard_size)
    n = len(shards)
    weight_map: dict[str, str] = {}
    expect: list[Expectation] = []
    names = []
    for i, shard in enumerate(shards, 1):
        name = hf_shard_file(i, n)
        expect += write_file(os.path.join(out_path, name), shard, meta, source, progress)
        weight_map.update({it.key: name for it in shard})
        names.append(name)
    index = {"metadata": {"total_size": sum(it.nbytes for it in items),
                          **{k: v for k, v in meta.items() if k != "format"}},
             "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_path, INDEX_NAME), "w", encoding="utf-8") as fh:
        json.dump(index, fh, indent=2)
    names.append(INDEX_NAME)
    return names, expect


def write(plan: ExportPlan, out_path: str, dst: str, source: TensorSource, progress: Progress | None,
          left_out: list[str]) -> tuple[list[str], list[Expectation]]:
    """Write the plan into ``out_path`` (a file, or a folder when sharded; ``dst``, its final name, names nothing
    inside); returns the file names (relative to the output) and the verifier's expectations."""
    meta = header_metadata(plan, source.reader, left_out)
    items = list(plan.items)
    if not plan.max_shard_size:
        return [""], write_file(out_path, items, meta, source, progress)
    names, expect = write_folder(out_path, items, meta, source, progress, plan.max_shard_size)
    if plan.config_file:
        shutil.copyfile(plan.config_file, os.path.join(out_path, HF_CONFIG))
        names.append(HF_CONFIG)
    return names, expect


__all__ = ["INDEX_NAME", "build_header", "check_header", "header_metadata", "split_shards", "write", "write_file",
           "write_folder"]
