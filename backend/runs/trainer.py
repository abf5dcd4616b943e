"""The built-in trainer, run under torchrun: a small decoder-only transformer LM on a local,
deterministic synthetic corpus, with FSDP2 (``fully_shard``) or DDP, DCP checkpoints and resume.

    python -m torch.distributed.run --nproc-per-node 2 -m shardscope.backend.runs.trainer --steps 50
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .report import report
from .rundir import MODEL_DEFAULTS

_KEEP_ALIVE: list = []


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The built-in trainer's command line: strategy, steps, model size, checkpointing, resume, run dir."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--strategy", choices=("fsdp", "ddp"), default="fsdp")
    p.add_argument("--steps", type=int, default=50, help="total steps (a resumed run ends at the same step)")
    p.add_argument("--batch-size", type=int, default=MODEL_DEFAULTS["batch_size"], help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=MODEL_DEFAULTS["seq_len"])
    p.add_argument("--vocab", type=int, default=MODEL_DEFAULTS["vocab"])
    p.add_argument("--width", type=int, default=MODEL_DEFAULTS["width"])
    p.add_argument("--depth", type=int, default=MODEL_DEFAULTS["depth"])
    p.add_argument("--heads", type=int, default=MODEL_DEFAULTS["heads"])
    p.add_argument("--lr", type=float, default=MODEL_DEFAULTS["lr"])
    p.add_argument("--seed", type=int, default=MODEL_DEFAULTS["seed"])
    p.add_argument("--grad-clip", type=float, default=MODEL_DEFAULTS["grad_clip"])
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--run-dir", default=os.environ.get("SHARDSCOPE_RUN_DIR", "."))
    return p.parse_args(argv)


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention then an MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` (batch, seq, width) with attention mask ``mask``."""
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """The built-in trainer's tiny causal language model (token and position embeddings, blocks, head)."""

    def __init__(self, vocab: int, width: int, depth: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits (batch, seq, vocab) for token ids ``idx`` (batch, seq)."""
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln(x))


def synthetic_batch(step: int, rank: int, world: int, args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    """Sequences with learnable structure: each token is a fixed function of the previous two,
    with a little noise. The same global batch for a step whatever the world size."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    total = args.batch_size * 2  # the global batch is fixed: two ranks' worth
    seq = torch.empty(total, args.seq_len + 1, dtype=torch.long)
    seq[:, :2] = torch.randint(0, args.vocab, (total, 2), generator=g)
    for i in range(2, args.seq_len + 1):
        seq[:, i] = (seq[:, i - 1] * 7 + seq[:, i - 2] * 3 + 1) % args.vocab
    noise = torch.rand(seq.shape, generator=g) < 0.05
    seq = torch.where(noise, torch.randint(0, args.vocab, seq.shape, generator=g), seq)
    per = math.ceil(total / world)
    part = seq[rank * per:(rank + 1) * per]
    if part.numel() == 0:
        part = seq[:1]
    return part.to(device)


def main(argv: list[str] | None = None) -> int:
    """Train, report and checkpoint; one rank of a torchrun launch.

    NOTE: over 60 lines on purpose: it is read as the example of a training loop that reports to Shardscope
    and saves DCP checkpoints, so setup, loop and save stay in one readable piece."""
    args = parse_args(argv)
    device_kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if device_kind == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if device_kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    torch.manual_seed(args.seed)
    tiny = TinyLM(args.vocab, args.width, args.depth, args.heads, args.seq_len).to(device)
    model: nn.Module = tiny  # DDP wraps it; fully_shard changes it in place
    if args.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for b in tiny.blocks:
            fully_shard(b)
        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    start = 0
    if args.resume:
        msd, osd = get_state_dict(model, opt)
        state: dict[str, Any] = {"model": msd, "optimizer": osd, "step": 0}
        dcp.load(state, checkpoint_id=args.resume)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        start = int(state["step"])
        if rank == 0:
            print(f"resumed from {args.resume} at step {start}", flush=True)
    ckpt_root = Path(args.run_dir) / "checkpoints"
    t_last = time.perf_counter()
    tokens_per_step = args.batch_size * 2 * args.seq_len
    for step in range(start + 1, args.steps + 1):
        batch = synthetic_batch(step, rank, world, args, device)
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        now = time.perf_counter()
        dt, t_last = now - t_last, now
        report(step=step, loss=loss.item(), lr=args.lr, steps_per_s=1 / dt if dt > 0 else None,
               tokens_per_s=tokens_per_step / dt if dt > 0 else None)
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if args.checkpoint_every and (step % args.checkpoint_every == 0 or step == args.steps):
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optimizer": osd, "step": step},
                     checkpoint_id=str(ckpt_root / f"step_{step:06d}"))
            if rank == 0:
                print(f"checkpoint {ckpt_root / f'step_{step:06d}'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # NOTE: keep the model alive until the process exits (worker_entry ends with os._exit). Freeing a DDP
    # model here runs ~Reducer -> ~ProcessGroupGloo, which joins gloo's worker thread while holding the GIL,
    # and that thread may need the GIL to free the barrier's tensors: a deadlock seen with torch 2.13.
    _KEEP_ALIVE.append((model, opt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
