"""Export a checkpoint that lives on S3, side by side with torch's own remote reader.

A 4-rank FSDP2 checkpoint (gloo processes, ``dcp.save``, model weights only, ~SIZE MiB) is uploaded to a
local S3 API server (moto's server mode, in its own process, counting every request it answers), then:

* torch:       ``FsspecReader`` + ``_EmptyStateDictLoadPlanner`` (what ``dcp_to_torch_save`` does) and
               ``safetensors.torch.save_file``, output fsynced (same durability as Shardscope)
* shardscope:  ``shardscope export s3://... out.safetensors`` (verified: the default), and ``--no-verify``
* verify:      ``shardscope verify --deep s3://...`` (every item read, CRC32 checked)

each in a fresh process: wall time, requests at the server, peak RSS (VmHWM).

    python benchmarks/remote_export.py [--size-mib 512] [--dir DIR] [--repeat 1] [--steps torch,shardscope]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
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
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
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
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def make_checkpoint(out: Path, size_mib: int) -> None:
    import torch.multiprocessing as mp

    vocab = 16000 if size_mib >= 256 else 4000
    per_layer = (14 * 1024 * 1024 + 11 * 1024) * 4
    layers = max(1, round((size_mib * 2**20 - 2 * vocab * 1024 * 4) / per_layer))
    mp.start_processes(_worker, args=(4, _port(), str(out), layers, vocab), nprocs=4, start_method="spawn")


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
        save_file(state["model"], out)
        fd = os.open(out, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        code = 0
    else:
        from shardscope.app.cli import main

        args = {"shardscope": ["export", url, out], "shardscope-no-verify": ["export", url, out, "--no-verify"],
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
    row.update(what=what, wall=wall, requests=server.total())
    if os.path.exists(out):
        os.unlink(out)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--dir", help="work folder (default: a temporary one)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--steps", default="torch,shardscope,shardscope-no-verify,verify-deep",
                    help="comma-separated steps to run")
    args = ap.parse_args()

    import s3fs
    from s3_server import S3Server

    work = Path(args.dir or tempfile.mkdtemp(prefix="ss-remote-bench-"))
    ckpt = work / f"fsdp2_r4_{args.size_mib}mib"
    if not (ckpt / ".metadata").exists():
        print(f"writing the checkpoint ({args.size_mib} MiB, 4 gloo ranks) ...", flush=True)
        make_checkpoint(ckpt, args.size_mib)
    size = sum(p.stat().st_size for p in ckpt.iterdir())
    server = S3Server()
    try:
        fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": server.endpoint})
        fs.mkdir(BUCKET)
        for f in ckpt.iterdir():  # one PUT per file (moto's multipart assembly is not thread-safe)
            fs.pipe(f"{BUCKET}/ckpt/{f.name}", f.read_bytes())
        url = f"s3://{BUCKET}/ckpt"
        print(f"checkpoint: {size / 2**20:.0f} MiB in {sum(1 for _ in ckpt.iterdir())} files at {url} "
              f"(moto server {server.endpoint})\n")
        rows = []
        for _ in range(args.repeat):
            for what in args.steps.split(","):
                rows.append(measure(server, what, url, str(work / "out.safetensors")))
                r = rows[-1]
                print(f"  {what:22s} {r['wall']:7.1f} s  {r['requests']:6d} requests  "
                      f"{r['peak_rss'] / 2**20:7.0f} MiB peak RSS", flush=True)
        print("\n| step | wall time | requests | peak RSS |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['what']} | {r['wall']:.1f} s | {r['requests']} | {r['peak_rss'] / 2**20:.0f} MiB |")
    finally:
        server.stop()
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
    else:
        main()
