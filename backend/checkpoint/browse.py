"""Everything the browser window shows for a checkpoint, computed in one background call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..progress import Progress
from .chunks import ChunkReader
from .layout import RankBalance, rank_balance, tensor_rank_bytes
from .model import Checkpoint, Problem
from .tree import TreeNode
from .values import small_value_repr, tensor_stats
from .verify import verify

SMALL_OBJECT_BYTES = 4096
MAX_OBJECT_VALUES = 2000


@dataclass
class BrowseData:
    """Filled in two steps: the tree as soon as the metadata is read (:func:`..compare.browse_file.load_any`),
    the analysis after."""

    ckpt: Checkpoint
    tree: TreeNode
    problems: list[Problem] | None = None
    balance: list[RankBalance] | None = None
    heat: tuple[list[int], np.ndarray] | None = None
    values: dict[str, str] | None = None  # small non-tensor values as text
    seal: str = ""  # what its manifest says by the file system's word (seal.quick_seal_summary)


def analyse(data: BrowseData, progress: Progress | None = None) -> BrowseData:
    """Step 2: health, rank balance, heat map and small values, filled into ``data``."""
    progress = progress or Progress()
    progress.start(3, "checking layout and files")
    problems = verify(data.ckpt)
    progress.advance(1, "rank balance")
    balance, heat = rank_balance(data.ckpt), tensor_rank_bytes(data.ckpt)
    progress.advance(1, "small values")
    values = small_values(data.ckpt)
    progress.advance(1, "done")
    data.problems, data.balance, data.heat, data.values = problems, balance, heat, values
    return data


def small_values(ckpt: Checkpoint) -> dict[str, str]:
    """Small non-tensor values as short text (the tree's value column); undecodable ones say so."""
    out: dict[str, str] = {}
    missing = {f.name for f in ckpt.files if f.bytes is None}
    with ChunkReader(ckpt) as reader:
        for o in ckpt.objects[:MAX_OBJECT_VALUES]:
            if o.inline:  # read with the file's header or pickle
                out[o.fqn] = small_value_repr(o.value, 60)
            elif o.file and o.file not in missing and o.length <= SMALL_OBJECT_BYTES:
                try:
                    out[o.fqn] = small_value_repr(reader.read_object(o), 60)
                except CheckpointError:
                    out[o.fqn] = "(not decodable safely)"
    return out


def value_stats(ckpt: Checkpoint, fqn: str, progress: Progress | None = None) -> Any:
    """Load one tensor's values and compute statistics (the inspector's background job)."""
    with ChunkReader(ckpt) as reader:
        tensor = reader.read_tensor(ckpt.tensor(fqn), progress)
    return tensor_stats(tensor, progress=progress)
