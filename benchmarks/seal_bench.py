"""seal, verify and verify --deep against ``sha256sum`` of the same files and against Megatron-Core's
``integrity.json`` rules (every top-level file hashed on one thread, as rank 0 does), cold cache, alternating,
medians; and diff of two sealed copies against diff of the same two unsealed.

    python benchmarks/seal_bench.py WORKDIR [--mb 1400] [--rounds 3]

The checkpoint is written by ``torch.distributed.checkpoint.save`` in one process (fp32 and bf16 tensors, dim-0
shards of one writer). Cold cache needs root (``sync; echo 3 > /proc/sys/vm/drop_caches``); the table says
whether it was dropped. Every step runs in a fresh process."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _measure import drop_caches as cold  # benchmarks/, this script's folder; also drift_bench's


def write_checkpoint(folder: Path, mb: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    n = max(1, mb // 64)  # tensors of 64 MiB each: fp32 4096 x 4096 and bf16 4096 x 8192, alternating
    g = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i}.weight": torch.randn(4096, 4096 if i % 2 else 8192, generator=g)
             .to(torch.float32 if i % 2 else torch.bfloat16) for i in range(n)}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def megatron_rules(folder: str) -> None:
    """Megatron's check: SHA-256 of every top-level file, one thread, 1 MiB reads."""
    for name in sorted(os.listdir(folder)):
        full = os.path.join(folder, name)
        if os.path.isfile(full) and not name.startswith("shardscope-manifest"):
            h = hashlib.sha256()
            with open(full, "rb") as f:
                while block := f.read(1 << 20):
                    h.update(block)


def two_pass_seal(folder: str) -> None:
    """seal as it was before the one-pass digests: files and chunk ranges in one pass, every tensor's logical
    digest in a second pass through the page cache (the streamed ranges left out)."""
    from shardscope.backend.checkpoint import seal
    from shardscope.backend.checkpoint.stream_digests import StreamedDigests
    from shardscope.backend.formats import open_checkpoint

    class NoneStreamed(StreamedDigests):
        def __init__(self, source, entries):
            super().__init__(source, [])

    seal.StreamedDigests = NoneStreamed
    seal.compute_manifest(open_checkpoint(folder, use_cache=False))


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{cmd}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--mb", type=int, default=1400)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    src, copy = a.workdir / "ckpt", a.workdir / "copy"
    if not src.exists():
        write_checkpoint(src, a.mb)
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(src, copy)
    cli = [sys.executable, "-m", "shardscope.app.cli"]
    files = sorted(str(p) for p in src.iterdir() if p.is_file() and not p.name.startswith("shardscope-manifest"))
    diff_unsealed = timed([*cli, "diff", str(src), str(copy)])
    steps = {
        "sha256sum": ["sha256sum", *files],
        "Megatron integrity rules (1 thread)": [sys.executable, "-c", f"import sys; sys.path.insert(0, "
                                                f"{str(Path(__file__).parent)!r}); import seal_bench; "
                                                f"seal_bench.megatron_rules({str(src)!r})"],
        "shardscope seal": [*cli, "seal", str(src)],
        "seal, tensors in a second pass (before)": [sys.executable, "-c", f"import sys; sys.path.insert(0, "
                                                    f"{str(Path(__file__).parent)!r}); import seal_bench; "
                                                    f"seal_bench.two_pass_seal({str(src)!r})"],
        "shardscope verify": [*cli, "verify", str(src)],
        "shardscope verify --deep": [*cli, "verify", "--deep", str(src)],
    }
    times: dict[str, list[float]] = {k: [] for k in steps}
    dropped = True
    for _ in range(a.rounds):
        for name, cmd in steps.items():  # alternating: every step once per round
            dropped &= cold()
            times[name].append(timed(cmd))
    timed([*cli, "seal", str(copy)])
    diff_sealed = timed([*cli, "diff", str(src), str(copy)])
    size = sum(os.path.getsize(f) for f in files)
    print(f"checkpoint: {size / 1e9:.2f} GB in {len(files)} files; cold cache: {'yes' if dropped else 'NO (not root)'}"
          f"; CPUs: {os.cpu_count()}; load {os.getloadavg()[0]:.1f}; medians of {a.rounds}")
    print("| step | seconds (median; runs) | × sha256sum |\n|---|---|---|")
    base = statistics.median(times["sha256sum"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.2f} ({', '.join(f'{t:.2f}' for t in ts)}) | {m / base:.2f} |")
    print(f"| diff of unsealed copies | {diff_unsealed:.2f} | |\n| diff of sealed copies | {diff_sealed:.2f} | "
          f"{diff_sealed / diff_unsealed:.2f}× unsealed |")
    print(json.dumps({k: statistics.median(v) for k, v in times.items()}))


if __name__ == "__main__":
    main()
