"""torch Distributed Checkpoint folders (``dcp.save`` with ``FileSystemWriter``): FSDP2, FSDP1 sharded, DDP, no
process group, per-rank ``__R.metadata`` files (``use_collectives=False``), safetensors-serialised items, and
leftovers of an interrupted save. The reading is :mod:`..checkpoint.reader`'s."""

from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING

from ..filenames import (
    DATA_FILE_RE,
    DATA_SUFFIX,
    METADATA,
    METADATA_TMP,
    RANK_METADATA_RE,
)
from .base import (
    FIRST_BLOCK,
    OPTIMIZER_MARKS,
    RESUMABLE,
    WEIGHTS,
    Facts,
    FileNames,
    Format,
    StorageOptions,
    Target,
    first_byte_and_optimizer,
    head,
)

if TYPE_CHECKING:
    from ..checkpoint.model import Checkpoint
    from ..progress import Progress


def has_dcp_files(files: FileNames) -> bool:
    """Names a DCP save writes (data files, its metadata, or the metadata's temporary)."""
    return METADATA in files or METADATA_TMP in files or any(n.endswith(DATA_SUFFIX) for n in files) or \
        any(RANK_METADATA_RE.match(n) for n in files)


def is_finished_save(path: str | os.PathLike) -> bool:
    """True when a local folder holds what ``dcp.load`` reads first: the ``.metadata`` the coordinator writes
    last, when a save finished (what a run may resume from)."""
    return os.path.isfile(os.path.join(path, METADATA))


def dcp_folder_facts(fmt: str, path: str, names: set[str], local: bool, kind: str | None = None) -> Facts:
    """A DCP folder's state and ranks from its names (and, ``local``, the first byte of ``.metadata``); its kind
    ``kind``, or, when the format does not know it, from the metadata's keys (``weights`` when no optimizer state
    is named: an imported model; that scan reads the whole ``.metadata``)."""
    ranks = sorted({int(m.group(1)) for n in names if (m := DATA_FILE_RE.match(n))})
    meta_ranks = {int(m.group(1)) for n in names if (m := RANK_METADATA_RE.match(n))}
    if METADATA_TMP in names:
        return Facts(fmt, "incomplete", "a .metadata.tmp is left: the save did not finish", ranks)
    if METADATA in names:
        if not local:
            return Facts(fmt, "complete", "", ranks, RESUMABLE)
        meta = os.path.join(path, METADATA)
        # most metadata a listing meets is small: read whole at once, it answers every question below (one open
        # of it, not three); a larger one is read in blocks for the first two and searched mapped for the third
        whole = head(meta, FIRST_BLOCK)
        first: bytes | None
        optim: bool | None
        if whole is not None and len(whole) < FIRST_BLOCK:
            first, optim = whole[:1], any(m in whole for m in OPTIMIZER_MARKS)
        else:
            whole = None
            # one open for both questions when the kind is asked
            first, optim = first_byte_and_optimizer(meta) if kind is None else (head(meta, 1), None)
        if first is None:
            return Facts(fmt, "unreadable", ".metadata cannot be read", ranks)
        if first not in (b"\x80", b"{"):
            return Facts(fmt, "unreadable", ".metadata is empty or not DCP metadata", ranks)
        if kind is None:
            # a weights-only DCP (an import) names no optimizer state; unknown (its first 16 MiB say nothing,
            # or it cannot be read): resumable, as every DCP folder was judged before
            kind = WEIGHTS if optim is False else RESUMABLE
        # writer ranks are those the metadata references, not a stale file's (verify names that file)
        stale = unreferenced_data_files(path, names, whole)
        ranks = sorted({int(m.group(1)) for n in names if n not in stale and (m := DATA_FILE_RE.match(n))})
        return Facts(_serialisation(fmt, path, names), "complete", "", ranks, kind)
    if meta_ranks:
        missing = sorted(set(ranks) - meta_ranks)
        every = sorted(set(ranks) | meta_ranks)
        if missing:
            return Facts(fmt, "incomplete", f"rank(s) {missing} wrote data but no __R.metadata", every)
        return Facts(fmt, "complete", "", every, RESUMABLE)
    return Facts(fmt, "incomplete", "no .metadata: the save did not finish (the coordinator writes it last)", ranks)


def unreferenced_data_files(path: str, names: set[str], meta: bytes | None = None) -> list[str]:
    """The ``__R_N.distcp`` files of a local DCP folder that its ``.metadata`` does not name (a stale file of an
    earlier save with more ranks): DCP pickles each file's relative path into the metadata, so a name whose bytes
    are not in it holds nothing of this save. A search of the mapped file (or of ``meta``, its bytes when already
    read), not a parse: cheap enough for a listing. An empty unnamed file is kept (a rank left with nothing to
    write writes one); [] when it cannot be read."""
    data = [n for n in names if DATA_FILE_RE.match(n)]
    if not data:
        return []
    if meta is not None:
        return sorted(n for n in data if meta.rfind(n.encode()) < 0 and _size(os.path.join(path, n)) != 0)
    try:
        with open(os.path.join(path, METADATA), "rb") as f, \
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            # the last ranks' names sit at the end of the file (storage_data is pickled last): search backwards
            absent = [n for n in data if mapped.rfind(n.encode()) < 0]
    except (OSError, ValueError):  # unreadable, or empty (mmap refuses a 0-byte file)
        return []
    return sorted(n for n in absent if _size(os.path.join(path, n)) != 0)


def _size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def _serialisation(fmt: str, path: str, names: set[str]) -> str:
    """``dcp-safetensors`` when the data files are safetensors (torch's SerializationFormat.SAFETENSORS)."""
    if fmt != "dcp":
        return fmt
    data = sorted(n for n in names if n.endswith(DATA_SUFFIX))
    if not data:
        return fmt
    first = head(os.path.join(path, data[0]), 9)
    if first and len(first) == 9 and first[:2] != b"PK" and first[8:9] == b"{":
        return "dcp-safetensors"
    return fmt


class DcpFormat(Format):
    name = "dcp"
    label = "PyTorch DCP"
    probe_reads_own_files = True

    def detect_folder(self, name: str, files: FileNames, dirs: list[str]) -> bool:
        return has_dcp_files(files)

    def probe_folder(self, path: str, names: set[str], dirs: list[str], local: bool = True) -> Facts:
        return dcp_folder_facts(self.name, path, names, local)

    def open(self, path: Target, storage_options: StorageOptions | None = None, use_cache: bool = True,
             progress: Progress | None = None) -> Checkpoint:
        from ..checkpoint.reader import open_checkpoint
        from ..checkpoint.storage import open_folder

        return open_checkpoint(open_folder(path, storage_options), progress, use_cache)


FORMAT = DcpFormat()
