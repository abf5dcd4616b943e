"""``shardscope gui CKPT`` (the real command line, in this process) whose window is closed while a background job
runs; prints when it asked to close and the helper processes the window had then (tests/test_window_close.py).

``close_driver.py CKPT importing``: closed while the checkpoint's analysis imports torch (cannot be interrupted);
``close_driver.py CKPT verifying``: closed just after Verify contents started on the opened checkpoint.
"""

from __future__ import annotations

import os
import sys
import time

from PySide6.QtCore import QThreadPool, QTimer
from PySide6.QtWidgets import QApplication
from shardscope.app.bootstrap import make_app
from shardscope.app.cli.main import main
from shardscope.app.main_window import MainWindow


def window() -> MainWindow | None:
    return next((w for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible()), None)


def children() -> list[int]:
    """This process's child processes (the metadata helpers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                pids.append(int(entry))
    return pids


def importing_torch(win: MainWindow) -> bool:
    return "torch" in sys.modules and QThreadPool.globalInstance().activeThreadCount() > 0


def verifying(win: MainWindow) -> bool:
    view = win.current_view()
    if view is None or view.data is None or view.data.problems is None or not view.progress.isHidden():
        return False
    view.verify_contents()
    return QThreadPool.globalInstance().activeThreadCount() > 0


def close_when(moment) -> None:
    timer = QTimer()
    timer.setInterval(10)

    def check() -> None:
        win = window()
        if win is not None and moment(win):
            timer.stop()
            print("helpers", *children(), flush=True)
            print(f"closing {time.time():.3f}", flush=True)
            win.close()

    timer.timeout.connect(check)
    timer.start()
    close_when.timer = timer  # kept alive with the event loop


if __name__ == "__main__":
    make_app()  # the one the command's window uses (made first, so the timer has its event loop)
    close_when({"importing": importing_torch, "verifying": verifying}[sys.argv[2]])
    sys.exit(main(["gui", sys.argv[1]]))
