"""Export a ~1.4 GB FSDP2 checkpoint (4 gloo ranks, ~116 M parameters + AdamW state):
Shardscope -> safetensors and -> torch .pt (verified, the default, and --no-verify), torch's
dcp_to_torch_save (synced, the reference, and unsynced), and `cp -r` + `sync`. Each step runs in a
fresh process; wall time and peak RSS (VmHWM, which counts mapped file pages) side by side.

    python benchmarks/export_bench.py [--dir DIR] [--repeat 3] [--layers 8] [--only STEP ...]

``--layers 11`` makes the ~2 GB (1.91 GiB) checkpoint of issue 23. Steps alternate within each round; the
table gives every run, then the medians side by side (run it under ``nice -n 10`` on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str, layers: int = 8) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    width, vocab = 1024, 16000

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)
            self.norm = nn.LayerNorm(width)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x)))) + self.proj(self.qkv(x)[..., :width])

    model = nn.Sequential(nn.Embedding(vocab, width), *[Layer() for _ in range(layers)], nn.Linear(width, vocab))
    for m in model[1:-1]:
        fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randint(0, vocab, (1, 4))).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd, "step": 1}, checkpoint_id=out)
    dist.destroy_process_group()


def generate(out: Path, layers: int = 8) -> None:
    """8 layers: 1.49 GiB (1.6 GB); 11 layers: 1.91 GiB (2.05 GB); about 151 MB per layer."""
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(4, _port(), str(out), layers), nprocs=4, start_method="spawn")


EXPORT = ("from shardscope.backend.formats import open_checkpoint\n"
          "from shardscope.backend.export import export, plan_export\n"
          "ck = open_checkpoint(SRC)\n")
STEPS = {
    # Every step writes the same tensors (model and optimizer: what dcp_to_torch_save writes) and ends
    # with them on disk: Shardscope fsyncs file and folder before its rename; torch and cp are followed
    # by `sync`. "verified" steps re-read every written tensor and compare CRC32s with the source bytes.
    "safetensors, verified": EXPORT + "export(plan_export(ck, 'safetensors', only=['model', 'optimizer']), DST)\n",
    "safetensors, --no-verify": EXPORT + "export(plan_export(ck, 'safetensors', only=['model', 'optimizer']), "
                                "DST, verify=False)\n",
    "torch .pt, verified": EXPORT + "export(plan_export(ck, 'torch'), DST)\n",
    "torch .pt, --no-verify": EXPORT + "export(plan_export(ck, 'torch'), DST, verify=False)\n",
    "dcp_to_torch_save + sync": "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
                                "import subprocess\ndcp_to_torch_save(SRC, DST)\n"
                                "subprocess.run(['sync'], check=True)\n",
    "dcp_to_torch_save (no sync)": "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
                                   "dcp_to_torch_save(SRC, DST)\n",
    "cp -r + sync": "import subprocess\nsubprocess.run(['cp', '-r', SRC, DST], check=True)\n"
                    "subprocess.run(['sync'], check=True)\n",
}
REFERENCE = "dcp_to_torch_save + sync"
GOALS = {"safetensors, verified": (0.5, 0.25), "torch .pt, verified": (0.7, 0.25)}


BASELINE = " (baseline code)"  # a step of STEPS run with another copy of the package first on sys.path


def measure(what: str, src: Path, dst: Path, baseline: str | None = None) -> dict:
    """One step in a fresh process: wall time and peak RSS (VmHWM: anonymous and mapped file pages)."""
    env = {**os.environ, "SHARDSCOPE_NO_CACHE": "1"}
    if what.endswith(BASELINE):
        what = what[:-len(BASELINE)]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [baseline, env.get("PYTHONPATH")]))
    code = (f"import time, torch\nSRC, DST = {str(src)!r}, {str(dst)!r}\n"
            "t0 = time.perf_counter()\n" + STEPS[what] +
            "import json\nhwm = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') "
            "if l.startswith('VmHWM'))\nprint(json.dumps({'seconds': time.perf_counter() - t0, 'peak_rss': hwm}))\n")
    subprocess.run(["sync"], check=False)  # no dirty pages of an earlier step in this one's time
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{what} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _suffix(what: str) -> str:
    what = what.removesuffix(BASELINE)
    return ".safetensors" if what.startswith("safetensors") else "" if what.startswith("cp") else ".pt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8, help="8: 1.49 GiB; 11: 1.91 GiB (about 151 MB each)")
    ap.add_argument("--only", nargs="*", default=list(STEPS))
    ap.add_argument("--baseline-code", metavar="DIR", help="a folder holding another `shardscope` package (e.g. an "
                    "older commit's): adds the verified safetensors step run with it, side by side")
    args = ap.parse_args()
    if args.baseline_code:
        args.only.append("safetensors, verified" + BASELINE)
    root = args.dir or Path(tempfile.mkdtemp(prefix="shardscope-export-bench-"))
    src = root / ("ckpt" if args.layers == 8 else f"ckpt-{args.layers}")
    if not (src / ".metadata").exists():
        print(f"writing the checkpoint to {src} (4 gloo ranks, {args.layers} layers) ...", flush=True)
        generate(src, args.layers)
    size = sum(f.stat().st_size for f in src.iterdir())
    measure("cp -r + sync", src, root / "warm")  # warm the page cache once
    shutil.rmtree(root / "warm", ignore_errors=True)
    rows: dict[str, list[dict]] = {what: [] for what in args.only}
    print(f"\ncheckpoint: {size / 2**30:.2f} GiB in {len(list(src.glob('*.distcp')))} files; load average "
          f"{os.getloadavg()[0]:.1f}\n\n| round | step | wall time | peak RSS |\n|---:|---|---:|---:|", flush=True)
    for i in range(args.repeat):  # interleaved, so a noisy minute of the shared disk hits every step alike
        for what in args.only:
            dst = root / f"out-{i}{_suffix(what)}"
            r = measure(what, src, dst, args.baseline_code)
            rows[what].append(r)
            print(f"| {i + 1} | {what} | {r['seconds']:.2f} s | {r['peak_rss'] / 2**20:.0f} MiB |", flush=True)
            shutil.rmtree(dst, ignore_errors=True) if dst.is_dir() else dst.unlink(missing_ok=True)
            Path(str(dst) + ".shardscope.json").unlink(missing_ok=True)  # the lineage sidecar
    med = {what: {"seconds": statistics.median(r["seconds"] for r in runs),
                  "peak_rss": statistics.median(r["peak_rss"] for r in runs)} for what, runs in rows.items()}
    ref = med.get(REFERENCE)
    cp = med.get("cp -r + sync")
    print(f"\ncheckpoint: {size / 2**30:.2f} GiB in {len(list(src.glob('*.distcp')))} files; medians of "
          f"{args.repeat} alternating runs; load average {os.getloadavg()[0]:.1f} at the end; source in the page "
          "cache; every output on disk when its clock stops (fsync / sync) unless marked\n")
    print(f"| step | wall time | vs {REFERENCE} | vs cp -r + sync | peak RSS | vs {REFERENCE} | goal |\n"
          "|---|---:|---:|---:|---:|---:|---|")
    for what, r in med.items():
        rt = f"{r['seconds'] / ref['seconds']:.2f}x" if ref else ""
        rc = f"{r['seconds'] / cp['seconds']:.2f}x" if cp else ""
        rm = f"{r['peak_rss'] / ref['peak_rss']:.2f}x" if ref else ""
        goal = ""
        if what in GOALS and ref:
            t, m = GOALS[what]
            ok = r["seconds"] <= t * ref["seconds"] and r["peak_rss"] <= m * ref["peak_rss"]
            if what.startswith("safetensors") and cp:
                ok = ok and r["seconds"] <= 2 * cp["seconds"]
            goal = f"<= {t}x time, <= {m}x RSS" + (", <= 2x cp" if what.startswith("safetensors") else "") \
                + (": met" if ok else ": NOT met")
        print(f"| {what} | {r['seconds']:.2f} s | {rt} | {rc} | {r['peak_rss'] / 2**20:.0f} MiB | {rm} | {goal} |")


if __name__ == "__main__":
    main()
