"""The one door: which format a path is, and the checkpoint model of it.

Formats are asked in :data:`FORMATS` order, most specific first (a Lightning or Megatron folder is also a DCP
folder; a Trainer checkpoint may hold safetensors files). A new format is a module with a :class:`~.base.Format`
and one line here; nothing else in Shardscope decides what a path is."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, TypeAlias

from ..errors import CheckpointError
from ..filenames import (
    FILE_SUFFIXES,
    HF_INDEXES,
    METADATA,
    basename,
    is_metadata_name,
    is_url,
)
from . import dcp, deepspeed, hf_folder, hf_index, hf_trainer, lightning, megatron, safetensors_file, torch_file
from .base import Facts, FileNames, Format, StorageOptions, Target

if TYPE_CHECKING:  # the model and the readers import numpy: only for annotations here
    from ..checkpoint.model import Checkpoint, Problem
    from ..checkpoint.seal import SealCheck
    from ..checkpoint.sources import CheckpointSource
    from ..checkpoint.storage import Folder
    from ..progress import Progress

# What the door opens: a path or URL as the user names it, or a folder on a URL already opened with its options.
Openable: TypeAlias = "str | os.PathLike[str] | Folder"

FOLDER_FORMATS: tuple[Format, ...] = (deepspeed.FORMAT, lightning.FORMAT, megatron.FORMAT, hf_folder.FORMAT, dcp.FORMAT,
                                      hf_trainer.FORMAT, hf_index.FORMAT)
FILE_FORMATS: tuple[Format, ...] = (safetensors_file.FORMAT, torch_file.FORMAT)
FORMATS: tuple[Format, ...] = FOLDER_FORMATS + FILE_FORMATS
NOT_A_CHECKPOINT = f"not a checkpoint file ({', '.join(FILE_SUFFIXES)}) or folder."


def format_named(name: str) -> Format:
    """The format called ``name`` (``Checkpoint.format``; a listing's variant such as ``dcp-safetensors`` gives
    its format); KeyError for a name no format has."""
    for f in FORMATS:
        if f.name == name or name.startswith(f"{f.name}-"):
            return f
    raise KeyError(name)


def label_of(name: str) -> str:
    """A format's name in words (the name itself when no format has it)."""
    try:
        return format_named(name).label
    except KeyError:
        return name


def detect_folder(name: str, files: FileNames, dirs: list[str]) -> Format | None:
    """The format of a folder from its name and its files' and subfolders' names, or None (names only)."""
    return next((f for f in FOLDER_FORMATS if f.detect_folder(name, files, dirs)), None)


def detect_file(name: str) -> Format | None:
    """The format of a single-file checkpoint from its name, or None."""
    if name.startswith("."):  # a writer's temporary
        return None
    return next((f for f in FILE_FORMATS if f.detect_file(name)), None)


def resolve(path: str | os.PathLike[str], storage_options: StorageOptions | None = None) -> tuple[Format, Target]:
    """The format of what ``path`` names and what to open: a folder, a checkpoint file, a DCP ``.metadata`` (its
    folder), an HF index file (its folder), local or on a URL. Bad input names the path."""
    text = str(path)
    if text.startswith("file://"):
        text = text[len("file://"):]
    if is_url(text):
        return _resolve_url(text, storage_options)
    if not os.path.lexists(text):
        raise CheckpointError(f"{text}: no such file or folder.", path=text)
    if os.path.isfile(text):
        base = os.path.basename(text)
        if is_metadata_name(base) or base in HF_INDEXES:
            return _resolve_folder(os.path.dirname(os.path.abspath(text)))
        found = detect_file(base)
        if found is None:
            raise CheckpointError(f"{text}: {NOT_A_CHECKPOINT}", path=text)
        return found, text
    if os.path.isdir(text):
        return _resolve_folder(text)
    return dcp.FORMAT, text  # a FIFO or device: the DCP reader refuses it by name


def _resolve_folder(folder: str) -> tuple[Format, str]:
    try:
        with os.scandir(folder) as it:
            entries = list(it)
    except OSError as exc:
        raise CheckpointError(f"{folder}: cannot list ({exc.strerror or exc}).", path=folder) from None
    files = {e.name for e in entries if not e.is_dir()}
    dirs = [e.name for e in entries if e.is_dir()]
    return _folder_format(os.path.basename(os.path.abspath(folder)), files, dirs), folder


def _folder_format(name: str, files: set[str], dirs: list[str]) -> Format:
    found = detect_folder(name, files, dirs) or next((f for f in FOLDER_FORMATS if f.opens_folder(name, files, dirs)),
                                                     None)
    return found or dcp.FORMAT  # the DCP reader says what is missing (and names DCP subfolders)


def _resolve_url(url: str, storage_options: StorageOptions | None) -> tuple[Format, Target]:
    """A URL: a file by its name (nothing is requested), else a folder (one listing)."""
    base = basename(url)
    if is_metadata_name(base) or base in HF_INDEXES:
        url = url.rstrip("/").rsplit("/", 1)[0]
    else:
        found = detect_file(base)
        if found is not None:
            return found, url
    from ..checkpoint.storage import open_folder

    folder = open_folder(url, storage_options)
    listing = folder.listing()
    if not listing:
        raise CheckpointError(f"{url}: no such file or folder, or an empty one.", path=url)
    return _folder_format(basename(url), set(listing), []), folder


def model_folder(path: str) -> tuple[str, str | None]:
    """The folder the door opens for a local ``path`` when that is one inside it (an HF Trainer or accelerate
    checkpoint's ``pytorch_model_fsdp_0/``, the iteration a Megatron save dir names), and a note naming it and what
    is left out; (``path``, None) when the door opens ``path`` itself. What ``export`` and ``watch`` export: the
    folder ``inspect`` shows."""
    if is_url(path) or not os.path.isdir(path):
        return path, None
    fmt, target = resolve(path)
    return fmt.model_folder(target) if isinstance(target, str) else (path, None)


def probe(path: str | os.PathLike[str]) -> Facts | None:
    """What a listing learns of one local checkpoint (state, writer ranks, kind) without reading it; None for a
    file its format does not take. Bad input names the path."""
    fmt, target = resolve(path)
    if not isinstance(target, str):  # a folder on a URL: a listing probes local checkpoints only
        raise CheckpointError(f"{path}: only a local checkpoint is probed.", path=str(path))
    if not fmt.is_folder:
        return fmt.probe_file(target, os.path.getsize(target))
    with os.scandir(target) as it:
        entries = list(it)
    files = {e.name for e in entries if not e.is_dir()}
    return fmt.probe_folder(target, files, [e.name for e in entries if e.is_dir()])


def open_checkpoint(path: Openable, storage_options: StorageOptions | None = None, use_cache: bool = True,
                    progress: Progress | None = None) -> Checkpoint:
    """The checkpoint model of whatever ``path`` names (see :func:`resolve`): what the window, ``inspect``,
    ``verify``, ``show``, ``export``, ``diff``, ``import`` and ``reshard`` open. Metadata and headers only."""
    from ..checkpoint.storage import Folder

    if isinstance(path, Folder):  # a URL already opened with storage options
        fmt = _folder_format(basename(path.path), set(path.listing()), [])
        return fmt.open(path, storage_options, use_cache, progress)
    fmt, target = resolve(path, storage_options)
    return fmt.open(target, storage_options, use_cache, progress)


def open_source(path: Openable, storage_options: StorageOptions | None = None) -> CheckpointSource:
    """What diff and import read one tensor at a time: the opened checkpoint behind the one Source."""
    from ..checkpoint.sources import CheckpointSource

    return CheckpointSource(open_checkpoint(path, storage_options))


def deep_checks(ckpt: Checkpoint, progress: Progress | None = None) -> list[Problem]:
    """The format's checks of bytes no chunk covers (Verify contents adds them)."""
    try:
        fmt = format_named(ckpt.format)
    except KeyError:
        return []
    return fmt.deep_checks(ckpt, progress)


def verify_contents(ckpt: Checkpoint, progress: Progress | None = None) -> list[Problem]:
    """``verify --deep`` and the window's Verify contents: every check of the checkpoint, every chunk and entry
    read once with its stored checksum checked, and the format's own checks of the bytes around them."""
    from ..checkpoint.verify import verify

    return verify(ckpt, deep=True, progress=progress) + deep_checks(ckpt, progress)


def verify_sealed(ckpt: Checkpoint, deep: bool = False, progress: Progress | None = None,
                  seal_progress: Progress | None = None) -> tuple[list[Problem], SealCheck]:
    """What ``verify`` and the window's Verify contents check, each once: the quick check (``deep``: every check of
    :func:`verify_contents`), then the checkpoint against its manifest whenever it has one (every file's SHA-256;
    ``deep``: every tensor's digest too; ``seal_progress`` counts its bytes, else ``progress`` does). Returns
    (every problem, the :class:`~..checkpoint.seal.SealCheck` saying what the manifest proved)."""
    from ..checkpoint.seal import check_seal
    from ..checkpoint.verify import verify

    problems = verify_contents(ckpt, progress) if deep else verify(ckpt)
    sealed = check_seal(ckpt, deep, seal_progress or progress)
    return problems + sealed.problems, sealed


__all__ = ["FILE_FORMATS", "FOLDER_FORMATS", "FORMATS", "METADATA", "NOT_A_CHECKPOINT", "deep_checks",
           "detect_file", "detect_folder", "format_named", "label_of", "model_folder", "open_checkpoint",
           "open_source", "resolve", "verify_contents", "verify_sealed"]
