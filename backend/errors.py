"""Errors the user can act on, and the exit-code contract every command follows.

Exit codes (documented in the README, applied in one place: ``shardscope.app.cli.main``):

* ``0`` (:data:`EXIT_OK`): success, healthy, no differences.
* ``1`` (:data:`EXIT_PROBLEMS`): the command ran and found problems (verify), differences (diff),
  a verification that failed, or a training run that failed.
* ``2`` (:data:`EXIT_BAD_INPUT`): bad input: a file that cannot be read as what it claims to be, a
  bad option, an unreachable storage endpoint. One line on stderr names the file (and tensor). ``diff``
  also exits 2 when some entries could not be read, after reporting them and comparing the rest (trouble
  outranks differences, as in GNU diff).
* ``3`` (:data:`EXIT_INTERNAL`): a bug in Shardscope. One line on stderr points to the log file that
  holds the traceback; never confused with "problems found".
* ``130`` (:data:`EXIT_INTERRUPTED`): cancelled or interrupted (Ctrl-C, SIGTERM).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130


class ShardscopeError(Exception):
    """Base class; its message is shown to the user as is (one line, no traceback), exit 2."""

    exit_code = EXIT_BAD_INPUT


class CheckpointError(ShardscopeError):
    """A checkpoint cannot be read: missing, not a checkpoint, damaged or refused."""

    def __init__(self, message: str, *, path: str | None = None, fqn: str | None = None, hint: str | None = None):
        self.path = path
        self.fqn = fqn
        self.hint = hint
        parts = [message]
        if hint:
            parts.append(hint)
        super().__init__(" ".join(parts))


class RefusedPickleError(CheckpointError):
    """A pickle asked for a global outside the allow-list; nothing in it was run."""


class Cancelled(ShardscopeError):
    """The user cancelled a long operation."""

    exit_code = EXIT_INTERRUPTED

    def __init__(self, message: str = "cancelled") -> None:
        super().__init__(message)
