"""The progress/cancel object long backend operations take (Qt-free, like Orange3's ``state``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

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
        self._hooks: list[Callable[[], None]] = []
        # NOTE: its own lock: a progress callback may cancel (under ``_lock``, held while it reports)
        self._hooks_lock = threading.Lock()

    def cancel(self) -> None:
        """Ask the operation to stop; it raises Cancelled at its next check. Work that cannot check (a wait on
        another process) registered what stops it with ``on_cancel``: that runs now, on this thread."""
        self._cancel.set()
        with self._hooks_lock:
            hooks = list(self._hooks)
        for hook in hooks:
            hook()

    def on_cancel(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Call ``hook`` when the operation is cancelled (at once if it already is); returns what removes it.
        The hook runs on the cancelling thread: it must only stop something (kill a helper process)."""
        with self._hooks_lock:
            self._hooks.append(hook)
        if self.cancelled:
            hook()

        def remove() -> None:
            with self._hooks_lock, contextlib.suppress(ValueError):
                self._hooks.remove(hook)

        return remove

    @contextlib.contextmanager
    def current(self) -> Iterator[Progress]:
        """Make this the thread's current operation (:func:`current`) while the block runs: code deep below,
        that is passed no progress (a metadata load in a helper process), can still be cancelled."""
        before = getattr(_CURRENT, "progress", None)
        _CURRENT.progress = self
        try:
            yield self
        finally:
            _CURRENT.progress = before

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


_CURRENT = threading.local()


def current() -> Progress | None:
    """The progress of the operation this thread runs (:meth:`Progress.current`), if any."""
    return getattr(_CURRENT, "progress", None)
