"""A found checkpoint's record, and the name rules that classify a folder or file as one (its format, state,
writer ranks and step): shared by the local walker (:mod:`.scan`) and the URL walker (:mod:`.remote_scan`)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

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
HF_TRAINER_RE = re.compile(r"^(tmp-)?checkpoint-\d+$")
STEP_RES = (
    re.compile(r"(?:^|[^a-z])(?:global_)?step[_=\-]?(\d+)", re.IGNORECASE),  # step_000100 step-100 step=12000
    re.compile(r"(?:^|[^a-z])checkpoint[_\-](\d+)", re.IGNORECASE),  # checkpoint-500
    re.compile(r"(?:^|[^a-z])iter(?:ation)?[_\-]?(\d+)", re.IGNORECASE),  # iter_0000100
    re.compile(r"^(\d+)$"),  # Orbax-style checkpoints/100
)


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


RESUMABLE = "resumable"  # a run can resume from it: optimizer or trainer state beside the weights
WEIGHTS = "weights"  # a consolidated or exported model: often the deliverable, never a run's resume point
# formats that hold weights only (safetensors cannot hold an optimizer's state); a torch file is weights unless
# its pickle names an optimizer (torch_file_kind; a remote one is not read, so it stays weights: never removed
# without --weights, and never taking a resumable checkpoint's place)
WEIGHTS_FORMATS = frozenset({"hf-safetensors", "hf-sharded", "safetensors", "torch"})


@dataclass(slots=True)
class CheckpointRecord:
    """One checkpoint found on disk (a folder, or a consolidated file)."""

    path: str
    run: str
    step: int | None
    format: str  # dcp, dcp-safetensors, lightning, hf-safetensors, hf-sharded, hf-trainer, torch, safetensors, empty
    ranks: list[int]
    bytes: int  # on disk (st_blocks), all files of the checkpoint
    mtime: float  # the newest file's modification time
    state: str  # complete, incomplete, writing, unreadable
    reason: str = ""  # why it is not complete, in a sentence
    is_file: bool = False
    files: int = 0
    kind: str = ""  # resumable (training state: optimizer or trainer state beside the weights) or weights

    def __post_init__(self) -> None:
        if not self.kind:
            self.kind = WEIGHTS if self.format in WEIGHTS_FORMATS else RESUMABLE

    @property
    def name(self) -> str:
        """The checkpoint's folder or file name (last part of its path)."""
        return os.path.basename(self.path)

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict (path, run, step, format, ranks, bytes, mtime, state)."""
        return {"path": self.path, "run": self.run, "step": self.step, "format": self.format, "kind": self.kind,
                "ranks": list(self.ranks), "bytes": self.bytes, "mtime": self.mtime, "state": self.state}


def is_checkpoint_file(name: str) -> bool:
    """A consolidated checkpoint's file name (hidden names are temporaries of a writer)."""
    return not name.startswith(".") and (name.endswith(CONSOLIDATED_SUFFIXES) or
                                         (name.startswith("pytorch_model") and name.endswith(".bin")))


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


def folder_state(path: str, fmt: str, names: set[str], dirs: list[str], probe: bool = True
                 ) -> tuple[str, str, list[int]]:
    """(state, reason, writer ranks) of a checkpoint folder, from names and (``probe``: a local folder) a few
    header bytes."""
    ranks = sorted({int(m.group(1)) for n in names if (m := DATA_FILE_RE.match(n))})
    if fmt == "empty":
        return "incomplete", "an empty folder: a save that never wrote a file", []
    if fmt == "hf-safetensors":
        ranks = sorted({int(m.group(1)) - 1 for n in names if (m := HF_SHARD_RE.match(n))})
        return "complete", "", ranks
    if fmt == "hf-sharded":
        return (*_hf_index_state(path, names), []) if probe else ("complete", "", [])
    if fmt == "hf-trainer":
        ranks = _nested_ranks(path, dirs) if probe else []
        if os.path.basename(path).startswith("tmp-"):
            return "incomplete", "a tmp-checkpoint folder: the Trainer did not finish this save", ranks
        if "trainer_state.json" not in names:
            return "incomplete", "no trainer_state.json: the Trainer did not finish this save", ranks
        return "complete", "", ranks
    meta_ranks = {int(m.group(1)) for n in names if (m := RANK_METADATA_RE.match(n))}
    if ".metadata.tmp" in names:
        return "incomplete", "a .metadata.tmp is left: the save did not finish", ranks
    if ".metadata" in names and not probe:
        return "complete", "", ranks
    if ".metadata" in names:
        head = read_head(os.path.join(path, ".metadata"), 1)
        if head is None:
            return "unreadable", ".metadata cannot be read", ranks
        if head not in (b"\x80", b"{"):
            return "unreadable", ".metadata is empty or not DCP metadata", ranks
        return "complete", "", ranks
    if meta_ranks:
        missing = sorted(set(ranks) - meta_ranks)
        if missing:
            return "incomplete", f"rank(s) {missing} wrote data but no __R.metadata", sorted(set(ranks) | meta_ranks)
        return "complete", "", sorted(set(ranks) | meta_ranks)
    return "incomplete", "no .metadata: the save did not finish (the coordinator writes it last)", ranks


def _nested_ranks(path: str, dirs: list[str]) -> list[int]:
    """Writer ranks of DCP folders one level down (HF Trainer's ``pytorch_model_fsdp_0/``)."""
    ranks: set[int] = set()
    for d in dirs:
        try:
            names = os.listdir(os.path.join(path, d))
        except OSError:
            continue
        ranks.update(int(m.group(1)) for n in names if (m := DATA_FILE_RE.match(n)))
    return sorted(ranks)


def _hf_index_state(path: str, names: set[str]) -> tuple[str, str]:
    index = next(n for n in HF_INDEXES if n in names)
    try:
        with open(os.path.join(path, index), "rb") as f:
            data = json.loads(f.read(64 << 20))
        wanted = set((data.get("weight_map") or {}).values())
    except (OSError, ValueError, AttributeError):
        return "unreadable", f"{index} is not readable JSON"
    missing = sorted(n for n in wanted if not isinstance(n, str) or n not in names)
    if missing:
        return "incomplete", f"{len(missing)} shard file(s) named in {index} are missing (e.g. {missing[0]})"
    return "complete", ""


def read_head(path: str, n: int, offset: int = 0) -> bytes | None:
    """Up to ``n`` bytes of a file from ``offset`` (negative: from its end); None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            if offset < 0:
                f.seek(offset, os.SEEK_END)
            elif offset:
                f.seek(offset)
            return f.read(n)
    except OSError:
        return None
