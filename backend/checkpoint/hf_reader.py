"""Folders written by torch's ``HuggingFaceStorageWriter`` (and plain safetensors folders).

Each ``*.safetensors`` file's JSON header says where every tensor's bytes are; a
``DCP_SHARDING_INFO`` entry in ``__metadata__`` gives each piece's offsets in the full tensor.
``shard-0000K-model-...`` names carry the writer (rank K-1). Only JSON is read: nothing to unpickle.
"""

from __future__ import annotations

import json
import math
import re
import struct
from array import array
from typing import Any

import numpy as np

from ..errors import CheckpointError
from .items import SAFETENSORS_DTYPES
from .model import Checkpoint, ChunkTable, FileInfo, Problem, TensorEntry
from .storage import Folder

SHARD_RE = re.compile(r"^shard-(\d+)-")
MAX_HEADER = 100 * 2**20


def is_hf_folder(listing: dict[str, int], folder: Folder) -> bool:
    if not any(n.endswith(".safetensors") for n in listing):
        return False
    if ".metadata" not in listing:
        return True
    with folder.open(".metadata") as f:
        return f.read(1) == b"{"  # the HF writer's .metadata is a JSON weight map, not a pickle


def read_header(handles: Any, name: str, size: int) -> tuple[dict, int]:
    where = handles.where(name)
    try:
        if size < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", handles.read(name, 0, 8))
        if n > MAX_HEADER or 8 + n > size:
            raise ValueError(f"header length {n} is implausible")
        header = json.loads(handles.read(name, 8, n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        return header, 8 + n
    except (ValueError, CheckpointError) as exc:
        raise CheckpointError(f"{where}: not a readable safetensors file ({exc}).", path=where) from None


def open_hf_folder(folder: Folder, listing: dict[str, int]) -> Checkpoint:
    names = sorted(n for n in listing if n.endswith(".safetensors"))
    files: list[FileInfo] = []
    pieces: dict[str, list[tuple]] = {}
    dtypes: dict[str, str] = {}
    problems: list[Problem] = []
    version = None
    handles = folder.handles()
    for fi, name in enumerate(names):
        m = SHARD_RE.match(name)
        files.append(FileInfo(name, int(m.group(1)) - 1 if m else None, listing[name]))
        header, base = read_header(handles, name, listing[name])
        meta = header.pop("__metadata__", None) or {}
        version = version or meta.get("DCP_VERSION")
        try:
            sharding = json.loads(meta["DCP_SHARDING_INFO"]) if meta.get("DCP_SHARDING_INFO") else {}
        except ValueError:
            sharding = {}
            problems.append(Problem("unreadable", f"{name}: DCP_SHARDING_INFO is not valid JSON.", file=name))
        for key, info in header.items():
            try:
                dtype = SAFETENSORS_DTYPES.get(info["dtype"], str(info["dtype"]).lower())
                shape = tuple(int(s) for s in info["shape"])
                a, b = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{folder.join(name)}: header entry {key!r} is malformed.",
                                      path=folder.join(name), fqn=key) from None
            offsets = tuple(int(o) for o in (sharding.get(key, {}).get("saved_offsets") or [0] * len(shape)))
            if len(offsets) != len(shape):
                raise CheckpointError(f"{folder.join(name)}: {key}: saved_offsets do not match the shape.",
                                      path=folder.join(name), fqn=key)
            dtypes.setdefault(key, dtype)
            pieces.setdefault(key, []).append((offsets, shape, fi, base + a, b - a))
    handles.close()
    if not pieces:
        raise CheckpointError(f"{folder.path}: safetensors files hold no tensors.", path=folder.path)
    ckpt = Checkpoint(folder.path, "hf-safetensors", version, files, [], [], ChunkTable.empty())
    t_idx, f_idx = array("i"), array("i")
    b_off, b_len, dim_start, dims = array("q"), array("q"), array("q"), array("q")
    for key, parts in pieces.items():
        nd = len(parts[0][1])
        shape = tuple(max(o[d] + s[d] for o, s, *_ in parts) for d in range(nd))
        first = len(t_idx)
        for offsets, sizes, fi, off, length in parts:
            t_idx.append(len(ckpt.tensors))
            f_idx.append(fi)
            b_off.append(off)
            b_len.append(length)
            dim_start.append(len(dims))
            dims.extend(offsets)
            dims.extend(sizes)
            if length != math.prod(sizes) * max(1, _itemsize(dtypes[key])):
                problems.append(Problem("unreadable", f"{key}: {length} bytes in {files[fi].name} for shape "
                                        f"{list(sizes)} of {dtypes[key]}.", fqn=key, file=files[fi].name))
        ckpt.tensors.append(TensorEntry(key, dtypes[key], shape, first, len(t_idx) - first, ckpt))
    ckpt.chunk_table = ChunkTable(np.frombuffer(t_idx, np.int32), np.frombuffer(f_idx, np.int32),
                                  np.frombuffer(b_off, np.int64), np.frombuffer(b_len, np.int64),
                                  np.frombuffer(dim_start, np.int64), np.frombuffer(dims, np.int64))
    if ".metadata" in listing:
        files.append(FileInfo(".metadata", None, listing[".metadata"], "metadata"))
        ckpt.metadata_files = [".metadata"]
    ckpt.problems = problems
    ckpt.reindex()
    return ckpt


def _itemsize(dtype: str) -> int:
    from .model import itemsize

    return itemsize(dtype)
