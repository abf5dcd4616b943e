"""Folders written by torch's ``HuggingFaceStorageWriter`` (and plain safetensors folders).

Each ``*.safetensors`` file's JSON header says where every tensor's bytes are; a
``DCP_SHARDING_INFO`` entry in ``__metadata__`` gives each piece's offsets in the full tensor.
``shard-0000K-model-...`` names carry the writer (rank K-1). Only JSON is read: nothing to unpickle.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Container
from itertools import repeat

import numpy as np

from ..errors import CheckpointError
from ..filenames import MAX_INDEX_BYTES, METADATA, hf_shard_rank, is_safetensors_file
from ..filenames import SAFETENSORS_INDEX as INDEX
from ..text import count
from .chunks import safe_name
from .codecs import RAW_VALUES
from .model import MAX_INDEX, Checkpoint, ChunkTable, FileInfo, Problem, TensorEntry, itemsize
from .safetensors_items import SafetensorsTable, parse_safetensors_file
from .storage import Folder, why_absent


def open_hf_folder(folder: Folder, listing: dict[str, int], weight_map: dict[str, str] | None = None,
                   headers: dict[str, SafetensorsTable] | None = None) -> Checkpoint:
    """The checkpoint model of a HuggingFaceStorageWriter (or plain safetensors) folder, from its headers
    (``headers``: those already parsed, by file name)."""
    names = sorted(n for n in listing if is_safetensors_file(n))
    files: list[FileInfo] = []
    tables: list[tuple[SafetensorsTable, dict]] = []
    problems: list[Problem] = []
    version = None
    with folder.handles() as handles:
        for name in names:
            files.append(FileInfo(name, hf_shard_rank(name), listing[name]))
            table = (headers or {}).get(name)
            if table is None:  # (a table of no entries is falsy)
                table = parse_safetensors_file(handles, name, listing[name])
            version = version or table.metadata.get("DCP_VERSION")
            tables.append((table, _sharding_info(table.metadata, name, problems)))
    if not any(len(t) for t, _ in tables):
        raise CheckpointError(f"{folder.path}: safetensors files hold no tensors.", path=folder.path)
    ckpt = Checkpoint(folder.path, "hf-safetensors", version, files, [], [], ChunkTable.empty(),
                      codec=RAW_VALUES)
    whole = len(tables) == 1 or len({k for t, _ in tables for k in t.names}) == sum(len(t) for t, _ in tables)
    pieces = None
    if whole and not any(sharding for _, sharding in tables):  # every tensor stored whole, in one file
        _whole_tensors(ckpt, [t for t, _ in tables], problems)
    else:
        pieces = _pieced_tensors(ckpt, folder, tables, problems)
    if METADATA in listing:
        files.append(FileInfo(METADATA, None, listing[METADATA], "metadata"))
        ckpt.metadata_files = [METADATA]
    if INDEX in listing:
        held = pieces if pieces is not None else {t.fqn for t in ckpt.tensors}
        problems += _index_problems(folder, listing, held, weight_map)
    ckpt.problems = problems
    ckpt.reindex()
    return ckpt


def _whole_tensors(ckpt: Checkpoint, tables: list[SafetensorsTable], problems: list[Problem]) -> None:
    """The tensors and chunk table when each tensor is one entry of one file (a single file, HF's sharded
    ``model-0000K-of-0000N``): built from the headers' columns, one chunk per tensor at offsets zero."""
    names = tables[0].names if len(tables) == 1 else [k for t in tables for k in t.names]
    dtypes = tables[0].dtypes if len(tables) == 1 else [d for t in tables for d in t.dtypes]

    def joined(column: str) -> np.ndarray:  # one file's columns are taken as they are
        return getattr(tables[0], column) if len(tables) == 1 else np.concatenate([getattr(t, column) for t in tables])

    ndim, sizes, b_off, b_len = joined("ndim"), joined("dims"), joined("data_offset"), joined("nbytes")
    n = len(names)
    f_idx = np.repeat(np.arange(len(tables), dtype=np.int32), [len(t) for t in tables])
    starts = np.zeros(n, np.int64)
    np.cumsum(ndim[:-1], out=starts[1:])
    kinds: list[tuple[int, ...]] = [()]  # one tuple per distinct shape, shared by its tensors
    kind = np.zeros(n, np.int64)  # each row's index into kinds
    numel = np.ones(n, np.float64)  # exact below 2**53; larger ones are checked exactly in Python
    for k in np.unique(ndim).tolist():
        if k == 0:
            continue
        rows = np.flatnonzero(ndim == k)
        block = sizes[starts[rows][:, None] + np.arange(k)]
        numel[rows] = block.prod(axis=1, dtype=np.float64)
        unique, which = np.unique(block, axis=0, return_inverse=True)
        kind[rows] = len(kinds) + which.reshape(-1)
        kinds += [tuple(u) for u in unique.tolist()]
    shapes = list(map(kinds.__getitem__, kind.tolist()))
    sizes_of = {d: max(1, itemsize(d)) for d in set(dtypes)}
    item = np.fromiter((sizes_of[d] for d in dtypes), np.float64, n)
    expected = numel * item
    for r in np.flatnonzero((expected != b_len) | (expected >= 2.0**53)).tolist():
        length, shape, dtype = int(b_len[r]), shapes[r], dtypes[r]
        if length != math.prod(shape) * sizes_of[dtype]:
            problems.append(Problem("unreadable", f"{names[r]}: {length} bytes in {ckpt.files[f_idx[r]].name} for "
                                    f"shape {list(shape)} of {dtype}.", fqn=names[r], file=ckpt.files[f_idx[r]].name))
    dims = np.zeros(2 * len(sizes), np.int64)  # each chunk's offsets (zeros) then its sizes
    row = np.repeat(np.arange(n), ndim)
    dims[2 * starts[row] + ndim[row] + (np.arange(len(sizes)) - starts[row])] = sizes
    ckpt.tensors = list(map(TensorEntry, names, dtypes, shapes, range(n), repeat(1, n), repeat(ckpt, n)))
    ckpt.chunk_table = ChunkTable(np.arange(n, dtype=np.int32), f_idx, b_off, b_len, 2 * starts, dims)


def _pieced_tensors(ckpt: Checkpoint, folder: Folder, tables: list[tuple[SafetensorsTable, dict]],
                    problems: list[Problem]) -> dict[str, list[tuple]]:
    """The tensors and chunk table when a tensor is in pieces across files (DCP_SHARDING_INFO's offsets)."""
    files = ckpt.files
    pieces: dict[str, list[tuple]] = {}
    dtypes: dict[str, str] = {}
    for fi, (table, sharding) in enumerate(tables):
        where = folder.join(files[fi].name)
        dims, starts = table.dims.tolist(), table.dim_start().tolist()
        for i, (key, dtype, nd, off, length) in enumerate(zip(table.names, table.dtypes, table.ndim.tolist(),
                                                              table.data_offset.tolist(), table.nbytes.tolist(),
                                                              strict=True)):
            shape = tuple(dims[starts[i]:starts[i] + nd])
            offsets = _saved_offsets(sharding.get(key), nd, where, key)
            if dtypes.setdefault(key, dtype) != dtype:
                raise CheckpointError(f"{where}: {key} is {dtype} here and {dtypes[key]} "
                                      "in another file.", path=where, fqn=key)
            pieces.setdefault(key, []).append((offsets, shape, fi, off, length))
    t_idx, f_idx = array("i"), array("i")
    b_off, b_len, dim_start, dims = array("q"), array("q"), array("q"), array("q")
    for key, parts in pieces.items():
        nd = len(parts[0][1])
        if any(len(s) != nd for _, s, *_ in parts):
            raise CheckpointError(f"{folder.path}: {key} has pieces of different ranks.", path=folder.path, fqn=key)
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
            if length != math.prod(sizes) * max(1, itemsize(dtypes[key])):
                problems.append(Problem("unreadable", f"{key}: {length} bytes in {files[fi].name} for shape "
                                        f"{list(sizes)} of {dtypes[key]}.", fqn=key, file=files[fi].name))
        ckpt.tensors.append(TensorEntry(key, dtypes[key], shape, first, len(t_idx) - first, ckpt))
    ckpt.chunk_table = ChunkTable(np.frombuffer(t_idx, np.int32), np.frombuffer(f_idx, np.int32),
                                  np.frombuffer(b_off, np.int64), np.frombuffer(b_len, np.int64),
                                  np.frombuffer(dim_start, np.int64), np.frombuffer(dims, np.int64))
    return pieces


def index_weight_map(where: Folder) -> dict[str, str]:
    """Tensor name -> shard file of the folder's HF ``model.safetensors.index.json``, every file a plain
    name inside the folder; CheckpointError naming the index when it is missing, too large or malformed."""
    index = where.join(INDEX)
    size = where.listing().get(INDEX)
    if size is None:
        raise CheckpointError(f"{index}: no such file.", path=index)
    if size > MAX_INDEX_BYTES:
        raise CheckpointError(f"{index}: {size} bytes is implausible for a safetensors index.", path=index)
    try:
        with where.handles() as handles:
            weight_map = json.loads(handles.read(INDEX, 0, size))["weight_map"]
        files = set(weight_map.values())
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CheckpointError(f"{index}: not a readable safetensors index ({type(exc).__name__}).",
                              path=index) from None
    bad = next((k for k, f in weight_map.items() if not isinstance(f, str) or not safe_name(f)), None) \
        if files and not all(isinstance(f, str) and safe_name(f) for f in files) else None
    if bad is not None:
        raise CheckpointError(f"{index}: its weight_map places {str(bad)[:200]!r} in {str(weight_map[bad])[:200]!r}, "
                              "not a file inside the folder; refused.", path=index, fqn=str(bad))
    return weight_map


def _index_problems(folder: Folder, listing: dict[str, int], pieces: Container[str],
                    weight_map: dict[str, str] | None = None) -> list[Problem]:
    """What the folder's index promises and the shards do not hold: a shard file that is absent (or refused),
    a tensor in none of the shards. Without this a folder missing a shard would look healthy."""
    try:
        weight_map = weight_map if weight_map is not None else index_weight_map(folder)  # read once by the caller
    except CheckpointError as exc:
        return [Problem("unreadable", str(exc), file=INDEX)]
    out = []
    by_file: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        by_file.setdefault(name, []).append(key)
    for name in sorted(n for n in by_file if n not in listing):
        keys = by_file[name]
        out.append(Problem("missing_file", f"{name} {why_absent(folder.path, name)}; the index places "
                           f"{count(len(keys), 'tensor')} in it ({_some(keys)}).", fqn=keys[0], file=name))
    lost = [k for k, n in weight_map.items() if n in listing and k not in pieces]
    if lost:
        out.append(Problem("missing_tensor", f"{INDEX} places {count(len(lost), 'tensor')} in shards that do "
                           f"not hold them ({_some(lost)}).", fqn=lost[0]))
    return out


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (" …" if len(names) > 3 else "")


def _sharding_info(meta: dict[str, str], name: str, problems: list[Problem]) -> dict:
    try:
        sharding = json.loads(meta["DCP_SHARDING_INFO"]) if meta.get("DCP_SHARDING_INFO") else {}
    except (ValueError, RecursionError):
        sharding = None
    if not isinstance(sharding, dict):
        problems.append(Problem("unreadable", f"{name}: DCP_SHARDING_INFO is not a JSON object.", file=name))
        return {}
    return sharding


def _saved_offsets(info: object, ndim: int, where: str, key: str) -> tuple[int, ...]:
    offsets = info.get("saved_offsets") if isinstance(info, dict) else None
    if offsets is None:
        return (0,) * ndim
    if not isinstance(offsets, list) or len(offsets) != ndim or \
            not all(type(o) is int and 0 <= o < MAX_INDEX for o in offsets):
        raise CheckpointError(f"{where}: {key}: saved_offsets {str(offsets)[:80]} do not match the shape.",
                              path=where, fqn=key)
    return tuple(offsets)
