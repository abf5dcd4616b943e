"""One ``.safetensors`` file (``save_file``, ``save_pretrained``'s ``model.safetensors``, a Shardscope export): its
JSON header gives every tensor's dtype, shape and byte range; non-tensor entries a Shardscope export kept in the
header metadata (``shardscope_objects``) ride along as values. Safetensors stores no checksums: a deep read
checks ranges and shapes only, and says so."""

from __future__ import annotations

import json
import os
import struct
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, ShardscopeError
from ..filenames import is_safetensors_file, is_url
from .base import CHECKSUMS_NONE, WEIGHTS, Facts, FileBytes, Format, StorageOptions, Target, head

if TYPE_CHECKING:
    from ..checkpoint.model import Checkpoint
    from ..progress import Progress

MAX_PROBED_HEADER = 1 << 20  # a listing parses headers up to this; longer ones are only length-checked
IDENTITY_HEADER_LIMIT = 100 << 20  # a longer header is not checksummed for lineage (its length prefix is)
OBJECTS_KEY = "shardscope_objects"  # header metadata: the non-tensor entries of an export, as JSON


class SafetensorsFileFormat(Format):
    name = "safetensors"
    label = "safetensors file"
    probe_reads_own_files = True
    kind = WEIGHTS
    is_folder = False
    checksums = CHECKSUMS_NONE

    def detect_file(self, name: str) -> bool:
        return is_safetensors_file(name)

    def probe_file(self, path: str, size: int, local: bool = True) -> Facts | None:
        if not local:
            return super().probe_file(path, size, local)
        state, reason = _state(path, size)
        return Facts(self.name, state, reason, kind=WEIGHTS)

    def identity_piece(self, path: str, size: int) -> tuple[int, int] | None:
        """The header: its length prefix and JSON (only the prefix when the length is implausible)."""
        if size < 8:
            return None
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        return (0, 8 + n) if n <= min(size - 8, IDENTITY_HEADER_LIMIT) else (0, 8)

    def open(self, path: Target, storage_options: StorageOptions | None = None, use_cache: bool = True,
             progress: Progress | None = None) -> Checkpoint:
        from ..checkpoint.hf_reader import open_hf_folder
        from ..checkpoint.model import ObjectEntry
        from ..checkpoint.safetensors_items import parse_safetensors_file
        from ..checkpoint.sources import header_problem
        from ..checkpoint.storage import open_folder, open_remote_file

        text = str(path)
        if is_url(text):
            where, name = open_remote_file(text, storage_options)
        else:
            where, name = open_folder(os.path.dirname(os.path.abspath(text))), os.path.basename(text)
        where.confined = False  # the file the user named: HF's cache links it to blobs/
        listing = where.listing()
        if name not in listing:
            raise CheckpointError(f"{where.join(name)}: no such file.", path=where.join(name))
        # NOTE: the header is parsed here first, through the folder's handles left open: on a URL those are the
        # folder's one shared planner, so open_hf_folder finds the header bytes cached (one GET per file)
        handles = where.handles()
        header = parse_safetensors_file(handles, name, listing[name])
        meta = header.metadata
        if handles.local:
            handles.close()
        ckpt = open_hf_folder(where, {name: listing[name]}, headers={name: header})  # parsed once (300,000 entries)
        ckpt.path, ckpt.format, ckpt.folder = text, self.name, where
        bad = header_problem(ckpt)
        if bad is not None:  # a header the safetensors library refuses: sizes that do not fit, entries overlapping
            raise CheckpointError(f"{where.join(bad.file or '')} (tensor {bad.fqn}): not a valid safetensors "
                                  f"header: {bad.message}", path=where.join(bad.file or ""), fqn=bad.fqn)
        ckpt.objects = [ObjectEntry(k, None, 0, 0, None, v, True) for k, v in _objects(meta).items()]
        return ckpt


def _objects(meta: dict[str, str]) -> dict[str, Any]:
    try:
        objects = json.loads(meta.get(OBJECTS_KEY) or "{}")
    except (ValueError, RecursionError):
        return {}
    return objects if isinstance(objects, dict) else {}


def _state(path: str, size: int) -> tuple[str, str]:
    """Whether a safetensors file is whole: its header parsed by the one parser (headers over 1 MiB only
    length-checked, to keep a listing quick), and its data ending within the file."""
    from ..checkpoint.dtypes import MAX_INDEX
    from ..checkpoint.items import ItemFormatError
    from ..checkpoint.safetensors_items import MAX_SAFETENSORS_HEADER, parse_safetensors_header, trailing_bytes

    first = head(path, 8)
    if first is None:
        return "unreadable", "the file cannot be read"
    if len(first) < 8:
        return "incomplete", "shorter than a safetensors header"
    (n,) = struct.unpack("<Q", first)
    if 8 + n > size:
        return ("incomplete", "truncated inside its header") if n <= MAX_SAFETENSORS_HEADER else \
            ("unreadable", f"header length {n} is implausible")
    if n > MAX_PROBED_HEADER:
        return "complete", ""
    try:
        with FileBytes(path) as src:
            end = parse_safetensors_header(src, os.path.basename(path), 0, size, MAX_INDEX).end
    except ItemFormatError as exc:
        return "unreadable", f"the safetensors header does not parse ({exc})"
    except (ShardscopeError, OSError):
        return "unreadable", "the file cannot be read"
    if end > size:
        return "incomplete", f"truncated: the header needs {end} bytes, the file has {size}"
    tail = trailing_bytes(end, size)
    return ("unreadable", tail) if tail else ("complete", "")


FORMAT = SafetensorsFileFormat()
