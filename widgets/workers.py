"""One way to run background work: a QRunnable with a QObject of signals (as superqt does).

The work is a plain backend function taking ``progress=``; results come back through queued
signals, so nothing here touches a widget from the worker thread.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import shiboken6
from PySide6.QtCore import QObject, QRunnable, QThreadPool, Signal
from shardscope.backend.errors import Cancelled, ShardscopeError
from shardscope.backend.log import log_file
from shardscope.backend.progress import Progress

log = logging.getLogger(__name__)


class WorkerSignals(QObject):
    started = Signal()
    # NOTE: sizes cross the Qt boundary as Python objects: Signal(int) is 32-bit and overflows past 2 GiB.
    progress = Signal(object, object, str)
    returned = Signal(object)
    errored = Signal(str)
    cancelled = Signal()
    finished = Signal()


class Worker(QRunnable):
    """Runs ``func(*args, progress=Progress, **kwargs)`` on the global thread pool."""

    _alive: ClassVar[set[Worker]] = set()  # NOTE: keeps the Python wrapper (and its signals) alive until finished

    def __init__(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        super().__init__()
        # NOTE: the pool deletes the C++ runnable after run(); with autoDelete off, PySide's pool kept a
        # reference to every Python worker for ever. `_alive` keeps the Python side until finished.
        self.setAutoDelete(True)
        self.signals = WorkerSignals()
        self.func, self.args, self.kwargs = func, args, kwargs
        self.progress = Progress(self.signals.progress.emit)

    def quit(self) -> None:
        """Cooperative cancel: the backend function stops at its next progress check."""
        self.progress.cancel()

    def start(self) -> Worker:
        Worker._alive.add(self)
        # NOTE: every worker used to leak (found by tests/test_soak.py): a slot holding the worker (this
        # one, or a caller's `lambda wk=w: ...`) is a cycle through C++ (signals -> connection -> slot ->
        # worker) that Python's GC cannot see. Deleting the signals object once finished drops its
        # connections; the slots already queued for this emission run first.
        ref = weakref.ref(self)

        def forget() -> None:
            worker = ref()
            if worker is not None:
                Worker._alive.discard(worker)
                worker.signals.deleteLater()

        self.signals.finished.connect(forget)
        QThreadPool.globalInstance().start(self)
        return self

    def run(self) -> None:  # worker thread
        self.signals.started.emit()
        try:
            result = self.func(*self.args, progress=self.progress, **self.kwargs)
        except Cancelled:
            self.signals.cancelled.emit()
        except ShardscopeError as exc:
            self.signals.errored.emit(str(exc))
        except MemoryError:
            self.signals.errored.emit("Out of memory while doing this.")
        except Exception as exc:
            log.exception("internal error in background work %s", getattr(self.func, "__qualname__", self.func))
            self.signals.errored.emit(f"Internal error: {type(exc).__name__}: {exc} (the traceback is in "
                                      f"{log_file()}; please report it)")
        else:
            self.signals.returned.emit(result)
        finally:
            self.signals.finished.emit()


def if_alive(owner: QObject, slot: Callable[..., Any]) -> Callable[..., None]:
    """``slot``, skipped once ``owner`` is deleted. NOTE: a worker may report after its tab was closed; Qt
    disconnects bound methods of a deleted QObject but not lambdas, which would touch deleted widgets."""

    def call(*args: Any) -> None:
        if shiboken6.isValid(owner):
            slot(*args)

    return call


def run_in_background(func: Callable[..., Any], *args: Any, on_result: Callable | None = None,
                      on_error: Callable | None = None, on_progress: Callable | None = None,
                      on_finished: Callable | None = None, **kwargs: Any) -> Worker:
    w = Worker(func, *args, **kwargs)
    if on_result:
        w.signals.returned.connect(on_result)
    if on_error:
        w.signals.errored.connect(on_error)
    if on_progress:
        w.signals.progress.connect(on_progress)
    if on_finished:
        w.signals.finished.connect(on_finished)
    return w.start()
