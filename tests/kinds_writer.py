"""The checkpoint kinds the fixtures lack, for tests/test_checkpoint_kinds.py, written by torch itself:
DTensors sharded on dim 1 and over 2-D meshes (FSDP+TP), uneven and zero-size shards, every dtype including float8 and
uint16/32, 0-dim and empty tensors, non-tensor objects of many kinds (io.BytesIO too), long and unicode
names, ``_extra_state``, ``dcp.async_save``, optimizer states, ``thread_count > 1``; and hostile folders.

Run as ``python tests/kinds_writer.py OUTDIR`` to write the healthy ones (the test module's fixture does, then
calls :func:`write_hostile`).
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

HERE = Path(__file__).parent
SPAWNED = ("dtensor", "async", "threads")  # written together by one 4-rank gloo run
SINGLE = ("dtypes", "objects", "names", "extra_state", "optim")  # dcp.save(no_dist=True)
RTL_NAME = "model.rtl\u202eevil.w"


# ------------------------------------------------------------------ writing (also runs in spawned ranks)
def _dtensor_state() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.randn(6, 10, generator=torch.Generator().manual_seed(7))
    mesh = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {
        "col": distribute_tensor(full, mesh, [Shard(1)]),  # 10 columns over 4 ranks: 3, 3, 3, 1
        "tiny_rows": distribute_tensor(torch.arange(15.0).reshape(3, 5), mesh, [Shard(0)]),  # rank 3: 0 rows
        "narrow_cols": distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(1)]),  # 2 ranks: 0 columns
        "tiny_2d": distribute_tensor(torch.arange(3.0).reshape(1, 3), mesh2, [Shard(0), Shard(1)]),  # 1 row, 2x2
        "rep": distribute_tensor(torch.arange(7.0), mesh, [Replicate()]),
        "sr": distribute_tensor(full, mesh2, [Shard(0), Replicate()]),
        "ss": distribute_tensor(full, mesh2, [Shard(0), Shard(1)]),
        "s00": distribute_tensor(torch.arange(40.0).reshape(8, 5), mesh2, [Shard(0), Shard(0)]),
        "rs": distribute_tensor(full, mesh2, [Replicate(), Shard(1)]),
        "fsdp_tp": _fsdp_tp(mesh2),
    }


def _fsdp_tp(mesh2) -> dict:
    """A tensor-parallel MLP sharded again by FSDP2 on the other mesh dimension (_StridedShard placements)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(3)
    m = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 6))
    parallelize_module(m, mesh2["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(m, mesh=mesh2["dp"])
    return m.state_dict()


def _rank(rank: int, world: int, store: str, root: str) -> None:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        dcp.save(_dtensor_state(), checkpoint_id=os.path.join(root, "dtensor"))
        dcp.async_save({"w": torch.arange(12.0).reshape(4, 3), "step": 5},
                       checkpoint_id=os.path.join(root, "async")).result()
        mesh = init_device_mesh("cpu", (world,))
        layers = {f"layer{i}.w": distribute_tensor(torch.full((5, 3), float(i)), mesh, [Shard(0)]) for i in range(6)}
        dcp.save(layers, storage_writer=dcp.FileSystemWriter(os.path.join(root, "threads"), thread_count=3))
        dist.barrier()
    finally:
        dist.destroy_process_group()


class WithExtraState(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.payload = torch.arange(4, dtype=torch.uint8)

    def get_extra_state(self):
        return {"version": 3, "blob": self.payload.clone()}

    def set_extra_state(self, state):
        self.payload = state["blob"]


def _optim_state() -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    adam = torch.optim.Adam(m.parameters(), lr=1e-3)
    for _ in range(2):
        loss = m(torch.randn(5, 4)).square().mean()
        sgd.zero_grad()
        adam.zero_grad()
        loss.backward()
        sgd.step()
        adam.step()
    msd, asd = get_state_dict(m, adam)
    return {"model": msd, "adam": asd, "sgd": sgd.state_dict()}


def _single_state(kind: str) -> dict:
    if kind == "dtypes":
        return {
            "b": torch.tensor([True, False, True]), "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
            "u8": torch.tensor([0, 200, 255], dtype=torch.uint8), "f16": torch.tensor([1.5, -2.0], dtype=torch.float16),
            "bf16": torch.tensor([1.5, -2.0, 3e38], dtype=torch.bfloat16),
            "c64": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
            "c128": torch.tensor([1j], dtype=torch.complex128),
            "f8": torch.tensor([0.5, -1.0, 448.0], dtype=torch.float8_e4m3fn),
            "f8b": torch.tensor([0.5, -1.0], dtype=torch.float8_e5m2),
            "u16": torch.tensor([1, 65535], dtype=torch.uint16), "u32": torch.tensor([7], dtype=torch.uint32),
            "scalar": torch.tensor(3.25), "iscalar": torch.tensor(7, dtype=torch.int64),
            "empty": torch.zeros(0), "empty2": torch.zeros(0, 4), "noncontig": torch.arange(12.0).reshape(3, 4).t(),
        }
    if kind == "objects":
        return {"bio": io.BytesIO(b"hello bytes"), "nested": {"a": {"b": [1, 2, {"c": "deep"}]}, "t": (1, "x", None)},
                "s": "a string", "none": None, "tup": (1, 2.5, "z"), "lst": [torch.ones(2), "mixed", 3],
                "f": 0.125, "i": 2**40, "by": b"raw bytes", "flag": True}
    if kind == "names":
        return {f"model.{'a' * 300}.weight": torch.ones(2), "model.ünïcödé.权重": torch.arange(3.0),
                "model.emoji.🔥.bias": torch.zeros(2), "model.sp ace.w": torch.ones(1), RTL_NAME: torch.ones(1),
                "model.new\nline.w": torch.ones(1), "model.tab\tw": torch.ones(1)}
    if kind == "extra_state":
        torch.manual_seed(0)
        return {"model": torch.nn.Sequential(WithExtraState(), torch.nn.LayerNorm(2)).state_dict()}
    return _optim_state()


def write_all(root: Path) -> None:
    """Every healthy checkpoint of this module under ``root``."""
    import warnings

    import torch.multiprocessing as mp

    warnings.filterwarnings("ignore")
    for kind in SINGLE:
        dcp.save(_single_state(kind), checkpoint_id=str(root / kind), no_dist=True)
    with tempfile.TemporaryDirectory(prefix="shardscope-unseen-") as tmp:
        mp.start_processes(_rank, args=(4, os.path.join(tmp, "store"), str(root)), nprocs=4, start_method="spawn")



def write_hostile(root: Path, good: Path) -> None:
    """Hostile and odd folders, made from ``good`` (a one-file healthy checkpoint) with torch's own classes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    def folder(name: str, copy: bool = False) -> Path:
        p = root / name
        shutil.copytree(good, p) if copy else p.mkdir()
        return p

    tops = {"top_dict": {"state_dict_metadata": {}}, "top_list": [1, 2], "top_none": None, "top_str": "Metadata",
            "top_tsm": TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([2]), []),
            "top_bytes": BytesStorageMetadata(), "top_index": MetadataIndex("x", torch.Size([0]))}
    for name, obj in tops.items():
        (folder(name, copy=True) / ".metadata").write_bytes(pickle.dumps(obj))
    chunk_entry = Metadata(state_dict_metadata={"a": ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))})
    (folder("entry_is_chunk") / ".metadata").write_bytes(pickle.dumps(chunk_entry))
    n = 100_000  # one tensor, one element in each of 100,000 files (none of which exist)
    big = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([n]),
                                [ChunkStorageMetadata(torch.Size([i]), torch.Size([1])) for i in range(n)])
    data = {MetadataIndex("big", torch.Size([i])): _StorageInfo(f"__{i}_0.distcp", 0, 500) for i in range(n)}
    (folder("files_100k") / ".metadata").write_bytes(pickle.dumps(Metadata({"big": big}, storage_data=data)))
    folder("empty")
    (root / "is_a_file").write_bytes(b"not a folder")
    (folder("metadata_is_dir") / ".metadata").mkdir()
    os.mkfifo(folder("metadata_fifo") / ".metadata")
    os.symlink("/etc/hostname", folder("metadata_link_out") / ".metadata")
    p = folder("shard_link_out", copy=True)
    os.remove(p / "__0_0.distcp")
    os.symlink((good / "__0_0.distcp").resolve(), p / "__0_0.distcp")
    p = folder("shard_link_in", copy=True)
    os.rename(p / "__0_0.distcp", p / "real.bin")
    os.symlink("real.bin", p / "__0_0.distcp")
    p = folder("stray", copy=True)  # things a real folder collects
    (p / "README.txt").write_text("notes")
    (p / "sub").mkdir()
    (p / "sub" / ".metadata").write_bytes(b"x")
    os.mkfifo(p / "a_fifo")
    os.symlink("/etc/passwd", p / "passwd_link")
    os.symlink("/nonexistent", p / "dangling")
    _write_zip_with_traversal(folder("zip_traversal"), _StorageInfo)


def _write_zip_with_traversal(p: Path, storage_info: type) -> None:
    """A one-tensor checkpoint whose item zip also holds members named ``../../..`` and ``/abs``."""
    import warnings
    import zipfile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(p), no_dist=True)
    buf = io.BytesIO()
    with zipfile.ZipFile(p / "__0_0.distcp") as src, zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info.filename))
        z.writestr("../../../../../tmp/shardscope-evil", b"evil")
        z.writestr("/tmp/shardscope-evil-abs", b"evil")
    (p / "__0_0.distcp").write_bytes(buf.getvalue())
    md = pickle.loads((p / ".metadata").read_bytes())  # we wrote it: safe
    for k, v in md.storage_data.items():
        md.storage_data[k] = storage_info(v.relative_path, 0, len(buf.getvalue()))
    (p / ".metadata").write_bytes(pickle.dumps(md))


if __name__ == "__main__":
    write_all(Path(sys.argv[1]))
    sys.exit(0)
