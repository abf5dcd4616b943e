"""The browser's steps for any path the window opens, through the one door (:mod:`..formats`): the tree as soon
as the metadata (or a file's header or pickle) is read, then health, balance and small values, then a tensor's
statistics or Verify contents on demand. Every value is read by the one chunk reader, with stored checksums
checked; a format's own deep checks are added by :func:`..formats.verify_contents`."""

from __future__ import annotations

from typing import Any

from ..checkpoint.browse import BrowseData, analyse, value_stats
from ..checkpoint.chunks import CorruptChunkError
from ..checkpoint.model import Checkpoint, Problem
from ..checkpoint.seal import quick_seal_summary
from ..checkpoint.tree import build_tree
from ..filenames import basename
from ..formats import open_checkpoint
from ..formats.registry import verify_sealed
from ..progress import Progress


def load_any(path: str, progress: Progress | None = None) -> BrowseData:
    """Step 1 for any path: the checkpoint model and its tree."""
    progress = progress or Progress()
    progress.start(2, "reading metadata")
    ckpt = open_checkpoint(path)
    progress.advance(1, "building the tree")
    return BrowseData(ckpt, build_tree(ckpt))


def analyse_any(data: BrowseData, progress: Progress | None = None) -> BrowseData:
    """Step 2: health, rank balance, heat map and small values; what the manifest says, by the file system."""
    data = analyse(data, progress)
    data.seal = quick_seal_summary(data.ckpt.path)
    return data


def stats_any(data: BrowseData, fqn: str, progress: Progress | None = None) -> Any:
    """Statistics of tensor ``fqn`` (the inspector's background job), read through the chunk reader; or the
    ``corrupt`` Problem when its bytes fail their stored CRC32, which the window adds to the checkpoint's health."""
    try:
        return value_stats(data.ckpt, fqn, progress)
    except CorruptChunkError as exc:
        return Problem("corrupt", str(exc), fqn=fqn, file=basename(exc.path) if exc.path else None)


def verify_contents_any(ckpt: Checkpoint, progress: Progress | None = None) -> tuple[list[Problem], str]:
    """The window's Verify contents (see :func:`..formats.registry.verify_sealed`, deep): every problem, and one
    line saying what the checkpoint's manifest proved."""
    problems, sealed = verify_sealed(ckpt, True, progress)
    return problems, sealed.summary()


__all__ = ["analyse_any", "load_any", "stats_any", "verify_contents_any"]
