"""`shardscope ls` on 1,000 checkpoints in 50 runs: goal under 2 s.

Generates a tree of 50 Shardscope run directories (config.json, status.json, a metrics file) with 20 DCP
checkpoint folders each (a small ``.metadata`` and one ``__R_0.distcp`` per rank for 4 ranks; sizes do not
matter to a listing, which reads names, ``stat`` and a few header bytes), then times, side by side with the
same (warm) page cache: the library scan in-process, the whole ``shardscope ls --json`` command (process
start and imports included), and two references that only walk the same tree: ``du -s`` (stats every file)
and ``find -name .metadata`` (lists every folder).

    python benchmarks/library_ls.py [--runs 50] [--per-run 20] [--ranks 4] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_tree(root: Path, runs: int, per_run: int, ranks: int) -> int:
    """Write the tree; returns the number of checkpoints."""
    n = 0
    for r in range(runs):
        run = root / f"run-{r:03d}"
        (run / "metrics").mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"strategy": "fsdp", "nproc": ranks}))
        (run / "status.json").write_text(json.dumps({"state": "finished", "pid": 1}))
        with open(run / "metrics" / "rank_0.jsonl", "w") as f:
            for step in range(1, per_run * 100 + 1):
                f.write(json.dumps({"step": step, "loss": 5.0 / step}) + "\n")
        for k in range(1, per_run + 1):
            ck = run / "checkpoints" / f"step_{k * 100:06d}"
            ck.mkdir(parents=True)
            (ck / ".metadata").write_bytes(b"\x80\x04" + bytes(1022))
            for rank in range(ranks):
                (ck / f"__{rank}_0.distcp").write_bytes(b"PK\x03\x04" + bytes(4092))
            n += 1
    old = time.time() - 3600
    for p in root.rglob("*"):
        os.utime(p, (old, old))
    return n


def best_of(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--per-run", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--keep", help="write the tree here and keep it")
    args = ap.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="shardscope-ls-bench-"))
    try:
        if root.exists() and any(root.iterdir()):  # a tree kept from an earlier --keep
            count = sum(1 for _ in root.glob("*/checkpoints/*"))
        else:
            root.mkdir(parents=True, exist_ok=True)
            count = make_tree(root, args.runs, args.per_run, args.ranks)
        files = sum(1 for _ in root.rglob("*"))
        from shardscope.backend.library import scan

        listing = scan([root])
        assert len(listing.checkpoints) == count and len(listing.runs) == args.runs, "the listing is wrong"
        cli = [sys.executable, "-m", "shardscope.app.cli", "ls", str(root), "--json"]
        rows = [
            ("shardscope library scan (in-process)", best_of(lambda: scan([root]))),
            ("`shardscope ls --json` (whole command)",
             best_of(lambda: subprocess.run(cli, check=True, stdout=subprocess.DEVNULL))),
            ("`du -s` (reference: stat every file)",
             best_of(lambda: subprocess.run(["du", "-s", str(root)], check=True, stdout=subprocess.DEVNULL))),
            ("`find -name .metadata` (reference: list every folder)",
             best_of(lambda: subprocess.run(["find", str(root), "-name", ".metadata"], check=True,
                                            stdout=subprocess.DEVNULL))),
        ]
        print(f"{count} checkpoints in {args.runs} runs ({files} files and folders); warm page cache; best of 3\n")
        print("| what | wall time | per checkpoint |")
        print("|---|---:|---:|")
        for name, seconds in rows:
            print(f"| {name} | {seconds:.3f} s | {1000 * seconds / count:.2f} ms |")
        goal = rows[1][1]
        print(f"\nGoal: the whole `shardscope ls` under 2 s: {'met' if goal < 2 else 'NOT met'} ({goal:.2f} s).")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
