"""The window soak for hours: tests/soak_driver.py (what tests/test_soak.py runs for a minute) on the
same checkpoints, as long as you like, with memory and reference counts reported.

    QT_QPA_PLATFORM=offscreen python benchmarks/soak_long.py --hours 2 [--dir DIR] [--seed N]

Writes its checkpoints under DIR (kept and reused), runs the driver in a fresh process, prints a
table (reference counts, resident memory, live objects after the warm-up and at the end) and exits 1 if
the window aborted, an exception escaped into Qt, or the reference counts of None/True/False fell.
``python tests/soak_driver.py --probe N ...`` says which kind of action leaves what behind.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from make_fixtures import make  # noqa: E402  (tests/ is not a package)
from soak_driver import make_big_checkpoint  # noqa: E402


def checkpoints(root: Path) -> dict[str, Path]:
    """The soak's checkpoints: 4-rank FSDP2, two steps of one run (compare), 512 ranks (big map)."""
    out = {}
    for name, kind, world in (("fsdp2_r4", "fsdp", 4), ("steps_r2", "steps", 2)):
        out[name] = root / name
        if not (root / f".{name}.done").exists():
            make(kind, world, out[name])
            (root / f".{name}.done").write_text("ok")
    out["big512"] = make_big_checkpoint(root)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "shardscope-soak")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    ck = checkpoints(args.dir)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=args.dir))
    seconds = args.hours * 3600
    cmd = [sys.executable, str(TESTS / "soak_driver.py"), str(ck["big512"]), str(ck["fsdp2_r4"]),
           "--compare", str(ck["steps_r2"] / "step2"), str(ck["steps_r2"] / "step3"), "--run-dir", str(run_dir),
           "--seconds", str(seconds), "--seed", str(args.seed)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    wall = time.monotonic() - t0
    line = next((x for x in proc.stdout.splitlines() if x.startswith("SOAK ")), None)
    if line is None:
        print(f"the window died after {wall:.0f} s (exit {proc.returncode}):\n{proc.stderr[-4000:]}", file=sys.stderr)
        return 1
    s = json.loads(line[5:])
    (a0, *first), (a1, *last) = s["refcounts_first_last"]
    print(f"soak: {s['actions']:,} actions in {s['seconds']:.0f} s ({s['actions'] / max(s['seconds'], 1):.1f}/s), "
          f"exit {proc.returncode}\n")
    print("| measure | first sample | last sample |\n|---|---:|---:|")
    for i, name in enumerate(("refcount(None)", "refcount(True)", "refcount(False)")):
        print(f"| {name} | {first[i]:,} (after {a0:,}) | {last[i]:,} (after {a1:,}) |")
    rss = s["rss_mib_first_max_last"]
    print(f"| resident memory | {rss[0]:,} MiB | {rss[2]:,} MiB (peak {rss[1]:,}) |")
    if len(s.get("live_objects_rss_mib", [])) == 2:  # after the warm-up and at the end, each after a full gc
        (w, o0, r0), (e, o1, r1) = s["live_objects_rss_mib"]
        print(f"| live Python objects | {o0:,} (after {w:,}) | {o1:,} (after {e:,}; "
              f"{(o1 - o0) / max(1, e - w):+.2f} per action) |")
        print(f"| resident memory after gc | {r0:,} MiB | {r1:,} MiB ({1024 * (r1 - r0) / max(1, e - w):+.1f} KiB "
              "per action) |")
    print()
    print("actions:", ", ".join(f"{k} {v:,}" for k, v in sorted(s["by_kind"].items(), key=lambda kv: -kv[1])))
    print(f"tooltips checked: {s['tooltips_checked']:,}; metrics lines written: {s['metrics_lines']:,}")
    if proc.returncode != 0:
        print(f"FAILED: {s['problem'] or s['errors'][:1]}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
