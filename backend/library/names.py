"""Checkpoints by their names alone: which folder or file is one, its format and step, which folders a listing
skips. Cheap enough for ``ls`` (no numpy or torch import); shared by the local and the remote listing."""

from __future__ import annotations

import os
import re
from typing import Any

WRITING_SECONDS = 5.0  # files changed this recently are still being written
CONSOLIDATED_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors")
CHECKPOINT_HOLDERS = {"checkpoints", "checkpoint", "ckpt", "ckpts"}
SKIP_DIRS = {"__pycache__", "node_modules", "site-packages", "wandb", "tensorboard"}
RUN_SKIP_DIRS = {"metrics", "logs", "exit"}
# The names torch's FileSystemWriter gives (as in checkpoint.reader; repeated here so that a listing does not
# import numpy and the checkpoint model: 0.3 s of the 1 s an `ls` takes).
DATA_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
RANK_METADATA_RE = re.compile(r"^__(\d+)\.metadata$")
HF_SHARD_RE = re.compile(r"^shard-(\d+)-.*\.safetensors$")
HF_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
URL_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")
MP_RANK_RE = re.compile(r"^mp_rank_(\d+)")  # Megatron-LM's per-model-parallel-rank folders
HF_TRAINER_RE = re.compile(r"^(tmp-)?checkpoint-\d+$")
STEP_RES = (
    re.compile(r"(?:^|[^a-z])(?:global_)?step[_=\-]?(\d+)", re.IGNORECASE),  # step_000100 step-100 step=12000
    re.compile(r"(?:^|[^a-z])checkpoint[_\-](\d+)", re.IGNORECASE),  # checkpoint-500
    re.compile(r"(?:^|[^a-z])iter(?:ation)?[_\-]?(\d+)", re.IGNORECASE),  # iter_0000100
    re.compile(r"^(\d+)$"),  # Orbax-style checkpoints/100
)
MAX_DEPTH = 24


def step_from_name(name: str) -> int | None:
    """The training step a checkpoint's name states (``epoch=3-step=12000.ckpt`` -> 12000), or None."""
    stem = name
    for suffix in CONSOLIDATED_SUFFIXES:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    for pattern in STEP_RES:
        m = pattern.search(stem)
        if m:
            return int(m.group(1))
    return None


def is_checkpoint_file(name: str) -> bool:
    """A consolidated checkpoint's file name (hidden names are temporaries of a writer)."""
    return not name.startswith(".") and (name.endswith(CONSOLIDATED_SUFFIXES) or
                                         (name.startswith("pytorch_model") and name.endswith(".bin")))



def is_url(path: str) -> bool:
    """``scheme://...`` other than ``file://`` (as checkpoint.remote decides; here without importing numpy)."""
    m = URL_RE.match(path)
    return bool(m) and m.group(1) != "file"


def within(path: str, root: str) -> bool:
    """True when ``path`` is ``root`` itself or lies inside it (whole path parts, not a string prefix)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)



def classify_folder(name: str, files: dict[str, Any] | set[str], dirs: list[str]) -> str | None:
    """The format of a checkpoint folder from its file names, or None when it is not one."""
    if any(n.endswith(".distcp") for n in files) or ".metadata" in files or ".metadata.tmp" in files or \
            any(RANK_METADATA_RE.match(n) for n in files):
        if "meta.pt" in files:
            return "lightning"
        if any(HF_SHARD_RE.match(n) for n in files):
            return "hf-safetensors"
        return "dcp"
    if any(HF_SHARD_RE.match(n) for n in files):
        return "hf-safetensors"
    if "trainer_state.json" in files or (HF_TRAINER_RE.match(name) and (files or dirs)):
        return "hf-trainer"
    if any(n in files for n in HF_INDEXES):
        return "hf-sharded"
    if not files and not dirs and step_from_name(name) is not None:
        return "empty"
    return None
