"""Bugs found by clicking the real window for a long time (Xvfb), each pinned by a test on real widgets."""

from __future__ import annotations

import os
import time

import pytest
from gui_support import no_thread_left_running, open_view  # noqa: F401  (an autouse fixture)
from PySide6.QtWidgets import QApplication


def min_width(widget) -> int:
    """The widget's minimum width once Qt has run the layout requests its labels posted."""
    for _ in range(5):
        QApplication.processEvents()
    return widget.minimumSizeHint().width()


def test_value_read_error_does_not_widen_the_window(qtbot, copy_of):
    """A chunk in a truncated file: the inspector's one-line error (a long path) used to set the view's
    minimum width to the whole line (1528 px), so the main window grew past a 1280 px screen."""
    ckpt = copy_of("fsdp2_r2")
    data = ckpt / "__1_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(50000)
    view = open_view(qtbot, ckpt)
    before = min_width(view)
    with qtbot.waitSignal(view.valuesDone, timeout=120000):
        assert view.select_path("optimizer.state.head.weight.exp_avg_sq")
    assert "truncated" in view.inspector.stats.text()
    assert min_width(view) <= max(before, 700)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_long_tensor_name_does_not_widen_the_window(qtbot, tmp_path):
    """A transformers-style optimizer key (long FQN) in the inspector title must not set the minimum width."""
    import torch
    import torch.distributed.checkpoint as dcp

    name = "optimizer.state." + ".".join(["model.decoder.layers.31.self_attn.q_proj_with_a_long_name"] * 3)
    dcp.save({name: torch.zeros(4, 3)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    view = open_view(qtbot, tmp_path / "ck")
    before = min_width(view)
    with qtbot.waitSignal(view.valuesDone, timeout=120000):
        assert view.select_path(name)
    assert name in view.inspector.title.text()
    assert min_width(view) <= max(before, 700)


def flip_a_value_byte(ckpt_dir, fqn: str) -> None:
    """Flip one byte inside the stored values of ``fqn``'s first chunk (bit rot only a CRC32 catches)."""
    from shardscope.backend.checkpoint.chunks import ChunkReader
    from shardscope.backend.checkpoint.reader import open_checkpoint

    ck = open_checkpoint(ckpt_dir)
    chunk = ck.tensor(fqn).chunks[0]
    with ChunkReader(ck) as reader:
        at = reader.locate(fqn, chunk).data_offset + 8
    with open(ckpt_dir / chunk.file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


def test_status_badge_follows_verify_contents(qtbot, copy_of):
    """The window's status badge said "● healthy" in green next to a Health tab listing a corrupt chunk
    that Verify contents had just found."""
    from shardscope.app.main_window import MainWindow

    ckpt = copy_of("fsdp2_r2")
    flip_a_value_byte(ckpt, "model.blocks.0.fc1.weight")
    win = MainWindow()
    qtbot.addWidget(win)
    win.quiet = True
    view = win.open_path(str(ckpt))
    qtbot.waitUntil(lambda: view.data is not None and view.data.problems is not None and view.progress.isHidden(),
                    timeout=120000)
    assert win.badge.text() == "● healthy"  # the quick check reads no values
    with qtbot.waitSignal(view.contentsVerified, timeout=120000) as sig:
        win.verify_current()
    assert [p.kind for p in sig.args[0]] == ["corrupt"]
    assert win.badge.text() == "● 1 problem"
    assert view.health.item(0).text().endswith(": 1 problem")


@pytest.mark.parametrize("name", ["hf_r2", "fsdp_safetensors_r2"])
def test_verify_contents_claims_no_crc32_that_safetensors_lacks(qtbot, fixtures, name):
    """safetensors stores no checksum, yet the Health tab said "every stored item read once and its CRC32
    matched" (the CLI says "CRC32 checked where the format stores one")."""
    view = open_view(qtbot, fixtures[name])
    with qtbot.waitSignal(view.contentsVerified, timeout=120000):
        view.verify_contents()
    text = view.health.item(0).text()
    assert text.startswith("✔ Contents verified") and "CRC32 matched" not in text
    assert "safetensors" in text


def test_large_module_stack_stays_within_a_chunk_budget(qtbot, tmp_path):
    """Selecting ``model.layers`` of a 512-rank checkpoint stacked 200 tensors, 35,000 chunk rectangles,
    and froze the window for 3.4 s; now the stack stops at a chunk budget and the caption says so."""
    import subprocess
    import sys
    from pathlib import Path

    from shardscope.widgets.shard_map import MAX_STACKED_CHUNKS

    script = Path(__file__).with_name("scale_checkpoint.py")
    subprocess.run([sys.executable, str(script), str(tmp_path / "ck"), "--ranks", "512", "--layers", "12"],
                   check=True, capture_output=True, timeout=600)
    view = open_view(qtbot, tmp_path / "ck")
    assert view.select_path("model.layers")
    tensors = [t for t in view.data.ckpt.tensors if t.fqn.startswith("model.layers.")]
    assert sum(t.chunk_count for t in tensors) > MAX_STACKED_CHUNKS  # the module is over the budget
    drawn = {ci.fqn for ci in view.map.chunk_items}
    assert 0 < len(view.map.chunk_items) <= MAX_STACKED_CHUNKS
    assert f"the first {len(drawn)} of {len(tensors)} tensors stacked" in view.map_caption.text()


def export_dialog(qtbot, fixtures, dst):
    from shardscope.backend.checkpoint.reader import open_checkpoint
    from shardscope.widgets.export_dialog import ExportDialog

    dlg = ExportDialog(open_checkpoint(fixtures["fsdp2_r2"]))
    qtbot.addWidget(dlg)
    dlg.dst.setText(str(dst))
    return dlg


def test_export_dialog_locks_every_option_while_it_runs(qtbot, fixtures, tmp_path):
    """Only destination, format, verify and overwrite were locked during an export: typing into Only,
    Exclude, Rename or Max shard size replaced the plan and the preview while the old plan was written."""
    dlg = export_dialog(qtbot, fixtures, tmp_path / "m.safetensors")
    with qtbot.waitSignal(dlg.finished_export, timeout=120000) as sig:
        dlg.export_button.click()
        assert [w for w in dlg.option_widgets() if w.isEnabled()] == []
    assert sig.args[0] is not None and (tmp_path / "m.safetensors").exists()
    assert dlg.only.isEnabled() and dlg.shard.isEnabled() and dlg.dst.isEnabled()
    assert not dlg.ranks.isEnabled()  # used by DCP (reshard) only


def test_export_dialog_speaks_of_its_own_fields(qtbot, fixtures, tmp_path):
    """A destination that exists said "give --force to overwrite it": the dialog has no --force."""
    (tmp_path / "m.safetensors").write_bytes(b"keep me")
    dlg = export_dialog(qtbot, fixtures, tmp_path / "m.safetensors")
    with qtbot.waitSignal(dlg.finished_export, timeout=120000):
        dlg.export_button.click()
    assert "--force" not in dlg.message.text() and "Overwrite the destination if it exists" in dlg.message.text()
    assert (tmp_path / "m.safetensors").read_bytes() == b"keep me"
    dlg.dst.setText(str(tmp_path / "noext"))
    assert "--" not in dlg.summary.text() and "Max shard size" in dlg.summary.text()
    dlg.dst.setText(str(tmp_path / "m2.safetensors"))
    dlg.only.setText("nothing.here")
    assert "--" not in dlg.summary.text() and "Only nothing.here matches no entry" in dlg.summary.text()


def test_compare_error_does_not_widen_the_window(qtbot, fixtures, copy_of):
    """Compare against a truncated checkpoint: the one-line error set the tab's minimum width past 1280 px."""
    from shardscope.widgets.compare_view import CompareView

    damaged = copy_of("fsdp2_r2")
    with open(damaged / "__1_0.distcp", "r+b") as f:
        f.truncate(50000)
    view = CompareView(str(fixtures["fsdp2_r2"]), str(damaged))
    qtbot.addWidget(view)
    view.resize(1200, 700)
    view.show()
    before = min_width(view)
    with qtbot.waitSignal(view.finished, timeout=120000) as sig:
        view.start()
    # the truncated file's entries are listed as unreadable, the rest compared (tests/test_compare_pairing.py)
    assert sig.args[0] is not None and sig.args[0].unreadable and "truncated" in view.summary.text()
    assert min_width(view) <= max(before, 900)


def test_library_says_why_a_double_click_did_not_open(qtbot, tmp_path, fixtures):
    """Double-clicking a consolidated .pt in the Library said "a.pt is complete; it opens once it is
    complete"; an unreadable checkpoint was also promised to open "once it is complete"."""
    import shutil

    import torch
    from shardscope.widgets.library_view import LibraryView

    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    torch.save({"w": torch.zeros(2)}, run / "a.pt")
    broken = run / "broken"
    shutil.copytree(fixtures["fsdp2_r2"], broken)
    (broken / ".metadata").write_bytes(b"")
    old = time.time() - 3600  # files that changed a moment ago are "writing"
    for p in [run / "a.pt", broken, *broken.iterdir()]:
        os.utime(p, (old, old))
    view = LibraryView([str(tmp_path / "runs")], None)
    qtbot.addWidget(view)
    view.show()
    qtbot.waitUntil(lambda: view.snapshot is not None and len(view.snapshot.listing.checkpoints) == 2,
                    timeout=120000)
    view.select_paths([str(run / "a.pt")])
    with qtbot.assertNotEmitted(view.openRequested, wait=100):
        view.open_selected()
    assert "consolidated file" in view.status.text() and "once it is complete" not in view.status.text()
    view.select_paths([str(broken)])
    with qtbot.assertNotEmitted(view.openRequested, wait=100):
        view.open_selected()
    assert "unreadable" in view.status.text() and "cannot be opened" in view.status.text()
    assert "once it is complete" not in view.open_button.toolTip()


def test_header_names_the_format_and_counts_ranks_in_words(qtbot, fixtures):
    """The header said "1 writer ranks" for a one-process save and showed the raw format id "hf-safetensors"."""
    view = open_view(qtbot, fixtures["nopg"])
    assert "1 writer rank ·" in view.header.text()
    view = open_view(qtbot, fixtures["hf_r2"])
    assert "hf-safetensors" not in view.header.text() and "safetensors files" in view.header.text()


def test_compare_with_its_own_export_says_why_nothing_paired(qtbot, fixtures, tmp_path):
    """A checkpoint compared with its own default safetensors export listed "75 only in A, 15 only in B"
    and "differences found", with no word that the export had dropped ``model.`` from every name.
    Now the names pair without the container prefix, and the view says so."""
    from shardscope.backend.checkpoint.reader import open_checkpoint
    from shardscope.backend.export import export, plan_export
    from shardscope.widgets.compare_view import CompareView

    dst = tmp_path / "m.safetensors"
    export(plan_export(open_checkpoint(fixtures["fsdp2_r2"]), "safetensors"), str(dst))
    view = CompareView(str(fixtures["fsdp2_r2"]), str(dst))
    qtbot.addWidget(view)
    view.show()
    with qtbot.waitSignal(view.finished, timeout=120000) as sig:
        view.start()
    assert sig.args[0].unchanged == 15 and sig.args[0].only_b == [] and sig.args[0].changed == []
    assert "without the container prefix 'model.'" in view.summary.text()


def test_statistics_table_is_not_clipped_in_a_narrow_pane(qtbot, fixtures):
    """Two checkpoints side by side: the statistics table keeps its natural width (the fix that lets
    error messages wrap must not clip "max 0.30244" to "0.3024")."""
    view = open_view(qtbot, fixtures["fsdp2_r2"])
    view.resize(620, 700)
    with qtbot.waitSignal(view.statsReady, timeout=120000):
        assert view.select_path("model.head.weight")
    min_width(view)
    stats = view.inspector.stats
    assert stats.width() >= stats.sizeHint().width() > 0


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


def wheel(view, steps: int = 1) -> None:
    """A real wheel event on the shard map's viewport (one notch per step, up = zoom in)."""
    from PySide6.QtCore import QPoint, QPointF, Qt
    from PySide6.QtGui import QWheelEvent

    vp = view.map.viewport()
    pos = QPointF(vp.rect().center())
    for _ in range(steps):
        QApplication.sendEvent(vp, QWheelEvent(pos, QPointF(vp.mapToGlobal(pos.toPoint())), QPoint(0, 0),
                                               QPoint(0, 120), Qt.MouseButton.NoButton,
                                               Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False))


def test_wheel_zoom_on_the_shard_map_is_kept(qtbot, fixtures):
    """Under Xvfb the wheel did nothing: zooming in brought up the scroll bars, their resize refitted the
    map, and the zoom was gone before the next paint. Double-click still fits the whole tensor."""
    view = open_view(qtbot, fixtures["fsdp2_r2"])
    view.select_path("model.blocks.0.fc1.weight")
    min_width(view)  # let the first layout settle
    fitted = view.map.transform().m11()
    wheel(view, 3)
    min_width(view)  # the scroll bars appear and resize the viewport
    assert view.map.transform().m11() == pytest.approx(fitted * 1.25 ** 3, rel=1e-6)
    view.resize(1100, 760)  # the user's zoom survives a window resize too
    min_width(view)
    assert view.map.transform().m11() == pytest.approx(fitted * 1.25 ** 3, rel=1e-6)
    view.map.mouseDoubleClickEvent(None)
    min_width(view)
    assert view.map.transform().m11() < fitted * 1.25
