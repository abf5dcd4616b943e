"""Logging for the command line and the window: one log file per user, ``--verbose`` on stderr.

Qt-free, so every layer can name the log file. Backend modules log through ``logging.getLogger(__name__)``;
this module only decides where it goes.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
from pathlib import Path

FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"


def log_file() -> Path:
    """The per-user log file: ``$SHARDSCOPE_LOG``, else ``$XDG_STATE_HOME/shardscope/shardscope.log``."""
    if os.environ.get("SHARDSCOPE_LOG"):
        return Path(os.environ["SHARDSCOPE_LOG"]).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "shardscope" / "shardscope.log"


def setup_logging(verbose: bool = False) -> Path | None:
    """Send ``shardscope.*`` records to the log file (INFO and up), and DEBUG to stderr when verbose.

    Returns the log file, or None when it cannot be written (a read-only home must not stop the tool).
    """
    root = logging.getLogger("shardscope")
    if getattr(root, "_shardscope_configured", False):
        return log_file()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False
    file = log_file()
    path: Path | None = file
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = logging.handlers.RotatingFileHandler(file, maxBytes=5_000_000, backupCount=2,
                                                                       encoding="utf-8")
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    except OSError:
        path = None
    if verbose:
        err = logging.StreamHandler()
        err.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        err.setLevel(logging.DEBUG)
        root.addHandler(err)
    # a marker on the stdlib's logger, whose class declares no such attribute
    root._shardscope_configured = True  # type: ignore[attr-defined]
    return path
