"""``shardscope gui`` (and plain ``shardscope [PATH]``): the window."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from shardscope.backend.errors import EXIT_BAD_INPUT

from .output import add_command
from .storage_options import add_storage_options, apply_to_fsspec


def register(sub: Any) -> None:
    sp = add_command(sub, "gui", run, "Open the checkpoint browser window (optionally on PATH).")
    sp.add_argument("path", nargs="?", help="what to open: a checkpoint folder, a .safetensors or "
                    ".pt/.pth/.bin/.ckpt file, an HF folder with model.safetensors.index.json (or that file), "
                    "or a run directory")
    sp.add_argument("--select", metavar="FQN", help="select this tensor (or module prefix) after loading")
    sp.add_argument("--screenshot", metavar="FILE.png", help="render the window to a PNG after loading, then exit")
    sp.add_argument("--size", metavar="WxH", default=None, help="window size, e.g. 1400x900")
    sp.add_argument("--run", metavar="RUN_DIR", help="follow this run directory in the Training panel")
    sp.add_argument("--compare", nargs=2, metavar=("A", "B"), help="open the Compare view on two checkpoints")
    sp.add_argument("--tab", choices=("inspector", "ranks", "health"), help="show this tab of the checkpoint view")
    add_storage_options(sp)


def no_display() -> bool:
    """True on a Linux/BSD machine with no screen and no offscreen platform asked for."""
    if sys.platform.startswith(("win", "darwin")) or os.environ.get("QT_QPA_PLATFORM"):
        return False
    return not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def run(args: argparse.Namespace) -> int:
    if no_display():
        print("shardscope: no display here (DISPLAY and WAYLAND_DISPLAY are unset), so no window can open.\n"
              "  On a server use the subcommands (inspect, verify, show, export, diff, train ...), run the window\n"
              "  on your desktop (it reads fsspec URLs and run folders on shared storage), or render a picture\n"
              "  with QT_QPA_PLATFORM=offscreen and --screenshot FILE.png.", file=sys.stderr)
        return EXIT_BAD_INPUT
    from shardscope.app.bootstrap import run as run_window

    apply_to_fsspec(args, [args.path or "", *(args.compare or [])])

    return run_window(args)
