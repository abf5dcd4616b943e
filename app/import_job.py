"""File › Import: a consolidated .pt / .safetensors file written as a DCP checkpoint, in the background with a
progress dialog; the new checkpoint opens in the window when it is written and verified."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import QFileDialog, QInputDialog, QMainWindow, QMessageBox, QProgressDialog

from ..backend.export.dcp_writer import import_file
from ..widgets.workers import run_in_background


def import_dialog(window: QMainWindow) -> None:
    """Ask for the file, the new folder, the ranks and a key prefix, then import (``window``: the MainWindow)."""
    src, _ = QFileDialog.getOpenFileName(window, "Import a consolidated checkpoint", "",
                                         "Checkpoints (*.pt *.pth *.bin *.safetensors)")
    if not src:
        return
    dst, _ = QFileDialog.getSaveFileName(window, "New DCP checkpoint folder", str(Path(src).with_suffix("")) + "-dcp")
    if not dst:
        return
    ranks, ok = QInputDialog.getInt(window, "Import", "Write it as if saved by this many ranks:", 1, 1, 4096)
    if not ok:
        return
    prefix, ok = QInputDialog.getText(window, "Import", "Nest every key under (e.g. model; empty: as is):")
    if ok:
        run_dcp_job(window, import_file, src, dst, ranks, prefix or None, title=f"Importing {Path(src).name}")


def run_dcp_job(window, func, *args, title: str) -> None:
    """Run ``func(*args)`` (a backend job that writes a DCP checkpoint) with a progress dialog over ``window``
    (the MainWindow); the written checkpoint opens there."""
    progress = QProgressDialog(title, "Cancel", 0, 1000, window)
    progress.setMinimumDuration(300)

    def done(result) -> None:
        progress.close()
        if result.verified is False:
            QMessageBox.warning(window, title, result.summary())
            return
        window.statusBar().showMessage(result.summary().splitlines()[0], 8000)
        window.open_path(result.dst)

    def failed(message: str) -> None:
        progress.close()
        QMessageBox.warning(window, title, f"{message}\n\nNothing was written.")

    # the dialog owns the job: its slots are skipped once it is gone; it is deleted when the job ends
    worker = run_in_background(func, *args, owner=progress, on_result=done, on_error=failed,
                               on_progress=lambda d, t, _m: progress.setValue(int(1000 * d / max(t, 1))),
                               on_cancelled=progress.close, on_finished=progress.deleteLater)
    progress.canceled.connect(worker.quit)
