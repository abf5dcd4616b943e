"""Write real DCP checkpoints with torch's own ``dcp.save`` from multi-process gloo runs.

Run as ``python tests/make_fixtures.py OUTDIR``; the test session calls :func:`make_all` once.
Every checkpoint here is written the way users write them (see shared/seeds).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from gloo_retry import retry_gloo
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class TinyNet(nn.Module):
    """Small model with 1-D, 2-D and odd-sized tensors, so shards are uneven."""

    def __init__(self, vocab: int = 37, dim: int = 12, depth: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _train_steps(model, opt, rank: int, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        idx = torch.randint(0, 37, (4, 8), generator=g)
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


_KEEP_ALIVE: list = []
DEADLINE = 600.0  # seconds one fixture's gloo run may take on a loaded machine before it is retried


def _worker(rank: int, world: int, store: str, kind: str, out: str) -> None:
    """One rank: write the fixture, then leave with ``os._exit``. NOTE: freeing a DDP model after the group is
    destroyed runs ~Reducer -> ~ProcessGroupGloo, which joins gloo's worker thread while holding the GIL, and
    that thread may need the GIL to free a collective's tensors: with torch 2.13 the rank then hangs for
    ever (seen in CI). So the model is kept alive and no destructor runs at exit (as backend/runs does)."""
    _write(rank, world, store, kind, out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _write(rank: int, world: int, store: str, kind: str, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    # Rendezvous through a file, not a TCP port: no free-port race with whatever else runs on the machine.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        torch.manual_seed(0)
        model = TinyNet()
        if kind.startswith("fsdp") or kind in ("init", "steps"):
            from torch.distributed.fsdp import fully_shard

            for b in model.blocks:
                fully_shard(b)
            fully_shard(model)
        elif kind == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        _KEEP_ALIVE.append(model)
        if kind == "init":  # the same untrained model at any world size: identical values
            dcp.save({"model": get_state_dict(model, [])[0]}, checkpoint_id=out)
            dist.barrier()
            return
        if kind == "steps":  # two checkpoints of one run, one step apart; the head's bias is frozen
            model.head.bias.requires_grad_(False) if hasattr(model, "head") else None
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        _train_steps(model, opt, rank)
        msd, osd = get_state_dict(model, opt)
        if kind == "steps":
            dcp.save({"model": msd, "optimizer": osd, "step": 2}, checkpoint_id=str(Path(out) / "step2"))
            _train_steps(model, opt, rank, steps=1)
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optimizer": osd, "step": 3}, checkpoint_id=str(Path(out) / "step3"))
            dist.barrier()
            return
        if kind == "fsdp_safetensors":
            from torch.distributed.checkpoint.filesystem import SerializationFormat

            writer = dcp.FileSystemWriter(out, serialization_format=SerializationFormat.SAFETENSORS)
            dcp.save({"model": msd, "optimizer": osd, "step": 2}, storage_writer=writer)
        elif kind == "hf":
            # torch's HuggingFace storage writer: safetensors per rank with DCP_SHARDING_INFO
            from torch.distributed.checkpoint import HuggingFaceStorageWriter

            dcp.save(msd, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))
        elif kind == "fsdp_nocollectives":
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=out, use_collectives=False)
        elif kind == "lightning":
            # What Lightning/Fabric's ModelParallel/FSDP strategy writes for a sharded save:
            # model and optimizer through DCP, everything else in meta.pt on rank 0.
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=out)
            if rank == 0:
                torch.save({"epoch": 1, "global_step": 2, "hparams": {"lr": 0.01}}, Path(out) / "meta.pt")
        else:
            state = {"model": msd, "optimizer": osd, "step": 2, "extra": {"note": "x", "ints": [1, 2]}}
            dcp.save(state, checkpoint_id=out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def make(kind: str, world: int, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    if kind == "nopg":
        torch.manual_seed(0)
        model = TinyNet()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train_steps(model, opt, 0)
        dcp.save({"model": model.state_dict(), "step": 2}, checkpoint_id=str(out), no_dist=True)
        return out
    rendezvous = tempfile.mkdtemp(prefix="shardscope-fixture-")
    try:
        ctx = mp.start_processes(_worker, args=(world, os.path.join(rendezvous, "store"), kind, str(out)),
                                 nprocs=world, start_method="spawn", join=False)
        deadline = time.monotonic() + DEADLINE
        while not ctx.join(timeout=5):  # raises when a rank fails (and ends the others)
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{kind} on {world} ranks did not finish in {DEADLINE:.0f} s")
    finally:
        shutil.rmtree(rendezvous, ignore_errors=True)
    return out


FIXTURES = {
    "fsdp2_r2": ("fsdp", 2),
    "fsdp2_r4": ("fsdp", 4),
    "ddp_r2": ("ddp", 2),
    "nopg": ("nopg", 1),
    "lightning_r2": ("lightning", 2),
    "fsdp_nocoll_r2": ("fsdp_nocollectives", 2),
    "fsdp_safetensors_r2": ("fsdp_safetensors", 2),
    "hf_r2": ("hf", 2),
    "init_r2": ("init", 2),
    "init_r4": ("init", 4),
    "steps_r2": ("steps", 2),
}


def empty(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    return folder


def make_all(root: Path) -> dict[str, Path]:
    paths = {}
    for name, (kind, world) in FIXTURES.items():
        target = root / name
        marker = root / f".{name}.done"
        if not marker.exists():
            retry_gloo(lambda target=target: empty(target), lambda out, kind=kind, world=world: make(kind, world, out),
                       name=f"make_fixtures: {name}")
            marker.write_text("ok")
        paths[name] = target
    return paths


if __name__ == "__main__":
    make_all(Path(sys.argv[1]))
