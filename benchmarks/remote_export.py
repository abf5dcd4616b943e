"""Export a checkpoint that lives on S3, side by side with torch's own remote reader.

A 4-rank FSDP2 checkpoint (gloo processes, ``dcp.save`` of the model and its AdamW state after one step,
~SIZE MiB in 4 ``.distcp`` files + ``.metadata``) is uploaded to a local S3 API server (moto's server mode,
in its own process, counting every request it answers, by kind), then:

* torch:       ``FsspecReader`` + ``_EmptyStateDictLoadPlanner`` (what ``dcp_to_torch_save`` does) and
               ``safetensors.torch.save_file`` of every tensor it read, output fsynced (same durability as
               Shardscope)
* shardscope:  ``shardscope export s3://... out.safetensors --only model --only optimizer`` (the same tensors,
               verified: the default), and the same with ``--no-verify``
* verify-deep: ``shardscope verify --deep s3://...`` (every item read, CRC32 checked)

each in a fresh process, the steps alternating, ``--repeat`` rounds: wall time, requests at the server (LIST,
GET, HEAD, other), peak RSS (VmHWM); a table per run, then medians, and whether each step made the same
requests on every run.

    python benchmarks/remote_export.py [--size-mib 480] [--dir DIR] [--repeat 3] [--steps torch,shardscope]
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
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

BUCKET = "bench"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str, layers: int, vocab: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    width = 1024

    def layer() -> nn.Module:
        return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(3 * width, width),
                             nn.Linear(width, 4 * width), nn.Linear(4 * width, width))

    model = nn.Sequential(nn.Embedding(vocab, width), *[layer() for _ in range(layers)], nn.Linear(width, vocab))
    for m in model[1:-1]:
        fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randint(0, vocab, (1, 4))).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def make_checkpoint(out: Path, size_mib: int) -> None:
    """About ``size_mib`` MiB of model weights and AdamW state (3 fp32 copies of every parameter)."""
    import torch.multiprocessing as mp

    vocab = 16000 if size_mib >= 768 else 4000
    params = size_mib * 2**20 / 4 / 3 * 1.11  # dcp.save's files hold a little less than params x 12 bytes here
    per_layer = 14 * 1024 * 1024 + 11 * 1024
    layers = max(1, round((params - 2 * vocab * 1024) / per_layer))
    mp.start_processes(_worker, args=(4, _port(), str(out), layers, vocab), nprocs=4, start_method="spawn")


def _flat(prefix: str, value, out: dict) -> None:
    """torch's nested state dict as flat dotted keys (safetensors holds a flat dict of tensors)."""
    import torch

    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _flat(f"{prefix}.{i}", v, out)
    elif isinstance(value, torch.Tensor):
        out[prefix] = value.contiguous()


# ------------------------------------------------------------------ the measured steps (fresh processes)
def child(what: str, url: str, out: str) -> None:
    from _measure import emit

    t0 = time.perf_counter()
    if what == "torch":
        from safetensors.torch import save_file
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        state: dict = {}
        _load_state_dict(state, storage_reader=FsspecReader(url), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
        flat: dict = {}
        _flat("", state, flat)
        save_file(flat, out)
        fd = os.open(out, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        code = 0
    else:
        from shardscope.app.cli import main

        same = ["--only", "model", "--only", "optimizer"]  # the tensors torch's step writes
        args = {"shardscope": ["export", url, out, *same],
                "shardscope-no-verify": ["export", url, out, *same, "--no-verify"],
                "verify-deep": ["verify", "--deep", url, "--no-cache"]}[what]
        code = main(args)
    emit(time.perf_counter() - t0, code=code)


def measure(server, what: str, url: str, out: str) -> dict:
    env = {**os.environ, **server.env(), "SHARDSCOPE_CACHE_DIR": tempfile.mkdtemp(prefix="ss-bench-cache-")}
    server.reset()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", what, url, out], capture_output=True, text=True,
                          env=env)
    wall = time.perf_counter() - t0
    shutil.rmtree(env["SHARDSCOPE_CACHE_DIR"], ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    kinds = server.kinds()
    row.update(what=what, wall=wall, requests=sum(kinds.values()), kinds=kinds)
    for path in (out, out + ".shardscope.json"):  # the output and its lineage sidecar
        if os.path.exists(path):
            os.unlink(path)
    return row


def _vs(a: float, b: float | None) -> str:
    return f"{a / b:.2f}x" if b else ""


def _kinds(r: dict) -> str:
    k = dict(r["kinds"])
    parts = [f"{k.pop(name, 0)} {name}" for name in ("LIST", "GET", "HEAD")]
    return ", ".join(parts + [f"{v} {name}" for name, v in sorted(k.items())])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=480)
    ap.add_argument("--dir", help="work folder (default: a temporary one)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", default="torch,shardscope,shardscope-no-verify,verify-deep",
                    help="comma-separated steps to run (alternating, --repeat rounds)")
    args = ap.parse_args()

    import s3fs
    from s3_server import S3Server

    work = Path(args.dir or tempfile.mkdtemp(prefix="ss-remote-bench-"))
    ckpt = work / f"fsdp2_adamw_r4_{args.size_mib}mib"
    if not (ckpt / ".metadata").exists():
        print(f"writing the checkpoint (~{args.size_mib} MiB: model + AdamW state, 4 gloo ranks) ...", flush=True)
        make_checkpoint(ckpt, args.size_mib)
    size = sum(p.stat().st_size for p in ckpt.iterdir())
    server = S3Server()
    try:
        fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": server.endpoint})
        fs.mkdir(BUCKET)
        for f in ckpt.iterdir():  # one PUT per file (moto's multipart assembly is not thread-safe)
            fs.pipe(f"{BUCKET}/ckpt/{f.name}", f.read_bytes())
        url = f"s3://{BUCKET}/ckpt"
        objects = sum(1 for _ in ckpt.iterdir())
        print(f"checkpoint: {size / 2**20:.0f} MiB in {objects} objects at {url} (moto server {server.endpoint}); "
              f"load average {os.getloadavg()[0]:.1f}\n")
        steps = args.steps.split(",")
        rows = []
        print("| run | step | wall time | requests | by kind | peak RSS |\n|---:|---|---:|---:|---|---:|")
        for i in range(args.repeat):
            for what in steps:
                r = measure(server, what, url, str(work / "out.safetensors"))
                r["run"] = i + 1
                rows.append(r)
                print(f"| {i + 1} | {what} | {r['wall']:.1f} s | {r['requests']} | {_kinds(r)} | "
                      f"{r['peak_rss'] / 2**20:.0f} MiB |", flush=True)
        ref = [r for r in rows if r["what"] == "torch"]
        ref_wall = statistics.median(r["wall"] for r in ref) if ref else None
        ref_req = statistics.median(r["requests"] for r in ref) if ref else None
        ref_rss = statistics.median(r["peak_rss"] for r in ref) if ref else None
        print(f"\nmedians of {args.repeat} runs, alternating; load average {os.getloadavg()[0]:.1f} at the end\n")
        print("| step | wall time | vs torch | requests | vs torch | same count every run | peak RSS | vs torch |\n"
              "|---|---:|---:|---:|---:|---|---:|---:|")
        for what in steps:
            mine = [r for r in rows if r["what"] == what]
            wall = statistics.median(r["wall"] for r in mine)
            req = statistics.median(r["requests"] for r in mine)
            rss = statistics.median(r["peak_rss"] for r in mine)
            counts = sorted({r["requests"] for r in mine})
            same = "yes" if len({json.dumps(r["kinds"], sort_keys=True) for r in mine}) == 1 \
                else f"no ({', '.join(map(str, counts))})"
            print(f"| {what} | {wall:.1f} s | {_vs(wall, ref_wall)} | {req:g} | {_vs(req, ref_req)} | {same} | "
                  f"{rss / 2**20:.0f} MiB | {_vs(rss, ref_rss)} |")
    finally:
        server.stop()
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
    else:
        main()
