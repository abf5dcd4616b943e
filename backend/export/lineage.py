"""What an export records of its source in its lineage sidecar (:mod:`..lineage`): the checkpoint's path, its
step and run as the library sees them (the same walk ``ls`` does, on that one checkpoint), its format, and its
identity when the export read it. (Step and run by the library's rules, without its walk: export sits below the
library.)"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ShardscopeError
from ..filenames import CHECKPOINT_HOLDERS, basename, is_url, lineage_sidecar, step_from_name
from ..formats import probe
from ..lineage import identity, make_sidecar, read_lineage


def _run_of(path: str) -> str:
    """The run a checkpoint belongs to, by the library's rule: the folder holding it, or the one above a
    ``checkpoints/`` folder."""
    parent = os.path.dirname(path.rstrip(os.sep))
    if os.path.basename(parent).lower() in CHECKPOINT_HOLDERS:
        parent = os.path.dirname(parent)
    return parent


def describe_source(src: str, fmt: str = "") -> dict[str, Any]:
    """The source part of a sidecar for the checkpoint at ``src`` (a local path or a URL). ``fmt``: the format
    it was opened as, when known."""
    name = basename(src)
    step = step_from_name(name)
    if is_url(src):
        return {"path": src, "name": name, "step": step, "run": "", "format": fmt, "identity": None}
    path = os.path.realpath(src)
    try:
        facts = probe(path)  # the formats' listing probe: a step a Trainer's state names, the format's variant
    except (ShardscopeError, OSError):
        facts = None
    if step is None and facts is not None:
        step = facts.step
    if step is None:  # an export of an export: the step its own sidecar records
        earlier = read_lineage(lineage_sidecar(path, os.path.isdir(path)))
        step = earlier.step if earlier is not None else None
    try:
        ident = identity(path)
    except OSError:  # a describing file that cannot be read: the export goes on, its source's identity unknown
        ident = None
    return {"path": path, "name": name, "step": step, "run": _run_of(path),
            "format": fmt or (facts.format if facts is not None else ""), "identity": ident}


def lineage_for(src: str, export_format: str, fmt: str = "", model: dict | None = None) -> dict[str, Any]:
    """The sidecar document of an export of ``src`` to ``export_format`` (:class:`~.atomic.AtomicOutput` adds
    the names a folder export wrote, and writes it); ``model``: a Hugging Face model export's architecture and
    every transform it applied, recorded under ``model``."""
    doc = make_sidecar(describe_source(src, fmt), export_format)
    if model is not None:
        doc["model"] = model
    return doc


__all__ = ["describe_source", "lineage_for"]
