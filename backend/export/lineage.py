"""What an export records of its source in its lineage sidecar (:mod:`..lineage`): the checkpoint's path, its
step and run as the library sees them (the same walk ``ls`` does, on that one checkpoint), its format, and its
identity when the export read it."""

from __future__ import annotations

import os
from typing import Any

from ..filenames import basename, is_url, step_from_name
from ..lineage import identity, make_sidecar, sidecar_bytes


def _library_record(path: str) -> Any:
    """The library's record of the checkpoint at ``path`` (its step and run), or None when the walk finds it
    as no single checkpoint (a DeepSpeed save folder of several tags, say)."""
    from ..library.scan import scan

    listing = scan([path], missing_ok=True)
    return listing.find(os.path.realpath(path))


def describe_source(src: str, fmt: str = "") -> dict[str, Any]:
    """The source part of a sidecar for the checkpoint at ``src`` (a local path or a URL). ``fmt``: the format
    it was opened as, when known."""
    name = basename(src)
    step = step_from_name(name)
    if is_url(src):
        return {"path": src, "name": name, "step": step, "run": "", "format": fmt, "identity": None}
    path = os.path.realpath(src)
    rec = _library_record(path)
    if rec is not None:
        step = step if step is not None else rec.step
    try:
        ident = identity(path)
    except OSError:  # a describing file that cannot be read: the export goes on, its source's identity unknown
        ident = None
    return {"path": path, "name": name, "step": step, "run": rec.run if rec is not None else os.path.dirname(path),
            "format": fmt or (rec.format if rec is not None else ""), "identity": ident}


def lineage_for(src: str, export_format: str, fmt: str = "") -> bytes:
    """The sidecar bytes of an export of ``src`` to ``export_format``."""
    return sidecar_bytes(make_sidecar(describe_source(src, fmt), export_format))


__all__ = ["describe_source", "lineage_for"]
