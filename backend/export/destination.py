"""The one check of an output's destination, before anything is written: what is there already (a file
export never replaces a folder, a folder export never a file), and that the destination and what the job
reads do not overlap (the source itself, a folder inside it, or a folder that holds it), by real path and
by file identity (the same folder by a symbolic link, a bind mount or another spelling), and for URLs by
storage and key prefix. Every writer goes through :class:`~.atomic.AtomicOutput`, which calls it; the
Export dialog calls it too, so it refuses in the same words."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterable
from typing import Any

from ..checkpoint.remote import fs_for
from ..checkpoint.storage import is_url
from ..filenames import (
    CHECKPOINT_HOLDERS,
    MAX_INDEX_BYTES,
    SAFETENSORS_INDEX,
    SAFETENSORS_SUFFIX,
    lineage_sidecar,
    within,
)
from ..lineage import read_sidecar, written_files
from .plan import ExportError

EXPORTS_FOLDER = "exports"  # where the Export dialog proposes to write: beside checkpoints/, never inside it


def _local_path(path: str) -> str | None:
    """The absolute path of a local path; None for a URL."""
    return None if is_url(path) else os.path.abspath(os.path.expanduser(path))


def _identity(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino): the same for one file or folder under every name it has (links, bind mounts)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _identities(path: str) -> list[tuple[int, int]]:
    """The identity of ``path`` (when it exists) and of every folder above it."""
    out = []
    while True:
        if (ident := _identity(path)) is not None:
            out.append(ident)
        up = os.path.dirname(path)
        if up == path:
            return out
        path = up


def _check_existing(dst: str, kind: str, force: bool) -> None:
    if not os.path.lexists(dst):
        return
    if kind == "file" and os.path.isdir(dst):  # a folder, or a link to one: never replaced by a file
        raise ExportError(f"{dst} is a folder; an export to a single file never replaces a folder (name a file, "
                          "e.g. inside it, or give a maximum shard size for a sharded folder).")
    if kind == "dir" and os.path.islink(dst):
        raise ExportError(f"{dst} is a symbolic link; give the folder it leads to, or another name.")
    if kind == "dir" and not os.path.isdir(dst):
        raise ExportError(f"{dst} is a file, not a folder; this writes a folder and never replaces a file.")
    if kind == "file" and not os.path.islink(dst) and not stat.S_ISREG(os.lstat(dst).st_mode):
        raise ExportError(f"{dst} is not a regular file; it is never replaced.")
    if not force:
        raise ExportError(f"{dst} exists; choose a name that does not exist yet, or allow overwriting it.")


def _overlap_local(dst: str, src: str) -> str | None:
    real_dst, real_src = os.path.realpath(dst), os.path.realpath(src)
    if within(real_dst, real_src):
        return "is the source" if real_dst == real_src else "lies inside the source"
    if within(real_src, real_dst):
        return "holds the source"
    # the same file or folder under another name (a bind mount, a hard link, another spelling)
    src_id, dst_id = _identity(real_src), _identity(real_dst)
    if src_id is not None and src_id in _identities(real_dst):
        return "is the source" if src_id == dst_id else "lies inside the source"
    if dst_id is not None and dst_id in _identities(real_src):
        return "holds the source"
    return None


def _overlap_remote(dst: str, src: str, storage_options: dict[str, Any] | None) -> str | None:
    dst_fs, dst_root = fs_for(dst.rstrip("/"), storage_options)
    src_fs, src_root = fs_for(src.rstrip("/"), storage_options)
    if type(dst_fs) is not type(src_fs):  # s3:// and s3a:// are one storage; s3:// and gs:// are not
        return None
    d, s = dst_root.strip("/"), src_root.strip("/")  # keys: "/" is os.sep wherever Shardscope runs (Linux)
    if within(d, s):
        return "is the source" if d == s else "lies inside the source"
    if within(s, d):
        return "holds the source"
    return None


def check_destination(dst: str, kind: str, force: bool = False, sources: Iterable[str] = (),
                      storage_options: dict[str, Any] | None = None) -> None:
    """Raise :class:`ExportError` (one line, exit 2) when writing ``dst`` (a ``"file"`` or a ``"dir"``) could
    remove or overwrite what the job did not write: an existing entry of the other kind, an existing one
    without ``force``, or a destination that is a source (``sources``: the paths or URLs the job reads), lies
    inside one, or holds one (overwriting it would replace the source's files)."""
    local_dst = _local_path(dst)
    for src in sources:
        if not src:
            continue
        local_src = _local_path(src)
        if local_dst is not None and local_src is not None:
            why = _overlap_local(local_dst, local_src)
        elif local_dst is None and local_src is None:
            why = _overlap_remote(dst, src, storage_options)
        else:
            why = None
        if why:
            raise ExportError(f"{dst} {why}, {local_src or src}; write the output somewhere else (nothing was "
                              "written).")
    if local_dst is not None:
        _check_existing((local_dst.rstrip(os.sep) or os.sep) if kind == "dir" else local_dst, kind, force)


def index_files(raw: bytes | None) -> set[str]:
    """An earlier sharded safetensors export's files as its own index (the bytes of ``raw``) records them
    (``producer: shardscope`` in its metadata, as every export writes it): the index and the shards it maps.
    Empty for any other index (a ``save_pretrained`` folder's), or none."""
    try:
        index = json.loads(raw) if raw is not None and len(raw) <= MAX_INDEX_BYTES else None
    except (ValueError, RecursionError):
        return set()
    meta = index.get("metadata") if isinstance(index, dict) else None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(meta, dict) or meta.get("producer") != "shardscope" or not isinstance(weight_map, dict):
        return set()
    shards = {v for v in weight_map.values() if isinstance(v, str) and v and "/" not in v and v not in (".", "..")}
    return {SAFETENSORS_INDEX, *shards}


def replaceable(folder: str) -> set[str]:
    """The entries of an existing output folder that a --force export may replace or remove: those a record of
    Shardscope's own says an earlier export wrote there (the ``files`` of the folder's lineage sidecar, else the
    shards an earlier export's index maps). Everything else in the folder is the user's, and is kept."""
    doc = read_sidecar(lineage_sidecar(folder, True))
    recorded = written_files(doc) if doc is not None else None
    if recorded is not None:
        return recorded
    try:
        with open(os.path.join(folder, SAFETENSORS_INDEX), "rb") as f:
            return index_files(f.read(MAX_INDEX_BYTES + 1))
    except OSError:
        return set()


__all__ = ["check_destination", "index_files", "replaceable"]


def export_suffix(w: Any) -> str:
    """What the name of an export by writer ``w`` (``registry.Writer``) ends in: its first suffix; a Hugging Face
    model folder ``-hf`` (beside a safetensors export of the same checkpoint); a DCP folder nothing."""
    return w.suffixes[0] if w.suffixes else ("-hf" if w.model else "")


def default_export_path(ckpt_path: str, stem: str, suffix: str = SAFETENSORS_SUFFIX) -> str:
    """The Export dialog's proposal: ``RUN/exports/<stem><suffix>`` for a checkpoint in ``RUN/checkpoints/``,
    else ``exports/`` beside the checkpoint. NOTE: it once proposed ``RUN/checkpoints/<name>.safetensors``,
    and a weights file among a run's checkpoints is easily taken for one of them."""
    parent = os.path.dirname(ckpt_path.rstrip("/"))
    if os.path.basename(parent).lower() in CHECKPOINT_HOLDERS:
        parent = os.path.dirname(parent)
    return os.path.join(parent, EXPORTS_FOLDER, stem + suffix)


def missing_folders(dst: str) -> list[str]:
    """The folders above a local destination that do not exist yet, outermost first ([] for a URL)."""
    if is_url(dst):
        return []
    out = []
    folder = os.path.dirname(os.path.abspath(dst))
    while folder and not os.path.lexists(folder):
        out.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return out[::-1]


def write_into_new_folders(job: Callable[..., Any], src: str, dst: str, *args: Any, **kw: Any) -> Any:
    """Run writer ``job(src, dst, ...)`` after making the folders ``dst`` needs; if the job fails, the folders it
    made are removed again (those still empty), so a failed export leaves nothing behind."""
    made = []
    try:
        for folder in missing_folders(dst):
            os.mkdir(folder)
            made.append(folder)
        return job(src, dst, *args, **kw)
    except BaseException:
        for folder in reversed(made):
            try:
                os.rmdir(folder)
            except OSError:
                break
        raise
