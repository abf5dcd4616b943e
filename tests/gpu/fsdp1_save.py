"""One rank (or more, one GPU each) of an FSDP1 run on CUDA with NCCL, for the GPU check (run_on_gpu.sh).

Wraps a small model in FSDP1 (``FullyShardedDataParallel``, one unit per block), trains 3 steps, then saves
``OUT/ckpt`` with ``dcp.save`` of ``get_state_dict`` (FSDP1's sharded state dict) and ``OUT/full.pt``: the full
model and optimizer state gathered by FSDP1 itself (``FULL_STATE_DICT``, rank 0), the reference the export is
compared with. Also calls Shardscope's ``report()`` with 1 GiB allocated on the device, for its CUDA counters.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def main() -> int:
    out = sys.argv[1]
    # one GPU: NCCL refuses two ranks on one device, and FSDP1 on one rank falls back to NO_SHARD; FSDP1_BACKEND=gloo
    # runs several ranks on the one GPU (gloo moves the CUDA tensors) so that FSDP1 really shards
    dist.init_process_group(os.environ.get("FSDP1_BACKEND", "nccl"))
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 256), *[Block(256) for _ in range(4)], nn.Linear(256, 1000)).cuda()
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.cuda.current_device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        x = torch.randint(0, 1000, (8, 64), device="cuda")
        loss = nn.functional.cross_entropy(model(x).reshape(-1, 1000), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd, "step": 3}, checkpoint_id=os.path.join(out, "ckpt"))
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        full = model.state_dict()
    if rank == 0:
        torch.save({k: v.detach().cpu() for k, v in full.items()}, os.path.join(out, "full.pt"))
        print(f"fsdp1: {dist.get_world_size()} ranks, sharding {model.sharding_strategy.name}, state dict values:",
              sorted({type(v).__name__ for v in msd.values()}), flush=True)
    # report()'s CUDA memory against the allocator's own numbers, with 1 GiB held
    os.environ["SHARDSCOPE_RUN_DIR"] = os.path.join(out, "report_run")
    from shardscope.backend.runs.report import report

    held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    report(step=1, loss=float(loss))
    print(f"report: rank {rank} torch.cuda.memory_allocated={torch.cuda.memory_allocated()} "
          f"memory_reserved={torch.cuda.memory_reserved()} max_memory_allocated={torch.cuda.max_memory_allocated()}",
          flush=True)
    del held
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
