"""The checkpoint library: every checkpoint under some roots, grouped by run, and pruning by rules.

Qt-free; the ``ls`` and ``prune`` subcommands and the Library window use it. Names are imported when first used
(PEP 562): ``ls`` needs the scan, not the pruning (a few tens of milliseconds of every listing's start).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"Plan": "prune", "Rules": "prune", "execute": "prune", "finish_leftovers": "prune", "make_plan": "prune",
          "parse_age": "prune", "CheckpointRecord": "records", "Leftover": "records", "Listing": "records",
          "RunRecord": "records", "scan": "scan"}

__all__ = ["CheckpointRecord", "Leftover", "Listing", "Plan", "Rules", "RunRecord", "execute", "finish_leftovers",
           "make_plan", "parse_age", "scan"]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
