"""The health panel (widgets/health_panel.py): hostile and damaged folders, the status badge following
verify-contents."""

from __future__ import annotations

import pytest
from damaged_metadata import write_evil_metadata
from gui_support import no_thread_left_running, open_view  # noqa: F401  (an autouse fixture)
from shardscope.widgets.checkpoint_view import CheckpointView

pytestmark = pytest.mark.gui


def test_hostile_folder_shows_error_and_runs_nothing(qtbot, copy_of, tmp_path):
    ckpt = copy_of("nopg")
    marker = tmp_path / "pwned"
    write_evil_metadata(ckpt, marker)
    view = CheckpointView(str(ckpt))
    qtbot.addWidget(view)
    with qtbot.waitSignal(view.failed, timeout=120000) as blocker:
        view.load()
    assert "refused" in blocker.args[0] and "os.system" in blocker.args[0].replace("posix.system", "os.system")
    assert "Cannot open" in view.header.text()
    assert not marker.exists()


def test_missing_shard_in_health_panel(qtbot, copy_of):
    ckpt = copy_of("fsdp2_r4")
    (ckpt / "__3_0.distcp").unlink()
    view = open_view(qtbot, ckpt)
    kinds = [p.kind for p in view.health.problems]
    assert "missing_file" in kinds
    item = view.health.item(kinds.index("missing_file"))
    assert "__3_0.distcp" in item.text()
    fqn = view.health.problems[kinds.index("missing_file")].fqn
    view.health.itemClicked.emit(item)
    assert view.selected_node() is not None and view.selected_node().path == fqn
    qtbot.waitUntil(lambda: view._stats_worker is None, timeout=120000)


def flip_a_value_byte(ckpt_dir, fqn: str) -> None:
    """Flip one byte inside the stored values of ``fqn``'s first chunk (bit rot only a CRC32 catches)."""
    from shardscope.backend.checkpoint.chunks import ChunkReader
    from shardscope.backend.formats import open_checkpoint

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



def test_a_crc32_failure_the_inspector_finds_updates_health_and_the_badge(qtbot, copy_of):
    """The Inspector showed a red CRC32 failure for model.blocks.0.fc1.weight while the status bar still said
    "● healthy" and the Health tab kept its ✔: a failure any read finds is listed in Health and counted."""
    from shardscope.app.main_window import MainWindow

    fqn = "model.blocks.0.fc1.weight"
    ckpt = copy_of("fsdp2_r2")
    flip_a_value_byte(ckpt, fqn)
    win = MainWindow()
    qtbot.addWidget(win)
    win.quiet = True
    view = win.open_path(str(ckpt))
    qtbot.waitUntil(lambda: view.data is not None and view.data.problems is not None and view.progress.isHidden(),
                    timeout=120000)
    assert win.badge.text() == "● healthy" and view.tabs.tabText(2) == "Health ✔"
    with qtbot.waitSignal(view.valuesDone, timeout=120000):
        assert view.select_path(fqn)  # small: its values load at once
    assert "CRC32" in view.inspector.stats.text()
    assert win.badge.text() == "● 1 problem" and view.tabs.tabText(2) == "Health (1)"
    assert [(p.kind, p.fqn) for p in view.health.problems] == [("corrupt", fqn)]
    assert any("CRC32" in view.health.item(i).text() for i in range(view.health.count()))
    with qtbot.waitSignal(view.contentsVerified, timeout=120000):
        win.verify_current()  # the same failure found again: listed once
    assert win.badge.text() == "● 1 problem" and [p.fqn for p in view.health.problems] == [fqn]

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


def test_the_health_message_wraps_instead_of_scrolling_sideways(qtbot):
    """The Health tab's verdict was one long line that needed horizontal scrolling: it wraps at the tab's width."""
    from shardscope.widgets.health_panel import HealthPanel

    panel = HealthPanel()
    qtbot.addWidget(panel)
    panel.resize(360, 300)
    panel.show()
    qtbot.waitExposed(panel)
    panel.set_problems([])
    item = panel.item(0)
    assert item.text().startswith("✔ Healthy") and panel.fontMetrics().horizontalAdvance(item.text()) > 2 * 360

    def wrapped() -> bool:
        rect = panel.visualItemRect(item)
        return rect.height() >= 2 * panel.fontMetrics().lineSpacing() and rect.right() <= panel.viewport().width()

    qtbot.waitUntil(wrapped, timeout=5000)
    assert panel.horizontalScrollBar().maximum() == 0 or not panel.horizontalScrollBar().isVisible()


def test_verify_contents_says_what_the_manifest_proved(qtbot, copy_of):
    """The Health tab after Verify contents: a sealed checkpoint's every file SHA-256 and tensor digest checked
    against its manifest; a byte changed since the seal is found through the manifest too."""
    from conftest import run_cli

    ckpt = copy_of("fsdp2_r2")
    assert run_cli("seal", ckpt).returncode == 0
    view = open_view(qtbot, ckpt)
    quick = view.health.item(view.health.count() - 1).text()  # the quick check: the file system's word only
    assert quick.startswith("✔ Manifest: sealed: every file the manifest lists is there"), quick
    with qtbot.waitSignal(view.contentsVerified, timeout=120000) as sig:
        view.verify_contents()
    assert sig.args[0] == []
    texts = [view.health.item(i).text() for i in range(view.health.count())]
    assert texts[-1].startswith("✔ Manifest: sealed: 3 files SHA-256 checked") and "tensor digests recomputed" in \
        texts[-1], texts
    flip_a_value_byte(ckpt, "model.blocks.0.fc1.weight")  # changed since the seal
    with qtbot.waitSignal(view.contentsVerified, timeout=120000) as sig:
        view.verify_contents()
    assert "digest_mismatch" in [p.kind for p in sig.args[0]]
    assert view.health.item(view.health.count() - 1).text().startswith("✘ Manifest: damaged")
