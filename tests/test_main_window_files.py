"""Consolidated files in the main window (offscreen): a .safetensors written by safetensors itself, a
torch.save file (tied weights, a strided view, non-tensor entries), an HF index folder written by our own
export, and a file that is no checkpoint."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from gui_support import leaf_paths, no_thread_left_running, wait_loaded  # noqa: F401  (an autouse fixture)
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent
from safetensors.torch import save_file
from shardscope.app.main_window import MainWindow
from shardscope.widgets.checkpoint_view import CheckpointView

pytestmark = pytest.mark.gui


@pytest.fixture
def window(qtbot):
    win = MainWindow()
    qtbot.addWidget(win)
    win.quiet = True
    win.resize(1280, 720)
    win.show()
    return win


def select_stats(qtbot, view: CheckpointView, fqn: str):
    """Select ``fqn`` in the tree and wait for its statistics (read in the background)."""
    with qtbot.waitSignal(view.statsReady, timeout=120000) as blocker:
        assert view.select_path(fqn)
    return blocker.args[0]


def assert_stats(stats, ref: torch.Tensor) -> None:
    assert stats.min == pytest.approx(ref.min().item())
    assert stats.max == pytest.approx(ref.max().item())
    assert stats.mean == pytest.approx(ref.double().mean().item())


def record_offsets(path: Path) -> dict[str, int]:
    """Where each ``data/N`` record's bytes start, by the standard library's zip reader (an independent check)."""
    out = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            if "/data/" in info.filename:
                f.seek(info.header_offset)
                head = f.read(30)
                nlen, xlen = struct.unpack_from("<HH", head, 26)
                out[info.filename] = info.header_offset + 30 + nlen + xlen
    return out


def test_window_opens_a_safetensors_file(qtbot, window, tmp_path):
    g = torch.Generator().manual_seed(1)
    sd = {"model.embed.weight": torch.randn(64, 32, generator=g), "model.norm.weight": torch.rand(32, generator=g),
          "lm_head.weight": torch.randn(16, 32, generator=g).to(torch.bfloat16)}
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    view = window.open_path(str(path))
    wait_loaded(qtbot, view)
    assert sorted(leaf_paths(view.proxy)) == sorted(sd)
    header = view.header.text()
    assert "safetensors file" in header and "3 tensors" in header and "3 chunks" in header
    assert "one file, not sharded" in header
    assert view.data.problems == [] and window.badge.text() == "● healthy"
    stats = select_stats(qtbot, view, "lm_head.weight")
    assert_stats(stats, sd["lm_head.weight"].float())
    (item,) = view.map.chunk_items  # one chunk: the whole tensor, in the one file
    assert item.chunk.file == "model.safetensors" and item.chunk.rank is None
    assert item.chunk.sizes == (16, 32)
    caption = view.map_caption.text()
    assert "1 chunk," in caption and "1 chunks" not in caption and "not sharded" in caption
    assert "no writer rank recorded" in caption
    # the Ranks tab says there are no ranks instead of drawing a rank 0 with nothing
    assert view.ranks.bars.isHidden() and view.ranks.heat.isHidden()
    assert "No writer ranks recorded" in view.ranks.hover.text() and view.ranks.files.rowCount() == 1
    # File › Open file offers these files (the folder dialog cannot pick a file)
    from shardscope.app.main_window import CHECKPOINT_FILES

    (action,) = [a for a in window.menuBar().actions()[0].menu().actions() if a.text() == "Open &file…"]
    assert action.shortcut().toString() == "Ctrl+Shift+O"
    assert all(f"*{ext}" in CHECKPOINT_FILES for ext in (".safetensors", ".pt", ".pth", ".bin", ".ckpt"))
    assert "model.safetensors.index.json" in CHECKPOINT_FILES


def test_window_reads_a_torch_file_with_crc32_checked(qtbot, window, tmp_path):
    g = torch.Generator().manual_seed(2)
    emb = torch.randn(50, 8, generator=g)
    big = torch.randn(6, 10, generator=g)
    state = {"model": {"embed.weight": emb, "head.weight": emb,  # tied: one storage, two names
                       "proj.weight": big.t(), "proj.bias": torch.arange(5, dtype=torch.int64)},
             "step": 42, "lr": 3e-4}
    path = tmp_path / "ckpt.pt"
    torch.save(state, path)
    view = window.open_path(str(path))
    wait_loaded(qtbot, view)
    fqns = ["model.embed.weight", "model.head.weight", "model.proj.weight", "model.proj.bias", "step", "lr"]
    assert sorted(leaf_paths(view.proxy)) == sorted(fqns)
    assert view.data.values["step"] == "42"
    assert "torch.save file" in view.header.text() and "2 non-tensor entries" in view.header.text()
    assert view.data.problems == []  # the tied weights share bytes: not an overlap
    # every tensor's chunk sits at its storage record, as the standard library's zip reader finds it
    starts = set(record_offsets(path).values())
    for t in view.data.ckpt.tensors:
        (chunk,) = t.chunks
        assert chunk.offset in starts and chunk.file == "ckpt.pt" and chunk.rank is None
    assert view.data.ckpt.tensor("model.embed.weight").chunks == view.data.ckpt.tensor("model.head.weight").chunks
    assert_stats(select_stats(qtbot, view, "model.proj.weight"), big.t())  # a strided view of its storage
    # one flipped byte in the embedding's record: the values are refused, Verify contents names it
    proj = view.data.ckpt.tensor("model.embed.weight").chunks[0]
    with open(path, "r+b") as f:
        f.seek(proj.offset + 17)
        byte = f.read(1)
        f.seek(proj.offset + 17)
        f.write(bytes([byte[0] ^ 0x40]))
    window.close_tab(window.tabs.indexOf(view))
    view = window.open_path(str(path))
    wait_loaded(qtbot, view)
    with qtbot.waitSignal(view.valuesDone, timeout=120000):
        view.select_path("model.head.weight")
    assert "CRC32" in view.inspector.stats.text() and view.inspector.last_stats is None
    with qtbot.waitSignal(view.contentsVerified, timeout=120000) as blocker:
        view.verify_button.click()
    problems = blocker.args[0]
    assert [p.kind for p in problems] == ["corrupt"]
    assert "model.embed.weight" in problems[0].message and "CRC32" in problems[0].message
    assert window.badge.text() == "● 1 problem"


def hf_index_folder(fixtures, out: Path) -> Path:
    """An HF-style sharded safetensors folder written by `shardscope export --max-shard-size`."""
    proc = run_cli("export", fixtures["fsdp2_r2"], out, "--max-shard-size", "3KB", timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


def test_dropping_an_hf_index_opens_its_folder(qtbot, window, fixtures, tmp_path):
    folder = hf_index_folder(fixtures, tmp_path / "hf")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(folder / "model.safetensors.index.json"))])
    drop = QDropEvent(QPointF(10, 10), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                      Qt.KeyboardModifier.NoModifier)
    window.dropEvent(drop)
    view = window.current_view()
    assert view is not None
    wait_loaded(qtbot, view)
    assert sorted(leaf_paths(view.proxy)) == sorted(index["weight_map"])
    assert sorted(f.name for f in view.data.ckpt.data_files) == shards
    assert f"{len(shards)} files, no writer ranks recorded" in view.header.text()
    fqn = next(iter(index["weight_map"]))
    select_stats(qtbot, view, fqn)
    (item,) = view.map.chunk_items
    assert item.chunk.file == index["weight_map"][fqn]
    with qtbot.waitSignal(view.contentsVerified, timeout=120000) as blocker:
        view.verify_contents()
    assert blocker.args[0] == []
    assert "safetensors stores no checksum" in view.health.item(0).text()


def test_not_a_checkpoint_file_is_one_line_in_the_window(qtbot, window, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    view = window.open_path(str(path))
    qtbot.waitUntil(lambda: "Cannot open" in view.header.text(), timeout=120000)
    assert "notes.txt" in view.header.text() and "not a checkpoint file" in view.header.text()
    assert view.data is None
