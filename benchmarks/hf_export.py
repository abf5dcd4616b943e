"""A torchtitan Llama 3 checkpoint of about 1 GB of fp32 weights (about 250 M parameters, written by torchtitan's own
model class and ``dcp.save``) to a Hugging Face model folder, side by side:

  torchtitan  torchtitan's own route, as its ``convert_to_hf.py`` takes it: build the model, ``dcp.load`` into its
              state dict, ``Llama3StateDictAdapter.to_hf``, ``safetensors.torch.save_file`` + config.json, fsync
              (the same durability as ours)
  shardscope  ``shardscope export SRC DST --hf --config CONFIG.json`` (streamed one output tensor at a time,
              every output tensor re-read and compared with the transform of the CRC-checked source bytes; fsync)

Each run is a fresh process (its whole wall time, imports included, and its VmHWM through ``_measure.emit``),
alternating, medians. The page cache is dropped before each run when root (said when not).

    python benchmarks/hf_export.py [--dir DIR] [--repeat 3] [--layers 16] [--dim 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _measure import drop_caches  # benchmarks/, this script's folder

HERE = Path(__file__).parent
ROOT = HERE.parent
VOCAB, HEADS, KV_HEADS, THETA, EPS = 32000, 16, 8, 500000.0, 1e-5

BUILD = r'''
import json, os, sys
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

def build(dim, layers, hidden, vocab, heads, kv_heads, theta, eps):
    cfg = Llama3Model.Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=_build_llama3_layers(n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=kv_heads, hidden_dim=hidden,
                                    rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=2048, theta=theta),
                                    attn_backend="flex"))
    return cfg, cfg.build()
'''

GENERATE = BUILD + r'''
import torch, torch.distributed.checkpoint as dcp
args = json.loads(sys.argv[2])
torch.manual_seed(0)
cfg, model = build(**args)
model.init_states()
dcp.save(model.state_dict(), checkpoint_id=sys.argv[1])
'''

# the measured steps: argv = SRC DST CONFIG ARGS_JSON; each ends with _measure.emit (VmHWM of this process)
TORCHTITAN = BUILD + r'''
import time
t0 = time.perf_counter()
import torch, torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torchtitan.models.llama3 import Llama3StateDictAdapter
src, dst, config = sys.argv[1], sys.argv[2], sys.argv[3]
cfg, model = build(**json.loads(sys.argv[4]))
state = model.state_dict()
dcp.load(state, checkpoint_id=src)
hf = Llama3StateDictAdapter(cfg, None).to_hf(state)
os.makedirs(dst)
save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(dst, "model.safetensors"),
          metadata={"format": "pt"})
with open(config) as f, open(os.path.join(dst, "config.json"), "w") as g:
    g.write(f.read())
for name in ("model.safetensors", "config.json"):
    fd = os.open(os.path.join(dst, name), os.O_RDONLY); os.fsync(fd); os.close(fd)
fd = os.open(dst, os.O_RDONLY); os.fsync(fd); os.close(fd)
'''

SHARDSCOPE = r'''
import sys, time
t0 = time.perf_counter()
from shardscope.app.cli.main import main
rc = main(["export", sys.argv[1], sys.argv[2], "--hf", "--config", sys.argv[3]])
assert rc == 0, rc
'''

EMIT = "\nsys.path.insert(0, {here!r})\nfrom _measure import emit\nemit(time.perf_counter() - t0)\n"


def hidden_dim(dim: int) -> int:
    """Llama's FFN width without a multiplier: 2/3 of 4·dim, rounded up to a multiple of 256 (2816 at dim 1024:
    about 254 M parameters at 16 layers, 1.0 GB in fp32)."""
    h = int(2 * 4 * dim / 3)
    return 256 * ((h + 255) // 256)


def hf_config(dim: int, layers: int, hidden: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": dim,
            "intermediate_size": hidden, "num_hidden_layers": layers, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "head_dim": dim // HEADS, "vocab_size": VOCAB, "rms_norm_eps": EPS,
            "rope_theta": THETA, "max_position_embeddings": 2048, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "torch_dtype": "float32"}


def cpu_of_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def measure(code: str, argv: list[str], out: Path) -> dict:
    """One run in a fresh process: its wall time as the parent sees it, its CPU time (user + system: what a
    shared machine's load does not stretch), and its own VmHWM."""
    shutil.rmtree(out, ignore_errors=True)
    dropped = drop_caches()
    cpu0 = cpu_of_children()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code + EMIT.format(here=str(HERE)), *argv], capture_output=True,
                          text=True)
    seconds = time.perf_counter() - t0
    cpu = cpu_of_children() - cpu0
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    inner = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"seconds": seconds, "cpu": cpu, "peak_rss": inner["peak_rss"], "cold": dropped}


def same_tensors(a: Path, b: Path) -> bool:
    """Both folders hold the same tensors, bit for bit (what makes the comparison fair)."""
    import torch
    from safetensors.torch import load_file

    def load(folder: Path) -> dict:
        out = {}
        for p in sorted(folder.glob("*.safetensors")):
            out.update(load_file(str(p)))
        return out

    x, y = load(a), load(b)
    return sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=1024)
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="hf-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src, config = work / "ckpt", work / "config.json"
    hidden = hidden_dim(args.dim)
    build_args = {"dim": args.dim, "layers": args.layers, "hidden": hidden, "vocab": VOCAB, "heads": HEADS,
                  "kv_heads": KV_HEADS, "theta": THETA, "eps": EPS}
    if not (src / ".metadata").exists():
        subprocess.run([sys.executable, "-c", GENERATE, str(src), json.dumps(build_args)], check=True)
    config.write_text(json.dumps(hf_config(args.dim, args.layers, hidden), indent=2))
    size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    steps = {"torchtitan": TORCHTITAN, "shardscope": SHARDSCOPE}
    results: dict[str, list[dict]] = {name: [] for name in steps}
    for _ in range(args.repeat):
        for name, code in steps.items():
            argv = [str(src), str(work / f"out-{name}"), str(config), json.dumps(build_args)]
            results[name].append(measure(code, argv, work / f"out-{name}"))
    identical = same_tensors(work / "out-torchtitan", work / "out-shardscope")
    dropped = all(r["cold"] for v in results.values() for r in v)
    load = os.getloadavg()[0]
    print(f"torchtitan Llama 3, {args.layers} layers, dim {args.dim}, {size / 1e9:.2f} GB of DCP files; "
          f"{args.repeat} runs each, alternating, fresh processes, cache "
          f"{'dropped before each run' if dropped else 'NOT dropped (not root)'}; load average {load:.1f} at the "
          f"end; tensors bit-identical: {identical}")
    base_t = statistics.median(r["seconds"] for r in results["torchtitan"])
    base_m = statistics.median(r["peak_rss"] for r in results["torchtitan"])
    base_c = statistics.median(r["cpu"] for r in results["torchtitan"])
    print("| route | median wall s | x torchtitan | median CPU s | x torchtitan | peak RSS MiB | x torchtitan | "
          "wall runs (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, runs in results.items():
        t = statistics.median(r["seconds"] for r in runs)
        c = statistics.median(r["cpu"] for r in runs)
        m = statistics.median(r["peak_rss"] for r in runs)
        print(f"| {name} | {t:.2f} | {t / base_t:.2f} | {c:.2f} | {c / base_c:.2f} | {m / 2**20:.0f} | "
              f"{m / base_m:.2f} | " + " ".join(f"{r['seconds']:.2f}" for r in runs) + " |")


if __name__ == "__main__":
    main()
