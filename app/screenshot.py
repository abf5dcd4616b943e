"""The ``--screenshot`` mode: render the window to a PNG once what it shows is ready, then quit.

Every step waits on the signal that says its part is ready (a checkpoint ``loaded``, a tensor's values
``valuesDone``, a comparison ``finished`` and its ``detailDone``), never on a fixed timer. A long
deadline only guards against a part that never reports; the picture is then taken anyway and the
exit code says so.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from PySide6.QtCore import QObject, QTimer
from PySide6.QtWidgets import QApplication, QWidget
from shardscope.backend.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_PROBLEMS
from shardscope.widgets.checkpoint_view import CheckpointView
from shardscope.widgets.compare_view import CompareView

DEADLINE_MS = 180_000
CONDITION_POLL_MS = 100


class Screenshot(QObject):
    """One picture of ``window`` saved to ``path`` when the part it follows is ready."""

    def __init__(self, app: QApplication, window: QWidget, path: str) -> None:
        super().__init__(window)
        self.app, self.window, self.path = app, window, path
        self.code = EXIT_OK
        self.done = False
        self._deadline = QTimer(self)
        self._deadline.setSingleShot(True)
        self._deadline.timeout.connect(self._too_late)
        self._deadline.start(DEADLINE_MS)

    # ------------------------------------------------------------------ what to wait for
    def checkpoint(self, view: CheckpointView, select: str | None) -> None:
        """After the analysis; with ``select``, after that entry's values are shown too."""

        def loaded(_data: object) -> None:
            if not select:
                self.grab()
            elif not view.select_path(select):
                self.fail(f"no entry {select!r} to select")
            elif view.values_pending():
                view.valuesDone.connect(self.grab)
            else:
                self.grab()

        view.loaded.connect(loaded)
        view.failed.connect(self.fail)

    def compare(self, view: CompareView, select: str | None) -> None:
        """After the comparison; with ``select``, after that entry's difference histogram."""

        def finished(result: object) -> None:
            if result is None:
                self.fail("the comparison failed")
            elif select and not view.select(select):
                self.fail(f"no changed entry {select!r} to select")
            elif view.detail_pending():
                view.detailDone.connect(self.grab)
            else:
                self.grab()

        view.finished.connect(finished)

    def when(self, condition: Callable[[], bool], prepare: Callable[[], object] | None = None) -> None:
        """For parts without a ready signal: check ``condition`` on the event loop until it holds,
        then ``prepare`` (e.g. draw plots now rather than at their next timer tick) and grab."""
        timer = QTimer(self)
        timer.setInterval(CONDITION_POLL_MS)

        def check() -> None:
            if condition():
                timer.stop()
                if prepare is not None:
                    prepare()
                self.grab()

        timer.timeout.connect(check)
        timer.start()

    # ------------------------------------------------------------------ the picture
    def fail(self, message: str) -> None:
        print(f"shardscope: {message}", file=sys.stderr)
        self.code = EXIT_BAD_INPUT
        self.grab()

    def _too_late(self) -> None:
        print(f"shardscope: still not ready after {DEADLINE_MS // 1000} s; taking the picture anyway", file=sys.stderr)
        self.code = EXIT_PROBLEMS
        self.grab()

    def grab(self, *_args: object) -> None:
        if self.done:
            return
        self.done = True
        self._deadline.stop()
        self.app.processEvents()  # pending layout requests and repaints of what just changed
        if not self.window.grab().save(self.path):
            print(f"shardscope: cannot write {self.path}", file=sys.stderr)
            self.code = EXIT_BAD_INPUT
        else:
            print(f"wrote {self.path}")
        QTimer.singleShot(0, self.app.quit)  # NOTE: also when called before the event loop runs
