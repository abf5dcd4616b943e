"""One torch.save file (``.pt``, ``.pth``, ``.bin``, Lightning's ``.ckpt``): its pickle read safely without torch
(:mod:`..checkpoint.torch_file_tree`: what ``torch.load(weights_only=True)`` accepts, no tensor made), then each
tensor is one chunk at its storage record's bytes in the zip archive, with the record's stored CRC32, so the one chunk
reader reads and checks its values like any other checkpoint's. A file that reader leaves to torch is loaded with
``weights_only=True`` and memory-mapped as before: torch maps the whole file, so every storage sits at its
record's offset from one base address; the records are only used when every storage matches one that way.

A file on a URL is copied to the temp folder once (torch's loader needs a local file) and the copy lives as long
as the opened checkpoint."""

from __future__ import annotations

import os
from itertools import chain
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..filenames import is_torch_file, is_url
from .base import (
    CHECKSUMS_RECORDS,
    RESUMABLE,
    WEIGHTS,
    Facts,
    FileBytes,
    Format,
    StorageOptions,
    Target,
    head,
    names_optimizer,
)

if TYPE_CHECKING:
    from ..checkpoint.download import Download
    from ..checkpoint.model import Checkpoint, ChunkTable, Problem
    from ..checkpoint.remote_reads import RemoteHandles
    from ..checkpoint.storage import Folder, LocalHandles
    from ..checkpoint.torch_file_tree import TensorView
    from ..progress import Progress

MAX_KIND_PROBE = 16 << 20  # bytes of a torch file's pickle read to tell its kind
BLOCK = 16 << 20
IDENTITY_TAIL_BYTES = 1 << 20  # a torch.save archive's end: its central directory, with every record's CRC32


class TorchFileFormat(Format):
    name = "torch"
    label = "torch.save file (loaded weights_only)"
    probe_reads_own_files = True
    kind = WEIGHTS
    is_folder = False
    checksums = CHECKSUMS_RECORDS

    def detect_file(self, name: str) -> bool:
        return is_torch_file(name)

    def probe_file(self, path: str, size: int, local: bool = True) -> Facts | None:
        if not local:  # not read: weights (never removed without asking, never taking a resumable one's slot)
            return super().probe_file(path, size, local)
        state, reason, is_torch = _state(path, size)
        if not is_torch:
            return None
        return Facts(self.name, state, reason, kind=torch_file_kind(path, size) if state == "complete" else WEIGHTS)

    def identity_piece(self, path: str, size: int) -> tuple[int, int] | None:
        """The archive's end: its central directory, which holds every record's CRC32."""
        return max(0, size - IDENTITY_TAIL_BYTES), min(size, IDENTITY_TAIL_BYTES)

    def open(self, path: Target, storage_options: StorageOptions | None = None, use_cache: bool = True,
             progress: Progress | None = None) -> Checkpoint:
        from ..checkpoint.download import Download

        text = str(path)
        if not is_url(text):
            return _open_local(text, text)
        copy = Download(text, storage_options).__enter__()
        try:
            ckpt = _open_local(copy.path or "", text)
        except BaseException:
            copy.__exit__()
            raise
        ckpt.format_data = _CopyKeeper(copy)  # the copy lives as long as the checkpoint read from it
        return ckpt

    def deep_checks(self, ckpt: Checkpoint, progress: Progress | None = None) -> list[Problem]:
        """The records no tensor's chunk covers (``data.pkl``, ``version``, ...) read once and their CRC32 checked
        (the tensors' records are checked as their chunks are read)."""
        from ..checkpoint.items import ItemFormatError, zip_records
        from ..checkpoint.model import Problem
        from ..progress import Progress

        progress = progress or Progress()
        info = ckpt.files[0]
        problems = []
        with ckpt.folder.handles() as handles:
            try:
                records = zip_records(handles, info.name, info.bytes or 0)
            except (ItemFormatError, CheckpointError) as exc:
                return [Problem("unreadable", f"{info.name}: its zip directory cannot be read ({exc}).",
                                file=info.name)]
            users = _record_users(ckpt)
            others = {k: r for k, r in records.items() if not (ckpt.located and r[0] in users)}
            progress.start(sum(r[1] for r in others.values()), "reading the other records")
            for key, (offset, length, crc) in sorted(others.items(), key=lambda kv: kv[1]):
                read = _record_crc(handles, info.name, offset, length, progress)
                if read != crc:
                    names = users.get(offset, [])
                    what = f" (holds {', '.join(names[:3])}{' …' if len(names) > 3 else ''})" if names else ""
                    problems.append(Problem("corrupt", f"{info.name}: record {key}{what} fails its CRC32 check "
                                            f"(stored {crc:08x}, read {read:08x}): the bytes changed on disk.",
                                            fqn=names[0] if names else None, file=info.name))
        return problems


class _CopyKeeper:
    """Holds a downloaded copy for as long as the checkpoint read from it is alive (the chunk reader reads the
    copy's records); removed when the checkpoint goes (a kill -9's copy: by the next download)."""

    def __init__(self, copy: Download) -> None:
        self.copy = copy

    def __del__(self) -> None:
        self.copy.__exit__()


def _open_local(path: str, shown: str) -> Checkpoint:
    """The checkpoint model of a local torch file: one chunk per tensor at its storage record."""
    from ..checkpoint.safe_pickle import gc_paused

    with gc_paused():  # 100,000 entries: the cyclic GC would rescan every object made so far, again and again
        return _model(path, shown)


def _model(path: str, shown: str) -> Checkpoint:
    import numpy as np

    from ..checkpoint.items import StoredTensor
    from ..checkpoint.model import Checkpoint, ChunkTable, FileInfo, ObjectEntry, Problem, TensorEntry
    from ..checkpoint.storage import open_folder
    from ..checkpoint.torch_file_tree import TorchFileLoad

    loaded = TorchFileLoad(path, name=shown)
    folder = open_folder(os.path.dirname(os.path.abspath(path)))
    folder.confined = False  # the file the user named: the Hugging Face cache links it to blobs/
    name = os.path.basename(path)
    tensors = loaded.tensors()
    size = os.stat(path).st_size
    records = loaded.storage_records  # by storage key, when read without torch.load
    if records is None:
        records = _locate_records(folder, name, size, tensors, loaded.records)
    ckpt = Checkpoint(shown, TORCH_FILE.name, None, [FileInfo(name, None, size)], [], [], ChunkTable.empty())
    ckpt.folder = folder
    ranges = [records.get(t.storage, (0, 0, 0)) for t in tensors.values()]
    ckpt.chunk_table = _one_chunk_each([t.shape for t in tensors.values()], ranges, np)
    ckpt.tensors = [TensorEntry(k, t.dtype, t.shape, i, 1, ckpt) for i, (k, t) in enumerate(tensors.items())]
    ckpt.located = {(k, name, r[0]): StoredTensor(t.dtype, t.shape, t.stride, t.storage_offset, r[0], r[1], r[2])
                    for (k, t), r in zip(tensors.items(), ranges, strict=True)} if records else {}
    ckpt.objects = [ObjectEntry(k, None, 0, 0, None, v, True) for k, v in loaded.objects().items()]
    ckpt.planner_data = loaded.paths()
    if tensors and not records:
        ckpt.problems.append(Problem("unlocated", f"{name}: the tensors' byte ranges in the file were not located "
                                     "(not a zip torch.save archive torch maps as expected), so their values "
                                     "cannot be read.", file=name))
    ckpt.reindex()
    return ckpt


def _one_chunk_each(shapes: list[tuple[int, ...]], ranges: list[tuple[int, int, int | None]], np: Any
                    ) -> ChunkTable:
    """A chunk table with one whole-tensor chunk per shape, all in file 0, at the given byte ranges."""
    from ..checkpoint.model import ChunkTable

    n = len(shapes)
    ndims = np.fromiter((len(s) for s in shapes), np.int64, n)
    dim_start = np.zeros(n, np.int64)
    if n:
        np.cumsum(2 * ndims[:-1], out=dim_start[1:])
    dims = np.fromiter(chain.from_iterable((0,) * len(s) + s for s in shapes), np.int64)
    offsets = np.fromiter((r[0] for r in ranges), np.int64, n)
    lengths = np.fromiter((r[1] for r in ranges), np.int64, n)
    return ChunkTable(np.arange(n, dtype=np.int32), np.zeros(n, np.int32), offsets, lengths, dim_start, dims)


def _locate_records(folder: Folder, name: str, size: int, tensors: dict[str, TensorView],
                    records: dict[str, tuple[int, int, int]] | None = None) -> dict[int, tuple[int, int, int | None]]:
    """For a file torch.load memory-mapped (:class:`..checkpoint.torch_file_tree.TorchFileLoad`'s fallback): storage
    address -> (offset, length, CRC32) of its record in the file, or {} unless every non-empty storage sits at its
    own record's offset from one base address and has that record's size. ``records``: the file's zip records
    when already read."""
    from ..checkpoint.items import ItemFormatError, zip_records

    if records is None:
        try:
            with folder.handles() as handles:
                records = zip_records(handles, name, size)
        except (ItemFormatError, CheckpointError):
            return {}
    stored = sorted(r for k, r in records.items() if k.startswith("data/") and r[1])
    storages = {t.storage: t.nbytes for t in tensors.values()}
    ptrs = sorted(p for p, n in storages.items() if n)
    if not ptrs or len(ptrs) != len(stored):
        return {}
    base = ptrs[0] - stored[0][0]
    if any(p - base != r[0] or storages[p] != r[1] for p, r in zip(ptrs, stored, strict=True)):
        return {}
    located: dict[int, tuple[int, int, int | None]] = dict(zip(ptrs, stored, strict=True))
    for p in storages:  # an empty storage: no bytes to read, nothing to check
        located.setdefault(p, (0, 0, None))
    return located


def _record_users(ckpt: Checkpoint) -> dict[int, list[str]]:
    """Record offset -> the tensors stored in it."""
    out: dict[int, list[str]] = {}
    t = ckpt.chunk_table
    for ti, off, ln in zip(t.tensor.tolist(), t.byte_offset.tolist(), t.length.tolist(), strict=True):
        if ln:
            out.setdefault(off, []).append(ckpt.tensors[ti].fqn)
    return out


def _record_crc(handles: LocalHandles | RemoteHandles, name: str, offset: int, length: int, progress: Progress
                ) -> int:
    """CRC32 of ``length`` bytes of file ``name`` from ``offset``, read in blocks (cancellable)."""
    import zlib

    buf = memoryview(bytearray(min(BLOCK, max(length, 1))))
    crc = pos = 0
    while pos < length:
        view = buf[:min(len(buf), length - pos)]
        handles.readinto(name, offset + pos, view)
        crc = zlib.crc32(view, crc)
        pos += len(view)
        progress.advance(len(view))
    return crc


def _state(path: str, size: int) -> tuple[str, str, bool]:
    """(state, reason, is a torch file) of a local file with a torch file's name."""
    first = head(path, 4)
    if first is None:
        return "unreadable", "the file cannot be read", True
    if size == 0:
        return "incomplete", "an empty file", True
    if first[:1] == b"\x80":
        return "complete", "", True  # torch's legacy (pre-zip) format
    if first != b"PK\x03\x04":
        return ("unreadable", "not a torch.save file", True) if not path.endswith(".bin") else ("", "", False)
    # torch.save writes no zip comment, so a whole archive ends with its end-of-central-directory record
    tail = head(path, 4, -22) if size >= 22 else None
    if tail != b"PK\x05\x06":
        return "incomplete", "truncated: the zip archive has no end record (torch.save did not finish)", True
    return "complete", "", True


def torch_file_kind(path: str, size: int) -> str:
    """``resumable`` when a torch file's pickle names an optimizer's state (``param_groups``, Lightning's
    ``optimizer_states``), else ``weights``: read from the archive's ``data.pkl`` record (at most 16 MiB), or
    the head of a legacy (pre-zip) file. Nothing is unpickled."""
    first = head(path, 4)
    if first == b"PK\x03\x04":
        from ..checkpoint.items import ItemFormatError, zip_records
        from ..errors import ShardscopeError

        try:
            with FileBytes(path) as src:
                pkl = zip_records(src, os.path.basename(path), size).get("data.pkl")
        except (ItemFormatError, ShardscopeError, OSError):
            pkl = None  # not an archive torch maps: its tensors are not readable, so it resumes nothing either
        found = names_optimizer(path, pkl[0], pkl[1], MAX_KIND_PROBE) if pkl else False
    elif first and first[:1] == b"\x80":
        found = names_optimizer(path, 0, min(size, MAX_KIND_PROBE), MAX_KIND_PROBE)
    else:
        found = False
    return RESUMABLE if found else WEIGHTS


TORCH_FILE = TorchFileFormat()
FORMAT = TORCH_FILE
