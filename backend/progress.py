"""The progress/cancel object long backend operations take (Qt-free, like Orange3's ``state``)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from .errors import Cancelled


class Progress:
    """Reports progress of a long operation and carries a cooperative cancel flag.

    ``callback(done, total, message)`` is called from the working thread; GUI code turns it
    into a queued signal. ``check()`` raises :class:`Cancelled` once ``cancel()`` was called.
    """

    def __init__(self, callback: Callable[[int, int, str], None] | None = None) -> None:
        self._callback = callback
        self._cancel = threading.Event()
        self._lock = threading.Lock()  # advance() is called from several I/O threads
        self.done = 0
        self.total = 0
        self.message = ""

    def cancel(self) -> None:
        """Ask the operation to stop; it raises Cancelled at its next check."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        """True once ``cancel`` was called."""
        return self._cancel.is_set()

    def check(self) -> None:
        """Raise Cancelled if the operation was asked to stop."""
        if self._cancel.is_set():
            raise Cancelled()

    def start(self, total: int, message: str = "") -> None:
        """Begin a phase of ``total`` steps with a message, and report it."""
        self.total, self.done, self.message = total, 0, message
        self._emit()

    def advance(self, amount: int = 1, message: str | None = None) -> None:
        """Count ``amount`` more steps done (optionally a new message), report, and stop here if cancelled."""
        with self._lock:
            self.done += amount
            if message is not None:
                self.message = message
            self._emit()
        self.check()

    def _emit(self) -> None:
        if self._callback is not None:
            self._callback(self.done, self.total, self.message)
