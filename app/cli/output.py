"""What every subcommand prints with: the one error line and a progress line on a terminal."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from shardscope.backend.errors import Cancelled
from shardscope.backend.progress import Progress
from shardscope.backend.text import count, escape_name, human_bytes, human_duration


def err(msg: str) -> None:
    """The one line a failed command prints on stderr."""
    print(f"shardscope: {escape_name(' '.join(str(msg).splitlines()))}", file=sys.stderr)


def print_problems(problems: list) -> None:
    """The health lines of ``inspect`` and ``verify``."""
    if not problems:
        print("  health     healthy")
        return
    print(f"  health     {count(len(problems), 'problem')}")
    for p in problems[:200]:
        print(f"    [{p.kind}] {escape_name(p.message)}")
    if len(problems) > 200:
        print(f"    ... and {len(problems) - 200} more (use --json for all)")


class TerminalProgress:
    """A progress line on stderr (bytes, rate, time left) when stderr is a terminal; in bytes, the phase's message
    says what is counted (an export counts each byte read and re-read to verify: twice its output's size)."""

    def __init__(self, enabled: bool = True, unit: str = "items") -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.unit = unit
        self._last = 0.0
        self._t0 = 0.0
        self.progress = Progress(self._show)

    def __enter__(self) -> Progress:
        self._t0 = time.monotonic()
        return self.progress

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()

    def _show(self, done: int, total: int, message: str) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and done < total:
            return
        self._last = now
        elapsed = max(now - self._t0, 1e-6)
        frac = done / total if total else 0.0
        bar = "#" * int(frac * 30)
        if self.unit == "bytes":
            rate = done / elapsed
            left = (total - done) / rate if rate > 0 else 0
            what = f"{message} " if message else ""
            text = (f"[{bar:<30}] {what}{human_bytes(done)} of {human_bytes(total)} {human_bytes(rate)}/s "
                    f"{human_duration(left)} left")
        else:
            text = f"[{bar:<30}] {done}/{total} {message[:40]}"
        sys.stderr.write("\r\033[K" + text)
        sys.stderr.flush()


def _terminated(signum: int, frame: Any) -> None:
    raise Cancelled("interrupted by SIGTERM")


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM stops the command as Ctrl-C does (exit 130, one line), also while it reads its source and before
    its output exists; while the output is written the writer's own handler takes over (backend.export.atomic)."""
    old = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def add_command(sub: Any, name: str, func: Any, help: str) -> Any:
    """Add subcommand ``name`` running ``func(args) -> int``; returns its parser."""
    sp = sub.add_parser(name, help=help, description=help)
    sp.set_defaults(func=func)
    return sp
