"""What the Library window shows after one poll: the listing, the loss at each checkpoint's step, and what
the current prune rules would free. Made in a worker thread every few seconds (Qt-free)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..filenames import is_url
from ..progress import Progress
from .prune import Plan, Rules, make_plan
from .records import Listing
from .scan import scan
from .step_metrics import checkpoint_metrics


@dataclass(slots=True)
class LibrarySnapshot:
    """One scan of the library for the view: the listing, each checkpoint's loss, the rules' plan, missing roots."""

    listing: Listing
    metric: dict[str, float] = field(default_factory=dict)  # checkpoint path -> the loss at its step
    plan: Plan | None = None  # the rules' plan (for "what the rules would free")
    missing: list[str] = field(default_factory=list)  # roots that do not exist (now), or cannot be listed: why


LOSS_NAMES = ("loss", "train_loss", "val_loss")  # ours and HF's "loss"; Lightning's usual names


def take_snapshot(roots: list[str], rules: Rules | None = None, metrics: tuple[str, ...] = LOSS_NAMES,
                  progress: Progress | None = None) -> LibrarySnapshot:
    """Scan ``roots`` (missing ones are reported, not fatal), read the first of ``metrics`` each run logs at
    each checkpoint's step, and plan ``rules``."""
    listing = scan(roots, progress=progress, missing_ok=True)
    values: dict[str, float] = {}
    for run in listing.runs:
        for metric in metrics:
            found = checkpoint_metrics(run, metric)
            if found:
                values.update(found)
                break
    plan = None
    if rules is not None and (rules.has_keep_rule() or rules.incomplete):
        plan = make_plan(listing, rules)
    missing = [r for r in roots if not is_url(r) and not os.path.exists(os.path.expanduser(r))]
    missing += listing.unreachable
    return LibrarySnapshot(listing, values, plan, missing)
