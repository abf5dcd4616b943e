"""A consolidated file in the browser: a torch ``.pt``/``.bin`` (loaded ``weights_only=True``, memory-mapped),
a ``.safetensors`` file, or an HF folder with ``model.safetensors.index.json``, shown as the same checkpoint
model a DCP folder gives: its file(s), one chunk per tensor, no writer ranks. The files are read by the
sources diff and import use (:mod:`.sources`); nothing here parses a format a second time.

A torch file's tensors get their byte range in the file from its zip directory: torch memory-maps the
whole file, so each storage sits at its record's offset from one base address, and the mapping is only
kept when every storage matches a record of its size that way. Values are then read from those bytes with
the record's stored CRC32 checked, and Verify contents checks every record's CRC32."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from ..checkpoint.browse import BrowseData, analyse, load_tree, value_stats
from ..checkpoint.chunks import ChunkReader, CorruptChunkError
from ..checkpoint.hf_reader import INDEX
from ..checkpoint.items import ItemFormatError, zip_records
from ..checkpoint.model import Checkpoint, ChunkTable, FileInfo, ObjectEntry, Problem, TensorEntry
from ..checkpoint.reader import open_checkpoint
from ..checkpoint.sources import TORCH_EXT, SafetensorsSource, TorchFileSource, open_source
from ..checkpoint.storage import RANK_METADATA_RE, Folder, is_url, open_folder
from ..checkpoint.tree import build_tree
from ..checkpoint.values import small_value_repr, tensor_stats
from ..checkpoint.verify import verify, verify_contents
from ..errors import CheckpointError
from ..progress import Progress

TORCH_FILE = "torch-file"  # Checkpoint.format of a torch.save file
BLOCK = 16 << 20
VALUE_TEXT = 60  # characters of a small non-tensor value in the tree


@dataclass
class FileBacking:
    """What a consolidated file's view keeps besides the checkpoint model."""

    values: dict[str, str]  # the non-tensor entries as short text
    source: TorchFileSource | None = None  # a torch file: its loaded (memory-mapped) tensors
    crc: dict[int, int] = field(default_factory=dict)  # a torch file: record offset -> stored CRC32


@dataclass
class FileBrowseData(BrowseData):
    """BrowseData of a consolidated file."""

    backing: FileBacking | None = None


def consolidated_path(path: str) -> str | None:
    """What to open as a consolidated file for ``path`` (an index JSON gives its folder), or None when
    ``path`` is a checkpoint folder (or its ``.metadata``) for the DCP reader."""
    text = str(path)
    if is_url(text):
        base = text.rstrip("/").rsplit("/", 1)[-1]
        return text if base.endswith((".safetensors", *TORCH_EXT)) else None
    if os.path.isfile(text):
        base = os.path.basename(text)
        if base == INDEX:
            return os.path.dirname(os.path.abspath(text))
        return None if base == ".metadata" or RANK_METADATA_RE.match(base) else text
    has = os.path.exists
    if os.path.isdir(text) and has(os.path.join(text, INDEX)) and not has(os.path.join(text, ".metadata")):
        return text
    return None


def open_file(target: str, storage_options: dict[str, Any] | None = None
              ) -> tuple[Checkpoint, FileBacking] | None:
    """A consolidated file (or HF index folder) as the checkpoint model and what backs its values; None when
    ``target`` turns out to be a DCP folder (an index next to a ``.metadata``: HF's storage writer)."""
    if is_url(target) and target.endswith(TORCH_EXT):
        raise CheckpointError(f"{target}: a torch file on a URL is not browsed (it would be copied whole); "
                              "copy it here first, or compare it with `shardscope diff`.", path=target)
    source = open_source(target, storage_options)
    try:
        if isinstance(source, SafetensorsSource):
            return _safetensors_checkpoint(source, target)
        if isinstance(source, TorchFileSource):
            return _torch_checkpoint(source, target)
        return None
    finally:
        if not isinstance(source, TorchFileSource):
            source.close()


def open_any(path: str, storage_options: dict[str, Any] | None = None, use_cache: bool = True
             ) -> tuple[Checkpoint, FileBacking | None]:
    """Whatever the window opens, for the commands (inspect, verify, show): a checkpoint folder's metadata,
    or a consolidated file's model and its backing (None for a folder)."""
    target = consolidated_path(path)
    # NOTE: a folder (an HF index folder, or the folder of an index file named) goes to the checkpoint reader,
    # which reports a missing or refused shard as a problem where the file sources refuse the whole folder
    is_file = target is not None and (is_url(target) or os.path.isfile(target))
    opened = open_file(target, storage_options) if is_file else None
    if opened is not None:
        return opened
    where = target or path
    return open_checkpoint(open_folder(where, storage_options) if is_url(where) else where, use_cache=use_cache), None


def read_tensor_any(ckpt: Checkpoint, backing: FileBacking | None, fqn: str, progress: Progress | None = None) -> Any:
    """Tensor ``fqn``'s values with their stored checksum checked: a torch file's from its record, everything
    else through the chunk reader."""
    if backing is None or backing.source is None:
        with ChunkReader(ckpt) as reader:
            return reader.read_tensor(ckpt.tensor(fqn), progress)
    return torch_file_tensor(ckpt, backing, fqn, progress)


def load_any(path: str, progress: Progress | None = None) -> BrowseData:
    """The browser's first step for any path: a checkpoint folder's metadata, or a consolidated file's
    header (safetensors) or ``weights_only`` load (torch), with the tree built."""
    target = consolidated_path(path)
    if target is None:
        return load_tree(path, progress)
    progress = progress or Progress()
    progress.start(2, "reading the file")
    opened = open_file(target)
    if opened is None:
        return load_tree(target, progress)
    ckpt, backing = opened
    progress.advance(1, "building the tree")
    return FileBrowseData(ckpt, build_tree(ckpt), backing=backing)


def analyse_any(data: BrowseData, progress: Progress | None = None) -> BrowseData:
    """The browser's second step (health, balance, small values); a consolidated file's non-tensor
    values come from its source."""
    analyse(data, progress)
    backing = getattr(data, "backing", None)
    if backing is not None:
        data.values = {**(data.values or {}), **backing.values}
    return data


def stats_any(data: BrowseData, fqn: str, progress: Progress | None = None) -> Any:
    """Statistics of tensor ``fqn`` (the inspector's background job): a torch file's values are read
    from its record with the CRC32 checked, everything else through the chunk reader."""
    backing = getattr(data, "backing", None)
    if backing is None or backing.source is None:
        return value_stats(data.ckpt, fqn, progress)
    return tensor_stats(torch_file_tensor(data.ckpt, backing, fqn, progress), progress=progress)


def verify_contents_any(ckpt: Checkpoint, progress: Progress | None = None) -> list[Problem]:
    """The window's Verify contents: a torch file's every zip record read once and its CRC32 checked,
    any other checkpoint's items through :func:`verify_contents`."""
    if ckpt.format != TORCH_FILE:
        return verify_contents(ckpt, progress)
    progress = progress or Progress()
    problems = verify(ckpt)
    info = ckpt.files[0]
    with ckpt.folder.handles() as handles:
        try:
            records = zip_records(handles, info.name, info.bytes or 0)
        except (ItemFormatError, CheckpointError) as exc:
            return [*problems, Problem("unreadable", f"{info.name}: its zip directory cannot be read ({exc}).",
                                       file=info.name)]
        users = _record_users(ckpt)
        progress.start(sum(r[1] for r in records.values()), "reading every record")
        for key, (offset, length, crc) in sorted(records.items(), key=lambda kv: kv[1]):
            read = _record_crc(handles, info.name, offset, length, progress)
            if read != crc:
                names = users.get(offset, [])
                what = f" (holds {', '.join(names[:3])}{' …' if len(names) > 3 else ''})" if names else ""
                problems.append(Problem("corrupt", f"{info.name}: record {key}{what} fails its CRC32 check (stored "
                                        f"{crc:08x}, read {read:08x}): the bytes changed on disk.",
                                        fqn=names[0] if names else None, file=info.name))
    return problems


def torch_file_tensor(ckpt: Checkpoint, backing: FileBacking, fqn: str, progress: Progress | None = None) -> Any:
    """Tensor ``fqn`` of a torch file: its record's bytes read and checked against the stored CRC32, viewed
    with the loaded tensor's dtype, shape and strides (the memory-mapped tensor when the records were not
    located)."""
    import torch

    loaded = backing.source.tensor(fqn)  # type: ignore[union-attr]
    chunk = ckpt.tensor(fqn).chunks[0]
    crc = backing.crc.get(chunk.offset) if chunk.length else None
    if crc is None:
        return loaded
    if progress:
        progress.start(1, f"reading {fqn}")
    buf = bytearray(chunk.length)
    with ckpt.folder.handles() as handles:
        handles.readinto(chunk.file, chunk.offset, memoryview(buf))
    read = zlib.crc32(buf)
    if read != crc:
        where = ckpt.folder.join(chunk.file)
        raise CorruptChunkError(f"{where} (tensor {fqn}): fails its CRC32 check (stored {crc:08x}, read {read:08x}): "
                                "the bytes changed on disk.", path=where, fqn=fqn)
    if progress:
        progress.advance(1)
    return torch.frombuffer(buf, dtype=loaded.dtype).as_strided(loaded.shape, loaded.stride(),
                                                                 loaded.storage_offset())


# ------------------------------------------------------------------ building the models
def _safetensors_checkpoint(source: SafetensorsSource, path: str) -> tuple[Checkpoint, FileBacking]:
    """The source's checkpoint model (its header parsed once), with the non-tensor entries shardscope
    keeps in the header metadata as entries without stored bytes."""
    ckpt = source.ckpt
    ckpt.path = path
    objects = [k for k, e in source.entries().items() if e.kind == "object"]
    values = {k: source.object(k) for k in objects}
    ckpt.objects = [ObjectEntry(k, None, 0, 0, None, v, True) for k, v in values.items()]
    return ckpt, FileBacking({k: small_value_repr(v, VALUE_TEXT) for k, v in values.items()})


def _torch_checkpoint(source: TorchFileSource, path: str) -> tuple[Checkpoint, FileBacking]:
    """One file, one chunk per tensor at its storage record's bytes (none when the records were not located)."""
    folder = open_folder(os.path.dirname(os.path.abspath(path)))
    folder.confined = False  # the file the user named: the Hugging Face cache links it to blobs/
    name = os.path.basename(path)
    entries = source.entries()
    tensors = {k: source.tensor(k) for k, e in entries.items() if e.kind == "tensor"}
    size = os.stat(path).st_size
    records = _locate_records(folder, name, size, tensors)
    ckpt = Checkpoint(path, TORCH_FILE, None, [FileInfo(name, None, size)], [], [], ChunkTable.empty())
    ckpt.folder = folder
    ranges = [records.get(t.untyped_storage().data_ptr(), (0, 0, 0)) for t in tensors.values()]
    ckpt.chunk_table = _one_chunk_each([tuple(t.shape) for t in tensors.values()], ranges)
    ckpt.tensors = [TensorEntry(k, entries[k].dtype or "", tuple(entries[k].shape or ()), i, 1, ckpt)
                    for i, k in enumerate(tensors)]
    objects = [k for k, e in entries.items() if e.kind == "object"]
    ckpt.objects = [ObjectEntry(k, None, 0, 0, None, source.object(k), True) for k in objects]
    if tensors and not records:
        ckpt.problems.append(Problem("unlocated", f"{name}: the tensors' byte ranges in the file were not located "
                                     "(not a zip torch.save archive torch maps as expected): values are read "
                                     "without their CRC32 checked.", file=name))
    ckpt.reindex()
    backing = FileBacking({o.fqn: small_value_repr(o.value, VALUE_TEXT) for o in ckpt.objects}, source,
                          {r[0]: r[2] for r in records.values()})
    return ckpt, backing


def _one_chunk_each(shapes: list[tuple[int, ...]], ranges: list[tuple[int, int, int]]) -> ChunkTable:
    """A chunk table with one whole-tensor chunk per shape, all in file 0, at the given byte ranges."""
    n = len(shapes)
    ndims = np.fromiter((len(s) for s in shapes), np.int64, n)
    dim_start = np.zeros(n, np.int64)
    if n:
        np.cumsum(2 * ndims[:-1], out=dim_start[1:])
    dims = np.fromiter(chain.from_iterable((0,) * len(s) + s for s in shapes), np.int64)
    offsets = np.fromiter((r[0] for r in ranges), np.int64, n)
    lengths = np.fromiter((r[1] for r in ranges), np.int64, n)
    return ChunkTable(np.arange(n, dtype=np.int32), np.zeros(n, np.int32), offsets, lengths, dim_start, dims)


def _locate_records(folder: Folder, name: str, size: int, tensors: dict[str, Any]) -> dict[int, tuple[int, int, int]]:
    """Storage address -> (offset, length, CRC32) of its record in the file, or {} unless every non-empty
    storage sits at its own record's offset from one base address and has that record's size."""
    try:
        with folder.handles() as handles:
            records = zip_records(handles, name, size)
    except (ItemFormatError, CheckpointError):
        return {}
    stored = sorted(r for k, r in records.items() if k.startswith("data/") and r[1])
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}
    ptrs = sorted(p for p, n in storages.items() if n)
    if not ptrs or len(ptrs) != len(stored):
        return {}
    base = ptrs[0] - stored[0][0]
    if any(p - base != r[0] or storages[p] != r[1] for p, r in zip(ptrs, stored, strict=True)):
        return {}
    return dict(zip(ptrs, stored, strict=True))


def _record_users(ckpt: Checkpoint) -> dict[int, list[str]]:
    """Record offset -> the tensors stored in it."""
    out: dict[int, list[str]] = {}
    t = ckpt.chunk_table
    for ti, off, ln in zip(t.tensor.tolist(), t.byte_offset.tolist(), t.length.tolist(), strict=True):
        if ln:
            out.setdefault(off, []).append(ckpt.tensors[ti].fqn)
    return out


def _record_crc(handles: Any, name: str, offset: int, length: int, progress: Progress) -> int:
    """CRC32 of ``length`` bytes of file ``name`` from ``offset``, read in blocks (cancellable)."""
    buf = memoryview(bytearray(min(BLOCK, max(length, 1))))
    crc = pos = 0
    while pos < length:
        view = buf[:min(len(buf), length - pos)]
        handles.readinto(name, offset + pos, view)
        crc = zlib.crc32(view, crc)
        pos += len(view)
        progress.advance(len(view))
    return crc
