"""The checkpoint library: every checkpoint under some roots, grouped by run, and pruning by rules.

Qt-free; the ``ls`` and ``prune`` subcommands and the Library window use it. Names are imported when first used
(PEP 562): ``ls`` needs the scan, not the pruning (a few tens of milliseconds of every listing's start).
"""

from __future__ import annotations

import importlib
from typing import Any

from .records import CheckpointRecord, Leftover, Listing, RunRecord
from .scan import scan  # NOTE: eager: the function shadows its submodule's name, as the package attribute

_LAZY = {"Plan", "Rules", "execute", "finish_leftovers", "make_plan", "parse_age"}  # of .prune

__all__ = ["CheckpointRecord", "Leftover", "Listing", "Plan", "Rules", "RunRecord", "execute", "finish_leftovers",
           "make_plan", "parse_age", "scan"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.prune"), name)
    globals()[name] = value
    return value
