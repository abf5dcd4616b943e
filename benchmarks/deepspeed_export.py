"""A DeepSpeed ZeRO-3 checkpoint (2 gloo ranks, about 180 M parameters + Adam: about 2.2 GB of files), written by
DeepSpeed's own save_checkpoint, consolidated to safetensors side by side:

  deepspeed   deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(..., safe_serialization=True),
              then `sync` (DeepSpeed writes without fsync; the same durability as ours)
  shardscope  `shardscope export SAVE out.safetensors` (verified: every byte re-read and compared; fsync)

Each run in a fresh process, cold cache (`sync; echo 3 > /proc/sys/vm/drop_caches`, needs root; say so when not),
alternating, medians; wall time and peak RSS (VmHWM) of the process (and its children).

    python benchmarks/deepspeed_export.py [--dir DIR] [--repeat 3] [--layers 12]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _measure import drop_caches as cold  # benchmarks/, this script's folder

HERE = Path(__file__).parent
ROOT = HERE.parent

TRAIN = r'''
import os, sys, warnings
warnings.filterwarnings("ignore")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed, deepspeed.comm.torch, torch
from torch import nn
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo")
width, layers, vocab = 1024, int(os.environ["BENCH_LAYERS"]), 16000
class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width); self.proj = nn.Linear(width, width)
        self.up = nn.Linear(width, 4 * width); self.down = nn.Linear(4 * width, width); self.norm = nn.LayerNorm(width)
    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x)))) + self.proj(self.qkv(x)[..., :width])
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(vocab, width), *[Layer() for _ in range(layers)], nn.Linear(width, vocab))
config = {"train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
          "zero_optimization": {"stage": 3}, "steps_per_print": 10**9}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
loss = engine(torch.randint(0, vocab, (1, 4))).float().mean()
engine.backward(loss); engine.step()
engine.save_checkpoint(sys.argv[1])
torch.distributed.barrier()
sys.stdout.flush(); os._exit(0)
'''

DEEPSPEED = ("from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as c\n"
             "import sys, os\nc(sys.argv[1], sys.argv[2], safe_serialization=True)\nos.sync()\n")
SHARDSCOPE = ("import sys\nfrom shardscope.app.cli.main import main\n"
              "rc = main(['export', sys.argv[1], sys.argv[2] + '/model.safetensors'])\nassert rc == 0, rc\n")
MEASURE = ("import json, resource, runpy, sys, time\nt0 = time.perf_counter()\nsys.argv = sys.argv[1:]\n"
           "exec(compile(open(sys.argv[0]).read(), sys.argv[0], 'exec'), {'__name__': '__main__'})\n"
           "hwm = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
           "kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024\n"
           "print('RESULT', json.dumps({'seconds': time.perf_counter() - t0, 'peak_rss': max(hwm, kids)}))\n")


def generate(save: Path, layers: int) -> None:
    script = save.parent / "train.py"
    script.write_text(TRAIN)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "BENCH_LAYERS": str(layers)}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    str(script), str(save)], check=True, env=env, stdout=subprocess.DEVNULL)


def measure(code: str, save: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    script = out.parent / "step.py"
    script.write_text(code)
    dropped = cold()
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(script), str(save), str(out)], capture_output=True,
                          text=True, env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return {**json.loads(line.split(" ", 1)[1]), "cold": dropped}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12)
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="ds-bench-"))
    save = work / "save"
    if not (save / "latest").exists():
        generate(save, args.layers)
    size = sum(p.stat().st_size for p in save.rglob("*") if p.is_file())
    results: dict[str, list[dict]] = {"deepspeed": [], "shardscope": []}
    for _ in range(args.repeat):
        for name, code in (("deepspeed", DEEPSPEED), ("shardscope", SHARDSCOPE)):
            results[name].append(measure(code, save, work / f"out-{name}"))
    dropped = all(r["cold"] for v in results.values() for r in v)
    print(f"DeepSpeed ZeRO-3 save, 2 ranks, {size / 2**30:.2f} GiB of files; {args.repeat} runs each, alternating, "
          f"cache {'dropped before each run' if dropped else 'NOT dropped (not root)'}")
    base_t = statistics.median(r["seconds"] for r in results["deepspeed"])
    base_m = statistics.median(r["peak_rss"] for r in results["deepspeed"])
    print(f"{'tool':<12} {'median s':>9} {'x ds':>6} {'peak RSS MiB':>13} {'x ds':>6}   runs (s)")
    for name, runs in results.items():
        t = statistics.median(r["seconds"] for r in runs)
        m = statistics.median(r["peak_rss"] for r in runs)
        print(f"{name:<12} {t:>9.2f} {t / base_t:>6.2f} {m / 2**20:>13.0f} {m / base_m:>6.2f}   "
              + " ".join(f"{r['seconds']:.2f}" for r in runs))


if __name__ == "__main__":
    main()
