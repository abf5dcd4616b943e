"""What torch's own readers say about a checkpoint, for comparisons (trusted fixtures only)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict


def torch_metadata(path: Path, rank: int | None = None):
    reader = FileSystemReader(str(path))
    return reader.read_metadata(rank=rank) if rank is not None else reader.read_metadata()


def torch_flat_tensors(path: Path) -> dict[str, tuple]:
    """fqn -> (dtype name, shape, sorted [(offsets, sizes, file, offset, length)])."""
    md = torch_metadata(path)
    out = {}
    for fqn, tm in md.state_dict_metadata.items():
        if not isinstance(tm, TensorStorageMetadata):
            continue
        chunks = []
        for c in tm.chunks:
            for idx, info in md.storage_data.items():
                if idx.fqn == fqn and tuple(idx.offset) == tuple(c.offsets):
                    chunks.append((tuple(c.offsets), tuple(c.sizes), info.relative_path, info.offset, info.length))
        out[fqn] = (str(tm.properties.dtype).removeprefix("torch."), tuple(tm.size), sorted(chunks))
    return out


def torch_consolidated(path: Path) -> dict:
    """What torch's dcp_to_torch_save would save for this folder (the nested state dict)."""
    sd: dict = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return sd


def flatten(d, prefix=""):
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = d
    return out


__all__ = ["flatten", "torch", "torch_consolidated", "torch_flat_tensors", "torch_metadata"]
