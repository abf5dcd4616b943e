"""The checkpoint library: every checkpoint under some roots, grouped by run, and pruning by rules.

Qt-free; the ``ls`` and ``prune`` subcommands and the Library window use it.
"""

from .prune import Plan, Rules, execute, finish_leftovers, make_plan, parse_age
from .records import CheckpointRecord, Leftover, Listing, RunRecord
from .scan import scan

__all__ = ["CheckpointRecord", "Leftover", "Listing", "Plan", "Rules", "RunRecord", "execute", "finish_leftovers",
           "make_plan", "parse_age", "scan"]
