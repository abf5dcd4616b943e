"""Reporting overhead and plot redraw speed.

1. ``report()`` per call (in-process, to a run directory on local disk) and its share of a step of the
   built-in trainer at its default size (the step time is measured by a short real run).
2. The Training panel's redraw with 1,000,000 points per curve over 4 ranks (loss raw + smoothed,
   mean, memory, throughput), offscreen, per frame after the first.

    QT_QPA_PLATFORM=offscreen python benchmarks/runs_bench.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def report_overhead(n: int = 20000) -> float:
    from shardscope import report

    d = tempfile.mkdtemp(prefix="shardscope-report-")
    os.environ["SHARDSCOPE_RUN_DIR"] = d
    report(step=0, loss=1.0)  # open the file
    t0 = time.perf_counter()
    for i in range(n):
        report(step=i, loss=1.0 / (i + 1), lr=3e-4, steps_per_s=10.0, tokens_per_s=1e4)
    per_call = (time.perf_counter() - t0) / n
    del os.environ["SHARDSCOPE_RUN_DIR"]
    return per_call


def trainer_step_time() -> float:
    run = Path(tempfile.mkdtemp(prefix="shardscope-steps-")) / "run"
    subprocess.run([sys.executable, "-m", "shardscope.app.cli", "train", "--steps", "40", "--checkpoint-every",
                    "0", "--run-dir", str(run)], check=True, capture_output=True)
    recs = [json.loads(line) for line in (run / "metrics" / "rank_0.jsonl").read_text().splitlines()]
    return statistics.median(1 / r["steps_per_s"] for r in recs[5:] if r.get("steps_per_s"))


def redraw_time(points: int = 1_000_000, ranks: int = 4, frames: int = 10) -> tuple[float, float]:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from shardscope.app.bootstrap import make_app
    from shardscope.backend.runs.follow import RunFollower
    from shardscope.backend.runs.metrics import Series
    from shardscope.widgets.run_plots import RunPlots

    app = make_app()
    plots = RunPlots()
    plots.resize(1400, 800)
    plots.show()
    follower = RunFollower(tempfile.mkdtemp())
    rng = np.random.default_rng(0)
    for r in range(ranks):
        s = Series(points)
        step = np.arange(1, points + 1, dtype=np.float64)
        s.cols["step"][:] = step
        s.cols["loss"][:] = 5 * np.exp(-step / 2e5) + rng.normal(0, 0.1, points)
        s.cols["time"][:] = step * 0.1
        s.cols["rss"][:] = 2**30 + rng.normal(0, 2**20, points)
        s.cols["tokens_per_s"][:] = 1e4 + rng.normal(0, 100, points)
        s.n = points
        follower.series[r] = s
    plots.set_follower(follower)
    t0 = time.perf_counter()
    plots.mark_dirty()
    plots.redraw()
    plots.repaint()
    app.processEvents()
    first = time.perf_counter() - t0
    times = []
    for i in range(frames):
        for r in range(ranks):  # a live frame: 10 new points per rank, then redraw and paint
            s = follower.series[r]
            s.append([{"step": points + i * 10 + k, "loss": 1.0, "time": 0.0, "rss": 2**30} for k in range(10)])
        t0 = time.perf_counter()
        plots.mark_dirty()
        plots.redraw()
        plots.repaint()
        app.processEvents()
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def main() -> None:
    per_call = report_overhead()
    step = trainer_step_time()
    first, frame = redraw_time()
    print("| measure | value | goal |\n|---|---:|---|")
    print(f"| report() per call | {per_call * 1e6:.1f} µs | |")
    print(f"| built-in trainer step (default size, 2 CPU ranks) | {step * 1e3:.1f} ms | |")
    print(f"| report() share of a step | {100 * per_call / step:.2f} % | < 1 % |")
    print(f"| redraw, 4 ranks x 1,000,000 points, first frame (smoothing computed) | {first * 1e3:.0f} ms | |")
    print(f"| redraw, 4 ranks x 1,000,000 points, live frame (median of 10) | {frame * 1e3:.0f} ms | < 50 ms |")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
