"""What an export will write, computed from the metadata alone (keys, dtypes, shapes, sizes)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..checkpoint.model import FLOAT_DTYPES, Checkpoint, ObjectEntry, TensorEntry, itemsize
from ..errors import ShardscopeError

DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                 "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32"}
FORMATS = ("safetensors", "torch")


class ExportError(ShardscopeError):
    pass


@dataclass(slots=True)
class ExportItem:
    key: str  # name in the output
    entry: TensorEntry
    dtype: str  # output dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.entry.shape) * itemsize(self.dtype)


@dataclass
class ExportPlan:
    ckpt: Checkpoint
    format: str
    items: list[ExportItem]
    objects: list[tuple[str, ObjectEntry]]  # (output key, entry)
    left_out: list[str] = field(default_factory=list)  # human-readable notes
    max_shard_size: int | None = None
    include_meta: bool = False  # Lightning meta.pt merged into a torch export

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.items)


def format_for(dst: str, fmt: str | None, max_shard_size: int | None) -> str:
    if fmt:
        if fmt not in FORMATS:
            raise ExportError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}.")
        return fmt
    ext = os.path.splitext(dst)[1].lower()
    if ext == ".safetensors" or max_shard_size:
        return "safetensors"
    if ext in (".pt", ".pth", ".bin", ".ckpt"):
        return "torch"
    raise ExportError(f"{dst}: cannot tell the format from the name; end it in .safetensors or .pt "
                      "(or give --format), or give --max-shard-size for a sharded safetensors folder.")


def plan_export(ckpt: Checkpoint, fmt: str, only: list[str] | None = None, strip_prefix: str | None = None,
                dtype: str | None = None, max_shard_size: int | None = None) -> ExportPlan:
    out_dtype = None
    if dtype:
        out_dtype = DTYPE_ALIASES.get(dtype.lower())
        if out_dtype is None:
            raise ExportError(f"--dtype {dtype}: use bf16, fp16 or fp32.")
    prefixes = [p.rstrip(".") for p in (only or [])]
    if not prefixes and fmt == "safetensors" and any(t.fqn.startswith("model.") for t in ckpt.tensors):
        prefixes = ["model"]

    def wanted(fqn: str) -> bool:
        return not prefixes or any(fqn == p or fqn.startswith(p + ".") for p in prefixes)

    def out_key(fqn: str) -> str:
        if strip_prefix and fqn.startswith(strip_prefix):
            return fqn[len(strip_prefix):]
        return fqn

    plan = ExportPlan(ckpt, fmt, [], [], max_shard_size=max_shard_size)
    skipped = [t.fqn for t in ckpt.tensors if not wanted(t.fqn)]
    if skipped:
        plan.left_out.append(f"{len(skipped)} tensors outside {', '.join(prefixes)} (e.g. {skipped[0]})")
    skipped_objects = [o.fqn for o in ckpt.objects if not wanted(o.fqn)]
    if skipped_objects:
        plan.left_out.append(f"{len(skipped_objects)} non-tensor entries outside {', '.join(prefixes)} "
                             f"(e.g. {skipped_objects[0]})")
    seen: dict[str, str] = {}
    for t in ckpt.tensors:
        if not wanted(t.fqn):
            continue
        key = out_key(t.fqn)
        if key in seen:
            raise ExportError(f"{t.fqn} and {seen[key]} both become {key!r} after --strip-prefix.")
        seen[key] = t.fqn
        d = out_dtype if (out_dtype and t.dtype in FLOAT_DTYPES) else t.dtype
        plan.items.append(ExportItem(key, t, d))
    for o in ckpt.objects:
        if wanted(o.fqn):
            plan.objects.append((out_key(o.fqn), o))
    if not plan.items and not plan.objects:
        raise ExportError(f"{ckpt.path}: nothing to export{' under ' + ', '.join(prefixes) if prefixes else ''}.")
    plan.include_meta = fmt == "torch" and bool(ckpt.extra_files.get("meta.pt")) and not only
    return plan
