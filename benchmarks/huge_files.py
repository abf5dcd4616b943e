"""Huge but legal single files: ``shardscope import`` of a safetensors file with 300,000 entries and of a
``.pt`` with 100,000 tiny tensors, against the plain way a user would do it with torch.

Writes both files with their own libraries (``safetensors.torch.save_file``: 300,000 float32 tensors of 4
values, about 28 MB, most of it header; ``torch.save``: 100,000 float32 tensors of 4 values), then runs, each in
a fresh process, alternating, N rounds:

- ``shardscope import FILE OUT`` (the whole command: process start, imports, the verification it does by default);
- the reference: ``torch.load(FILE, weights_only=True)`` (``safetensors.torch.load_file`` for the safetensors
  file) then ``torch.distributed.checkpoint.save(state_dict, checkpoint_id=OUT)`` in one process (its imports
  included, no verification).

Prints wall time and peak RSS (VmHWM of the process) per step, medians, and the ratio to the reference.
Also times ``inspect --json``, ``verify`` and ``export`` (to safetensors) of each file once, for the record.

    python benchmarks/huge_files.py [--rounds 3] [--entries 300000] [--tensors 100000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

REFERENCE = """
import sys, time, torch
import torch.distributed.checkpoint as dcp
src, out = sys.argv[1], sys.argv[2]
if src.endswith(".safetensors"):
    from safetensors.torch import load_file
    sd = load_file(src)
else:
    sd = torch.load(src, weights_only=True)
dcp.save(sd, checkpoint_id=out)
"""

MAKE = """
import sys, torch
n, kind, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
g = torch.Generator().manual_seed(0)
sd = {f"layer.{i}.w": torch.randn(4, generator=g) for i in range(n)}
if kind == "safetensors":
    from safetensors.torch import save_file
    save_file(sd, out)
else:
    torch.save(sd, out)
"""


def measured(cmd: list[str]) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit code) of a command in a fresh process (GNU time's %M: VmHWM)."""
    t0 = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True)
    seconds = time.perf_counter() - t0
    rss = int(p.stderr.strip().splitlines()[-1]) * 1024 if p.stderr.strip() else 0
    if p.returncode:
        print(f"  {' '.join(cmd[:4])} ... exited {p.returncode}: {p.stderr.strip()[-400:]}", file=sys.stderr)
    return seconds, rss, p.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--entries", type=int, default=300_000, help="entries of the safetensors file")
    ap.add_argument("--tensors", type=int, default=100_000, help="tensors of the .pt file")
    ap.add_argument("--keep", help="write the files here and keep them (reused when present)")
    args = ap.parse_args()
    root = args.keep or tempfile.mkdtemp(prefix="shardscope-huge-")
    os.makedirs(root, exist_ok=True)
    py = sys.executable
    shardscope = [py, "-m", "shardscope.app.cli"]
    files = {"safetensors": os.path.join(root, f"entries-{args.entries}.safetensors"),
             "pt": os.path.join(root, f"tensors-{args.tensors}.pt")}
    try:
        for kind, path in files.items():
            if not os.path.exists(path):
                n = args.entries if kind == "safetensors" else args.tensors
                subprocess.run([py, "-c", MAKE, str(n), kind, path + ".tmp"], check=True)
                os.replace(path + ".tmp", path)
        out = os.path.join(root, "out")
        times: dict[tuple[str, str], list[tuple[float, int]]] = {}
        for _ in range(args.rounds):
            for kind, path in files.items():
                for who, cmd in (("shardscope import", [*shardscope, "import", path, out]),
                                 ("torch.load + dcp.save", [py, "-c", REFERENCE, path, out])):
                    shutil.rmtree(out, ignore_errors=True)
                    seconds, rss, rc = measured(cmd)
                    times.setdefault((kind, who), []).append((seconds if rc == 0 else float("nan"), rss))
                    print(f"  {kind}: {who}: {seconds:.2f} s, {rss / 2**20:.0f} MiB", file=sys.stderr, flush=True)
        shutil.rmtree(out, ignore_errors=True)
        sizes = {k: os.path.getsize(p) for k, p in files.items()}
        print(f"safetensors: {args.entries:,} entries, {sizes['safetensors'] / 2**20:.1f} MiB; .pt: {args.tensors:,} "
              f"tensors, {sizes['pt'] / 2**20:.1f} MiB; fresh process each, alternating, median of {args.rounds}; "
              f"load average {os.getloadavg()[0]:.1f} at the end\n")
        print("| file | step | wall time | vs reference | peak RSS | vs reference | runs (s) |")
        print("|---|---|---:|---:|---:|---:|---|")
        for kind in files:
            ref_t = statistics.median(t for t, _ in times[(kind, "torch.load + dcp.save")])
            ref_m = statistics.median(m for _, m in times[(kind, "torch.load + dcp.save")])
            for who in ("shardscope import", "torch.load + dcp.save"):
                rows = times[(kind, who)]
                t = statistics.median(x for x, _ in rows)
                m = statistics.median(x for _, x in rows)
                print(f"| {kind} | {who} | {t:.2f} s | {t / ref_t:.2f}x | {m / 2**20:.0f} MiB | {m / ref_m:.2f}x | "
                      f"{' '.join(f'{x:.1f}' for x, _ in rows)} |")
        print("\nOther commands on the same files (one run each):\n")
        print("| file | command | wall time | peak RSS |")
        print("|---|---|---:|---:|")
        for kind, path in files.items():
            exported = os.path.join(root, "exported.safetensors")
            for name, cmd in (("inspect --json", [*shardscope, "--no-cache", "inspect", "--json", path]),
                              ("verify", [*shardscope, "verify", path]),
                              ("export to safetensors", [*shardscope, "export", path, exported, "--force"])):
                seconds, rss, rc = measured(cmd)
                print(f"| {kind} | `{name}` | {seconds:.2f} s{'' if rc in (0, 1) else f' (exit {rc})'} | "
                      f"{rss / 2**20:.0f} MiB |")
            if os.path.exists(exported):
                os.remove(exported)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
