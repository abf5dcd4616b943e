"""File › Import (app/import_job.py) into a folder that exists."""

from __future__ import annotations

import pytest
from gui_support import no_thread_left_running  # noqa: F401  (an autouse fixture)
from PySide6.QtWidgets import QApplication

pytestmark = pytest.mark.gui


def test_import_into_an_existing_folder_does_not_speak_of_force(qtbot, tmp_path):
    """File › Import into a folder that exists said "give --force to overwrite it": the window has no
    --force (and nothing in the folder may be touched)."""
    from PySide6.QtCore import QTimer
    from shardscope.app.import_job import run_dcp_job
    from shardscope.app.main_window import MainWindow
    from shardscope.backend.export.dcp_writer import import_file

    dst = tmp_path / "exists"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    win = MainWindow()
    qtbot.addWidget(win)
    seen: list[str] = []

    def read_and_close() -> None:  # the warning is modal: read it, close it
        box = QApplication.activeModalWidget()
        if box is not None and hasattr(box, "text") and "Nothing was written" in box.text():
            seen.append(box.text())
            box.close()
        else:
            QTimer.singleShot(50, read_and_close)

    QTimer.singleShot(50, read_and_close)
    import torch

    torch.save({"w": torch.ones(4, 2)}, tmp_path / "m.pt")
    run_dcp_job(win, import_file, str(tmp_path / "m.pt"), str(dst), 2, None, title="Import")
    qtbot.waitUntil(lambda: bool(seen), timeout=120000)
    assert "--force" not in seen[0] and "does not exist yet" in seen[0]
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]
