"""transformers Trainer checkpoints (``checkpoint-500/``: the model's weights, ``optimizer.pt``, ``scheduler.pt``,
``rng_state.pth`` and ``trainer_state.json``; with FSDP, DCP folders ``pytorch_model_fsdp_0/`` and ``optimizer_0/``
inside). Listed as one resumable checkpoint; opened as its weights, or pointed into its DCP folders."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..errors import CheckpointError
from ..filenames import (
    ACCELERATE_MODEL_DIR,
    DATA_FILE_RE,
    HF_TRAINER_RE,
    HF_TRAINER_STATE,
    METADATA,
    SAFETENSORS_INDEX,
    SAFETENSORS_SUFFIX,
)
from . import dcp, hf_folder, hf_index
from .base import RESUMABLE, Facts, FileNames, Format, StorageOptions, Target

if TYPE_CHECKING:
    from ..checkpoint.model import Checkpoint
    from ..progress import Progress

MAX_STATE_BYTES = 64 << 20


class HfTrainerFormat(Format):
    name = "hf-trainer"
    label = "Hugging Face Trainer checkpoint"

    def detect_folder(self, name: str, files: FileNames, dirs: list[str]) -> bool:
        return HF_TRAINER_STATE in files or bool(HF_TRAINER_RE.match(name) and (files or dirs))

    def opens_folder(self, name: str, files: FileNames, dirs: list[str]) -> bool:
        """accelerate's ``save_state`` folder (no ``trainer_state.json``, any name): its model's DCP folder
        ``pytorch_model_fsdp_0/`` beside ``optimizer_0/``."""
        return any(ACCELERATE_MODEL_DIR.match(d) for d in dirs)

    def probe_folder(self, path: str, names: set[str], dirs: list[str], local: bool = True) -> Facts:
        ranks = _nested_ranks(path, dirs) if local else []
        step = trainer_state_step(os.path.join(path, HF_TRAINER_STATE)) \
            if local and HF_TRAINER_STATE in names else None
        if os.path.basename(path.rstrip("/")).startswith("tmp-"):
            return Facts(self.name, "incomplete", "a tmp-checkpoint folder: the Trainer did not finish this save",
                         ranks, RESUMABLE, step)
        if HF_TRAINER_STATE not in names:
            return Facts(self.name, "incomplete", "no trainer_state.json: the Trainer did not finish this save",
                         ranks, RESUMABLE, step)
        return Facts(self.name, "complete", "", ranks, RESUMABLE, step)

    def open(self, path: Target, storage_options: StorageOptions | None = None, use_cache: bool = True,
             progress: Progress | None = None) -> Checkpoint:
        from ..checkpoint.storage import open_folder

        folder = open_folder(path, storage_options)
        listing = folder.listing()
        if SAFETENSORS_INDEX in listing:
            ckpt = hf_index.FORMAT.open(folder, storage_options, use_cache, progress)
        elif _has_safetensors(listing):
            ckpt = hf_folder.FORMAT.open(folder, storage_options, use_cache, progress)
        elif (model := self.model_folder(folder.path)[0]) != folder.path:  # with FSDP: the model's DCP folder
            return dcp.FORMAT.open(model, storage_options, use_cache, progress)
        else:
            raise CheckpointError(f"{folder.path}: a Trainer checkpoint without safetensors weights here: open "
                                  "the DCP folder or the file inside it that holds what you want.", path=folder.path)
        ckpt.format = self.name
        return ckpt

    def model_folder(self, path: str) -> tuple[str, str | None]:
        """With FSDP (no safetensors weights beside it): the model's DCP folder, and a note naming what is left
        out (the optimizer's folder, random states) and any other model's folder."""
        models = model_folders(path)
        if not models or _has_safetensors(os.listdir(path)):
            return path, None
        others = sorted(n for n in os.listdir(path) if n not in models and not n.startswith("."))
        note = (f"accelerate FSDP folder: exporting {models[0]}/"
                + (f"; left out {', '.join(others[:6])}{' ...' if len(others) > 6 else ''}" if others else "")
                + (f"; other models: {', '.join(models[1:])}" if len(models) > 1 else ""))
        return os.path.join(path, models[0]), note


def _has_safetensors(names: Iterable[str]) -> bool:
    """Weights this format opens in place: an index or safetensors files."""
    return any(n == SAFETENSORS_INDEX or n.endswith(SAFETENSORS_SUFFIX) for n in names)


def model_folders(path: str) -> list[str]:
    """The model's DCP folders (``pytorch_model_fsdp_0/`` with its ``.metadata``) in a local HF Trainer or
    accelerate FSDP checkpoint folder, by name; [] for a URL or a folder without one."""
    if "://" in path or not os.path.isdir(path):
        return []
    return sorted(n for n in os.listdir(path) if ACCELERATE_MODEL_DIR.match(n)
                  and os.path.exists(os.path.join(path, n, METADATA)))


def _nested_ranks(path: str, dirs: list[str]) -> list[int]:
    """Writer ranks of DCP folders one level down (``pytorch_model_fsdp_0/``)."""
    ranks: set[int] = set()
    for d in dirs:
        try:
            names = os.listdir(os.path.join(path, d))
        except OSError:
            continue
        ranks.update(int(m.group(1)) for n in names if (m := DATA_FILE_RE.match(n)))
    return sorted(ranks)


def trainer_state_step(path: str) -> int | None:
    """``global_step`` of a Trainer's ``trainer_state.json``, or None."""
    try:
        if os.path.getsize(path) > MAX_STATE_BYTES:
            return None
        with open(path, "rb") as f:
            step = json.load(f).get("global_step")
        return int(step) if isinstance(step, int) else None
    except (OSError, ValueError, AttributeError, RecursionError):
        return None


FORMAT = HfTrainerFormat()
