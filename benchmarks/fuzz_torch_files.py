"""The long mutation-fuzzing run of the torch-file reader (backend/checkpoint/unpickler/ through torch_file_tree.py):
N mutated ``data.pkl`` files of a real ``torch.save`` file (bytes flipped, cut, inserted; BUILD/SETITEM/APPEND opcodes
and memo references inserted at opcode boundaries), each read, with ``torch.load(weights_only=True)`` as the oracle:
what the reader reads, torch reads to the same names, tensors and values; what it refuses, torch refuses. Failures
are printed with their case number (the seed is fixed: ``--seed``); the fixed-seed pass in the tests is the first
600 cases of seed 0.

    python benchmarks/fuzz_torch_files.py --cases 20000 [--seed 1] [--minutes 10]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import zipfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch
from hostile_torch_files import with_pickle
from shardscope.backend.checkpoint.flatten import dotted, flatten
from shardscope.backend.checkpoint.torch_file_tree import TorchFileLoad
from shardscope.backend.checkpoint.unpickler import allow_torch_safe_globals
from shardscope.backend.errors import CheckpointError
from test_torch_file_open import _mutated, _same, mutation_seed


def check(path: Path) -> str:
    """The case's outcome, or 'MISMATCH: ...' where the reader and torch.load disagree."""
    try:
        loaded = TorchFileLoad(str(path))
        kind = "torch.load" if loaded.fallback else "read"
    except CheckpointError as exc:
        loaded, kind = None, "refused" if "weights_only refuses" in str(exc) else "error"
    if kind not in ("read", "refused"):
        return kind
    try:
        ref = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # any failure of torch's loader
        ref = exc
    if kind == "refused":
        return kind if isinstance(ref, Exception) else "MISMATCH: refused what torch.load reads"
    if isinstance(ref, Exception):
        return f"MISMATCH: read what torch.load refuses ({str(ref)[:100]})"
    flat = {dotted(k): (k, v) for k, v in flatten(ref).items()}
    if loaded.paths() != {n: k for n, (k, _) in flat.items()}:
        return "MISMATCH: other names"
    for n, view in loaded.tensors().items():
        t = flat[n][1]
        if (view.dtype, view.shape, view.stride, view.storage_offset) != (
                str(t.dtype).removeprefix("torch."), tuple(t.shape), t.stride(), t.storage_offset()):
            return f"MISMATCH: tensor {n}"
    for n, v in loaded.objects().items():
        if not _same(v, flat[n][1]):
            return f"MISMATCH: value {n}"
    return kind


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=0)
    ap.add_argument("--kind", choices=("values", "numpy"), default="values", help="the seed (mutation_seed)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fuzz-torch-"))
    torch.manual_seed(0)
    src = tmp / "seed.pt"
    torch.save(mutation_seed(args.kind), src)
    with zipfile.ZipFile(src) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    allow_torch_safe_globals()
    rng, counts, start = random.Random(args.seed), Counter(), time.monotonic()
    for case in range(args.cases):
        if args.minutes and time.monotonic() - start > args.minutes * 60:
            break
        try:
            mutated = _mutated(pkl, rng)
        except ValueError:
            counts["unwalkable"] += 1
            continue
        path = with_pickle(tmp, mutated, "case.pt", src)
        outcome = check(path)
        counts[outcome.split(":")[0]] += 1
        if outcome.startswith("MISMATCH"):
            print(f"case {case} (seed {args.seed}): {outcome}", flush=True)
            path.rename(tmp / f"mismatch-{case}.pt")
    print(f"{sum(counts.values())} cases in {time.monotonic() - start:.0f} s: {dict(counts)}")
    return 1 if counts["MISMATCH"] else 0


if __name__ == "__main__":
    sys.exit(main())
