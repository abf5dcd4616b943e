"""The Export dialog's destination: proposed outside the run's checkpoints/ folder, made when missing."""

from __future__ import annotations

import shutil

from gui_support import no_thread_left_running  # noqa: F401  (an autouse fixture)
from safetensors import safe_open


def test_default_destination_is_beside_checkpoints_and_made_when_missing(qtbot, fixtures, tmp_path):
    """It once proposed RUN/checkpoints/step_000030.safetensors, and prune then took that export for the run's
    newest checkpoint. Now RUN/exports/, made by the export (and removed again when the export fails)."""
    from shardscope.backend.checkpoint import open_checkpoint
    from shardscope.widgets.export_dialog import ExportDialog

    run = tmp_path / "run"
    ck = run / "checkpoints" / "step_000030"
    shutil.copytree(fixtures["fsdp2_r2"], ck)
    dlg = ExportDialog(open_checkpoint(ck), "model")
    qtbot.addWidget(dlg)
    assert dlg.dst.text() == str(run / "exports" / "model.safetensors")
    dlg2 = ExportDialog(open_checkpoint(ck), "")
    qtbot.addWidget(dlg2)
    assert dlg2.dst.text() == str(run / "exports" / "step_000030.safetensors")
    with qtbot.waitSignal(dlg2.finished_export, timeout=120000) as blocker:
        dlg2.export_button.click()
    assert blocker.args[0] is not None and blocker.args[0].verified is True, dlg2.message.text()
    with safe_open(str(run / "exports" / "step_000030.safetensors"), framework="pt") as h:
        assert len(list(h.keys())) == 15
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000030"]
    # a failing export into folders that do not exist leaves none of them behind
    (ck / "__0_0.distcp").write_bytes(b"damaged")
    dlg3 = ExportDialog(open_checkpoint(ck), "model")
    qtbot.addWidget(dlg3)
    dlg3.dst.setText(str(tmp_path / "new" / "deeper" / "m.safetensors"))
    with qtbot.waitSignal(dlg3.finished_export, timeout=120000) as blocker:
        dlg3.export_button.click()
    assert blocker.args[0] is None and "Nothing was written" in dlg3.message.text()
    assert not (tmp_path / "new").exists()
