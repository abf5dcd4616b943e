"""Where a library walk looks and what it skips (the checkpoint file-name rules themselves are
:mod:`..filenames`', the formats' ``detect`` decides what a folder or file is)."""

from __future__ import annotations

from ..filenames import CHECKPOINT_HOLDERS, is_url, step_from_name, within

WRITING_SECONDS = 5.0  # files changed this recently are still being written
SKIP_DIRS = {"__pycache__", "node_modules", "site-packages", "wandb", "tensorboard"}
RUN_SKIP_DIRS = {"metrics", "logs", "exit"}
MAX_DEPTH = 24

__all__ = ["CHECKPOINT_HOLDERS", "MAX_DEPTH", "RUN_SKIP_DIRS", "SKIP_DIRS", "WRITING_SECONDS", "is_url",
           "step_from_name", "within"]
