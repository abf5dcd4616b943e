"""Errors the user can act on: each names the file (and tensor) involved."""

from __future__ import annotations


class ShardscopeError(Exception):
    """Base class; its message is shown to the user as is (no traceback)."""


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

    def __init__(self, message: str = "cancelled") -> None:
        super().__init__(message)
