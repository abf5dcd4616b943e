"""``verify`` of a checkpoint on a URL against the manifest beside it (an export or import to a URL PUTs one there,
see :mod:`..export.output_seal`): the manifest fetched with one GET, every file of the checkpoint (the folder's
listing, or the one object) hashed as its bytes stream in, 8 MiB per request, files in parallel; then the checks
of a local checkpoint (:func:`.seal.check_seal`): a missing, extra, resized or changed file is named with the
tensors it holds, and ``deep`` recomputes every tensor's digest through the checkpoint's reader. A URL without a
manifest is unsealed, as a local checkpoint is; Megatron's ``integrity.json`` is checked on local folders only."""

from __future__ import annotations

import hashlib
from typing import Any

from ..filenames import MANIFEST_FILE_SUFFIX, MANIFEST_NAME, is_own_temporary, is_seal_file
from ..progress import Progress
from .digests import BLOCK, FileHash, parallel
from .manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError, parse_manifest
from .model import Checkpoint
from .remote import call


def _where(ckpt: Checkpoint) -> tuple[Any, bool]:
    """The checkpoint's storage folder and whether the checkpoint is that folder (else one object in it)."""
    folder = ckpt.folder
    return folder, ckpt.path.rstrip("/") == folder.path.rstrip("/")


def _key(folder: Any, name: str) -> str:
    return f"{folder.root.rstrip('/')}/{name}"


def _info_or_none(fs: Any, key: str) -> dict | None:
    try:
        return fs.info(key)
    except FileNotFoundError:
        return None


def read_remote_manifest(ckpt: Checkpoint) -> tuple[str, Manifest | None]:
    """(the manifest's URL, the manifest; None when there is none). ManifestError when it is not a valid one (fail
    closed) or larger than any manifest."""
    folder, is_folder = _where(ckpt)
    name = MANIFEST_NAME if is_folder else ckpt.path.rstrip("/").rsplit("/", 1)[-1] + MANIFEST_FILE_SUFFIX
    url, key = folder.join(name), _key(folder, name)
    info = call(url, _info_or_none, folder.fs, key)
    if info is None:
        return url, None
    if int(info.get("size") or 0) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{url}: larger than {MAX_MANIFEST_BYTES >> 20} MiB: not a manifest.", path=url)
    return url, parse_manifest(call(url, folder.fs.cat_file, key), url)


def remote_files(ckpt: Checkpoint) -> dict[str, int]:
    """Every file of the checkpoint by its name -> size, as :func:`.manifest.checkpoint_files` has them locally:
    the folder's listing (one level, as a checkpoint's folder on object storage is written) less the seal files
    and Shardscope's temporaries; or the one object."""
    folder, is_folder = _where(ckpt)
    listing = folder.listing()
    if not is_folder:
        name = ckpt.path.rstrip("/").rsplit("/", 1)[-1]
        return {name: listing[name]} if name in listing else {}
    return {n: s for n, s in listing.items() if not is_seal_file(n) and not is_own_temporary(n)}


def hash_remote_files(ckpt: Checkpoint, names: list[str], progress: Progress | None = None) -> dict[str, FileHash]:
    """SHA-256 of each named file of the checkpoint, streamed in :data:`.digests.BLOCK` reads, files in parallel."""
    folder, _ = _where(ckpt)

    def one(name: str) -> FileHash:
        url, h, n = folder.join(name), hashlib.sha256(), 0
        with call(url, folder.fs.open, _key(folder, name), "rb", block_size=BLOCK) as f:
            while block := call(url, f.read, BLOCK):
                h.update(block)
                n += len(block)
                if progress:
                    progress.advance(len(block))
        return FileHash(n, h.hexdigest(), {})

    return dict(zip(names, parallel(one, names, progress), strict=True))


__all__ = ["hash_remote_files", "read_remote_manifest", "remote_files"]
