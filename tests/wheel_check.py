"""Check an installed (not editable) Shardscope: every module imports, the CLI and the window run.

``python tests/wheel_check.py --site DIR --script PATH`` with the python of the environment the wheel
was installed into, from outside the source tree. CI runs it in a second fresh venv (.ci/run);
tests/test_install.py runs it on a ``pip install --target`` of a freshly built wheel.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import subprocess
import sys
import tempfile
from pathlib import Path

FIXTURE = """
import sys, torch, torch.distributed.checkpoint as dcp
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(37, 12), torch.nn.Linear(12, 37))
dcp.save({"model": model.state_dict(), "step": 3}, checkpoint_id=sys.argv[1], no_dist=True)
"""


def fail(message: str) -> None:
    raise SystemExit(f"wheel check: {message}")


def run(*cmd: object, env: dict | None = None) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        fail(f"`{' '.join(map(str, cmd))}` exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def import_everything(site: Path) -> list[str]:
    """Import every module of the installed package; it must come from ``site``, not a source tree."""
    import shardscope

    where = Path(shardscope.__file__).resolve().parent
    if not where.is_relative_to(site.resolve()):
        fail(f"shardscope was imported from {where}, not from the installed {site}")
    names = []

    def broken(name: str) -> None:
        fail(f"cannot import {name}: {sys.exc_info()[1]!r}")

    for info in pkgutil.walk_packages(shardscope.__path__, "shardscope.", onerror=broken):
        if info.name.endswith("__main__"):
            continue  # running it is checked below (`python -m shardscope --help`)
        try:
            importlib.import_module(info.name)
        except Exception as exc:  # reported with the module name
            fail(f"cannot import {info.name}: {exc!r}")
        names.append(info.name)
    for needed in ("shardscope.backend.compare", "shardscope.app.main_window", "shardscope.app.cli",
                   "shardscope.widgets.shard_map"):
        if needed not in names:
            fail(f"{needed} is not in the installed package")
    shots = list((where / "resources" / "screenshots").glob("*.png"))
    if not shots:
        fail(f"no screenshots shipped under {where / 'resources'}")
    return names


def check_screenshot(path: Path) -> None:
    from PySide6.QtGui import QImage

    img = QImage(str(path))
    if img.isNull() or (img.width(), img.height()) != (1280, 720):
        fail(f"{path}: not a 1280x720 picture")
    colours = {img.pixel(x, y) for x in range(0, 1280, 7) for y in range(0, 720, 7)}
    if len(colours) < 20:
        fail(f"{path}: only {len(colours)} colours, the window drew next to nothing")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, required=True, help="where the wheel was installed")
    parser.add_argument("--script", type=Path, required=True, help="the installed `shardscope` command")
    args = parser.parse_args()
    names = import_everything(args.site)
    exe = args.script
    if "inspect" not in run(exe, "--help"):
        fail("`shardscope --help` lists no inspect command")
    run(sys.executable, "-m", "shardscope", "--help")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        run(sys.executable, "-c", FIXTURE, ckpt)
        tensors = {t["fqn"] for t in json.loads(run(exe, "inspect", "--json", ckpt))["tensors"]}
        if tensors != {"model.0.weight", "model.1.weight", "model.1.bias"}:
            fail(f"`shardscope inspect` found {sorted(tensors)} in the checkpoint")
        run(exe, "verify", ckpt)
        shot = Path(tmp) / "x.png"
        run(exe, "gui", ckpt, "--select", "model.0.weight", "--screenshot", shot, "--size", "1280x720",
            env={"QT_QPA_PLATFORM": "offscreen"})
        check_screenshot(shot)
    print(f"wheel check: {len(names)} modules import from {args.site}; --help, inspect, verify and the "
          "window's screenshot work")
    return 0


if __name__ == "__main__":
    sys.exit(main())
