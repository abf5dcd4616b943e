"""``shardscope diff`` against the plain torch loop, side by side.

Writes FSDP2 checkpoints with torch's ``dcp.save`` from a 2-process gloo run (``fully_shard``, model + Adam
state), exports one to a ``.pt`` with ``shardscope export --format torch``, then times, alternating, in fresh
processes under ``nice -n 10``:

- ``shardscope diff CKPT CKPT.pt`` (a checkpoint against its own export: no differences), against the loop
  ``dcp_to_torch_save(CKPT)``, ``torch.load`` both files, ``torch.equal`` every tensor pair (``allclose`` for
  the report when they differ);
- ``--pair``: ``shardscope diff A B`` of two checkpoints of the same shapes whose every value differs,
  against ``dcp_to_torch_save`` of both, ``torch.load``, compare.

Wall time and peak RSS (the largest process of the step's tree, from ``wait4``) are the medians of the runs.
Every file of both sides is read to its end once before the first run, and nothing is dropped from
the page cache, so every step sees the same cache state.

    python benchmarks/diff_bench.py [--size small|full|2g] [--pair] [--no-export] [--repeat 3] [--dir DIR]
                                    [--before REV] [--no-warmup-run]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARDSCOPE = [sys.executable, "-m", "shardscope.app.cli"]
# (vocab, width, layers): bytes on disk are about 12 x parameters (fp32 weights + Adam's two moments)
SIZES = {"small": (8000, 1024, 1), "full": (16000, 1024, 7), "2g": (16000, 1024, 11)}


def _worker(rank: int, world: int, store: str, out: str, size: str, seed: int) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(seed)
    vocab, width, layers = SIZES[size]

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)
            self.norm = nn.LayerNorm(width)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x)))) + self.proj(self.qkv(x)[..., :width])

    model = nn.Sequential(nn.Embedding(vocab, width), *[Layer() for _ in range(layers)], nn.Linear(width, vocab))
    with torch.no_grad():  # every value depends on the seed (LayerNorm starts at exactly 1 and 0 otherwise)
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.01)
    for m in model[1:-1]:
        fully_shard(m)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed * 10 + rank)
    model(torch.randint(0, vocab, (2, 8), generator=g)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=out)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no destructors after the group (see tests/make_fixtures.py)


def generate(out: Path, size: str, seed: int) -> None:
    """A real 2-rank gloo FSDP2 run saving with dcp.save (in a child: this process stays small)."""
    subprocess.run([sys.executable, __file__, "--generate", str(out), "--size", size, "--seed", str(seed)],
                   check=True)


def _generate_here(out: str, size: str, seed: int) -> None:
    import torch.multiprocessing as mp

    store = tempfile.mktemp(prefix="diff-bench-store-")
    mp.start_processes(_worker, args=(2, store, out, size, seed), nprocs=2, start_method="spawn")


# The torch loop: what a user writes without Shardscope. A DCP folder goes through dcp_to_torch_save first.
TORCH_LOOP = r"""
import os, sys, tempfile, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

def load(path, tmp):
    if os.path.isdir(path):
        pt = os.path.join(tmp, os.path.basename(path.rstrip('/')) + '.pt')
        dcp_to_torch_save(path, pt)
        path = pt
    return torch.load(path, map_location='cpu', weights_only=True)

def flat(d, prefix=''):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from flat(v, f'{prefix}{k}.')
        else:
            yield f'{prefix}{k}', v

with tempfile.TemporaryDirectory(dir=sys.argv[3]) as tmp:
    a = dict(flat(load(sys.argv[1], tmp)))
    b = dict(flat(load(sys.argv[2], tmp)))
changed = 0
for k in sorted(a.keys() & b.keys()):
    x, y = a[k], b[k]
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
            changed += 1
            if x.shape == y.shape and x.is_floating_point():
                torch.allclose(x, y)
                (x.double() - y.double()).abs().max()
    elif x != y:
        changed += 1
print(f'{len(a.keys() ^ b.keys())} unpaired, {changed} changed')
sys.exit(1 if changed or a.keys() ^ b.keys() else 0)
"""


def before_tree(rev: str, root: Path) -> Path:
    """The code of revision ``rev`` as an importable ``shardscope`` package under ``root`` (git archive, the
    installed package's layout), so the same interpreter runs the code before a change: PYTHONPATH=<returned>."""
    src, pkg = root / f"src-{rev}", root / f"pkg-{rev}"
    if not pkg.exists():
        src.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(HERE.parent), "archive", rev], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
        (pkg / "shardscope").mkdir(parents=True)
        (pkg / "shardscope" / "__init__.py").write_bytes((src / "app" / "package" / "__init__.py").read_bytes())
        for d in ("app", "backend", "widgets", "resources"):
            (pkg / "shardscope" / d).symlink_to(src / d)
    return pkg


def run_measured(argv: list[str], env: dict | None = None) -> dict:
    """One step in a fresh process under nice -n 10: wall time, exit code and the peak RSS of its process tree
    (wait4 on this child: its own and its reaped descendants' largest)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(["nice", "-n", "10", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env={**os.environ, "SHARDSCOPE_NO_CACHE": "1", **(env or {})})
    errs = p.stderr.read() if p.stderr else b""
    _, status, usage = os.wait4(p.pid, 0)
    seconds = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode not in (0, 1):
        raise SystemExit(f"{argv} failed ({p.returncode}):\n{errs.decode()[-3000:]}")
    return {"seconds": seconds, "peak_rss": usage.ru_maxrss * 1024, "rc": p.returncode}


def warm(*paths: Path) -> None:
    """Read every file of both sides once: every step then starts with the same page cache."""
    for path in paths:
        files = sorted(path.iterdir()) if path.is_dir() else [path]
        for f in files:
            with open(f, "rb") as fh:
                while fh.read(16 << 20):
                    pass


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size


def compare(label: str, a: Path, b: Path, tmp: Path, repeat: int, warmup_run: bool, before: tuple | None
            ) -> list[str]:
    steps = {"shardscope diff": [*SHARDSCOPE, "diff", str(a), str(b)],
             "torch loop": [sys.executable, "-c", TORCH_LOOP, str(a), str(b), str(tmp)]}
    envs: dict[str, dict] = {}
    if before:
        name = f"shardscope diff before ({before[0]})"
        steps[name] = steps["shardscope diff"]
        envs[name] = {"PYTHONPATH": str(before[1])}
    warm(a, b)
    for what in steps if warmup_run else ():  # one warm-up run of each (imports, page cache), not counted
        run_measured(steps[what], envs.get(what))
    runs: dict[str, list[dict]] = {k: [] for k in steps}
    for i in range(repeat):  # alternating: a noisy minute on the shared machine hits both alike
        order = list(steps) if i % 2 == 0 else list(reversed(steps))
        for what in order:
            r = run_measured(steps[what], envs.get(what))
            runs[what].append(r)
            print(f"  {label}: {what} run {i + 1}: {r['seconds']:.2f} s, {r['peak_rss'] / 2**20:.0f} MiB, "
                  f"exit {r['rc']}", flush=True)
    med = {k: (statistics.median(r["seconds"] for r in v), statistics.median(r["peak_rss"] for r in v),
               {r["rc"] for r in v}) for k, v in runs.items()}
    ref_t, ref_m, _ = med["torch loop"]
    rows = []
    for what, (t, m, rcs) in med.items():
        all_t = ", ".join(f"{r['seconds']:.1f}" for r in runs[what])
        rows.append(f"| {label} | {what} | {t:.2f} s ({all_t}) | {t / ref_t:.2f}x | {m / 2**20:.0f} MiB | "
                    f"{m / ref_m:.2f}x | {'/'.join(map(str, sorted(rcs)))} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SIZES), default="full")
    ap.add_argument("--pair", action="store_true", help="also two checkpoints whose every value differs")
    ap.add_argument("--no-export", action="store_true", help="skip the checkpoint-vs-export comparison")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--before", metavar="REV", help="also time diff as of git revision REV (same interpreter)")
    ap.add_argument("--no-warmup-run", action="store_true", help="no uncounted first run of each step (the files "
                    "are still read once before)")
    ap.add_argument("--generate", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate:
        _generate_here(args.generate, args.size, args.seed)
        return
    root = args.dir or Path(tempfile.mkdtemp(prefix="shardscope-diff-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    a, b, pt = root / f"{args.size}-a", root / f"{args.size}-b", root / f"{args.size}-a.pt"
    todo = [(a, 0)] + ([(b, 1)] if args.pair else [])
    for path, seed in todo:
        if not (path / ".metadata").exists():
            print(f"writing {path} (2 gloo ranks, FSDP2, seed {seed}) ...", flush=True)
            generate(path, args.size, seed)
    if not args.no_export and not pt.exists():
        print(f"exporting {pt} ...", flush=True)
        subprocess.run([*SHARDSCOPE, "export", str(a), str(pt), "--format", "torch"], check=True,
                       stdout=subprocess.DEVNULL)
    tmp = root / "tmp"
    tmp.mkdir(exist_ok=True)
    before = (args.before, before_tree(args.before, root / "before")) if args.before else None
    rows = []
    if not args.no_export:
        rows += compare(f"{size_of(a) / 2**30:.2f} GiB vs its .pt", a, pt, tmp, args.repeat,
                        not args.no_warmup_run, before)
    if args.pair:
        rows += compare(f"{size_of(a) / 2**30:.2f} GiB vs {size_of(b) / 2**30:.2f} GiB, all values differ",
                        a, b, tmp, args.repeat, not args.no_warmup_run, before)
    load = os.getloadavg()
    print(f"\nmedians of {args.repeat} alternating runs (all times in parentheses), nice -n 10, page cache warm "
          f"for both; load average at the end {load[0]:.1f}; peak RSS = largest process of the step (wait4)\n")
    print("| comparison | step | wall time | vs torch loop | peak RSS | vs torch loop | exit |\n"
          "|---|---|---:|---:|---:|---:|---|")
    print("\n".join(rows))
    print(json.dumps({"root": str(root)}))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    main()
