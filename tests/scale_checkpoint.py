"""A DCP checkpoint at scale for the window: 2,000 tensors saved by 512 FSDP2 ranks, written in seconds.

``.metadata`` is written with torch's own classes (as ``dcp.save`` does; see benchmarks/metadata_open.py),
with FSDP2's row-wise ``torch.chunk`` layout: a tensor with fewer rows than ranks lands on the first
ranks only, so ranks 0-127 write about 20x more than the rest (the imbalance real FSDP2 runs show with
small layers). Every item of the first layer (``model.layers.0.*``) is a real ``torch.save`` archive,
so its values load; the other items are holes of the right length in the ``__R_0.distcp`` files
(layout, balance and health are exact; their values are not readable).

    python tests/scale_checkpoint.py OUTDIR [--ranks 512] [--layers 250]
"""

from __future__ import annotations

import argparse
import io
import math
import os
import pickle
from pathlib import Path


def shapes(dim: int) -> dict[str, tuple[int, ...]]:
    """One layer's tensors (FSDP2 splits dim 0 over the ranks)."""
    return {"attn.q.weight": (dim, 4 * dim), "attn.k.weight": (dim, 4 * dim), "attn.v.weight": (dim, 4 * dim),
            "attn.o.weight": (dim, 4 * dim), "mlp.up.weight": (4 * dim, dim), "mlp.down.weight": (dim, 4 * dim),
            "norm1.weight": (dim,), "norm2.weight": (dim,)}


def _archive(piece) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(piece.clone(), buf)
    return buf.getvalue()


def write_scale_checkpoint(folder: Path, ranks: int = 512, layers: int = 250, dim: int = 128,
                           real_layers: int = 1) -> Path:
    """Write the checkpoint into ``folder`` (created); returns it. ``layers`` x 8 tensors plus an
    embedding that every rank holds a piece of; ``dim`` sets how many ranks the layers reach."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    folder.mkdir(parents=True, exist_ok=True)
    files = [open(folder / f"__{r}_0.distcp", "wb") for r in range(ranks)]
    sdm, storage = {}, {}
    sizes: dict[tuple, int] = {}  # archive length per chunk shape (same shape, same length)
    gen = torch.Generator().manual_seed(0)
    try:
        tensors = [("model.embed.weight", (8 * ranks, dim), True)]
        tensors += [(f"model.layers.{layer}.{name}", shape, layer < real_layers)
                    for layer in range(layers) for name, shape in shapes(dim).items()]
        for fqn, shape, is_real in tensors:
            real = torch.randn(shape, generator=gen) * 0.02 if is_real else None
            per = math.ceil(shape[0] / ranks)
            chunks = []
            for r in range(ranks):
                start, stop = r * per, min(shape[0], (r + 1) * per)
                if stop <= start:
                    break
                csize = (stop - start, *shape[1:])
                offsets = (start,) + (0,) * (len(shape) - 1)
                meta = ChunkStorageMetadata(torch.Size(offsets), torch.Size(csize))
                chunks.append(meta)
                f = files[r]
                pos = f.tell()
                if real is not None:
                    data = _archive(real[start:stop])
                    sizes.setdefault(csize, len(data))
                    f.write(data)
                else:
                    if csize not in sizes:
                        sizes[csize] = len(_archive(torch.zeros(csize)))
                    f.seek(pos + sizes[csize])  # a hole of the item's length
                storage[MetadataIndex(fqn, meta.offsets)] = _StorageInfo(f.name.rsplit("/", 1)[-1], pos,
                                                                        f.tell() - pos)
            sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)
    finally:
        for f in files:
            f.truncate(f.tell())
            f.close()
    md = Metadata(sdm, planner_data={k: tuple(k.split(".")) for k in sdm}, storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id=str(folder), save_id="scale-fixture"), version="1.0.0")
    tmp = folder / ".metadata.writing"
    with open(tmp, "wb") as f:
        pickle.dump(md, f)  # written with torch's classes, as dcp.save does
    os.replace(tmp, folder / ".metadata")
    return folder


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--layers", type=int, default=250)
    ap.add_argument("--dim", type=int, default=128)
    a = ap.parse_args()
    print(write_scale_checkpoint(a.outdir, a.ranks, a.layers, a.dim))
