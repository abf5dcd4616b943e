"""A checkpoint's content manifest (``shardscope seal``): what its files and its tensors are, by SHA-256.

``{"schema": "shardscope-manifest/1", "format", "files": {RELPATH: {"bytes", "sha256"}}, "tensors": {FQN: {"dtype",
"shape", "sha256", "chunks": [{"file", "offset", "length", "sha256"}]}}, "objects": {KEY: {"sha256"}}}``.

A tensor's ``sha256`` is that of its **logical bytes**: the whole tensor as torch loads it, C-contiguous,
little-endian, in its stored dtype. It does not depend on the layout (DCP at any world size, a reshard, a
safetensors or ``.pt`` export), so two checkpoints hold the same values exactly when their digests are equal.
A chunk's ``sha256`` is that of its stored bytes in its file (``offset``, ``length``): it says which range of a
damaged file changed. A tensor an output wrote with other values than its source's (a cast) carries
``derived_from``: the source's digest, and ``transform``: what was done.

This module owns the schema: the dataclasses, writing (atomically) and reading, where every field of the
untrusted JSON is checked before it is used. Computing digests is :mod:`.digests`; sealing and checking is
:mod:`.seal`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..atomic_file import write_atomic
from ..errors import CheckpointError
from ..filenames import MEGATRON_INTEGRITY, is_own_temporary, is_seal_file, manifest_path
from .dtypes import DTYPE_NAMES, MAX_INDEX, MAX_NDIM

SCHEMA = "shardscope-manifest/1"
MAX_MANIFEST_BYTES = 512 << 20  # a manifest of 1,000,000 tensors is about 300 MB; far larger is not one
HEX64 = re.compile(r"^[0-9a-f]{64}$")
HEAD_BYTES = 1 << 20  # read_manifest_files: the first bytes, where a written manifest lists its files


class ManifestError(CheckpointError):
    """A manifest file that is not one (bad JSON, a field of the wrong kind, a path leading outside)."""


@dataclass(frozen=True, slots=True)
class FileDigest:
    bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class ChunkDigest:
    """A tensor's chunk: its stored bytes ``offset .. offset+length`` of ``file`` and their SHA-256."""

    file: str
    offset: int
    length: int
    sha256: str


@dataclass(frozen=True, slots=True)
class TensorDigest:
    dtype: str
    shape: tuple[int, ...]
    sha256: str  # of the logical bytes (see the module's docstring)
    chunks: tuple[ChunkDigest, ...] = ()
    derived_from: str | None = None  # the source tensor's digest, when these values were made from it (a cast)
    transform: str | None = None  # what made them ("cast from float32")


@dataclass(slots=True)
class Manifest:
    format: str
    files: dict[str, FileDigest]
    tensors: dict[str, TensorDigest]
    objects: dict[str, str]  # key -> SHA-256 of its stored bytes
    written: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def to_json(self) -> dict[str, Any]:
        """The manifest as the JSON document it is written as."""
        return {"schema": SCHEMA, "format": self.format, "written": self.written,
                "files": {k: {"bytes": f.bytes, "sha256": f.sha256} for k, f in sorted(self.files.items())},
                "tensors": {k: _tensor_json(t) for k, t in self.tensors.items()},
                "objects": {k: {"sha256": v} for k, v in self.objects.items()}}

    def tensors_in(self, rel: str) -> list[str]:
        """The tensors with a chunk stored in file ``rel``."""
        return [k for k, t in self.tensors.items() if any(c.file == rel for c in t.chunks)]


def _tensor_json(t: TensorDigest) -> dict[str, Any]:
    out: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape), "sha256": t.sha256,
                           "chunks": [{"file": c.file, "offset": c.offset, "length": c.length, "sha256": c.sha256}
                                      for c in t.chunks]}
    if t.derived_from is not None:
        out["derived_from"] = t.derived_from
        out["transform"] = t.transform
    return out


def write_manifest(path: str, manifest: Manifest) -> None:
    """Write ``manifest`` to ``path`` atomically (temporary, fsync, rename), readable by everyone."""
    write_atomic(path, json.dumps(manifest.to_json(), separators=(",", ":")) + "\n", mode=0o644)


def manifest_bytes(manifest: Manifest) -> bytes:
    """The manifest as written (for an upload beside a URL output)."""
    return (json.dumps(manifest.to_json(), separators=(",", ":")) + "\n").encode()


def _read_small(path: str, failure: str) -> bytes | None:
    """At most one byte more than a manifest may hold, of the file at ``path``; None when there is none."""
    try:
        with open(path, "rb") as f:
            return f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ManifestError(f"{path}: {failure} ({exc.strerror}).", path=path) from None


def read_manifest(path: str) -> Manifest | None:
    """The manifest at ``path``; None when there is none. ManifestError naming the file and the field when it is
    not a valid one (fail closed: a damaged manifest is never read as "no manifest")."""
    data = _read_small(path, "cannot read the manifest")
    return None if data is None else parse_manifest(data, path)


def parse_manifest(data: bytes, where: str) -> Manifest:
    """A manifest from its JSON bytes, every field checked (ManifestError naming ``where`` and the field)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where}: larger than {MAX_MANIFEST_BYTES >> 20} MiB: not a manifest.", path=where)
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc}).", path=where) from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ManifestError(f"{where}: not a Shardscope manifest (its schema is not {SCHEMA!r}).", path=where)
    fmt, written = doc.get("format"), doc.get("written", "")
    if not isinstance(fmt, str) or not isinstance(written, str):
        raise ManifestError(f"{where}: 'format' and 'written' must be strings.", path=where)
    files = _files(doc, where)
    tensors = {k: _tensor(k, v, where) for k, v in _mapping(doc, "tensors", where).items()}
    objects = {k: _hex(v, "sha256", where, k) for k, v in _mapping(doc, "objects", where).items()}
    return Manifest(fmt, files, tensors, objects, written)


def manifest_beside(path: str) -> str | None:
    """The manifest beside the single-file checkpoint at ``path`` when it is one of ours, else None: it goes where
    the checkpoint goes (prune moves and removes it with the checkpoint)."""
    mpath = manifest_path(path, False)
    try:
        return mpath if read_manifest_files(mpath) is not None else None
    except ManifestError:
        return None  # not ours: left as it is


def read_manifest_files(path: str) -> dict[str, FileDigest] | None:
    """Only the files the manifest at ``path`` lists (None when there is none; ManifestError when it is not one):
    what a listing compares with the disk. A manifest in the order Shardscope writes it is parsed only up to its
    ``"tensors"`` member (a listing must not parse 300,000 tensors' digests; a quote inside a name is escaped in
    JSON, so the first ``,"tensors":`` ends the files); any other is parsed whole."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read the manifest ({exc.strerror}).", path=path) from None
    cut = head.find(b',"tensors":')
    if cut < 0:
        manifest = read_manifest(path)
        return None if manifest is None else manifest.files
    try:
        doc = json.loads(head[:cut] + b"}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: not valid JSON ({exc}).", path=path) from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ManifestError(f"{path}: not a Shardscope manifest (its schema is not {SCHEMA!r}).", path=path)
    return _files(doc, path)


def _files(doc: dict, where: str) -> dict[str, FileDigest]:
    return {_relpath(k, where): FileDigest(_count(v, "bytes", where, k), _hex(v, "sha256", where, k))
            for k, v in _mapping(doc, "files", where).items()}


def _mapping(doc: dict, key: str, where: str) -> dict[str, Any]:
    value = doc.get(key)
    if not isinstance(value, dict):
        raise ManifestError(f"{where}: {key!r} is not a mapping.", path=where)
    return value


def _record(v: Any, where: str, name: str) -> dict:
    if not isinstance(v, dict):
        raise ManifestError(f"{where}: the entry of {name!r} is not a mapping.", path=where)
    return v


def _count(v: Any, key: str, where: str, name: str) -> int:
    n = _record(v, where, name).get(key)
    if type(n) is not int or not 0 <= n < MAX_INDEX:
        raise ManifestError(f"{where}: {name!r}: {key!r} is not a byte count.", path=where)
    return n


def _hex(v: Any, key: str, where: str, name: str) -> str:
    h = _record(v, where, name).get(key)
    if not isinstance(h, str) or not HEX64.match(h):
        raise ManifestError(f"{where}: {name!r}: {key!r} is not a SHA-256 in hex.", path=where)
    return h


def _relpath(rel: Any, where: str) -> str:
    """A file name relative to the checkpoint: forward slashes, no empty, ``.`` or ``..`` part, no NUL."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or "\x00" in rel or \
            any(p in ("", ".", "..") for p in rel.split("/")):
        raise ManifestError(f"{where}: the file name {rel!r} leads outside the checkpoint.", path=where)
    return rel


def _tensor(fqn: str, v: Any, where: str) -> TensorDigest:
    rec = _record(v, where, fqn)
    dtype, shape, chunks = rec.get("dtype"), rec.get("shape"), rec.get("chunks", [])
    if dtype not in DTYPE_NAMES:
        raise ManifestError(f"{where}: {fqn!r}: unknown dtype {dtype!r}.", path=where, fqn=fqn)
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or \
            any(type(d) is not int or not 0 <= d < MAX_INDEX for d in shape):
        raise ManifestError(f"{where}: {fqn!r}: the shape is not a list of sizes.", path=where, fqn=fqn)
    if not isinstance(chunks, list):
        raise ManifestError(f"{where}: {fqn!r}: 'chunks' is not a list.", path=where, fqn=fqn)
    parts = tuple(ChunkDigest(_relpath(_record(c, where, fqn).get("file"), where), _count(c, "offset", where, fqn),
                              _count(c, "length", where, fqn), _hex(c, "sha256", where, fqn)) for c in chunks)
    derived = rec.get("derived_from")
    transform = rec.get("transform")
    if derived is not None:
        derived = _hex(rec, "derived_from", where, fqn)
        if not isinstance(transform, str):
            raise ManifestError(f"{where}: {fqn!r}: 'transform' is not a string.", path=where, fqn=fqn)
    return TensorDigest(dtype, tuple(shape), _hex(rec, "sha256", where, fqn), parts, derived,
                        transform if derived is not None else None)


# ------------------------------------------------------------------ Megatron-Core's integrity.json
def megatron_integrity(files: dict[str, FileDigest]) -> bytes:
    """Megatron-Core's ``integrity.json`` for a folder's top-level files: ``{"algorithm": "sha256", "files":
    {name: hex}}`` (subfolders and the file itself left out, as Megatron writes it)."""
    top = {k: f.sha256 for k, f in sorted(files.items()) if "/" not in k and k != MEGATRON_INTEGRITY}
    return (json.dumps({"algorithm": "sha256", "files": top}, indent=2) + "\n").encode()


def read_megatron_integrity(path: str) -> dict[str, str] | None:
    """The name -> SHA-256 map of a Megatron ``integrity.json`` (None when there is none); ManifestError when it
    is not one."""
    data = _read_small(path, "cannot read")
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: not valid JSON ({exc}).", path=path) from None
    if not isinstance(doc, dict) or doc.get("algorithm") != "sha256" or not isinstance(doc.get("files"), dict):
        raise ManifestError(f"{path}: not a Megatron integrity manifest (algorithm sha256, files).", path=path)
    out = {}
    for name, h in doc["files"].items():
        if _relpath(name, path) != name or "/" in name or not isinstance(h, str) or not HEX64.match(h):
            raise ManifestError(f"{path}: the entry {name!r} is not a top-level file with a SHA-256.", path=path)
        out[name] = h
    return out


def checkpoint_files(path: str, is_folder: bool) -> dict[str, int]:
    """Every file of the checkpoint at ``path`` by its name relative to it (forward slashes) -> size: for a
    folder every regular file under it, Shardscope's own temporaries and seal files left out; for a file, the
    file. A symbolic link is refused (it may lead outside the checkpoint)."""
    if not is_folder:
        return {os.path.basename(path): os.stat(path).st_size}
    out = {}
    for top, dirs, names in os.walk(path, followlinks=False):
        rel_top = os.path.relpath(top, path)
        for name in sorted(names) + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            full = os.path.join(top, name)
            rel = name if rel_top == "." else f"{rel_top.replace(os.sep, '/')}/{name}"
            if is_own_temporary(name) or (rel_top == "." and is_seal_file(name)):
                continue
            if os.path.islink(full):
                raise CheckpointError(f"{full}: a symbolic link in the checkpoint; seal hashes only the "
                                      "checkpoint's own files (copy the file in its place).", path=full)
            st = os.stat(full)
            if os.path.isfile(full):
                out[rel] = st.st_size
    return out


SEALED, UNSEALED, DAMAGED, MODIFIED = "sealed", "unsealed", "damaged", "modified"


def seal_state(path: str, is_folder: bool) -> str:
    """What a listing says of a checkpoint's seal, from its manifest's file list and the file system alone (no
    byte of the checkpoint read): ``unsealed`` (no manifest), ``damaged`` (a bad manifest, a file missing, extra or
    of another size), ``modified`` (a file modified after the seal, its size kept: ``verify`` tells), else
    ``sealed``. Only ``verify`` proves the bytes."""
    mpath = manifest_path(path, is_folder)
    try:
        files = read_manifest_files(mpath)
        if files is None:
            return UNSEALED
        sealed_at = os.stat(mpath).st_mtime_ns
        names = checkpoint_files(path, is_folder)
        if names.keys() != files.keys() or any(files[k].bytes != n for k, n in names.items()):
            return DAMAGED
        folder = path if is_folder else os.path.dirname(path)
        if any(os.stat(os.path.join(folder, *k.split("/"))).st_mtime_ns > sealed_at for k in names):
            return MODIFIED
    except (CheckpointError, OSError):  # a bad manifest (ManifestError), a file gone or a link in the folder
        return DAMAGED
    return SEALED
