"""Starting the window: the QApplication, the ``gui`` subcommand's options, and the demo's window."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

from PySide6.QtWidgets import QApplication
from shardscope.backend.errors import EXIT_PROBLEMS
from shardscope.backend.runs.launcher import RunConfig
from shardscope.backend.runs.rundir import is_run_dir
from shardscope.widgets.workers import stop_background

from .first_run import start_demo
from .main_window import MainWindow
from .screenshot import Screenshot
from .settings import settings

# how long a closed window waits for its cancelled background work to stop before the process leaves without it
STOP_GRACE_MS = 250


def make_app() -> QApplication:
    """The one QApplication (Fusion style; Qt 6 scales for high-DPI screens by itself)."""
    from shardscope.backend.checkpoint import reader_process

    # Qt's own threads are invisible to `threading`: in the window every metadata load runs in the helper
    # process, so its address-space cap can never reach a thread of the window.
    reader_process.ISOLATE = True
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Shardscope")
    app.setOrganizationName("Shardscope")
    app.setStyle("Fusion")  # follows the system colour scheme (dark or light) in Qt 6
    return app  # type: ignore[return-value]


def parse_size(text: str | None) -> tuple[int, int] | None:
    """``1280x720`` -> (1280, 720)."""
    if not text:
        return None
    try:
        w, h = (int(v) for v in text.lower().split("x"))
        return w, h
    except ValueError:
        raise SystemExit(f"shardscope: --size wants WxH, e.g. 1280x720, not {text!r}") from None


def run(args: argparse.Namespace) -> int:
    """The ``gui`` subcommand: open the window as ``args`` says; exit code of the window."""
    return _exit(_run(args))


def run_demo(config: RunConfig | None = None, run_dir: str | None = None) -> int:
    """``shardscope demo``'s window: open at once on the Training tab with the run live; its last
    checkpoint opens (a tensor selected, a hint shown) when the run ends."""
    app = make_app()
    win = MainWindow()
    win.show()
    if start_demo(win, config, run_dir) is None:
        return _exit(EXIT_PROBLEMS)
    return _exit(app.exec())


def _exit(code: int) -> int:
    """Leave promptly once the window closed (it used to take ~5 s): background work is cancelled, and the
    interpreter's teardown skips its last full garbage collection."""
    settings().sync()
    if not stop_background(STOP_GRACE_MS):
        # NOTE: work that cannot stop at a progress check is left (in practice `import torch` for a checkpoint's
        # small values, ~5 s): QApplication's destructor would wait for it, and its import would end during the
        # interpreter's teardown ("Exception ignored ... torch/library.py"). Everything to keep is written (the
        # settings synced, the log flushed); helper processes leave when their socket closes with this process.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    # NOTE: a normal interpreter teardown follows, so the "deallocating True/None" aborts once hidden here by
    # os._exit (PySide6 6.12.0 losing references, excluded in pyproject.toml) would show; tests/test_soak.py
    # proves the window and its exit clean. Frozen, the objects alive now are left out of the full collections
    # the teardown makes: with torch imported they took 1-2 s.
    gc.freeze()
    return code


def _run(args: argparse.Namespace) -> int:
    app = make_app()
    win = MainWindow()
    size = parse_size(getattr(args, "size", None))
    if size:
        win.resize(*size)
    shot_path = getattr(args, "screenshot", None)
    shot = Screenshot(app, win, shot_path) if shot_path else None
    win.quiet = shot is not None
    select = getattr(args, "select", None)
    run_dir = getattr(args, "run", None)
    path = getattr(args, "path", None)
    if path and is_run_dir(path):
        run_dir, path = path, None
    panel = win.training_panel(run_dir) if run_dir else None
    pair = getattr(args, "compare", None)
    if pair:
        view = win.compare(*pair)
        if shot:
            shot.compare(view, select)
    elif path:
        cview = win.open_path(path)
        if getattr(args, "tab", None):
            cview.show_tab(args.tab)
        if shot:
            shot.checkpoint(cview, select)
    elif shot and panel is not None:
        shot.when(lambda: panel.follower is not None and bool(panel.follower.series), panel.plots.redraw)
    elif shot:  # the Library (start page), once its first scan is shown
        shot.when(lambda: win.library.snapshot is not None)
    win.show()
    code = app.exec()
    return shot.code if shot else code
