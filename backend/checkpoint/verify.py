"""Health check: files present and long enough, chunks tiling their tensors, and with ``deep``
every item decoded and its CRC32 checked (bit rot that ``torch.load`` would never notice)."""

from __future__ import annotations

import zlib

import numpy as np

from ..errors import CheckpointError
from ..progress import Progress
from .layout import coverage_problems
from .model import Checkpoint, Problem
from .values import ChunkReader, read_lightning_meta

CRC_BLOCK = 8 << 20


def verify(ckpt: Checkpoint, deep: bool = False, progress: Progress | None = None) -> list[Problem]:
    """All problems of a checkpoint: those found while reading, plus layout, files and (deep) items."""
    problems = list(ckpt.problems)
    problems += coverage_problems(ckpt)
    problems += _file_problems(ckpt)
    if deep:
        problems += _deep_problems(ckpt, progress)
    return problems


def _first_users(ckpt: Checkpoint, file_index: int, limit: int = 3) -> list[str]:
    t = ckpt.chunk_table
    tids = np.unique(t.tensor[t.file == file_index])[:limit]
    return [ckpt.tensors[int(i)].fqn for i in tids]


def _file_problems(ckpt: Checkpoint) -> list[Problem]:
    problems = []
    t = ckpt.chunk_table
    ends = t.byte_offset + t.length
    for fi, f in enumerate(ckpt.files):
        if f.kind != "data":
            continue
        used = t.file == fi
        users = _first_users(ckpt, fi)
        objects = [o for o in ckpt.objects if o.file == f.name]
        if f.bytes is None:
            n = int(np.unique(t.tensor[used]).size) + len(objects)
            names = ", ".join(users or [o.fqn for o in objects[:3]])
            problems.append(Problem("missing_file", f"{f.name} is missing; {n} entries have data in it "
                                    f"(e.g. {names}).", fqn=(users or [None])[0], file=f.name))
            continue
        need = int(ends[used].max()) if used.any() else 0
        for o in objects:
            need = max(need, o.offset + o.length)
        if need > f.bytes:
            bad = np.nonzero(used & (ends > f.bytes))[0]
            fqn = ckpt.tensors[int(t.tensor[bad[0]])].fqn if len(bad) else next(
                (o.fqn for o in objects if o.offset + o.length > f.bytes), None)
            problems.append(Problem("short_file", f"{f.name} has {f.bytes} bytes but its items need {need}: the file "
                                    f"is truncated ({len(bad)} chunks cut off, first {fqn}).", fqn=fqn, file=f.name))
        if not used.any() and not objects and ckpt.metadata_files:
            problems.append(Problem("unused_file", f"{f.name} is not referenced by the metadata (left from "
                                    "another save?).", file=f.name))
    return problems


def _deep_problems(ckpt: Checkpoint, progress: Progress | None) -> list[Problem]:
    problems: list[Problem] = []
    missing = {f.name for f in ckpt.files if f.bytes is None}
    total = len(ckpt.chunk_table) + len(ckpt.objects)
    if progress:
        progress.start(total, "reading every item")
    with ChunkReader(ckpt) as reader:
        for e in ckpt.tensors:
            for c in e.chunks:
                if progress:
                    progress.advance(1, e.fqn)
                if not c.file or c.file in missing:
                    continue
                try:
                    st = reader.locate(e.fqn, c)
                    if st is not None and st.crc32 is not None:
                        crc = 0
                        pos, left = st.data_offset, st.nbytes
                        while left:
                            n = min(CRC_BLOCK, left)
                            crc = zlib.crc32(reader.handles.read(c.file, pos, n), crc)
                            pos += n
                            left -= n
                        if crc != st.crc32:
                            problems.append(Problem(
                                "corrupt", f"{e.fqn}: chunk at offsets {list(c.offsets)} in {c.file} fails its "
                                f"CRC32 check (stored {st.crc32:08x}, read {crc:08x}): the bytes changed on disk.",
                                fqn=e.fqn, file=c.file))
                            continue
                    reader.read_chunk(e.fqn, c, e.dtype)
                except CheckpointError as exc:
                    problems.append(Problem("unreadable", str(exc), fqn=e.fqn, file=c.file))
        for o in ckpt.objects:
            if progress:
                progress.advance(1, o.fqn)
            if not o.file or o.file in missing:
                continue
            try:
                reader.read_object(o)
            except CheckpointError as exc:
                problems.append(Problem("unreadable", str(exc), fqn=o.fqn, file=o.file))
    if ckpt.extra_files.get("meta.pt"):
        try:
            read_lightning_meta(ckpt)
        except CheckpointError as exc:
            problems.append(Problem("unreadable", str(exc), file="meta.pt"))
    return problems
