"""What an export will write (``planner.plan_export`` computes it from the metadata alone: keys, dtypes,
shapes, sizes). A plan is never changed by the writers; what they find at write time goes into the result."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..checkpoint.model import Checkpoint, ObjectEntry, TensorEntry, itemsize
from ..errors import ShardscopeError
from .hf_transforms import Transform
from .layouts import Layout


class ExportError(ShardscopeError):
    """Bad export options or an output that cannot be written (one line, exit 2)."""


@dataclass(frozen=True, slots=True)
class ExportItem:
    """One output tensor: its name in the output, the source entry, the output dtype, and the exact transform that
    makes it from the source tensor (``hf_transforms.Transform``; None: the source tensor as stored)."""

    key: str
    entry: TensorEntry
    dtype: str
    transform: Transform | None = None
    shape: tuple[int, ...] = field(init=False, compare=False)  # of the output tensor
    nbytes: int = field(init=False, compare=False)  # size of the output tensor at the output dtype

    def __post_init__(self) -> None:
        # NOTE: worked out once: the writers ask for it millions of times in an export of 300,000 tensors
        shape = self.transform.shape(self.entry.shape) if self.transform else self.entry.shape
        object.__setattr__(self, "shape", tuple(shape))
        object.__setattr__(self, "nbytes", math.prod(shape) * itemsize(self.dtype))


@dataclass(frozen=True)
class ExportPlan:
    """What goes where. ``keys_renamed``: output keys differ from the stored names, so a torch
    export writes a flat dict instead of the nested one ``dcp_to_torch_save`` would."""

    ckpt: Checkpoint
    format: str
    items: tuple[ExportItem, ...]
    objects: tuple[tuple[str, ObjectEntry], ...]  # (output key, entry)
    layout: Layout
    left_out: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    max_shard_size: int | None = None
    include_meta: bool = False  # Lightning meta.pt merged into a torch export
    keys_renamed: bool = False
    config_file: str | None = None  # copied next to a sharded safetensors export
    config_text: str | None = None  # a Hugging Face model export's config.json, as written
    model: dict | None = None  # a Hugging Face model export: its architecture and transforms (the lineage sidecar)
    record_source: bool = False  # put the source path into the output's metadata

    @property
    def total_bytes(self) -> int:
        """Bytes of all output tensors together, at their output dtypes."""
        return sum(i.nbytes for i in self.items)

    def need_bytes(self) -> int:
        """Free space the output needs: tensors, non-tensor entries, headers and the archive directory."""
        return (self.total_bytes + sum(o.length for _, o in self.objects) + 512 * (len(self.items) + 1)
                + (1 << 20))


__all__ = ["ExportError", "ExportItem", "ExportPlan"]
