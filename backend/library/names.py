"""Where a library walk looks and what it skips (the checkpoint file-name rules themselves are
:mod:`..filenames`', the formats' ``detect`` decides what a folder or file is)."""

from __future__ import annotations

import os

from ..filenames import CHECKPOINT_HOLDERS, is_url, step_from_name, within

WRITING_SECONDS = 5.0  # files changed this recently are still being written
SKIP_DIRS = {"__pycache__", "node_modules", "site-packages", "wandb", "tensorboard"}
RUN_SKIP_DIRS = {"metrics", "logs", "exit"}
MAX_DEPTH = 24


def run_name(path: str) -> str:
    """The name of the run a checkpoint at ``path`` belongs to, from the path alone: the folder holding it, or the
    one above a ``checkpoints/`` folder ("" at the top)."""
    parent = os.path.dirname(path.rstrip("/" + os.sep))
    if os.path.basename(parent).lower() in CHECKPOINT_HOLDERS:
        parent = os.path.dirname(parent)
    return os.path.basename(parent)


__all__ = ["CHECKPOINT_HOLDERS", "MAX_DEPTH", "RUN_SKIP_DIRS", "SKIP_DIRS", "WRITING_SECONDS", "is_url",
           "run_name", "step_from_name", "within"]
