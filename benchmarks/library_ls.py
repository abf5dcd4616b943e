"""`shardscope ls` on 10,000 checkpoints in 200 runs against `find` on the same tree: goal <= 0.3 s warm on a quiet
machine, process start included (issue 35).

Generates a tree of 200 Shardscope run directories (config.json, status.json, a metrics file) with 50 DCP
checkpoint folders each (a small ``.metadata`` and one ``__R_0.distcp`` per rank for 4 ranks; sizes do not
matter to a listing, which reads names, ``stat`` and a few header bytes), warms the page cache, then runs, each
as a real subprocess, alternating, ``--rounds`` times: ``shardscope ls ROOT`` and ``shardscope ls ROOT --json``
(process start and imports included; the listing's probe cache warm: it lives in a temporary
``$SHARDSCOPE_CACHE_DIR`` that the first listing fills), ``shardscope --no-cache ls ROOT`` (every header read
again), and two references that only walk the same tree: ``find ROOT -name .metadata`` (lists every folder) and
``du -s`` (stats every file). Prints medians of wall time and of CPU time (user + system of the child: what a
loaded machine does not inflate as much); the library scan in-process is timed too (best of the rounds), to
show what the interpreter and imports add.

    python benchmarks/library_ls.py [--runs 200] [--per-run 50] [--ranks 4] [--rounds 5] [--keep DIR]
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


def wall(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall time, user + system CPU time) of one run of ``cmd``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    took = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return took, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--per-run", type=int, default=50)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--keep", help="write the tree here and keep it")
    ap.add_argument("--baseline", metavar="PYTHONPATH", help="also time `shardscope ls` with the `shardscope` package "
                    "found on this path (an older version laid out as installed), in the same rounds")
    args = ap.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="shardscope-ls-bench-"))
    cache = tempfile.mkdtemp(prefix="shardscope-ls-bench-cache-")
    os.environ["SHARDSCOPE_CACHE_DIR"] = cache  # the listing's probe cache: this run's own, warmed below
    try:
        if root.exists() and any(root.iterdir()):  # a tree kept from an earlier --keep
            count = sum(1 for _ in root.glob("*/checkpoints/*"))
        else:
            root.mkdir(parents=True, exist_ok=True)
            count = make_tree(root, args.runs, args.per_run, args.ranks)
        files = sum(1 for _ in root.rglob("*"))
        from shardscope.backend.library import scan

        listing = scan([root])  # also warms the page cache
        assert len(listing.checkpoints) == count and len(listing.runs) == args.runs, "the listing is wrong"
        cli = [sys.executable, "-m", "shardscope.app.cli", "ls", str(root)]
        steps = {
            "`shardscope ls` (whole command)": cli,
            "`shardscope ls --json` (whole command)": [*cli, "--json"],
            "`find -name .metadata` (reference: list every folder)": ["find", str(root), "-name", ".metadata"],
            "`du -s` (reference: stat every file)": ["du", "-s", str(root)],
        }
        envs: dict[str, dict[str, str] | None] = dict.fromkeys(steps)
        if args.baseline:
            env = {**os.environ, "PYTHONPATH": args.baseline}
            for name, cmd in (("`shardscope ls`, baseline", cli),
                              ("`shardscope ls --json`, baseline", [*cli, "--json"])):
                steps[name], envs[name] = cmd, env
        # last in each round, right after the baseline's (which reads every header), so that it finds the headers
        # in the page cache as the baseline did: a warm `ls` leaves them unread, and a loaded machine evicts them
        steps["`shardscope --no-cache ls` (every header read)"] = [*cli[:3], "--no-cache", *cli[3:]]
        envs[next(reversed(steps))] = None
        subprocess.run(cli, check=True, stdout=subprocess.DEVNULL)  # bytecode written (where allowed)
        if args.baseline:
            subprocess.run(cli, check=True, stdout=subprocess.DEVNULL, env=envs["`shardscope ls`, baseline"])
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
        scans = []
        for _ in range(args.rounds):
            for name, cmd in steps.items():
                times[name].append(wall(cmd, envs[name]))
            t0 = time.perf_counter()
            scan([root])
            scans.append(time.perf_counter() - t0)
        find = statistics.median(t for t, _ in times["`find -name .metadata` (reference: list every folder)"])
        print(f"{count} checkpoints in {args.runs} runs ({files} files and folders); warm page cache; fresh process "
              f"each, alternating, median of {args.rounds}; load average {os.getloadavg()[0]:.1f} at the end\n")
        print("| what | wall time | vs find | CPU time (user+sys) | per checkpoint | runs (s) |")
        print("|---|---:|---:|---:|---:|---|")
        for name, ts in times.items():
            m = statistics.median(t for t, _ in ts)
            cpu = statistics.median(c for _, c in ts)
            print(f"| {name} | {m:.3f} s | {m / find:.1f}x | {cpu:.3f} s | {1000 * m / count:.3f} ms | "
                  f"{' '.join(f'{t:.2f}' for t, _ in ts)} |")
        best = min(scans)
        print(f"| library scan in-process (best of {args.rounds}) | {best:.3f} s | {best / find:.1f}x | | "
              f"{1000 * best / count:.3f} ms | |")
        goal = statistics.median(t for t, _ in times["`shardscope ls` (whole command)"])
        print(f"\nGoal: the whole `shardscope ls` <= 0.3 s warm on a quiet machine: "
              f"{'met' if goal <= 0.3 else 'NOT met'} here ({goal:.2f} s).")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
