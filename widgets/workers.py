"""One way to run background work: a callable on the global thread pool with a QObject of signals.

The work is a plain backend function taking ``progress=``; results come back through queued
signals, so nothing here touches a widget from the worker thread. Start work with
``run_in_background(func, ..., owner=widget, on_result=...)``: it is the only place that connects
to a worker's signals, and it guards every slot by the widget that owns it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import shiboken6
from PySide6.QtCore import QCoreApplication, QObject, QThreadPool, Signal
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


class Worker:
    """Runs ``func(*args, progress=Progress, **kwargs)`` on the global thread pool (started by
    :func:`run_in_background`, which connects its signals)."""

    _alive: ClassVar[set[Worker]] = set()  # NOTE: keeps the worker (and its signals) alive until finished

    def __init__(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        # NOTE: the signals belong to the application (C++ deletes them on the GUI thread, see start()),
        # not to this Python object: its last reference may go on the pool's thread, which must never
        # delete a QObject that lives on the GUI thread.
        self.signals = WorkerSignals(QCoreApplication.instance())
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
        # NOTE: a plain callable, not a QRunnable subclass. PySide6 6.11.3's QThreadPool.start(runnable)
        # keeps a reference to about half of the auto-delete runnables that start at once on an idle
        # thread (the pool's Python wrapper holds them after Qt deleted them): each kept its worker, its
        # arguments and its result for ever (found with tests/soak_driver.py --probe; shown by
        # benchmarks/pyside_leaks.py). Started as a callable, nothing is kept.
        QThreadPool.globalInstance().start(self.run)
        return self

    def run(self) -> None:  # worker thread
        self.signals.started.emit()
        try:
            with self.progress.current():  # what it runs in a helper process is cancelled with it
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
            # NOTE: what the work holds (closures over widgets, checkpoints) goes here, not when the worker
            # goes, which may be on this thread
            self.func, self.args, self.kwargs = _done, (), {}
            self.signals.finished.emit()


def _done(*_args: Any, **_kwargs: Any) -> None:
    """What a finished worker's ``func`` becomes."""


def run_in_background(func: Callable[..., Any], *args: Any, owner: QObject, on_result: Callable | None = None,
                      on_error: Callable | None = None, on_progress: Callable | None = None,
                      on_cancelled: Callable | None = None, on_finished: Callable | None = None,
                      **kwargs: Any) -> Worker:
    """Run ``func(*args, progress=..., **kwargs)`` on the pool and call the ``on_*`` slots on the GUI thread.

    Every slot is connected before the work starts (a fast failure is never unheard) and is skipped once
    ``owner`` (the widget the slots touch) is deleted; the work is asked to stop when ``owner`` goes.
    NOTE: a worker may report after its tab or dialog was closed. Qt drops connections to bound methods of
    a deleted QObject, but not to lambdas or closures, which then touched deleted widgets ("Internal C++
    object already deleted"; found by tests/test_soak.py). So no code connects to a worker's signals
    itself: every connection goes through here, guarded by its owner.
    """
    _collect_on_gui_thread()
    w = Worker(func, *args, **kwargs)
    s = w.signals
    for signal, slot in ((s.progress, on_progress), (s.returned, on_result), (s.errored, on_error),
                         (s.cancelled, on_cancelled), (s.finished, on_finished)):
        if slot is not None:
            signal.connect(_while_alive(owner, slot))
    _stop_with(owner, w)
    return w.start()


def stop_background(wait_ms: int) -> bool:
    """Ask every running worker to stop (each at its next progress check) and wait up to ``wait_ms`` for the pool
    to empty; True when no work runs any more. For leaving the application: its teardown waits for the pool."""
    for worker in list(Worker._alive):
        worker.quit()
    return QThreadPool.globalInstance().waitForDone(wait_ms)


class Rerun:
    """One background computation at a time for a widget that recomputes as its inputs change (a dialog's plan):
    :meth:`ask` while one runs makes exactly one more run when it ends, ``start`` reading the inputs as they are
    then, so what is shown is never older than the last ask. ``start(done)`` starts the work with
    :func:`run_in_background`, passing ``done`` as its ``on_finished``, and returns the worker (None: nothing to
    run for the inputs as they are)."""

    def __init__(self, start: Callable[[Callable[[], None]], Worker | None]) -> None:
        self._start = start
        self.worker: Worker | None = None  # the run in progress
        self._again = False

    def ask(self) -> None:
        """Run now, or once more when the run in progress ends."""
        if self.worker is not None:
            self._again = True
            return
        self.worker = self._start(self._done)

    def _done(self) -> None:
        self.worker = None
        if self._again:
            self._again = False
            self.ask()


_collector: object | None = None


def _collect_on_gui_thread() -> None:
    """Python's cycle collection from now on runs on a GUI-thread timer only (pyqtgraph's GarbageCollector).

    NOTE: automatic collection runs in whichever thread allocates past a threshold. On a pool thread it
    finalised unreachable widgets (a closed window's cycles) there, and ~QWidget waited for the GIL that
    the GUI thread held while it deleted another widget: a deadlock (seen in tests/test_window_scale.py).
    """
    global _collector
    if _collector is None:
        from pyqtgraph.util.garbage_collector import GarbageCollector

        _collector = GarbageCollector(interval=1.0)


def _while_alive(owner: QObject, slot: Callable[..., Any]) -> Callable[..., None]:
    def call(*args: Any) -> None:
        if shiboken6.isValid(owner):
            slot(*args)

    return call


def _stop_with(owner: QObject, worker: Worker) -> None:
    """Cancel ``worker`` if ``owner`` is destroyed first. One ``destroyed`` connection per owner (not one
    per worker: a panel polling twice a second would pile them up), holding the running workers weakly."""
    running: weakref.WeakSet[Worker] | None = getattr(owner, "_background_workers", None)
    if running is None:
        running = weakref.WeakSet()
        owner._background_workers = running  # type: ignore[attr-defined]
        # NOTE: the slot holds the set only, never the owner (which is being destroyed when it runs)
        owner.destroyed.connect(lambda *_a: [wk.quit() for wk in list(running)])
    running.add(worker)
