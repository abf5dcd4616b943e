"""The proof an output carries: the content manifest (see :mod:`..checkpoint.manifest`) of what an export, import,
reshard, average or watch wrote, computed from the written bytes before the output is committed, and, when the
source is sealed, checked against the source's: every tensor copied unchanged must have the source's digest
(else the output is not committed); a tensor written with other values (a cast) records the source's digest it was
made from (``derived_from``) and how (``transform``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..checkpoint.digests import checkpoint_files, hash_files
from ..checkpoint.manifest import FileDigest, Manifest, read_manifest, write_manifest
from ..checkpoint.model import Checkpoint
from ..checkpoint.seal import compute_manifest
from ..errors import CheckpointError
from ..filenames import MANIFEST_NAME, is_url, manifest_path
from .plan import ExportError


@dataclass(frozen=True, slots=True)
class Origin:
    """Where an output tensor's values come from: the source's entry, and what was done to them (None: copied
    unchanged)."""

    fqn: str
    transform: str | None = None


def source_manifest(path: str) -> Manifest | None:
    """The manifest of the checkpoint an output is made from (None: unsealed, or a URL). A manifest that is not
    one fails the output (fail closed: a damaged manifest is never taken for none)."""
    if not path or is_url(path):
        return None
    return read_manifest(manifest_path(path, os.path.isdir(path)))


def output_manifest(tmp_path: str, kind: str, dst: str) -> Manifest:
    """The manifest of the output written at ``tmp_path`` (a ``kind`` "file" or "dir"), under the names it will
    have at ``dst``: every file hashed, every tensor's logical digest, read back from the written bytes. A file is
    opened through a hard link under its final name (its reader knows it by its name) in a folder of temporary
    name beside it, removed after (or, after a kill -9, by the next output's clean-up)."""
    from ..formats import open_checkpoint

    if kind == "dir":
        return compute_manifest(_opened(open_checkpoint, tmp_path, dst))
    named = tmp_path + "-seal"
    os.mkdir(named)
    try:
        link = os.path.join(named, os.path.basename(dst))
        try:
            os.link(tmp_path, link)
        except OSError:  # a file system without hard links
            os.symlink(tmp_path, link)
        manifest = compute_manifest(_opened(open_checkpoint, link, dst))
    finally:
        shutil.rmtree(named, ignore_errors=True)
    return manifest


def _opened(open_checkpoint: Callable[..., Checkpoint], path: str, dst: str) -> Checkpoint:
    try:
        return open_checkpoint(path, use_cache=False)
    except CheckpointError as exc:
        raise ExportError(f"{dst}: the written output does not read back as a checkpoint ({exc}).") from None


def seal_kept(folder: str) -> bool:
    """--force over a folder: the entries kept from the old folder (a model folder's config.json) are files of
    the output too, so its manifest lists them, hashed now. False (the manifest removed: the output goes unsealed)
    when one cannot be sealed (a symbolic link)."""
    path = os.path.join(folder, MANIFEST_NAME)
    manifest = read_manifest(path)
    try:
        names = checkpoint_files(folder, True)
    except CheckpointError:
        os.unlink(path)
        return False
    if manifest is not None:
        extra = [n for n in names if n not in manifest.files]
        for rel, h in hash_files(folder, True, extra, {}).items():
            manifest.files[rel] = FileDigest(h.bytes, h.sha256)
        write_manifest(path, manifest)
    return True


def check_against_source(manifest: Manifest, source: Manifest | None, origins: dict[str, Origin]) -> list[str]:
    """Compare the output's tensors with the sealed source's (``origins``: output name -> where it came from):
    the tensors whose values were to be copied unchanged and whose digest differs (named with why), empty when
    all are equal; a transformed tensor gets ``derived_from`` (in ``manifest``, in place)."""
    if source is None:
        return []
    bad = []
    for key, origin in origins.items():
        made, was = manifest.tensors.get(key), source.tensors.get(origin.fqn)
        if made is None or was is None:
            continue  # not written (left out), or not in the source's manifest: nothing to prove against
        if origin.transform is not None:
            manifest.tensors[key] = replace(made, derived_from=was.sha256, transform=origin.transform)
        elif (made.sha256, made.dtype, made.shape) != (was.sha256, was.dtype, was.shape):
            bad.append(f"{key} (its SHA-256 differs from {origin.fqn}'s in the source's manifest)")
    return bad


__all__ = ["Origin", "check_against_source", "output_manifest", "seal_kept", "source_manifest"]
