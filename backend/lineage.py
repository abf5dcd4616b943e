"""An export's lineage: which checkpoint it was made from (path, step, run, format) and that checkpoint's
identity when it was read (sizes and times of the files that describe it, and a CRC32 of them), kept in a
small JSON sidecar next to the export (``filenames.lineage_sidecar``), never inside the exported file.

The library reads sidecars (format-neutral: any checkpoint may have one) and compares the identity recorded
there with the source's identity now: ``same``, ``changed`` or ``missing``. Names from :mod:`.filenames`, a
file's identifying header from its format (:meth:`~.formats.base.Format.identity_piece`; no numpy, no torch):
``ls`` reads these and must stay cheap.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any

from .filenames import describes_checkpoint, is_url
from .formats.registry import FILE_FORMATS

SCHEMA = "shardscope-lineage/1"
MAX_SIDECAR_BYTES = 1 << 20  # a sidecar names one source; far larger is not one of ours
MAX_DESCRIBING_BYTES = 64 << 20  # of a describing file (.metadata), at most this much is checksummed

SAME, CHANGED, MISSING, UNKNOWN = "same", "changed", "missing", "unknown"
REMOVED = "removed by watch"  # missing, and the watch record beside the export says a watch removed it by its rules

_crc_memo: dict[tuple[str, int, int, int], int] = {}  # (path, size, mtime_ns, inode) -> CRC32 of its piece
_memo_lock = threading.Lock()


def _piece(path: str, name: str, size: int) -> tuple[int, int] | None:
    """(offset, length) of the part of a file that identifies its contents cheaply, or None for none."""
    if describes_checkpoint(name):
        return 0, min(size, MAX_DESCRIBING_BYTES)
    # the file formats by name alone (a hidden name too: registry.detect_file would skip a writer's temporary)
    fmt = next((f for f in FILE_FORMATS if f.detect_file(name)), None)
    return None if fmt is None else fmt.identity_piece(path, size)


def _piece_crc(path: str, name: str, st: os.stat_result) -> int | None:
    """CRC32 of a file's identifying piece; remembered by (size, time, inode), as the Library polls."""
    key = (path, st.st_size, st.st_mtime_ns, st.st_ino)
    with _memo_lock:
        if key in _crc_memo:
            return _crc_memo[key]
    piece = _piece(path, name, st.st_size)
    if piece is None:
        return None
    crc = 0
    with open(path, "rb") as f:
        f.seek(piece[0])
        left = piece[1]
        while left > 0:
            block = f.read(min(left, 1 << 20))
            if not block:
                break
            crc = zlib.crc32(block, crc)
            left -= len(block)
    with _memo_lock:
        if len(_crc_memo) > 4096:
            _crc_memo.clear()
        _crc_memo[key] = crc
    return crc


def identity(path: str) -> dict[str, Any] | None:
    """What identifies a local checkpoint now: for a file, its size, time and a CRC32 of its header (a
    safetensors header, a torch archive's central directory); for a folder, the size and time of the files
    that describe it (``.metadata``, an index, ``meta.pt``, ...; every file when none does), the count and
    bytes of the others, and a CRC32 of the describing files. None when nothing is there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not os.path.isdir(path):
        entries = [(os.path.basename(path), path, st)]
        described = entries
    else:
        entries = []
        with os.scandir(path) as it:
            for e in it:
                if e.is_file(follow_symlinks=False):
                    entries.append((e.name, e.path, e.stat(follow_symlinks=False)))
        entries.sort()
        described = [x for x in entries if describes_checkpoint(x[0])] or entries
    files = {name: {"bytes": s.st_size, "mtime_ns": s.st_mtime_ns} for name, _, s in described}
    others = [s for name, _, s in entries if name not in files]
    crc, of = 0, []
    for name, p, s in described:
        piece = _piece_crc(p, name, s)
        if piece is not None:
            crc = zlib.crc32(piece.to_bytes(4, "little"), crc)
            of.append(name)
    return {"files": files, "other_files": len(others), "other_bytes": sum(s.st_size for s in others),
            "crc32": f"{crc:08x}", "crc32_of": of}


def make_sidecar(source: dict[str, Any], export_format: str) -> dict[str, Any]:
    """The sidecar's document: the source (path, name, step, run, format, identity) and what was written."""
    return {"schema": SCHEMA, "written": time.time(), "export_format": export_format, "source": source}


MAX_WRITTEN_FILES = 100_000  # names an export of a folder records; far more is not one of ours


def with_written_files(doc: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The sidecar's document with ``files``: the names a folder export wrote into its folder (what a later
    --force export there may replace; every other entry of the folder is kept)."""
    return {**doc, "files": sorted(names)}


def written_files(doc: dict[str, Any]) -> set[str] | None:
    """The names a folder export's sidecar records it wrote (plain names only: an untrusted file), or None
    when it records none (a file export, or a sidecar of an older Shardscope)."""
    names = doc.get("files")
    if not isinstance(names, list) or len(names) > MAX_WRITTEN_FILES:
        return None
    plain = {n for n in names if isinstance(n, str) and n not in ("", ".", "..") and "/" not in n
             and os.sep not in n and "\0" not in n}
    return plain if len(plain) == len(names) else None


def sidecar_bytes(doc: dict[str, Any]) -> bytes:
    """The sidecar's bytes (indented JSON, for people reading it)."""
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


@dataclass(frozen=True, slots=True)
class Lineage:
    """An export's lineage as its sidecar records it, and how its source compares now."""

    source: str  # the source checkpoint's path or URL
    step: int | None
    run: str
    format: str
    state: str  # same, changed, missing, unknown (a URL source, or no identity recorded)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "source_step": self.step, "source_run": self.run,
                "source_format": self.format, "source_changed": self.state == CHANGED,
                "source_missing": self.state == MISSING, "source_removed_by_watch": self.state == REMOVED}


def _text(v: Any) -> str:
    return v if isinstance(v, str) else ""


def parse_sidecar(raw: bytes) -> dict[str, Any] | None:
    """The sidecar's document when ``raw`` is one of ours (an untrusted file: types checked), else None."""
    if len(raw) > MAX_SIDECAR_BYTES:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("source"), dict) or \
            not isinstance(doc["source"].get("path"), str) or not doc["source"]["path"]:
        return None
    return doc


def compare(doc: dict[str, Any], check_source: bool = True) -> Lineage:
    """The lineage a parsed sidecar records, with its source compared to what is there now (``check_source``
    False: not compared, ``unknown``; a sidecar read from object storage names a path on the machine that wrote
    it)."""
    src = doc["source"]
    path = src["path"]
    step = src.get("step")
    recorded = src.get("identity")
    if not check_source or is_url(path) or not isinstance(recorded, dict):
        state = UNKNOWN
    else:
        try:
            now = identity(path)
        except OSError:
            now = None
        state = MISSING if now is None else SAME if now == recorded else CHANGED
    return Lineage(path, step if isinstance(step, int) and not isinstance(step, bool) else None,
                   _text(src.get("run")), _text(src.get("format")), state)


def read_sidecar(sidecar: str) -> dict[str, Any] | None:
    """The document of a local sidecar file when it is one of ours (a regular file with our schema), else None."""
    try:
        with open(sidecar, "rb") as f:
            if not os.path.isfile(sidecar):
                return None
            raw = f.read(MAX_SIDECAR_BYTES + 1)
    except OSError:
        return None
    return parse_sidecar(raw)


def read_lineage(sidecar: str) -> Lineage | None:
    """The lineage in a local sidecar file, compared with its source now; None when there is none."""
    doc = read_sidecar(sidecar)
    return None if doc is None else compare(doc)


__all__ = ["CHANGED", "MISSING", "REMOVED", "SAME", "UNKNOWN", "Lineage", "compare", "identity", "make_sidecar",
           "parse_sidecar", "read_lineage", "read_sidecar", "sidecar_bytes", "with_written_files", "written_files"]
