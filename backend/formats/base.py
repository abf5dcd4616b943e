"""What a checkpoint format is to the rest of Shardscope: a :class:`Format` with a cheap ``detect`` (names only),
a cheap ``probe`` for listings (names and a few header bytes: whether a save finished, its writer ranks, its
kind) and an ``open`` that returns the one :class:`~..checkpoint.model.Checkpoint` model, whose chunks the one
chunk reader reads with their stored checksums checked.

Detecting and probing import neither numpy nor torch (``ls`` lists thousands of checkpoints); a format's
``open`` imports its reader when it is called."""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:  # the model imports numpy: only for annotations here
    from ..checkpoint.model import Checkpoint, Problem
    from ..checkpoint.storage import Folder
    from ..progress import Progress

# The door's own types. A folder's file names as a listing has them: a set of names, or a listing that maps each
# name to its size (``Folder.listing()``); detecting asks only ``in`` and iterates.
FileNames: TypeAlias = Collection[str]
# What a format's ``open`` is given (``registry.resolve`` says which): a local path or URL, or a folder on a URL
# already listed with its storage options (so it is listed once).
Target: TypeAlias = "str | Folder"
# fsspec's keyword arguments for a URL's file system (credentials, endpoint, ...): passed through as they are.
StorageOptions: TypeAlias = dict[str, Any]

RESUMABLE = "resumable"  # a run can resume from it: optimizer or trainer state beside the weights
WEIGHTS = "weights"  # a consolidated or exported model: often the deliverable, never a run's resume point
# what a deep read can prove about the bytes, said in the window and by verify
CHECKSUMS_STORED = "CRC32 checked where the format stores one: torch.save items do, safetensors does not"
CHECKSUMS_NONE = "safetensors stores no checksum: every byte read, dtype and size checked, no CRC32 to compare"
CHECKSUMS_RECORDS = "a torch.save file stores a CRC32 per record: every record's checked"


@dataclass(frozen=True)
class Facts:
    """What a listing learns of one checkpoint without reading it: ``state`` is complete, incomplete or
    unreadable (with ``reason``); ``format`` may name a variant (``dcp-safetensors``). ``pinned`` says, in words,
    why no prune may remove it whatever its rules (the framework's own resume pointer names it: Megatron's
    ``latest_checkpointed_iteration.txt``, DeepSpeed's ``latest``); empty when nothing pins it."""

    format: str
    state: str
    reason: str = ""
    ranks: list[int] = field(default_factory=list)
    kind: str = RESUMABLE  # a save that did not finish is judged as what it was to become: never offered as weights
    step: int | None = None
    pinned: str = ""  # why no rule may remove it (the checkpoint a framework's "latest" file names), or ""


class Format:
    """One checkpoint format. Subclasses set the attributes and override what applies to them."""

    name = ""  # Checkpoint.format and the library's format column: one vocabulary
    label = ""  # the format in words (the window's Checkpoint panel)
    kind = RESUMABLE  # what a checkpoint of this format is unless its probe says otherwise
    is_folder = True  # a folder of files, or one file
    checksums = CHECKSUMS_STORED
    # the framework's own file manifest, in its own format, that ``seal`` writes beside its manifest (Megatron-Core's
    # integrity.json); checked by ``verify`` wherever one lies in a folder, whatever the format
    integrity_manifest = False
    # its probe reads nothing but the checkpoint's own files, so a listing may reuse it while they are unchanged
    # (library.probe_cache); False where it reads elsewhere too (DeepSpeed's ``latest`` beside the folder)
    probe_reads_own_files = False

    # ------------------------------------------------------------ names only
    def detect_folder(self, name: str, files: FileNames, dirs: list[str]) -> bool:
        """True when a folder with these file and subfolder names is a checkpoint of this format."""
        return False

    def detect_file(self, name: str) -> bool:
        """True when a file of this name is a checkpoint of this format."""
        return False

    def opens_folder(self, name: str, files: FileNames, dirs: list[str]) -> bool:
        """True for a folder this format opens when named, though a listing does not list it as a checkpoint
        (a plain folder of safetensors files; a DeepSpeed save folder, whose ``latest`` tag is opened)."""
        return False

    # ------------------------------------------------------------ a few header bytes
    def probe_folder(self, path: str, names: set[str], dirs: list[str], local: bool = True) -> Facts:
        """A folder's state, ranks and kind for a listing (``local=False``: names only, nothing is read)."""
        return Facts(self.name, "complete", kind=self.kind)

    def probe_file(self, path: str, size: int, local: bool = True) -> Facts | None:
        """A file's state and kind for a listing; None when the file is not a checkpoint after all."""
        if not local:
            return Facts(self.name, "complete" if size else "incomplete", "" if size else "an empty object",
                         kind=self.kind)
        return Facts(self.name, "complete", kind=self.kind)

    def identity_piece(self, path: str, size: int) -> tuple[int, int] | None:
        """(offset, length) of the bytes of a local file of this format that identify its contents cheaply (a
        header, an archive's central directory): what an export's lineage checksums; None when none does."""
        return None

    # ------------------------------------------------------------ reading
    def model_folder(self, path: str) -> tuple[str, str | None]:
        """What :meth:`open` reads of the local folder ``path`` when that is a folder inside it (an HF Trainer
        checkpoint's ``pytorch_model_fsdp_0/``), and a note saying so; (``path``, None) when it reads ``path``."""
        return path, None

    def open(self, path: Target, storage_options: StorageOptions | None = None, use_cache: bool = True,
             progress: Progress | None = None) -> Checkpoint:
        """The checkpoint model (metadata or headers only; no tensor values are read)."""
        raise NotImplementedError

    def deep_checks(self, ckpt: Checkpoint, progress: Progress | None = None) -> list[Problem]:
        """Checks of bytes no chunk or entry covers (a torch file's other records), for Verify contents."""
        return []

    def __repr__(self) -> str:
        return f"<format {self.name}>"


class FileBytes:
    """One local file as the header parsers read it (:class:`..checkpoint.items.ByteSource`), for probes: no
    folder confinement to set up, no numpy; ``read`` past the end is a CheckpointError like the real handles'."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._f = open(path, "rb")

    def read(self, name: str, offset: int, length: int) -> bytes:
        from ..errors import CheckpointError

        self._f.seek(offset)
        data = self._f.read(length)
        if len(data) != length:
            raise CheckpointError(f"{self.path}: file ends early (at {offset + len(data)} of {offset + length}).",
                                  path=self.path)
        return data

    def where(self, name: str) -> str:
        return self.path

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> FileBytes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def head(path: str, n: int, offset: int = 0) -> bytes | None:
    """``n`` bytes of a local file from ``offset`` (negative: from the end); None when it cannot be read.
    Unbuffered (``os.open``/``os.pread``: three system calls): a listing reads a few bytes of thousands of files."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if offset < 0:
            offset += os.fstat(fd).st_size
            if offset < 0:
                return None  # before the start of the file
        return _read_at(fd, n, offset)
    except OSError:
        return None
    finally:
        os.close(fd)


def _read_at(fd: int, n: int, offset: int) -> bytes:
    """Up to ``n`` bytes at ``offset`` (fewer only at the end of the file)."""
    data = os.pread(fd, n, offset)
    if 0 < len(data) < n:  # a short read before the end (rare: some network file systems)
        parts = [data]
        got = len(data)
        while got < n:
            more = os.pread(fd, n - got, offset + got)
            if not more:
                break
            parts.append(more)
            got += len(more)
        data = b"".join(parts)
    return data


OPTIMIZER_MARKS = (b"param_groups", b"optimizer_states", b"exp_avg", b"momentum_buffer")
SCAN_BLOCK = 8 << 20


def names_optimizer(path: str, start: int = 0, length: int | None = None, limit: int = 16 << 20) -> bool | None:
    """True when the bytes of a local file (a pickle: a torch file's ``data.pkl``, a DCP ``.metadata``) spell an
    optimizer's state key, False when they do not; None when they cannot be read, or when the first ``limit``
    bytes say nothing and more follow (a listing reads no more than that). Read in blocks, never unpickled."""
    return _scan_optimizer(path, start, length, limit)[1]


def first_byte_and_optimizer(path: str, limit: int = 16 << 20) -> tuple[bytes | None, bool | None]:
    """The first byte of a local file and :func:`names_optimizer` of the whole file, from one open (a listing
    asks both of every DCP ``.metadata``); (None, None) when it cannot be read."""
    return _scan_optimizer(path, 0, None, limit)


FIRST_BLOCK = 64 << 10  # most metadata a listing meets is smaller: one read, and no fstat


def _scan_optimizer(path: str, start: int, length: int | None, limit: int) -> tuple[bytes | None, bool | None]:
    """(first byte from ``start``, whether the bytes name optimizer state: see :func:`names_optimizer`); (None,
    None) when the file cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None, None
    try:
        left = limit if length is None else min(length, limit)
        pos, keep, first = start, b"", b""
        size = min(left, FIRST_BLOCK)
        while left > 0:
            block = _read_at(fd, size, pos)
            if not block:
                break
            if not first:
                first = block[:1]
            left -= len(block)
            pos += len(block)
            data = keep + block
            if any(m in data for m in OPTIMIZER_MARKS):
                return first, True
            keep = data[-32:]
            if len(block) < size:  # the end of the file
                break
            size = min(left, SCAN_BLOCK)
        if not first:
            first = _read_at(fd, 1, start)
        if length is not None:
            whole = length
        elif left > 0:  # the end of the file came before the limit
            whole = pos - start
        else:
            whole = os.fstat(fd).st_size - start
        return first, (False if whole <= limit else None)
    except OSError:
        return None, None
    finally:
        os.close(fd)
