"""DeepSpeed checkpoints by their names alone: the files ``engine.save_checkpoint`` writes into a tag folder, the
save folder around it (``latest`` names the tag) and the tag itself. Imports neither numpy nor torch (for
``ls``-cheap detection); :mod:`.checkpoint.deepspeed_state` reads what the files hold."""

from __future__ import annotations

import re
from collections.abc import Iterable

# ZeRO-0/1/2: one model file per model-parallel rank; ZeRO-3: one per data-parallel rank too
MODEL_FILE_RE = re.compile(r"(?:zero_pp_rank_([0-9]+)_)?mp_rank_([0-9]+)_model_states\.pt\Z")
# the optimizer partitions, one per data-parallel rank (bf16_ while bf16 is enabled, fp16_ from old releases)
OPTIM_FILE_RE = re.compile(r"(bf16_|fp16_)?zero_pp_rank_([0-9]+)_mp_rank_([0-9]+)_optim_states\.pt\Z")
LATEST = "latest"  # the save folder's file that names the newest tag
RECOVERY_SCRIPT = "zero_to_fp32.py"  # rank 0 copies it into the save folder
STEP_TAG_RE = re.compile(r"global_step[0-9]+\Z")  # the tag DeepSpeed gives a save by default
MAX_TAG = 255


def model_file(name: str) -> tuple[int | None, int] | None:
    """(data-parallel rank or None below ZeRO-3, model-parallel rank) of a model-states file name, else None."""
    m = MODEL_FILE_RE.match(name)
    return None if m is None else (None if m.group(1) is None else int(m.group(1)), int(m.group(2)))


def optim_file(name: str) -> tuple[str, int, int] | None:
    """(prefix: '', 'bf16_' or 'fp16_', data-parallel rank, model-parallel rank) of an optimizer-states file name."""
    m = OPTIM_FILE_RE.match(name)
    return None if m is None else (m.group(1) or "", int(m.group(2)), int(m.group(3)))


def is_deepspeed_step_folder(file_names: Iterable[str]) -> bool:
    """A tag folder (``global_step2/``): it holds a model-states file (every DeepSpeed save writes one)."""
    return any(MODEL_FILE_RE.match(n) for n in file_names)


def is_deepspeed_save_dir(file_names: Iterable[str], dir_names: Iterable[str]) -> bool:
    """The folder ``save_checkpoint`` was given: a ``latest`` file or the recovery script beside tag folders
    (``global_stepN`` by default; a ``latest`` file with any folder counts too, as tags may be named freely)."""
    files, dirs = set(file_names), list(dir_names)
    if LATEST in files and dirs:
        return True
    return RECOVERY_SCRIPT in files and any(STEP_TAG_RE.match(d) for d in dirs)


def parse_latest(text: bytes) -> str | None:
    """The tag a ``latest`` file names, or None when it is not one plain folder name (no separator, not ``.``
    or ``..``, printable, at most 255 characters): a tag never leads outside the save folder."""
    try:
        tag = text.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    if not tag or len(tag) > MAX_TAG or tag in (".", "..") or not tag.isprintable() or \
            any(c in tag for c in "/\\\x00"):
        return None
    return tag


__all__ = ["LATEST", "MODEL_FILE_RE", "OPTIM_FILE_RE", "is_deepspeed_save_dir", "is_deepspeed_step_folder",
           "model_file", "optim_file", "parse_latest"]
