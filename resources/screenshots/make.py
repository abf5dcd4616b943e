"""Remake the README's screenshots of the real window (``--screenshot``), at 1280x720 and 1920x1080.

    DISPLAY=:99 python resources/screenshots/make.py [--work DIR]     # under Xvfb: a real xcb window
    QT_QPA_PLATFORM=offscreen python resources/screenshots/make.py    # or offscreen

Inputs are made the way users make them: a real 2-rank FSDP2 run of the built-in trainer
(``shardscope train``, checkpoints every 10 steps) and the 512-rank, 2,000-tensor checkpoint of
``tests/scale_checkpoint.py``. Each picture is taken when the window says it is ready (signals).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
SIZES = ("1280x720", "1920x1080")


def shardscope(*args: object, env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "shardscope.app.cli", *map(str, args)]
    print("$", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True, env=env)


def inputs(work: Path, env: dict[str, str]) -> tuple[Path, Path]:
    """(a run with checkpoints at steps 10, 20, 30, the 512-rank checkpoint), made once."""
    run = work / "run"
    if not (run / "checkpoints" / "step_000030" / ".metadata").exists():
        shardscope("train", "--steps", 30, "--checkpoint-every", 10, "--run-dir", run, env=env)
    big = work / "r512"
    if not (big / ".metadata").exists():
        subprocess.run([sys.executable, str(ROOT / "tests" / "scale_checkpoint.py"), str(big)], check=True, env=env)
    return run, big


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/shardscope-screenshots"))
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    # a fresh settings folder: no remembered splitter positions or column widths in the pictures
    env = {**os.environ, "XDG_CONFIG_HOME": str(args.work / "config"), "SHARDSCOPE_DATA_DIR": str(args.work / "data")}
    run, big = inputs(args.work, env)
    last = run / "checkpoints" / "step_000030"
    shots = {
        "browser-2ranks": ("gui", last, "--select", "model.blocks.0.mlp.0.weight", "--tab", "inspector"),
        "ranks-2ranks": ("gui", last, "--select", "model.blocks", "--tab", "ranks"),
        "browser-512ranks": ("gui", big, "--select", "model.layers.0.attn.q.weight", "--tab", "inspector"),
        "ranks-512ranks": ("gui", big, "--select", "model.layers.0.mlp.up.weight", "--tab", "ranks"),
        "compare": ("gui", "--compare", run / "checkpoints" / "step_000010", last,
                    "--select", "model.blocks.0.mlp.0.weight"),
    }  # the Training panel's and the Library's pictures (training*.png, library.png) are grabs of a session in the
    #    real window under Xvfb: the demo mid-run, `gui RUN_DIR --screenshot PNG --size 1280x720`, `gui --screenshot`
    for name, cmd in shots.items():
        for size in SIZES:
            shardscope(*cmd, "--screenshot", args.out / f"{name}-{size}.png", "--size", size, env=env)


if __name__ == "__main__":
    main()
