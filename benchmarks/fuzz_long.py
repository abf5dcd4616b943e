"""The long mutation-fuzzing run: N mutated ``.metadata`` and M mutated ``.distcp`` files from real
``dcp.save`` checkpoints, each opened, verified deep and read in worker processes; counts tracebacks,
hangs (over the per-case limit) and peaks above 2x the checkpoint's size + 300 MB.

    python benchmarks/fuzz_long.py --metadata 100000 --distcp 20000 --workers 2

The fixtures come from ``tests/make_fixtures.py`` (written once into ``--fixtures``). Failing cases are
saved under ``--out`` with the seed that reproduces them (``tests/fuzz/harness.py``: ``mutated(seed, case)``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))

CHECKPOINTS = ["fsdp2_r2", "fsdp2_r4", "ddp_r2", "nopg", "fsdp_safetensors_r2", "fsdp_nocoll_r2", "lightning_r2"]
BATCH = 250


def _batch(args: tuple[str, str, list[int], float, str]) -> dict:
    """Worker: run a batch of cases of one kind; return counts, the worst peak and the failures."""
    import tempfile

    from fuzz.harness import corpus, make_case, mutated, run_case

    fixtures, kind, cases, timeout, out = args
    meta, data = corpus([Path(fixtures) / n for n in CHECKPOINTS])
    seeds = meta if kind == "metadata" else data
    counts: Counter = Counter()
    failures = []
    worst = 0
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        for case in cases:
            seed = seeds[case % len(seeds)]
            blob = mutated(seed, case)
            folder = make_case(seed.checkpoint, seed.target, blob, Path(tmp) / "case")
            result = run_case(folder, timeout)
            counts[result.kind] += 1
            worst = max(worst, result.peak)
            if result.kind in ("crash", "hang", "memory"):
                dst = Path(out) / f"{kind}-{case}"
                dst.mkdir(parents=True, exist_ok=True)
                (dst / seed.target).write_bytes(blob)
                (dst / "README.txt").write_text(f"{seed.checkpoint.name}/{seed.target} case {case}: {result.kind}\n"
                                                f"{result.detail}\n")
                failures.append({"kind": kind, "case": case, "seed": f"{seed.checkpoint.name}/{seed.target}",
                                 "outcome": result.kind, "detail": result.detail[-1500:]})
    return {"counts": dict(counts), "worst_peak": worst, "failures": failures}


def _fixtures(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(TESTS / "make_fixtures.py"), str(path)], check=True)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--metadata", type=int, default=100_000, help="mutated .metadata cases")
    ap.add_argument("--distcp", type=int, default=20_000, help="mutated .distcp cases")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=30.0, help="per-case limit in seconds (a hang)")
    ap.add_argument("--start", type=int, default=0, help="first case number (to continue a run)")
    ap.add_argument("--fixtures", default=str(Path.home() / ".cache" / "shardscope-fuzz-fixtures"))
    ap.add_argument("--out", default="fuzz-failures", help="where failing cases are saved")
    ap.add_argument("--minutes", type=float, default=0, help="stop submitting new batches after this long")
    args = ap.parse_args()
    fixtures = _fixtures(Path(args.fixtures))
    jobs = []
    for kind, n in (("metadata", args.metadata), ("distcp", args.distcp)):
        cases = list(range(args.start, args.start + n))
        jobs += [(str(fixtures), kind, cases[i:i + BATCH], args.timeout, args.out) for i in range(0, n, BATCH)]
    # interleave the two kinds so a time-boxed run covers both
    meta_jobs = [j for j in jobs if j[1] == "metadata"]
    data_jobs = [j for j in jobs if j[1] == "distcp"]
    ratio = max(1, len(meta_jobs) // max(1, len(data_jobs)))
    order = []
    while meta_jobs or data_jobs:
        order += meta_jobs[:ratio] + data_jobs[:1]
        del meta_jobs[:ratio], data_jobs[:1]
    t0 = time.monotonic()
    totals = {"metadata": Counter(), "distcp": Counter()}
    worst = 0
    failures: list[dict] = []
    with ProcessPoolExecutor(args.workers, max_tasks_per_child=4) as pool:
        pending = {}
        it = iter(order)
        for job in it:
            pending[pool.submit(_batch, job)] = job
            if len(pending) >= 2 * args.workers:
                break
        while pending:
            fut = next(iter(pending))
            job = pending.pop(fut)
            try:
                res = fut.result(timeout=args.timeout * BATCH + 600)
            except FutureTimeout:
                totals[job[1]]["hang"] += len(job[2])
                failures.append({"kind": job[1], "case": job[2][0], "outcome": "hang", "detail": "batch timed out"})
                continue
            totals[job[1]].update(res["counts"])
            worst = max(worst, res["worst_peak"])
            failures += res["failures"]
            done = sum(sum(c.values()) for c in totals.values())
            print(f"{time.monotonic() - t0:7.0f} s  {done} cases  metadata {dict(totals['metadata'])}  "
                  f"distcp {dict(totals['distcp'])}  failures {len(failures)}", flush=True)
            if args.minutes and time.monotonic() - t0 > args.minutes * 60:
                continue  # let the running batches finish, submit no more
            nxt = next(it, None)
            if nxt is not None:
                pending[pool.submit(_batch, nxt)] = nxt
    elapsed = time.monotonic() - t0
    print("\n| kind | cases | ok | problems found | clean error (exit 2) | tracebacks | hangs > "
          f"{args.timeout:.0f} s | memory over 2x+300 MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind, c in totals.items():
        print(f"| {kind} | {sum(c.values())} | {c['ok']} | {c['problems']} | {c['error']} | {c['crash']} | "
              f"{c['hang']} | {c['memory']} |")
    print(f"\n{elapsed / 60:.1f} min, worst peak above the worker's baseline {worst >> 20} MB")
    for f in failures[:20]:
        print(json.dumps(f)[:2000])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
