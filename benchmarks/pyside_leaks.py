"""Two PySide6 behaviours the window soak found, shown without any Shardscope code.

    QT_QPA_PLATFORM=offscreen python benchmarks/pyside_leaks.py

1. ``QThreadPool.start(runnable)`` with a Python ``QRunnable`` subclass (auto-delete) keeps a reference to
   many runnables that start at once on an idle thread: the pool's Python wrapper still holds them after Qt
   deleted them, so each keeps whatever it references for ever. ``QThreadPool.start(callable)`` keeps
   nothing. (widgets/workers.py starts its workers as callables for this reason.)
2. On PySide6 6.11.3 the first ``setBackground`` / ``setTextAlignment`` on a new ``QTableWidgetItem`` (and
   painting such items) adds a reference to ``None`` that is never given back; no object is kept (memory
   does not grow), but
   ``sys.getrefcount(None)`` climbs (the soak saw ~200 per action; the inspector's chunk table sets both on
   every row). PySide6 6.12.0 has the opposite fault, dropping references to ``None`` until the process
   aborts (``none_dealloc``), which is why ``pyproject.toml`` excludes it.

Prints what it measured and the PySide6 version; exits 0 (it documents, it does not judge).
"""

from __future__ import annotations

import gc
import os
import sys
import time
import weakref

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import PySide6
from PySide6.QtCore import QRunnable, Qt, QThreadPool
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QApplication, QTableWidgetItem

N = 300
ITEM = QTableWidgetItem("x")


class Job(QRunnable):
    def __init__(self) -> None:
        super().__init__()
        self.setAutoDelete(True)

    def run(self) -> None:
        pass


class Task:
    def __call__(self) -> None:
        pass


def busy(seconds: float) -> None:
    """Keep the GUI thread working, as a window does between two background jobs."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def pool_keeps(app: QApplication, make, pause: float) -> int:
    """How many of N finished jobs are still alive (only the pool could hold them)."""
    pool = QThreadPool.globalInstance()
    refs = []
    for _ in range(N):
        job = make()
        refs.append(weakref.ref(job))
        pool.start(job)
        del job
        busy(pause)
    pool.waitForDone()
    app.processEvents()
    gc.collect()
    return sum(r() is not None for r in refs)


def none_refs_per_call(call) -> float:
    call()
    gc.collect()
    before = sys.getrefcount(None)
    for _ in range(N):
        call()
    gc.collect()
    return (sys.getrefcount(None) - before) / N


def main() -> int:
    app = QApplication([])
    print(f"PySide6 {PySide6.__version__}, Python {sys.version.split()[0]}")
    for label, pause in (("queued in a burst", 0.0), ("one at a time, GUI thread busy 3 ms after each", 0.003)):
        print(f"  QThreadPool.start(QRunnable subclass), {label}: {pool_keeps(app, Job, pause)} of {N} "
              "finished runnables kept")
    print(f"  QThreadPool.start(callable), one at a time: {pool_keeps(app, Task, 0.003)} of {N} kept")
    for name, call in (("QTableWidgetItem(text)", lambda: QTableWidgetItem("x")),
                       ("QTableWidgetItem(text).setBackground(colour)",
                        lambda: QTableWidgetItem("x").setBackground(QColor("red"))),
                       ("QTableWidgetItem(text).setTextAlignment(flags)",
                        lambda: QTableWidgetItem("x").setTextAlignment(Qt.AlignmentFlag.AlignRight)),
                       ("the same item's setBackground again", lambda: ITEM.setBackground(QColor("red")))):
        print(f"  {name}: {none_refs_per_call(call):+.2f} references to None per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
