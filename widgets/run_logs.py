"""The Training panel's log tail: one tab per rank (and the launcher), in rank order; the failed ranks'
tracebacks under the header; and the log text without torchrun's start-up notices."""

from __future__ import annotations

from PySide6.QtCore import QObject, Qt
from PySide6.QtWidgets import QPlainTextEdit, QTabWidget, QToolButton

LOG_LINES = 20000


def without_banners(log: str) -> str:
    """A log tail without torchrun's start-up notices framed by rules of "*" (the OMP_NUM_THREADS one).
    NOTE: a run whose torchrun was killed (kill -9, a scheduler) leaves only that notice in the launcher's log;
    the panel used to say "torchrun failed: Setting OMP_NUM_THREADS environment variable ..." as if it were
    the cause, with the notice as the traceback."""
    out: list[str] = []
    notice: list[str] | None = None  # the lines of a notice being read (kept if it never closes)
    for line in log.splitlines():
        if line.strip() and not line.strip("*"):  # a rule of stars opens or closes a notice
            notice = [line] if notice is None else None
        elif notice is not None:
            notice.append(line)
        else:
            out.append(line)
    return "\n".join(out + (notice or [])).strip()


class LogTabs(QTabWidget):
    """The Logs tab: a read-only view per rank that logs (launcher first), made when its first line comes."""

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.views: dict[int, QPlainTextEdit] = {}

    def view(self, rank: int) -> QPlainTextEdit:
        """The view of ``rank``'s log (-1: the launcher; below: other logs), made and placed in order if new."""
        view = self.views.get(rank)
        if view is None:
            view = QPlainTextEdit()
            view.setReadOnly(True)
            view.setMaximumBlockCount(LOG_LINES)
            view.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
            self.views[rank] = view
            title = "launcher" if rank == -1 else f"rank {rank}" if rank >= 0 else "other"
            order = sorted(self.views)
            self.insertTab(order.index(rank), view, title)
        return view

    def reset(self) -> None:
        """No logs (another run is shown)."""
        for i in reversed(range(self.count())):
            self.removeTab(i)
        self.views.clear()


class Traceback(QObject):
    """The failed ranks' tracebacks: a "Show the traceback" toggle and a small text box (the panel lays both out
    under its header), hidden while nothing failed; a failure brings its rank's log to the front."""

    def __init__(self, logs: LogTabs, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.logs = logs
        self.button = QToolButton()
        self.button.setCheckable(True)
        self.button.setText("Show the traceback")
        self.button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.button.setArrowType(Qt.ArrowType.RightArrow)
        self.button.toggled.connect(self._toggle)
        self.button.hide()
        # NOTE: a fixed, small height: a long traceback scrolls here instead of squashing the plots
        self.text = QPlainTextEdit()
        self.text.setReadOnly(True)
        self.text.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.text.setMaximumHeight(160)
        self.text.hide()

    def set_failures(self, failures: dict[int, str], root_cause: int | None = None) -> None:
        """Show these tracebacks (rank -> text; -1: torchrun's); none: the toggle and the box hide."""
        text = "\n\n".join(f"--- {'launcher' if r == -1 else f'rank {r}'}\n{tb}" for r, tb in sorted(failures.items()))
        if text != self.text.toPlainText():
            self.text.setPlainText(text)
            # the rank that failed first (torchrun_root_cause) when it left a traceback (a rank killed by
            # a signal often printed nothing), else the first failed rank: its log in front
            first = root_cause if root_cause in failures else min(failures, default=None)
            if first is not None and first in self.logs.views:  # the failed rank's log in front
                self.logs.setCurrentWidget(self.logs.views[first])
        self.button.setVisible(bool(text))
        self.text.setVisible(bool(text) and self.button.isChecked())

    def _toggle(self, on: bool) -> None:
        self.button.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow)
        self.button.setText("Hide the traceback" if on else "Show the traceback")
        self.text.setVisible(on and bool(self.text.toPlainText()))
