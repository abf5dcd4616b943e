"""Sealing a checkpoint (writing its content manifest, :mod:`.manifest`) and checking one against its manifest:
every file's SHA-256 (a flipped byte, a truncated, missing or extra file is named, with the tensors it holds and
the chunk ranges that changed), with ``deep`` every tensor's logical digest too. Fail closed: a file or tensor the
manifest does not list is "unsealed", a problem, never healthy. Megatron-Core's ``integrity.json`` is checked
where there is one and written when a Megatron folder is sealed. Signing goes through OpenSSF's ``model-signing``
with a local elliptic-curve key (no network)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import CheckpointError, ShardscopeError
from ..filenames import MEGATRON_INTEGRITY, SIGNATURE_NAME, is_url, manifest_path, signature_path
from ..progress import Progress
from ..text import count
from .digests import FileHash, chunk_ranges, hash_files, object_digest, tensor_digests
from .manifest import (
    DAMAGED,
    MODIFIED,
    SEALED,
    UNSEALED,
    ChunkDigest,
    FileDigest,
    Manifest,
    ManifestError,
    TensorDigest,
    checkpoint_files,
    megatron_integrity,
    read_manifest,
    read_megatron_integrity,
    seal_state,
    write_manifest,
)
from .model import Checkpoint, Problem
from .sources import CheckpointSource
from .stream_digests import StreamedDigests

MAX_NAMED = 5  # tensors or ranges named in one problem's message


@dataclass(slots=True)
class SealCheck:
    """What a check against a checkpoint's manifest proved."""

    manifest: str | None  # the manifest's path (None: unsealed)
    files_checked: int = 0
    tensors_checked: int = 0  # (deep) tensor digests recomputed and equal
    integrity_checked: int = 0  # files of a Megatron integrity.json that matched
    problems: list[Problem] = field(default_factory=list)

    @property
    def state(self) -> str:
        """sealed, unsealed or damaged."""
        return "damaged" if self.problems else "sealed" if self.manifest else "unsealed"

    def summary(self) -> str:
        """One line saying what the manifest proved."""
        if self.manifest is None:
            return "unsealed: no manifest (shardscope seal writes one)"
        what = f"{count(self.files_checked, 'file')} SHA-256 checked"
        if self.tensors_checked:
            what += f", {count(self.tensors_checked, 'tensor digest')} recomputed"
        return f"{self.state}: {what} against {os.path.basename(self.manifest)}"


def is_folder_checkpoint(ckpt: Checkpoint) -> bool:
    return os.path.isdir(ckpt.path)


def _local(ckpt: Checkpoint, what: str) -> None:
    if is_url(ckpt.path):
        raise ShardscopeError(f"{ckpt.path}: {what} reads and writes local checkpoints only (copy it here first).")


def compute_manifest(ckpt: Checkpoint, progress: Progress | None = None) -> Manifest:
    """The manifest of a checkpoint as it is now, each byte read once where the layout allows: every file hashed
    front to back with, in the same pass, the chunk ranges in it and the logical digests of the tensors stored as
    runs of their row-major bytes (:mod:`.stream_digests`); the other tensors (assembled layouts) in a second pass;
    every non-tensor entry's digest."""
    _local(ckpt, "seal")
    is_folder = is_folder_checkpoint(ckpt)
    names = checkpoint_files(ckpt.path, is_folder)
    source = CheckpointSource(ckpt)
    try:
        streamed = StreamedDigests(source, ckpt.tensors)
        ranges = chunk_ranges(ckpt)
        for name, more in streamed.ranges.items():
            ranges.setdefault(name, []).extend(more)
        if progress:
            progress.start(sum(names.values()), f"sealing {ckpt.path}")
        fh = hash_files(ckpt.path, is_folder, list(names), ranges, progress)
        digests = streamed.digests(fh)
        rest = [e for e in ckpt.tensors if e.fqn not in digests]
        if progress and rest:
            progress.start(sum(e.nbytes for e in rest), f"sealing {ckpt.path}: tensors in other layouts")
        digests.update(tensor_digests(source, rest, progress))
        objects = {o.fqn: object_digest(source, o) for o in ckpt.objects}
    finally:
        source.close()
    tensors = {}
    for ti, e in enumerate(ckpt.tensors):
        chunks = tuple(ChunkDigest(c.file, c.offset, c.length, fh[c.file].ranges[(ti, k)])
                       for k, c in enumerate(e.chunks) if c.file in fh)
        tensors[e.fqn] = TensorDigest(e.dtype, tuple(e.shape), digests[e.fqn], chunks)
    return Manifest(ckpt.format, {k: FileDigest(h.bytes, h.sha256) for k, h in fh.items()}, tensors, objects)


def seal(ckpt: Checkpoint, health: list[Problem], progress: Progress | None = None, integrity: bool = False
         ) -> tuple[str, Manifest]:
    """Write the checkpoint's manifest (atomically); with ``integrity`` (the format's ``integrity_manifest``: a
    Megatron folder), Megatron's ``integrity.json`` too when it has none, else that one checked. ``health``: what
    :func:`.verify.verify` found; a checkpoint with problems is refused (a manifest of damaged or incomplete bytes
    would vouch for them). Returns (the manifest's path, the manifest)."""
    if health:
        raise CheckpointError(f"{ckpt.path}: not sealed: {health[0].message}", path=ckpt.path, fqn=health[0].fqn)
    manifest = compute_manifest(ckpt, progress)
    is_folder = is_folder_checkpoint(ckpt)
    if integrity and is_folder:
        _megatron_integrity(ckpt.path, manifest)
    path = manifest_path(ckpt.path, is_folder)
    write_manifest(path, manifest)
    return path, manifest


def _megatron_integrity(folder: str, manifest: Manifest) -> None:
    """Check a Megatron folder's ``integrity.json`` against the digests just computed (a mismatch refuses the
    seal), or write one, in Megatron's own format, and list it in the manifest."""
    path = os.path.join(folder, MEGATRON_INTEGRITY)
    listed = read_megatron_integrity(path)
    if listed is not None:
        bad = _integrity_problems(listed, {k: v.sha256 for k, v in manifest.files.items()}, path)
        if bad:
            raise CheckpointError(f"{folder}: not sealed: {bad[0].message}", path=path)
        return
    from ..atomic_file import write_atomic
    from .digests import bytes_digest

    data = megatron_integrity(manifest.files)
    write_atomic(path, data, mode=0o644)
    manifest.files[MEGATRON_INTEGRITY] = FileDigest(len(data), bytes_digest(data))


def _integrity_problems(listed: dict[str, str], actual: dict[str, str], where: str) -> list[Problem]:
    out = []
    for name, h in sorted(listed.items()):
        if name not in actual:
            out.append(Problem("missing_file", f"{name} is listed in {where} but missing.", file=name))
        elif actual[name] != h:
            out.append(Problem("digest_mismatch", f"{name}: its SHA-256 differs from {where}'s.", file=name))
    return out


def quick_seal_summary(path: str) -> str:
    """One line of what :func:`seal_state` says of the checkpoint at ``path`` (no byte read); '' for a URL."""
    if is_url(path):
        return ""
    return {SEALED: "sealed: every file the manifest lists is there, of its size, none modified since the seal "
                    "(bytes not read: Verify contents checks every SHA-256)",
            UNSEALED: "unsealed: no manifest (shardscope seal writes one)",
            MODIFIED: "sealed, but a file was modified after the seal (Verify contents checks its SHA-256)",
            DAMAGED: "damaged: a file the manifest lists is missing, extra or of another size (Verify contents "
                     "names it)"}[seal_state(path, os.path.isdir(path))]


def unchanged_manifest(ckpt: Checkpoint) -> Manifest | None:
    """The checkpoint's manifest when, by the file system's word, its files are the ones sealed (:func:`seal_state`
    is ``sealed``); else None. What ``diff`` trusts to skip reading tensors whose digests are equal; ``verify``
    checks the bytes themselves."""
    if is_url(ckpt.path):
        return None
    is_folder = is_folder_checkpoint(ckpt)
    if seal_state(ckpt.path, is_folder) != SEALED:
        return None
    try:
        return read_manifest(manifest_path(ckpt.path, is_folder))
    except ManifestError:
        return None


def check_seal(ckpt: Checkpoint, deep: bool = False, progress: Progress | None = None) -> SealCheck:
    """The checkpoint checked against its manifest (and a Megatron ``integrity.json``), whenever it has one:
    missing, extra, resized and changed files, the tensors they hold and (``deep``) every tensor's digest.
    A checkpoint without either is "unsealed" with no problems; on a URL, the manifest beside it
    (:mod:`.seal_remote`)."""
    if is_url(ckpt.path):
        return _check_remote(ckpt, deep, progress)
    is_folder = is_folder_checkpoint(ckpt)
    path = manifest_path(ckpt.path, is_folder)
    integrity = os.path.join(ckpt.path, MEGATRON_INTEGRITY) if is_folder else None
    try:
        manifest = read_manifest(path)
        listed = read_megatron_integrity(integrity) if integrity else None
    except ManifestError as exc:
        return SealCheck(path, problems=[Problem("bad_manifest", str(exc), file=exc.path)])
    if manifest is None and listed is None:
        return SealCheck(None)
    names = checkpoint_files(ckpt.path, is_folder)
    expected = manifest.files if manifest is not None else {}
    todo = [n for n in names if n in expected or (listed is not None and n in listed)]
    if progress:
        progress.start(sum(names[n] for n in todo) + (sum(e.nbytes for e in ckpt.tensors) if deep else 0),
                       f"checking {ckpt.path} against its manifest")
    fh = hash_files(ckpt.path, is_folder, todo, {}, progress)
    result = SealCheck(path if manifest is not None else integrity)
    if listed is not None:
        bad = _integrity_problems(listed, {k: h.sha256 for k, h in fh.items()}, MEGATRON_INTEGRITY)
        result.problems += bad
        result.integrity_checked = len(listed) - len(bad)
    if manifest is not None:
        result.problems += _file_problems(ckpt, manifest, names, fh)
        result.files_checked = sum(1 for n in expected if n in fh and fh[n].sha256 == expected[n].sha256)
        if deep:
            bad = _tensor_problems(ckpt, manifest, progress)
            result.problems += bad
            result.tensors_checked = len(ckpt.tensors) - len({p.fqn for p in bad})
    return result


def _check_remote(ckpt: Checkpoint, deep: bool = False, progress: Progress | None = None) -> SealCheck:
    """:func:`check_seal` of a checkpoint on a URL: its files read and hashed through :mod:`.seal_remote`."""
    from .seal_remote import hash_remote_files, read_remote_manifest, remote_files

    try:
        url, manifest = read_remote_manifest(ckpt)
    except ManifestError as exc:
        return SealCheck(exc.path, problems=[Problem("bad_manifest", str(exc), file=exc.path)])
    if manifest is None:
        return SealCheck(None)
    names = remote_files(ckpt)
    todo = [n for n in names if n in manifest.files]
    if progress:
        progress.start(sum(names[n] for n in todo) + (sum(e.nbytes for e in ckpt.tensors) if deep else 0),
                       f"checking {ckpt.path} against its manifest")
    fh = hash_remote_files(ckpt, todo, progress)
    result = SealCheck(url)
    result.problems += _file_problems(ckpt, manifest, names, fh)
    result.files_checked = sum(1 for n, want in manifest.files.items() if n in fh and fh[n].sha256 == want.sha256)
    if deep:
        bad = _tensor_problems(ckpt, manifest, progress)
        result.problems += bad
        result.tensors_checked = len(ckpt.tensors) - len({p.fqn for p in bad})
    return result


def _file_problems(ckpt: Checkpoint, manifest: Manifest, names: dict[str, int], fh: dict[str, FileHash]
                   ) -> list[Problem]:
    out = []
    for rel in sorted(set(names) - set(manifest.files)):
        out.append(Problem("unsealed_file", f"{rel} is not in the manifest: unverified (written after the seal, "
                           "or by something else).", file=rel))
    is_folder = is_folder_checkpoint(ckpt)
    for rel, want in sorted(manifest.files.items()):
        held = _held(manifest, rel)
        if rel not in names:
            out.append(Problem("missing_file", f"{rel} is missing ({want.bytes} bytes in the manifest){held}.",
                               fqn=_first(manifest, rel), file=rel))
        elif fh[rel].bytes != want.bytes:
            out.append(Problem("digest_mismatch", f"{rel} has {fh[rel].bytes} bytes, the manifest {want.bytes}: "
                               f"{'truncated' if fh[rel].bytes < want.bytes else 'grown'}{held}.",
                               fqn=_first(manifest, rel), file=rel))
        elif fh[rel].sha256 != want.sha256:
            changed = _changed_chunks(ckpt.path, is_folder, manifest, rel)
            where = "; changed: " + ", ".join(changed[:MAX_NAMED]) + (" …" if len(changed) > MAX_NAMED else "") \
                if changed else held
            out.append(Problem("digest_mismatch", f"{rel}: its SHA-256 differs from the manifest's{where}.",
                               fqn=changed[0].split(" ")[0] if changed else _first(manifest, rel), file=rel))
    return out


def _held(manifest: Manifest, rel: str) -> str:
    held = manifest.tensors_in(rel)
    if not held:
        return ""
    return f"; it holds {count(len(held), 'tensor')}: " + ", ".join(held[:MAX_NAMED]) + \
        (" …" if len(held) > MAX_NAMED else "")


def _first(manifest: Manifest, rel: str) -> str | None:
    return next(iter(manifest.tensors_in(rel)), None)


def _changed_chunks(root: str, is_folder: bool, manifest: Manifest, rel: str) -> list[str]:
    """``fqn bytes a..b`` of every chunk stored in ``rel`` whose stored bytes differ from the manifest's (the
    file read once more, only when its digest differs; not on a URL, where the tensors it holds are named)."""
    if is_url(root):
        return []
    ranges = [((fqn, k), c.offset, c.length) for fqn, t in manifest.tensors.items()
              for k, c in enumerate(t.chunks) if c.file == rel]
    if not ranges:
        return []
    got = hash_files(root, is_folder, [rel], {rel: ranges})[rel].ranges
    out = []
    for (fqn, k), off, ln in ranges:
        if got[(fqn, k)] != manifest.tensors[fqn].chunks[k].sha256:
            out.append(f"{fqn} (bytes {off}..{off + ln})")
    return out


def _tensor_problems(ckpt: Checkpoint, manifest: Manifest, progress: Progress | None) -> list[Problem]:
    out = []
    for fqn in sorted(set(manifest.tensors) - {e.fqn for e in ckpt.tensors}):
        out.append(Problem("missing_tensor", f"{fqn} is in the manifest but not in the checkpoint.", fqn=fqn))
    sealed = [e for e in ckpt.tensors if e.fqn in manifest.tensors]
    for e in ckpt.tensors:
        if e.fqn not in manifest.tensors:
            out.append(Problem("unsealed_tensor", f"{e.fqn} is not in the manifest: unverified.", fqn=e.fqn))
    source = CheckpointSource(ckpt)
    errors: dict[str, CheckpointError] = {}
    try:
        digests = tensor_digests(source, sealed, progress, errors)
    finally:
        source.close()
    for e in sealed:
        want = manifest.tensors[e.fqn]
        if e.fqn in errors:
            out.append(Problem("digest_mismatch", f"{e.fqn}: its values cannot be read to check their digest "
                               f"({errors[e.fqn]}).", fqn=e.fqn))
        elif (e.dtype, tuple(e.shape)) != (want.dtype, want.shape):
            out.append(Problem("digest_mismatch", f"{e.fqn}: {e.dtype} {list(e.shape)}, the manifest says "
                               f"{want.dtype} {list(want.shape)}.", fqn=e.fqn))
        elif digests[e.fqn] != want.sha256:
            out.append(Problem("digest_mismatch", f"{e.fqn}: its values' SHA-256 differs from the manifest's.",
                               fqn=e.fqn))
    return out


# ------------------------------------------------------------------ signing (OpenSSF model-signing)
def sign(ckpt_path: str, key: str) -> str:
    """Sign the sealed checkpoint (its files and its manifest) as an OpenSSF model-signing bundle with the
    elliptic-curve private key at ``key`` (PEM), no network; ``model_signing``'s own verification with the
    public key accepts it. Returns the bundle's path."""
    try:
        from model_signing import hashing, signing
    except ImportError:
        raise ShardscopeError("signing needs the model-signing package (pip install 'shardscope[sign]').") from None
    is_folder = os.path.isdir(ckpt_path)
    bundle = signature_path(ckpt_path, is_folder)
    config = signing.Config().use_elliptic_key_signer(private_key=key)
    if is_folder:
        config.set_hashing_config(hashing.Config().set_ignored_paths(paths=[SIGNATURE_NAME]))
    try:
        config.sign(ckpt_path, bundle)
    except (ValueError, OSError, TypeError) as exc:
        raise ShardscopeError(f"{key}: cannot sign with this key ({exc}).") from None
    return bundle


def check_signature(ckpt_path: str, public_key: str) -> Problem | None:
    """None when the checkpoint's model-signing bundle verifies with ``public_key``; else the problem."""
    try:
        from model_signing import verifying
    except ImportError:
        raise ShardscopeError("checking a signature needs the model-signing package.") from None
    bundle = signature_path(ckpt_path, os.path.isdir(ckpt_path))
    if not os.path.exists(bundle):
        return Problem("unsigned", f"{bundle} is missing: the checkpoint is not signed.", file=bundle)
    try:
        verifying.Config().use_elliptic_key_verifier(public_key=public_key).verify(ckpt_path, bundle)
    except (ValueError, OSError) as exc:
        return Problem("bad_signature", f"{bundle}: the signature does not verify ({str(exc)[:300]}).", file=bundle)
    return None
