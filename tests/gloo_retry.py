"""The one retry rule for the gloo runs the tests start (make_fixtures.py, lightning_writer.py and the
checkpoint-kinds writer): a busy machine can fail one (a rendezvous port another process took in between,
a rank slow to start), so it is tried again, each try from an empty folder, and the last failure stands."""

from __future__ import annotations

import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
ATTEMPTS = 3


class RunFailed(Exception):
    """A writer process that exited non-zero; ``proc`` is its completed process (output captured)."""

    def __init__(self, proc: subprocess.CompletedProcess) -> None:
        super().__init__(f"exit {proc.returncode}")
        self.proc = proc


def run_ok(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` with its output captured; :class:`RunFailed` unless it exits 0."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RunFailed(proc)
    return proc


def retry_gloo(empty_folder: Callable[[], Path], run: Callable[[Path], T], attempts: int = ATTEMPTS,
               name: str = "") -> T:
    """``run(empty_folder())`` until it returns, at most ``attempts`` times; ``empty_folder`` gives an empty
    folder each try (clears the last try's, or makes a new one). The last try's exception is raised; with
    ``name``, each failed try is reported on stderr (``NAME failed (attempt K of N):`` and its traceback)."""
    for attempt in range(1, attempts + 1):
        folder = empty_folder()
        try:
            return run(folder)
        except Exception:
            if name:
                print(f"{name} failed (attempt {attempt} of {attempts}):", file=sys.stderr)
                traceback.print_exc()
            if attempt == attempts:
                raise
    raise AssertionError("attempts must be at least 1")
