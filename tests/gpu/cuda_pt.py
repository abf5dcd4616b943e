"""A ``.pt`` written by ``torch.save`` from CUDA tensors (storages tagged ``cuda:0``, as most users' files are), for
the GPU check: Shardscope lists it without torch.load (the native reader, no fallback), and its export and import
hold the same values as ``torch.load(map_location="cpu")``. Exits 1 on any difference."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

out = sys.argv[1]
torch.manual_seed(0)
dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of this script where there is no GPU
model = nn.Sequential(nn.Embedding(1000, 256), nn.LayerNorm(256), nn.Linear(256, 1000)).to(dev, torch.bfloat16)
opt = torch.optim.AdamW(model.parameters())
model(torch.randint(0, 1000, (4, 8), device=dev)).float().sum().backward()
opt.step()
torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}, f"{out}/gpu.pt")

from shardscope.backend.checkpoint.torch_file_tree import TorchFileLoad  # noqa: E402

load = TorchFileLoad(f"{out}/gpu.pt")
print("native reader:", "yes" if load.fallback is None else f"no, fell back: {load.fallback}")
sh = [sys.executable, "-m", "shardscope.app.cli"]
for cmd in (["verify", "--deep", f"{out}/gpu.pt"], ["export", f"{out}/gpu.pt", f"{out}/gpu.safetensors"],
            ["import", f"{out}/gpu.pt", f"{out}/gpu_dcp"]):
    p = subprocess.run(sh + cmd, capture_output=True, text=True)
    print(" ".join(cmd[:1]), "exit", p.returncode, (p.stdout + p.stderr).strip().splitlines()[-1][:160])
from safetensors.torch import load_file  # noqa: E402

ref = torch.load(f"{out}/gpu.pt", map_location="cpu", weights_only=True)
flat = dict(ref["model"])  # what a safetensors export holds by default: the model's weights, under their own names
got = load_file(f"{out}/gpu.safetensors")
bad = [k for k, v in flat.items()
       if k not in got or got[k].dtype != v.dtype or not torch.equal(got[k], v.reshape(got[k].shape))]
import torch.distributed.checkpoint as dcp  # noqa: E402

sd = {"model": {k: torch.empty_like(v) for k, v in ref["model"].items()}}
dcp.load(sd, checkpoint_id=f"{out}/gpu_dcp", no_dist=True)
bad += [f"dcp:{k}" for k, v in ref["model"].items() if not torch.equal(sd["model"][k], v)]
print(f"compared {len(flat)} tensors of the {dev}-saved .pt (export) and {len(ref['model'])} (import): "
      f"{len(bad)} differ", bad[:5])
sys.exit(1 if bad or load.fallback is not None else 0)
