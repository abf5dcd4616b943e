"""drift over 3 copies of a checkpoint against ``cat`` of their files, and average of the 3 against reading them
once plus writing the output once; cold cache, steps alternating, medians.

    python benchmarks/drift_bench.py WORKDIR [--mb 1400] [--rounds 3]

The checkpoint is written by ``torch.distributed.checkpoint.save`` in one process (fp32 and bf16 tensors); its
copies are ``step_000001..3`` of one run folder. drift and average run in this process through the backend (the
CLI's work without its start-up and ``import torch``, which the baselines do not pay either). Cold cache needs
root (``sync; echo 3 > /proc/sys/vm/drop_caches``); the output says whether it was dropped."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from seal_bench import cold, write_checkpoint  # the same checkpoint and cache drop


def timed(func) -> float:
    t0 = time.perf_counter()
    func()
    return time.perf_counter() - t0


def main() -> None:
    from shardscope.backend.compare.averaging import average_checkpoints
    from shardscope.backend.compare.drift import run_drift

    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--mb", type=int, default=1400)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    run = a.workdir / "run"
    first = run / "step_000001"
    if not first.exists():
        write_checkpoint(first, a.mb)
        for i in (2, 3):
            shutil.copytree(first, run / f"step_{i:06d}")
    ckpts = [str(run / f"step_{i:06d}") for i in (1, 2, 3)]
    files = sorted(str(p) for c in ckpts for p in Path(c).iterdir() if p.is_file())
    out = a.workdir / "average.safetensors"

    def average() -> None:
        average_checkpoints(ckpts, str(out), force=True)

    def read_and_write() -> None:
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
        blocks = written // (4 << 20) + 1
        subprocess.run(["dd", "if=/dev/zero", f"of={a.workdir / 'written'}", "bs=4M", f"count={blocks}",
                        "conv=fsync"], capture_output=True, check=True)

    average()
    written = out.stat().st_size
    steps = {"cat of the 3 checkpoints' files": lambda: subprocess.run(["cat", *files], stdout=subprocess.DEVNULL,
                                                                       check=True),
             "drift of the 3": lambda: run_drift([str(run)]),
             "read once + write the output once (cat, dd conv=fsync)": read_and_write,
             "average of the 3 (safetensors, verified)": average}
    times: dict[str, list[float]] = {k: [] for k in steps}
    dropped = True
    for _ in range(a.rounds):
        for name, step in steps.items():  # alternating: every step once per round
            dropped &= cold()
            times[name].append(timed(step))
    size = sum(os.path.getsize(f) for f in files)
    m = {k: statistics.median(v) for k, v in times.items()}
    print(f"3 checkpoints: {size / 1e9:.2f} GB in {len(files)} files; output {written / 1e9:.2f} GB; cold cache: "
          f"{'yes' if dropped else 'NO (not root)'}; CPUs: {os.cpu_count()}; load {os.getloadavg()[0]:.1f}; "
          f"medians of {a.rounds}")
    print("| step | seconds (median; runs) | ratio | goal |\n|---|---|---|---|")
    names = list(steps)
    for base, step, goal in ((names[0], names[1], 2.0), (names[2], names[3], 1.5)):
        for name in (base, step):
            runs = ", ".join(f"{t:.2f}" for t in times[name])
            ratio = m[name] / m[base]
            verdict = f"<= {goal}x: {'met' if ratio <= goal else 'missed'}" if name == step else ""
            print(f"| {name} | {m[name]:.2f} ({runs}) | {ratio:.2f}x | {verdict} |")
    print(json.dumps(m))


if __name__ == "__main__":
    main()
