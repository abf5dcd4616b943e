"""Subcommands beyond inspect/verify/show: gui, export, train, demo. Each registers itself here."""

from __future__ import annotations

import argparse
from collections.abc import Callable

COMMANDS: list[Callable] = []


def command(func: Callable) -> Callable:
    COMMANDS.append(func)
    return func


@command
def _gui(add: Callable) -> None:
    sp = add("gui", run_gui, "Open the checkpoint browser window (optionally on PATH).")
    sp.add_argument("path", nargs="?", help="checkpoint folder or run directory to open")
    sp.add_argument("--select", metavar="FQN", help="select this tensor (or module prefix) after loading")
    sp.add_argument("--screenshot", metavar="FILE.png", help="render the window to a PNG after loading, then exit")
    sp.add_argument("--size", metavar="WxH", default=None, help="window size, e.g. 1400x900")


def run_gui(args: argparse.Namespace) -> int:
    from shardscope.app.main_window import run

    return run(args)
