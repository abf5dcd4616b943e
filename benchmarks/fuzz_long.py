"""The long mutation-fuzzing run: N mutated ``.metadata`` and M mutated ``.distcp`` files from real
``dcp.save`` checkpoints, each opened, verified deep and read in worker processes; counts tracebacks,
hangs (over the per-case limit), peaks above 2x the checkpoint's size + 300 MB, and (``.distcp`` cases,
torch's own DCP loader as the oracle) "healthy" verdicts on folders torch cannot load or values that differ
from torch's. Two more kinds with an oracle: ``order``, the same Metadata pickled in another order (an extra
attribute placed first, or storage_data dropped: torch's loader the oracle, a problem where it reads is a
failure too), and ``safetensors``, ``save_file`` outputs with holes, names twice, tails and overlaps
(``safetensors.safe_open`` the oracle), and ``zstd``, torch's own ZStandard DCP with an item mutated inside or
outside its frame or a frame lying about its size (``tests/fuzz/zstd_files.py``; torch's loader the oracle).

    python benchmarks/fuzz_long.py --metadata 100000 --distcp 20000 --workers 1 [--minutes M]
    python benchmarks/fuzz_long.py --metadata 0 --distcp 0 --order 2000 --safetensors 20000   # the new kinds only
    python benchmarks/fuzz_long.py ... --start-metadata 26750 --start-distcp 5250   # continue case numbers
    python benchmarks/fuzz_long.py ... --isolated   # metadata loads in the helper process, as in the window

The fixtures come from ``tests/make_fixtures.py`` (written once into ``--fixtures``). Failing cases are
saved under ``--out`` with the seed that reproduces them (``tests/fuzz/harness.py``: ``mutated(seed, case)``).
The case numbers each kind ran are printed at the end, so runs can be added up without overlap.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))

CHECKPOINTS = ["fsdp2_r2", "fsdp2_r4", "ddp_r2", "nopg", "fsdp_safetensors_r2", "fsdp_nocoll_r2", "lightning_r2"]
BATCH = 250
KINDS = ("metadata", "distcp", "order", "safetensors", "zstd")
ZSTD_SEED = "zstd_dcp"  # written beside the fixtures by torch's FileSystemWriter with ZStandard


_SEEDS: dict[str, list] = {}


def _load_corpus(fixtures: str, isolated: bool = False) -> None:
    """Worker initializer: read the seed files once per worker (it imports torch; it used to run per batch).
    ``isolated``: metadata loads go through the helper process, as on the window's worker threads."""
    import tempfile

    from fuzz.harness import corpus, torch_reads
    from fuzz.safetensors_files import safetensors_corpus
    from shardscope.backend.checkpoint import reader_process

    reader_process.ISOLATE = True if isolated else None
    _SEEDS["metadata"], _SEEDS["distcp"] = corpus([Path(fixtures) / n for n in CHECKPOINTS])
    _SEEDS["order"] = [s for s in _SEEDS["metadata"] if s.target == ".metadata" and torch_reads(s.checkpoint)]
    with tempfile.TemporaryDirectory(prefix="fuzz-st-") as tmp:
        _SEEDS["safetensors"] = safetensors_corpus(Path(tmp))
    _SEEDS["zstd"] = [Path(fixtures) / ZSTD_SEED]


def _case(kind: str, seed: object, case: int, timeout: float, tmp: Path) -> tuple[bytes, str, object]:
    """Run case ``case`` of a kind on its seed: (the mutated bytes, the file they went to, the outcome)."""
    from fuzz.harness import make_case, mutated, run_case, run_same_metadata_case, torch_reads
    from fuzz.mutators import metadata_attribute_order
    from fuzz.safetensors_files import NAME, exercise_safetensors
    from fuzz.safetensors_files import mutated_file as mutated_safetensors

    if kind == "zstd":
        from fuzz.zstd_files import mutated_items, rebuild

        folder = rebuild(seed, tmp / "case", mutated_items(seed, case))  # the .distcp and its .metadata
        data = next(folder.glob("*.distcp"))
        return data.read_bytes(), data.name, run_case(folder, timeout, oracle=True)
    if kind == "safetensors":
        folder = tmp / "case"
        folder.mkdir(exist_ok=True)
        blob = mutated_safetensors(seed, case)
        (folder / NAME).write_bytes(blob)
        return blob, NAME, run_case(folder, timeout, oracle=True, check=exercise_safetensors)
    blob = mutated(seed, case, [metadata_attribute_order] if kind == "order" else None)
    folder = make_case(seed.checkpoint, seed.target, blob, tmp / "case")
    if kind == "order":
        return blob, seed.target, run_same_metadata_case(folder, timeout)
    oracle = kind == "distcp" and torch_reads(seed.checkpoint)  # torch's loader as the oracle
    return blob, seed.target, run_case(folder, timeout, oracle=oracle)


def _batch(args: tuple[str, str, list[int], float, str]) -> dict:
    """Worker: run a batch of cases of one kind; return counts, the worst peak and the failures."""
    import faulthandler
    import tempfile

    fixtures, kind, cases, timeout, out = args
    if not _SEEDS:
        _load_corpus(fixtures)  # not started through the pool's initializer
    seeds = _SEEDS[kind]
    counts: Counter = Counter()
    failures = []
    worst = 0
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        for case in cases:
            seed = seeds[case % len(seeds)]
            # NOTE: a hang inside C code never reaches the per-case SIGALRM; this watchdog (a C thread) then
            # prints every thread's stack and ends the worker, which the parent reports with the batch.
            faulthandler.dump_traceback_later(2 * timeout + 60, exit=True)
            try:
                blob, target, result = _case(kind, seed, case, timeout, Path(tmp))
            finally:
                faulthandler.cancel_dump_traceback_later()
            counts[result.kind] += 1
            worst = max(worst, result.peak)
            if result.kind in ("crash", "hang", "memory", "unsound"):
                dst = Path(out) / f"{kind}-{case}"
                dst.mkdir(parents=True, exist_ok=True)
                (dst / target).write_bytes(blob)
                where = getattr(seed, "name", None) or f"{seed.checkpoint.name}/{seed.target}"
                (dst / "README.txt").write_text(f"{where} case {case}: {result.kind}\n{result.detail}\n")
                failures.append({"kind": kind, "case": case, "seed": where, "outcome": result.kind,
                                 "detail": result.detail[-1500:]})
    return {"counts": dict(counts), "worst_peak": worst, "failures": failures}


def _fixtures(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(TESTS / "make_fixtures.py"), str(path)], check=True)
    if not (path / ZSTD_SEED / ".metadata").is_file():
        from fuzz.zstd_files import write_zstd_checkpoint

        write_zstd_checkpoint(path / ZSTD_SEED)
    return path


def _jobs(args: argparse.Namespace, fixtures: Path) -> list[tuple]:
    """The batches in the order they run: the two kinds interleaved, so a time-boxed run covers both."""
    starts = {"metadata": args.start if args.start_metadata is None else args.start_metadata,
              "distcp": args.start if args.start_distcp is None else args.start_distcp}
    per_kind = {}
    for kind, n in (("metadata", args.metadata), ("distcp", args.distcp), ("order", args.order),
                    ("safetensors", args.safetensors), ("zstd", args.zstd)):
        first = starts.get(kind, args.start)
        cases = list(range(first, first + n))
        per_kind[kind] = [(str(fixtures), kind, cases[i:i + BATCH], args.timeout, args.out) for i in range(0, n, BATCH)]
    meta_jobs, data_jobs = per_kind["metadata"], per_kind["distcp"]
    ratio = max(1, len(meta_jobs) // max(1, len(data_jobs)))
    others = [per_kind["order"], per_kind["safetensors"], per_kind["zstd"]]
    order = []
    while meta_jobs or data_jobs or any(others):
        order += meta_jobs[:ratio] + data_jobs[:1] + [jobs.pop(0) for jobs in others if jobs]
        del meta_jobs[:ratio], data_jobs[:1]
    return order


class Run:
    """Counts, failures and the case numbers done, per kind."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.totals = {k: Counter() for k in KINDS}
        self.done: dict[str, list[int]] = {k: [] for k in KINDS}
        self.worst = 0
        self.failures: list[dict] = []

    def add(self, job: tuple, res: dict) -> None:
        kind = job[1]
        self.totals[kind].update(res["counts"])
        self.done[kind] += job[2]
        self.worst = max(self.worst, res["worst_peak"])
        self.failures += res["failures"]
        n = sum(sum(c.values()) for c in self.totals.values())
        secs = time.monotonic() - self.t0
        kinds = "  ".join(f"{k} {dict(c)}" for k, c in self.totals.items() if c)
        print(f"{secs:7.0f} s  {n} cases ({n / max(secs, 1e-9):.1f}/s)  {kinds}  failures {len(self.failures)}",
              flush=True)

    def report(self, timeout: float) -> None:
        print("\n| kind | cases | ok | problems found | clean error (exit 2) | tracebacks | hangs > "
              f"{timeout:.0f} s | memory over 2x+300 MB | healthy or wrong values where the oracle disagrees |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for kind, c in self.totals.items():
            print(f"| {kind} | {sum(c.values())} | {c['ok']} | {c['problems']} | {c['error']} | {c['crash']} | "
                  f"{c['hang']} | {c['memory']} | {c['unsound']} |")
        for kind, cases in self.done.items():
            span = sorted(cases)
            whole = bool(span) and span == list(range(span[0], span[-1] + 1))
            where = f"{span[0]}-{span[-1]}{'' if whole else ' (with gaps)'}" if span else "none"
            print(f"{kind} case numbers run: {where}")
        print(f"\n{(time.monotonic() - self.t0) / 60:.1f} min, worst peak above the worker's baseline "
              f"{self.worst >> 20} MB")
        for f in self.failures[:20]:
            print(json.dumps(f)[:2000])


def _run(args: argparse.Namespace, order: list[tuple], fixtures: Path) -> Run:
    """Feed the batches to the worker pool, two per worker in flight, until done or out of time."""
    run = Run()
    with ProcessPoolExecutor(args.workers, initializer=_load_corpus, initargs=(str(fixtures), args.isolated)) as pool:
        it = iter(order)
        pending = {pool.submit(_batch, job): job for job in itertools.islice(it, 2 * args.workers)}
        while pending:
            fut = next(iter(pending))
            job = pending.pop(fut)
            try:
                res = fut.result(timeout=args.timeout * BATCH + 600)
            except (FutureTimeout, BrokenProcessPool) as exc:
                outcome = "hang" if isinstance(exc, FutureTimeout) else "worker died"
                run.totals[job[1]]["hang" if outcome == "hang" else "crash"] += len(job[2])
                run.failures.append({"kind": job[1], "case": f"{job[2][0]}-{job[2][-1]}", "outcome": outcome,
                                     "detail": "the batch did not finish (see the worker's stack above)"})
                for f in pending:
                    f.cancel()
                break  # a finding to look at before going on
            run.add(job, res)
            if args.minutes and time.monotonic() - run.t0 > args.minutes * 60:
                continue  # let the running batches finish, submit no more
            nxt = next(it, None)
            if nxt is not None:
                pending[pool.submit(_batch, nxt)] = nxt
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--metadata", type=int, default=100_000, help="mutated .metadata cases")
    ap.add_argument("--distcp", type=int, default=20_000, help="mutated .distcp cases")
    ap.add_argument("--order", type=int, default=2_000, help=".metadata cases pickled in another order (torch oracle)")
    ap.add_argument("--safetensors", type=int, default=20_000, help="mutated .safetensors cases (library oracle)")
    ap.add_argument("--zstd", type=int, default=2_000, help="torch ZStandard DCP items mutated (torch oracle)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=30.0, help="per-case limit in seconds (a hang)")
    ap.add_argument("--start", type=int, default=0, help="first case number of both kinds (to continue a run)")
    ap.add_argument("--start-metadata", type=int, help="first .metadata case number (default: --start)")
    ap.add_argument("--start-distcp", type=int, help="first .distcp case number (default: --start)")
    ap.add_argument("--fixtures", default=str(Path.home() / ".cache" / "shardscope-fuzz-fixtures"))
    ap.add_argument("--out", default="fuzz-failures", help="where failing cases are saved")
    ap.add_argument("--minutes", type=float, default=0, help="stop submitting new batches after this long")
    ap.add_argument("--isolated", action="store_true",
                    help="load metadata in the helper process (the window's path); its memory is not measured")
    args = ap.parse_args()
    fixtures = _fixtures(Path(args.fixtures))
    run = _run(args, _jobs(args, fixtures), fixtures)
    run.report(args.timeout)
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
