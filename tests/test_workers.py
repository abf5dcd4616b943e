"""Background work whose owner widget is deleted while it runs: no slot touches a deleted widget and the
work is asked to stop (widgets/workers.py). pytest-qt fails a test when an exception escapes into Qt
from a slot ("Internal C++ object (QLabel) already deleted"), which is what these would raise unguarded.

The workers are held up on an event (or queued behind such workers), so "mid-flight" is certain, not a
race: the owner is gone before any of them reports.
"""

from __future__ import annotations

import threading

import pytest
import shiboken6
from PySide6.QtCore import QObject, QThreadPool
from PySide6.QtWidgets import QLabel, QWidget
from shardscope.backend.errors import ShardscopeError
from shardscope.widgets.workers import Worker, run_in_background

pytestmark = pytest.mark.gui

DEADLINE_MS = 120_000


@pytest.fixture(autouse=True)
def no_thread_left_running():
    yield
    assert QThreadPool.globalInstance().waitForDone(10000), "a background worker was left running"


def held(go: threading.Event, outcome: str):
    """Work that waits for ``go``, then returns, fails, or reports progress (and stops if cancelled)."""

    def work(progress=None):
        progress.start(2, "waiting")
        if not go.wait(DEADLINE_MS / 1000):
            raise TimeoutError("the test never released the work")
        if outcome == "error":
            raise ShardscopeError("it failed")
        if outcome == "progress":
            progress.advance(1, "half")  # raises Cancelled once the owner asked the work to stop
        return outcome

    return work


def start_all(go: threading.Event, owner: QWidget, label: QLabel, heard: list) -> list[Worker]:
    """One worker per outcome, every slot a lambda touching ``label`` (Qt never disconnects lambdas)."""

    def touch(what):
        return lambda *a: (label.setText(f"{what} {a}"), heard.append(what))

    return [run_in_background(held(go, outcome), owner=owner, on_result=touch("result"), on_error=touch("error"),
                              on_progress=touch("progress"), on_cancelled=touch("cancelled"),
                              on_finished=touch("finished"))
            for outcome in ("result", "error", "progress")]


def wait_ended(qtbot, workers: list[Worker]) -> None:
    """Every worker finished and its queued slots ran (its `finished` bookkeeping is the last slot)."""
    qtbot.waitUntil(lambda: not any(w in Worker._alive for w in workers), timeout=DEADLINE_MS)


def test_slots_of_a_deleted_owner_are_skipped_and_its_work_cancelled(qtbot):
    go = threading.Event()
    kept, gone = QWidget(), QWidget()
    qtbot.addWidget(kept)
    kept_label, gone_label = QLabel(kept), QLabel(gone)
    heard_kept: list[str] = []
    heard_gone: list[str] = []
    for_kept = start_all(go, kept, kept_label, heard_kept)
    for_gone = start_all(go, gone, gone_label, heard_gone)
    qtbot.waitUntil(lambda: "progress" in heard_kept, timeout=DEADLINE_MS)  # the first workers are running
    gone.deleteLater()
    qtbot.waitUntil(lambda: not shiboken6.isValid(gone_label), timeout=DEADLINE_MS)
    assert all(w.progress.cancelled for w in for_gone), "deleting the owner did not ask its work to stop"
    assert not any(w.progress.cancelled for w in for_kept)
    heard_gone.clear()  # what it heard while it existed
    go.set()
    wait_ended(qtbot, for_kept + for_gone)
    assert heard_gone == []
    # the same slots on a live owner ran: the signals were delivered, the guard is what kept the others quiet
    assert {"result", "error", "progress", "finished"} <= set(heard_kept), heard_kept
    assert heard_kept.count("finished") == 3


def test_closing_tabs_while_their_work_is_queued(qtbot, fixtures, tmp_path):
    """The real window: a values load, a compare and the Training panel's listing are queued behind
    workers that hold every pool thread; their tabs close; then the pool runs them."""
    from shardscope.app.main_window import MainWindow

    win = MainWindow()
    qtbot.addWidget(win)
    win.quiet = True
    win.resize(1280, 720)
    win.show()
    view = win.open_path(str(fixtures["fsdp2_r4"]))
    qtbot.waitUntil(lambda: view.data is not None and view.data.problems is not None and view.progress.isHidden(),
                    timeout=DEADLINE_MS)
    go = threading.Event()
    blocker_owner = QObject()
    pool = QThreadPool.globalInstance()
    blockers = [run_in_background(held(go, "result"), owner=blocker_owner) for _ in range(pool.maxThreadCount())]
    qtbot.waitUntil(lambda: pool.activeThreadCount() == pool.maxThreadCount(), timeout=DEADLINE_MS)

    before = set(Worker._alive)
    tensor = next(t.fqn for t in view.data.ckpt.tensors if t.nbytes > 0)
    assert view.select_path(tensor) and view.values_pending()
    steps = fixtures["steps_r2"]
    compare = win.compare(str(steps / "step2"), str(steps / "step3"))
    panel = win.training_panel(str(tmp_path / "run"))  # lists runs, polls the run, looks for SLURM
    queued = set(Worker._alive) - before
    assert len(queued) >= 4 and pool.activeThreadCount() == pool.maxThreadCount()
    for w in (view, compare, panel):
        for pane in (win.tabs, win.side_tabs):
            if pane.indexOf(w) >= 0:
                win.close_tab(pane.indexOf(w), pane)
    qtbot.waitUntil(lambda: not any(shiboken6.isValid(w) for w in (view, compare, panel)), timeout=DEADLINE_MS)
    assert all(w.progress.cancelled for w in queued), "work of a closed tab was not asked to stop"
    go.set()
    wait_ended(qtbot, blockers + list(queued))
    assert not win.all_views()


def test_rerun_makes_one_more_run_with_the_latest_inputs_however_often_it_is_asked(qtbot):
    """Rerun (the watch and prune dialogs' plans): asks while a run is held up make exactly one more run, which
    reads the inputs as they are when it starts; nothing runs twice at once."""
    from shardscope.widgets.workers import Rerun

    owner = QLabel()
    go = threading.Event()
    inputs = {"value": 1}
    started: list[int] = []
    shown: list[int] = []

    def work(value, progress=None):
        if value == 1 and not go.wait(DEADLINE_MS / 1000):  # the first run is held up
            raise TimeoutError("the test never released the work")
        return value

    def start(done):
        started.append(inputs["value"])
        return run_in_background(work, inputs["value"], owner=owner, on_result=shown.append, on_finished=done)

    rerun = Rerun(start)
    rerun.ask()
    for v in (2, 3, 4):  # while the first run is held up
        inputs["value"] = v
        rerun.ask()
    assert started == [1] and rerun.worker is not None
    go.set()
    qtbot.waitUntil(lambda: shown == [1, 4] and rerun.worker is None, timeout=DEADLINE_MS)
    assert started == [1, 4]
