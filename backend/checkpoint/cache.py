"""A cache of parsed metadata in the user's cache directory, keyed by the metadata files' identity.

Never written into the checkpoint folder. Stored as JSON plus ``.npy`` arrays (no pickle), so
a damaged or planted cache file cannot run code; any problem reading it means a miss.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import numpy as np

from ..filenames import cache_enabled, cache_folder
from .codecs import ItemCodec
from .model import Checkpoint, ChunkTable, FileInfo, ObjectEntry, Problem, TensorEntry
from .storage import Folder

log = logging.getLogger(__name__)
FORMAT = 5  # 2: written only after the metadata passed validate.py; 3: planner_data checked as a tree; 4: an
# unreferenced data file has no rank; 5: the items' stream transforms (the DCP codec's)
ARRAYS = ("tensor", "file", "byte_offset", "length", "dim_start", "dims")


def cache_dir() -> Path:
    """Where parsed metadata is cached (``SHARDSCOPE_CACHE_DIR`` or the XDG cache folder)."""
    return Path(cache_folder())


def key_for(folder: Folder, meta_names: list[str]) -> str | None:
    """The cache key of these metadata files, or None when caching is off or their identity is unknown."""
    if not cache_enabled():
        return None
    ident = folder.identity(meta_names)
    if ident is None:
        return None
    return hashlib.sha256(f"v{FORMAT}\0{ident}".encode()).hexdigest()[:40]


def load(key: str, path: str) -> Checkpoint | None:
    """The cached checkpoint model for ``key``, or None on any miss or damage."""
    d = cache_dir() / key
    try:
        head = json.loads((d / "head.json").read_text())
        if head.get("format_version") != FORMAT:
            return None
        arrays = {a: np.load(d / f"{a}.npy", allow_pickle=False) for a in ARRAYS}
        codec = ItemCodec.from_json(head["transforms"])
    except (OSError, ValueError, KeyError, TypeError):
        log.debug("metadata cache miss for %s", path, exc_info=True)
        return None
    files = [FileInfo(n, r, b, k) for n, r, b, k in head["files"]]
    ckpt = Checkpoint(path, head["format"], head["version"], files, [], [], ChunkTable(**arrays),
                      save_id=head["save_id"], metadata_files=head["metadata_files"],
                      extra_files=head["extra_files"], codec=codec)
    ckpt.tensors = [TensorEntry(f, dt, tuple(s), a, b, ckpt) for f, dt, s, a, b in head["tensors"]]
    ckpt.objects = [ObjectEntry(*o) for o in head["objects"]]
    ckpt.planner_data = {k: tuple(v) for k, v in head["planner_data"].items()}
    ckpt.problems = [Problem(**p) for p in head["problems"]]
    ckpt.reindex()
    return ckpt


def store(key: str, ckpt: Checkpoint) -> None:
    """Write the checkpoint model under ``key`` (atomically; a failure only costs a slower next open)."""
    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
        t = ckpt.chunk_table
        for a in ARRAYS:
            np.save(tmp / f"{a}.npy", getattr(t, a), allow_pickle=False)
        head = {
            "format_version": FORMAT, "format": ckpt.format, "version": ckpt.version, "save_id": ckpt.save_id,
            "files": [[f.name, f.rank, f.bytes, f.kind] for f in ckpt.files],
            "tensors": [[e.fqn, e.dtype, list(e.shape), e.first_chunk, e.chunk_count] for e in ckpt.tensors],
            "objects": [[o.fqn, o.file, o.offset, o.length, o.rank] for o in ckpt.objects],
            "planner_data": {k: list(v) for k, v in ckpt.planner_data.items()},
            "problems": [{"kind": p.kind, "message": p.message, "fqn": p.fqn, "file": p.file}
                         for p in ckpt.problems],
            "metadata_files": ckpt.metadata_files, "extra_files": ckpt.extra_files,
            "transforms": ckpt.codec.to_json() if isinstance(ckpt.codec, ItemCodec) else [],
        }
        (tmp / "head.json").write_text(json.dumps(head))
        final = root / key
        if final.exists():
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
            return
        os.replace(tmp, final)
    except (OSError, TypeError, ValueError, RecursionError):
        log.warning("cannot write the metadata cache for %s", ckpt.path, exc_info=True)  # only a slower next open
