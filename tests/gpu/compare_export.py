"""Compare Shardscope's exports of the FSDP1 checkpoint with FSDP1's own full state dict and with torch's
``dcp_to_torch_save`` (for the GPU check, run_on_gpu.sh). Exits 1 on any difference."""

from __future__ import annotations

import sys

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

out = sys.argv[1]
full = torch.load(f"{out}/full.pt", weights_only=True)
mine = load_file(f"{out}/model.safetensors")
dcp_to_torch_save(f"{out}/ckpt", f"{out}/torch_ref.pt")
ref = torch.load(f"{out}/torch_ref.pt", weights_only=True)
bad = 0
for name, t in full.items():
    for label, got in (("shardscope export", mine.get(name)), ("dcp_to_torch_save", ref["model"].get(name))):
        if got is None or got.dtype != t.dtype or got.shape != t.shape or not torch.equal(got, t):
            print(f"DIFFERS: {name} in {label}")
            bad += 1
extra = sorted(set(mine) - set(full))
print(f"compared {len(full)} tensors of FSDP1's FULL_STATE_DICT with the safetensors export and with "
      f"dcp_to_torch_save: {bad} differences; names only in the export: {extra}")
sys.exit(1 if bad or extra else 0)
