"""The Training tab of the main window (widgets/training_panel.py without training runs): the Runs list
after a run folder is renamed, a tab opened again while a run goes on, a killed torchrun's message."""

from __future__ import annotations

import json
import time

import pytest
from gui_support import no_thread_left_running  # noqa: F401  (an autouse fixture)
from PySide6.QtCore import Qt
from test_training_panel import SHORT, fake_run

pytestmark = pytest.mark.gui


def test_a_followed_run_renamed_on_disk_leaves_no_blank_entry(qtbot, tmp_path):
    """Renaming (or deleting) the run folder shown in the Training panel left a blank entry with its old name at
    the top of the Runs list for good, and the header said "no status.json: a run started outside Shardscope;
    following its files" about a folder that no longer existed."""
    from shardscope.widgets.training_panel import TrainingPanel

    panel = TrainingPanel(runs_root=tmp_path)
    qtbot.addWidget(panel)
    try:
        run = fake_run(tmp_path / "run-a", {"state": "finished", "explanation": "success"})
        panel.follow(str(run))
        panel.refresh_runs(select=str(run))

        def names() -> list[str]:
            return [panel.run_list.item(i).text().split()[0] for i in range(panel.run_list.count())]

        qtbot.waitUntil(lambda: names() == ["run-a"] and panel.ckpt_list.count() == 2, timeout=SHORT)
        run.rename(tmp_path / "my-run")
        panel.refresh_runs()
        qtbot.waitUntil(lambda: "no longer exists" in panel.status.text(), timeout=SHORT)
        panel.refresh_runs()
        qtbot.waitUntil(lambda: names() == ["my-run"], timeout=SHORT)
        assert "started outside Shardscope" not in panel.status.text()
        assert panel.ckpt_list.count() == 0  # its checkpoints went with it: nothing to open or resume
        assert not panel.stop_button.isEnabled() and not panel.resume_button.isEnabled()
        panel.run_list.setCurrentRow(0)  # picked again under its new name: followed as before
        qtbot.waitUntil(lambda: "finished" in panel.status.text() and panel.ckpt_list.count() == 2, timeout=SHORT)
        assert json.loads((tmp_path / "my-run" / "status.json").read_text())["state"] == "finished"
    finally:
        panel.shutdown()


def test_a_training_tab_opened_again_shows_the_run_still_going(qtbot, tmp_path):
    """Closing the Training tab while a run went on, then Run › Training panel (Ctrl+T): the new panel said "No
    run selected" with Stop disabled, though the run was still training."""
    import subprocess
    import sys

    from shardscope.widgets.training_panel import TrainingPanel

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    panel = None
    try:
        fake_run(tmp_path / "old", {"state": "finished", "explanation": "success"})
        running = fake_run(tmp_path / "going", {"state": "running", "pid": live.pid, "scheduler": "local",
                                                "start_time": time.time()})
        panel = TrainingPanel(runs_root=tmp_path)
        qtbot.addWidget(panel)
        qtbot.waitUntil(lambda: panel.follower is not None and panel.stop_button.isEnabled(), timeout=SHORT)
        assert panel.follower.run_dir == running
        assert panel.run_list.currentItem().data(Qt.ItemDataRole.UserRole) == str(running)
    finally:
        if panel is not None:
            panel.shutdown()
        live.kill()
        live.wait(60)


def test_a_killed_torchrun_is_not_blamed_on_its_omp_notice(qtbot, tmp_path):
    """kill -9 of torchrun itself: its log holds only the OMP_NUM_THREADS start-up notice, and the panel said
    "torchrun failed: Setting OMP_NUM_THREADS environment variable ..." under "killed by SIGKILL", with the
    notice offered as the traceback. A real traceback after the notice is still shown."""
    from shardscope.widgets.training_panel import TrainingPanel
    from test_training_panel import SHORT, fake_run

    notice = ("*****************************************\nSetting OMP_NUM_THREADS environment variable for each "
              "process to be 1 in default, to avoid your system being overloaded, please further tune the "
              "variable for optimal performance in your application as needed. \n"
              "*****************************************\n")
    run = fake_run(tmp_path / "runs" / "killed", {"state": "failed", "exit_code": -9, "failed_ranks": [],
                                                  "explanation": "killed by SIGKILL (often the out-of-memory "
                                                                 "killer; see `dmesg`)"})
    (run / "logs").mkdir()
    (run / "logs" / "launcher.log").write_text(notice)
    panel = TrainingPanel(runs_root=tmp_path / "runs")
    qtbot.addWidget(panel)
    try:
        panel.follow(str(run))
        qtbot.waitUntil(lambda: "killed by SIGKILL" in panel.status.text(), timeout=SHORT)
        assert "OMP_NUM_THREADS" not in panel.status.text() and "torchrun failed" not in panel.status.text()
        assert not panel.details_button.isVisibleTo(panel)
        (run / "logs" / "launcher.log").write_text(notice + "Traceback (most recent call last):\n"
                                                   "RuntimeError: rendezvous failed\n")
        qtbot.waitUntil(lambda: "torchrun failed: RuntimeError: rendezvous failed" in panel.status.text(),
                        timeout=SHORT)
        assert "OMP_NUM_THREADS" not in panel.details.toPlainText()
    finally:
        panel.shutdown()
