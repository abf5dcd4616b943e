"""Open a checkpoint folder: find its metadata, read it safely, and build the checkpoint model.

Handles torch ``FileSystemWriter`` folders (FSDP2, FSDP1 sharded, DDP, no process group),
per-rank ``__R.metadata`` files written with ``use_collectives=False`` (merged), the older
module paths and missing optional fields of torch 2.0 to 2.13, Lightning/Fabric folders with
``meta.pt``, and leftover ``.metadata.tmp`` files from an interrupted save. Which folders are DCP
folders is the formats' decision (:mod:`..formats`); this is the DCP formats' reader.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..filenames import DATA_SUFFIX, METADATA, METADATA_TMP, RANK_METADATA_RE, rank_of_file
from ..progress import Progress
from ..text import count
from . import cache, validate
from .codecs import ItemCodec, check_descriptors
from .model import Checkpoint, ChunkTable, FileInfo, ObjectEntry, Problem, TensorEntry
from .reader_process import load_metadata_pickle
from .safe_pickle import (
    BytesStorageRecord,
    ChunkRecord,
    MetadataIndexRecord,
    StorageInfoRecord,
    TensorStorageRecord,
    gc_paused,
)
from .storage import Folder, open_folder, outside_link
from .streaming import Events, NotStreamable, join_storage, max_dims, stream_metadata


def open_checkpoint(path: str | os.PathLike[str] | Folder, progress: Progress | None = None,
                    use_cache: bool = True) -> Checkpoint:
    """Read a DCP checkpoint folder's metadata (never its tensor data) into a :class:`Checkpoint`."""
    folder = open_folder(path)
    listing = folder.listing()
    problems: list[Problem] = []
    for name in sorted(listing):
        if name.endswith(METADATA_TMP):
            problems.append(Problem("leftover_tmp", f"{name} is left from an interrupted save; the save that "
                                    "wrote it did not finish (safe to delete once you know which save).",
                                    file=name))
    meta_names = _metadata_names(folder, listing)
    key = cache.key_for(folder, meta_names) if use_cache else None
    if key is not None:
        cached = cache.load(key, folder.path)
        if cached is not None:
            cached.problems[:0] = problems
            cached.folder = folder
            _refresh_files(cached, listing)
            return cached

    if progress:
        progress.start(len(meta_names), "reading metadata")
    ckpt = _read_streaming(folder, listing, meta_names) if len(meta_names) == 1 and STREAMING else None
    if ckpt is None:
        ckpt = _read_graphs(folder, listing, meta_names, progress)
    validate.check_table(ckpt, folder.join(meta_names[0]))
    if key is not None:  # NOTE: before the listing's problems are added: a cache hit adds them anew
        cache.store(key, ckpt)
    ckpt.problems[:0] = problems
    ckpt.folder = folder
    return ckpt


def _metadata_names(folder: Folder, listing: dict[str, int]) -> list[str]:
    """``.metadata``, else the per-rank ``__R.metadata`` files in rank order; bad input when there are none."""
    if METADATA in listing:
        return [METADATA]
    if folder.local and os.path.lexists(folder.join(METADATA)):  # there, but left out of the listing
        where = folder.join(METADATA)
        raise CheckpointError(f"{where}: not a regular file ({_file_kind(where)}); refused.", path=where)
    ranked = sorted((int(m.group(1)), n) for n in listing if (m := RANK_METADATA_RE.match(n)))
    if ranked:
        return [n for _, n in ranked]
    data = sorted(n for n in listing if n.endswith(DATA_SUFFIX))
    if data:
        raise CheckpointError(
            f"{folder.path}: {count(len(data), '.distcp file')} but no .metadata: the save did not finish (the "
            "coordinator writes .metadata last), so this checkpoint cannot be read or loaded.", path=folder.path)
    inside = _checkpoint_subfolders(folder)
    raise CheckpointError(
        f"{folder.path}: not a distributed checkpoint (no .metadata file and no .distcp files).",
        path=folder.path, hint=(f"It holds distributed checkpoints in {', '.join(inside)}: open one of those."
                                if inside else "Open the folder that dcp.save or Lightning's sharded save wrote."))


def _file_kind(path: str) -> str:
    """What a path that is not a regular file is, in words."""
    import stat

    target = outside_link(path, os.path.dirname(path))
    if target is not None:
        return f"a symbolic link to {target}, outside the checkpoint folder"
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "a dangling symbolic link"
    return "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"


def _checkpoint_subfolders(folder: Folder, limit: int = 8) -> list[str]:
    """Subfolders holding a ``.metadata`` (an accelerate ``save_state`` folder: ``pytorch_model_fsdp_0/``,
    ``optimizer_0/``), named for the error message; local folders only (a remote listing costs requests)."""
    if not folder.local:
        return []
    try:
        with os.scandir(folder.path) as it:
            names = sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
    except OSError:
        return []
    found = [f"{n}/" for n in names if os.path.isfile(os.path.join(folder.path, n, METADATA))]
    return found[:limit] + (["..."] if len(found) > limit else [])


def _read_graphs(folder: Folder, listing: dict[str, int], meta_names: list[str],
                 progress: Progress | None) -> Checkpoint:
    """Every metadata file unpickled as an object graph, then merged and built."""
    parsed = []
    for name in meta_names:
        fp = folder.join(name)
        try:
            with folder.open(name) as fh:
                parsed.append(load_metadata_pickle(fh, fp))
        except OSError as exc:
            raise CheckpointError(f"{fp}: cannot read ({exc}).", path=fp) from None
        if progress:
            progress.advance(1)
        _check_metadata(parsed[-1], fp)
    with gc_paused():
        return build_checkpoint(folder.path, parsed, listing, meta_names)


STREAMING = True  # tests turn it off to exercise the object-graph path on the same files


def _check_metadata(md: Any, fp: str) -> None:
    if type(md).__name__ != "MetadataRecord" or not isinstance(md.get("state_dict_metadata"), dict):
        raise CheckpointError(f"{fp}: does not hold DCP Metadata.", path=fp)


def _read_streaming(folder: Folder, listing: dict[str, int], meta_names: list[str]) -> Checkpoint | None:
    fp = folder.join(meta_names[0])
    try:
        with folder.open(meta_names[0]) as fh:
            md, ev = stream_metadata(fh, fp)
    except OSError as exc:
        raise CheckpointError(f"{fp}: cannot read ({exc}).", path=fp) from None
    except NotStreamable:
        return None
    _check_metadata(md, fp)
    try:
        with gc_paused():
            return build_streamed(folder.path, md, ev, listing, meta_names)
    except NotStreamable:
        return None


def build_streamed(folder: str, md: Any, ev: Events, listing: dict[str, int], meta_names: list[str]) -> Checkpoint:
    """The checkpoint model from a streamed ``.metadata`` (see :mod:`.streaming`)."""
    where = os.path.join(folder, meta_names[0])
    return _build(folder, md.state_dict_metadata, ev, validate.optional_str(md.get("version"), where, "version"),
                  md.get("storage_meta"), md.get("planner_data"), listing, meta_names)


def _build(folder: str, sdm: dict, ev: Events, version: str | None, storage_meta: Any, planner_data: Any,
           listing: dict[str, int], meta_names: list[str]) -> Checkpoint:
    """The one builder: tensor records (with ``first``/``count`` into the event arrays) and the storage
    entries of ``ev``, joined with a numpy sort; both readers end here."""
    where = os.path.join(folder, meta_names[0])
    ckpt = Checkpoint(folder, "dcp", version, [], [], [], ChunkTable.empty(), metadata_files=list(meta_names))
    problems: list[Problem] = []
    counts = []
    claimed = 0
    for fqn, rec in sdm.items():
        validate.as_fqn(fqn, where)
        if isinstance(rec, TensorStorageRecord):
            dtype = validate.dtype_of(rec.get("properties"), where, fqn)
            first, count = rec.get("first"), rec.get("count")
            if first != claimed:
                raise NotStreamable("tensor chunks out of order")
            claimed += count
            shape = validate.as_dims(rec.get("size"), where, "shape", fqn)
            ckpt.tensors.append(TensorEntry(fqn, dtype, shape, first, count, ckpt))
            counts.append(count)
    tensor_of_chunk = np.repeat(np.arange(len(counts), dtype=np.int32), np.asarray(counts, np.int64))
    pos, object_positions = join_storage(tensor_of_chunk, ev, {t.fqn: i for i, t in enumerate(ckpt.tensors)})
    paths = sorted(validate.as_path(p, where) for p in set(ev.info_path))  # the hooks let only str through
    ckpt.files = [FileInfo(p, rank_of_file(p), listing.get(p)) for p in paths]
    ckpt.chunk_table = _chunk_table(tensor_of_chunk, pos, ev, {p: i for i, p in enumerate(paths)})
    problems += _unstored(ckpt, pos, ev)
    problems += _objects(ckpt, sdm, ev, object_positions, where)
    ckpt.codec = _codec(ev, where, problems)
    _finish(ckpt, listing, meta_names, storage_meta, planner_data, problems)
    return ckpt


def _codec(ev: Events, where: str, problems: list[Problem]) -> ItemCodec:
    """DCP's items with the stream transforms each was written through (``_StorageInfo.transform_descriptors``,
    validated); a problem per file and transform Shardscope cannot decode, naming the first entry it holds."""
    transforms: dict[tuple[str, int], tuple[str, ...]] = {}
    unknown: dict[tuple[str, str], list[str]] = {}
    for i, descs in ev.transforms.items():
        fqn, path = ev.index_fqn[i], ev.info_path[i]
        transforms[(path, int(ev.info_offset[i]))] = checked = validate.transforms(descs, where, fqn)
        bad = check_descriptors(checked)
        if bad is not None:
            unknown.setdefault((path, bad), []).append(fqn)
    for (path, desc), names in sorted(unknown.items()):
        problems.append(Problem("unreadable", f"{path}: {count(len(names), 'entry', 'entries')} (first: {names[0]}) "
                                f"stored through stream transform {desc!r}, which Shardscope cannot decode (it "
                                "decodes stream.zstd/1, torch's ZStandard).", fqn=names[0], file=path))
    return ItemCodec(transforms)


def _chunk_table(tensor_of_chunk: np.ndarray, pos: np.ndarray, ev: Events, file_ids: dict[str, int]) -> ChunkTable:
    info_file = np.fromiter((file_ids[p] for p in ev.info_path), np.int32, len(ev.info_path))
    info_off = np.frombuffer(ev.info_offset, np.int64)
    info_len = np.frombuffer(ev.info_length, np.int64)
    found = pos >= 0
    safe = np.where(found, pos, 0)
    ndim = np.frombuffer(ev.chunk_ndim, np.int32).astype(np.int64)
    dim_start = np.zeros(len(ndim), np.int64)
    if len(ndim):
        np.cumsum(2 * ndim[:-1], out=dim_start[1:])
    return ChunkTable(
        tensor_of_chunk, np.where(found, info_file[safe] if len(info_file) else -1, -1).astype(np.int32),
        np.where(found, info_off[safe] if len(info_off) else 0, 0),
        np.where(found, info_len[safe] if len(info_len) else 0, 0),
        dim_start, np.frombuffer(ev.chunk_dims, np.int64))


def _unstored(ckpt: Checkpoint, pos: np.ndarray, ev: Events) -> list[Problem]:
    """A problem for each chunk (the first thousand) that has no storage entry."""
    out = []
    t = ckpt.chunk_table
    for j in np.nonzero(pos < 0)[0][:1000]:
        e = ckpt.tensors[int(t.tensor[j])]
        s0 = int(t.dim_start[j])
        offs = ev.chunk_dims[s0:s0 + e.ndim].tolist()
        out.append(Problem("no_storage", f"{e.fqn}: chunk at offsets {offs} has no storage entry in the "
                           "metadata.", fqn=e.fqn))
    return out


def _objects(ckpt: Checkpoint, sdm: dict, ev: Events, object_positions: list[int], where: str) -> list[Problem]:
    """The non-tensor entries, and a problem for each one without storage or of an unknown kind."""
    problems = []
    by_fqn = {ev.index_fqn[i]: i for i in object_positions}
    for fqn, rec in sdm.items():
        if isinstance(rec, TensorStorageRecord):
            continue
        if isinstance(rec, BytesStorageRecord):
            i = by_fqn.get(fqn)
            if i is None:
                ckpt.objects.append(ObjectEntry(fqn, None, 0, 0, None))
                problems.append(Problem("no_storage", f"{fqn}: non-tensor entry has no storage entry.", fqn=fqn))
            else:
                rel = ev.info_path[i]
                ckpt.objects.append(ObjectEntry(fqn, rel, validate.as_index(ev.info_offset[i], where, "offset", fqn),
                                                validate.as_index(ev.info_length[i], where, "length", fqn),
                                                rank_of_file(rel)))
        else:
            kind = getattr(rec, "kind", type(rec).__name__)  # the DCP class a record stands in for
            problems.append(Problem("unreadable", f"{fqn}: unknown metadata entry {kind}.", fqn=fqn))
    return problems


def _finish(ckpt: Checkpoint, listing: dict[str, int], meta_names: list[str], storage_meta: Any,
            planner_data: Any, problems: list[Problem]) -> None:
    """What both builders add after the chunks: unreferenced files, metadata, ids (formats.lightning adds its
    ``meta.pt``)."""
    files = ckpt.files
    known = {f.name for f in files}
    for name in sorted(listing):
        if name not in known and name.endswith(DATA_SUFFIX):
            # a file the metadata does not name is no writer rank of this save (a stale file of an earlier save
            # with more ranks; verify names it); an empty one is a rank that had nothing to write
            files.append(FileInfo(name, None if listing[name] else rank_of_file(name), listing[name]))
    for name in meta_names:
        files.append(FileInfo(name, None, listing.get(name), "metadata"))
    if storage_meta is not None:
        where = os.path.join(ckpt.path, meta_names[0])
        ckpt.save_id = validate.optional_str(validate.record(storage_meta, where, "storage_meta").get("save_id"),
                                             where, "save_id")
    names = [t.fqn for t in ckpt.tensors] + [o.fqn for o in ckpt.objects]
    ckpt.planner_data, problem = validate.planner_data(planner_data, names, os.path.join(ckpt.path, meta_names[0]))
    ckpt.problems = problems + ([problem] if problem else [])
    ckpt.reindex()


def _refresh_files(ckpt: Checkpoint, listing: dict[str, int]) -> None:
    """Sizes on disk change without the metadata changing (a truncated shard): read them anew."""
    ckpt.files = [FileInfo(f.name, f.rank, listing.get(f.name), f.kind) for f in ckpt.files]
    ckpt.reindex()


def _chunks(md: Any, fqn: str, where: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A tensor record's chunks as validated (offsets, sizes) pairs."""
    chunks = md.get("chunks")
    if not isinstance(chunks, list):
        raise validate.bad(where, "the chunk list is not a list", fqn)
    ndim = len(validate.as_dims(md.get("size"), where, "shape", fqn))
    out = []
    for c in chunks:
        if not isinstance(c, ChunkRecord):
            raise validate.bad(where, f"a chunk is {type(c).__name__}, not a chunk record", fqn)
        out.append((validate.as_dims(c.get("offsets"), where, "chunk offsets", fqn, ndim),
                    validate.as_dims(c.get("sizes"), where, "chunk sizes", fqn, ndim)))
    return out


def _graph_events(parsed: list[Any], where: str, limit: int) -> tuple[dict, Events]:
    """Unpickled object graphs (one or several per-rank files, ``use_collectives=False``) as the
    streaming reader's events, so one builder serves both readers. A chunk several files name is kept once."""
    sdm: dict[str, Any] = {}
    chunks: dict[str, list] = {}
    seen: dict[str, set] = {}
    ev = Events()
    for m in parsed:
        for fqn, md in m.state_dict_metadata.items():
            validate.as_fqn(fqn, where)
            if isinstance(md, TensorStorageRecord):
                mine = _chunks(md, fqn, where)
                if fqn not in chunks:
                    sdm[fqn], chunks[fqn], seen[fqn] = md, [], set()
                chunks[fqn] += [c for c in mine if c[0] not in seen[fqn]]
                seen[fqn].update(c[0] for c in mine)
            else:
                sdm.setdefault(fqn, md)
        for key, info in validate.mapping(m.get("storage_data"), where, "storage_data").items():
            _storage_event(ev, key, info, where)
    if 2 * sum(len(c[0]) for cs in chunks.values() for c in cs) > limit:
        raise validate.bad(where, "the chunks repeat far more often than the file's size allows (memo references)")
    for fqn, rec in sdm.items():
        if isinstance(rec, TensorStorageRecord):
            copy = TensorStorageRecord()
            copy.__dict__.update(properties=rec.get("properties"), size=rec.get("size"), first=len(ev.chunk_ndim),
                                 count=len(chunks[fqn]))
            for offsets, sizes in chunks[fqn]:
                ev.chunk_ndim.append(len(offsets))
                ev.chunk_dims.extend(offsets)
                ev.chunk_dims.extend(sizes)
            sdm[fqn] = copy
    return sdm, ev


def _storage_event(ev: Events, key: Any, info: Any, where: str) -> None:
    """One validated ``storage_data`` entry appended to the events."""
    if not isinstance(key, MetadataIndexRecord) or not isinstance(info, StorageInfoRecord):
        raise validate.bad(where, f"a storage entry is {type(key).__name__} -> {type(info).__name__}")
    fqn = validate.as_fqn(key.get("fqn"), where)
    offset = key.get("offset")
    ev.index_fqn.append(fqn)
    if offset is None:
        ev.index_ndim.append(-1)
    else:
        dims = validate.as_dims(offset, where, "storage offsets", fqn)
        ev.index_ndim.append(len(dims))
        ev.index_dims.extend(dims)
    ev.info_path.append(validate.as_path(info.get("relative_path"), where, fqn))
    ev.info_offset.append(validate.as_index(info.get("offset"), where, "offset", fqn))
    ev.info_length.append(validate.as_index(info.get("length"), where, "length", fqn))
    if info.get("transform_descriptors"):  # torch's stream transforms (ZStandard), checked in _build
        ev.transforms[len(ev.info_path) - 1] = info.get("transform_descriptors")


def build_checkpoint(folder: str, parsed: list[Any], listing: dict[str, int],
                     meta_names: list[str]) -> Checkpoint:
    """The checkpoint model from unpickled metadata object graphs (one or several per-rank files)."""
    where = os.path.join(folder, meta_names[0])
    sdm, ev = _graph_events(parsed, where, max_dims(sum(listing.get(n) or 0 for n in meta_names)))
    planner: Any = {}  # each per-rank file holds its own rank's paths
    for m in parsed:
        mine = m.get("planner_data")
        if mine is None or not isinstance(planner, dict):
            continue
        if isinstance(mine, dict):
            planner.update(mine)
        else:
            planner = mine  # not a mapping: validate.planner_data records the problem
    version = validate.optional_str(parsed[0].get("version"), where, "version")
    return _build(folder, sdm, ev, version, parsed[0].get("storage_meta"), planner, listing, meta_names)
