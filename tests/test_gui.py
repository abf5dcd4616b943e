"""The browser window under pytest-qt (QT_QPA_PLATFORM=offscreen) on real checkpoints."""

from __future__ import annotations

import os
import pickle

import pytest
from gui_support import no_thread_left_running, open_view  # noqa: F401  (an autouse fixture)
from PySide6.QtCore import Qt
from shardscope.backend.checkpoint.tree import TreeNode
from shardscope.widgets.checkpoint_view import CheckpointView
from shardscope.widgets.palette import rank_color
from shardscope.widgets.tensor_tree import NodeRole, TensorTreeModel
from torch_reference import flatten, torch_consolidated


def wait_loaded(qtbot, view: CheckpointView) -> None:
    """Wait until a view opened elsewhere (the window's open_path) has its tree and analysis shown."""
    qtbot.waitUntil(lambda: view.data is not None and view.data.problems is not None and view.progress.isHidden(),
                    timeout=120000)


def leaf_paths(model, parent=None):
    from PySide6.QtCore import QModelIndex

    parent = parent or QModelIndex()
    out = []
    for r in range(model.rowCount(parent)):
        idx = model.index(r, 0, parent)
        node: TreeNode = idx.data(NodeRole)
        if node.entry is not None:
            out.append(node.path)
        out += leaf_paths(model, idx)
    return out


def test_tree_has_every_entry(qtbot, qtmodeltester, fixtures):
    view = open_view(qtbot, fixtures["fsdp2_r2"])
    ck = view.data.ckpt
    assert sorted(leaf_paths(view.proxy)) == sorted([t.fqn for t in ck.tensors] + [o.fqn for o in ck.objects])
    qtmodeltester.check(TensorTreeModel(view.data.tree, view.data.values))


def test_filter_narrows_rows(qtbot, fixtures):
    view = open_view(qtbot, fixtures["fsdp2_r2"])
    view.filter_edit.setText("fc1.weight")
    qtbot.waitUntil(lambda: len(leaf_paths(view.proxy)) < 10, timeout=120000)
    assert set(leaf_paths(view.proxy)) == {
        "model.blocks.0.fc1.weight", "model.blocks.1.fc1.weight",
        "optimizer.state.blocks.0.fc1.weight.exp_avg", "optimizer.state.blocks.0.fc1.weight.exp_avg_sq",
        "optimizer.state.blocks.1.fc1.weight.exp_avg", "optimizer.state.blocks.1.fc1.weight.exp_avg_sq",
        "optimizer.state.blocks.0.fc1.weight.step", "optimizer.state.blocks.1.fc1.weight.step"}
    view.filter_mode.setCurrentText("regex")
    view.filter_edit.setText(r"^model\.head\.")
    qtbot.waitUntil(lambda: set(leaf_paths(view.proxy)) == {"model.head.weight", "model.head.bias"}, timeout=120000)


def test_shard_map_draws_one_rect_per_chunk(qtbot, fixtures):
    view = open_view(qtbot, fixtures["fsdp2_r4"])
    with qtbot.waitSignal(view.statsReady, timeout=120000):
        assert view.select_path("model.emb.weight")
    entry = view.data.ckpt.tensor("model.emb.weight")  # 37 x 12 over 4 ranks: 10, 10, 10, 7 rows
    items = view.map.chunk_items
    assert len(items) == entry.chunk_count == 4
    total_h = sum(i.rect.height() for i in items)
    for item, chunk in zip(items, entry.chunks, strict=True):
        assert item.chunk == chunk
        assert item.item.brush().color() == rank_color(chunk.rank)
        assert item.rect.width() == pytest.approx(800.0)
        assert item.rect.height() == pytest.approx(total_h * chunk.sizes[0] / 37)
    assert not view.map.gap_items and not view.map.overlap_items


def hover_tooltip(qtbot, shard_map, scene_point) -> str:
    """Rest the pointer on a scene point of a shard map as Qt does (a ToolTip event); the tip shown."""
    from PySide6.QtCore import QEvent
    from PySide6.QtGui import QHelpEvent
    from PySide6.QtWidgets import QApplication, QToolTip

    vp = shard_map.viewport()
    pos = shard_map.mapFromScene(scene_point)
    QApplication.sendEvent(vp, QHelpEvent(QEvent.Type.ToolTip, pos, vp.mapToGlobal(pos)))
    return QToolTip.text() if QToolTip.isVisible() else ""


def test_shard_map_hover_names_the_chunk_under_the_pointer(qtbot, fixtures):
    from PySide6.QtCore import QPointF
    from PySide6.QtWidgets import QToolTip

    view = open_view(qtbot, fixtures["fsdp2_r4"])
    with qtbot.waitSignal(view.statsReady, timeout=120000):
        assert view.select_path("model.emb.weight")
    m = view.map
    # NOTE: no graphics item carries a tooltip (PySide6 6.12.0 lost a reference to None per call)
    assert [it for it in m.scene().items() if it.toolTip()] == []
    for ci in m.chunk_items:
        text = hover_tooltip(qtbot, m, ci.rect.center())
        c = ci.chunk
        assert text.startswith("model.emb.weight\n") and f"rank {c.rank} (writer)" in text, text
        assert f"offsets {list(c.offsets)}" in text and f"file {c.file}" in text, text
    hover_tooltip(qtbot, m, m.chunk_items[-1].rect.bottomLeft() + QPointF(1, 50))  # under the tensor: nothing
    qtbot.waitUntil(lambda: not QToolTip.isVisible(), timeout=60000)
    # a module: tensors stacked, each chunk found in its own band
    assert view.select_path("model.blocks.0")
    qtbot.waitUntil(lambda: view._stats_worker is None, timeout=120000)
    assert len({ci.fqn for ci in m.chunk_items}) > 3
    for ci in m.chunk_items[::3]:
        assert hover_tooltip(qtbot, m, ci.rect.center()).startswith(ci.fqn + "\n")


def test_hover_index_prefers_problems_to_chunks_to_frames(fixtures):
    from PySide6.QtCore import QRectF
    from shardscope.backend.checkpoint import open_checkpoint
    from shardscope.widgets.shard_map import CHUNK, FRAME, GAP, OVERLAP, HoverIndex

    a, b = open_checkpoint(fixtures["nopg"]).tensors[:2]
    index = HoverIndex()
    index.start_band(0, 100)  # tensor a: a frame, one chunk over its left half, a gap across the middle
    index.add(QRectF(0, 0, 100, 100), FRAME, a)
    index.add(QRectF(0, 0, 50, 100), CHUNK, a, "c0")
    index.add(QRectF(40, 0, 20, 10), GAP, a, "gap")
    index.start_band(120, 200)  # tensor b below it: one chunk and an overlap inside it
    index.add(QRectF(0, 120, 100, 80), FRAME, b)
    index.add(QRectF(0, 120, 100, 80), CHUNK, b, "c1")
    index.add(QRectF(10, 130, 5, 5), OVERLAP, b, "overlap")
    assert index.lookup(10, 50)[1] == (CHUNK, a, "c0")
    assert index.lookup(45, 5)[1] == (GAP, a, "gap")
    assert index.lookup(80, 50)[1] == (FRAME, a, None)
    assert index.lookup(50, 110) is None  # between the two tensors
    assert index.lookup(12, 132)[1] == (OVERLAP, b, "overlap")
    assert index.lookup(50, 150)[1] == (CHUNK, b, "c1")
    assert index.lookup(150, 150) is None and index.lookup(10, -5) is None


def test_inspector_stats_equal_torch(qtbot, fixtures):
    view = open_view(qtbot, fixtures["ddp_r2"])
    with qtbot.waitSignal(view.statsReady, timeout=120000) as blocker:
        view.select_path("optimizer.state.head.weight.exp_avg_sq")
    stats = blocker.args[0]
    ref = flatten(torch_consolidated(fixtures["ddp_r2"]))["optimizer.state.head.weight.exp_avg_sq"]
    assert stats.min == pytest.approx(ref.min().item())
    assert stats.max == pytest.approx(ref.max().item())
    assert stats.mean == pytest.approx(ref.double().mean().item())
    assert stats.std == pytest.approx(ref.double().std().item())
    assert view.inspector.chunks.rowCount() == 1
    assert "exp_avg_sq" in view.inspector.title.text()
    text = view.inspector.copy_chunks()
    assert "__" in text and "offsets" in text


def test_hostile_folder_shows_error_and_runs_nothing(qtbot, copy_of, tmp_path):
    ckpt = copy_of("nopg")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
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


def test_rank_click_filters_tree_and_highlights(qtbot, fixtures):
    view = open_view(qtbot, fixtures["ddp_r2"])
    before = set(leaf_paths(view.proxy))
    view.ranks.select_rank(1)
    after = set(leaf_paths(view.proxy))
    ck = view.data.ckpt
    expected = {t.fqn for t in ck.tensors if 1 in t.ranks} | {o.fqn for o in ck.objects if o.rank == 1}
    assert after == expected and after < before
    view.ranks.select_rank(None)
    assert set(leaf_paths(view.proxy)) == before


def test_main_window_screenshot(tmp_path, fixtures):
    """`shardscope gui PATH --select FQN --screenshot FILE` writes a PNG and exits 0."""
    from conftest import run_cli

    out = tmp_path / "shot.png"
    proc = run_cli("gui", fixtures["fsdp2_r2"], "--select", "model.emb.weight", "--screenshot", out,
                   "--size", "1000x700", timeout=300)
    assert proc.returncode == 0, proc.stderr
    from PySide6.QtGui import QImage

    img = QImage(str(out))
    assert img.width() == 1000 and img.height() == 700
    # the selected tensor's shard map is in the picture: both writer ranks' colours fill real areas
    assert rank_pixels(img, 0) > 2000 and rank_pixels(img, 1) > 2000


def rank_pixels(img, rank: int) -> int:
    """How many pixels of a rendered window have exactly rank ``rank``'s colour."""
    import numpy as np
    from PySide6.QtGui import QImage

    img = img.convertToFormat(QImage.Format.Format_RGB32)
    pixels = np.frombuffer(img.constBits(), dtype=np.uint32, count=img.bytesPerLine() * img.height() // 4)
    return int((pixels == rank_color(rank).rgb()).sum())


def test_two_checkpoints_side_by_side(qtbot, fixtures):
    from shardscope.app.main_window import MainWindow

    win = MainWindow()
    qtbot.addWidget(win)
    win.quiet = True
    a = win.open_path(str(fixtures["fsdp2_r2"]))
    wait_loaded(qtbot, a)
    b = win.open_path(str(fixtures["fsdp2_r4"]))
    wait_loaded(qtbot, b)
    def views(pane) -> list:  # the checkpoint tabs of a pane (the window may hold others, e.g. Library)
        return [pane.widget(i) for i in range(pane.count()) if isinstance(pane.widget(i), CheckpointView)]

    assert views(win.tabs) == [a, b] and win.side_tabs.isHidden()
    win.move_to_other_side()
    assert views(win.tabs) == [a] and views(win.side_tabs) == [b] and win.side_tabs.count() == 1
    assert not win.side_tabs.isHidden()
    assert win.current_view() is b
    win.close_tab(0, win.side_tabs)
    assert win.side_tabs.isHidden() and win.current_view() is a


def test_export_dialog_previews_runs_and_cancels(qtbot, fixtures, tmp_path):
    from safetensors import safe_open
    from shardscope.backend.checkpoint import open_checkpoint
    from shardscope.widgets.export_dialog import ExportDialog

    ckpt = open_checkpoint(fixtures["fsdp2_r4"])
    dlg = ExportDialog(ckpt, "model")
    qtbot.addWidget(dlg)
    dlg.dst.setText(str(tmp_path / "m.safetensors"))
    assert dlg.strip.text() == "model."
    keys = dlg.keys.stringList()
    assert len(keys) == 15 and all(not k.startswith("model.") for k in keys)
    assert "15 tensors" in dlg.summary.text()
    dlg.shard.setText("not a size")
    assert not dlg.export_button.isEnabled() and "not a size" in dlg.summary.text()
    dlg.shard.setText("")
    with qtbot.waitSignal(dlg.finished_export, timeout=120000) as blocker:
        dlg.export_button.click()
    result = blocker.args[0]
    assert result is not None and result.verified is True
    assert not dlg.show_button.isHidden()
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as h:
        assert set(h.keys()) == {k.split()[0] for k in keys}
    assert "verified" in dlg.message.text()
    dlg.dst.setText(str(tmp_path / "m.pt"))  # another destination: the last result line is stale
    assert dlg.message.text() == "" and dlg.show_button.isHidden() and dlg.result is None
    # cancel: the worker stops at its next progress check and nothing is left behind
    dlg2 = ExportDialog(ckpt, "")
    qtbot.addWidget(dlg2)
    dlg2.dst.setText(str(tmp_path / "all.pt"))
    with qtbot.waitSignal(dlg2.finished_export, timeout=120000) as blocker:  # NOTE: listening before it starts
        dlg2.start()
        dlg2._worker.quit()
    assert blocker.args[0] is None
    assert not (tmp_path / "all.pt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]  # no temporary of any name left


def test_export_dialog_reshards(qtbot, fixtures, tmp_path):
    from shardscope.backend.checkpoint import open_checkpoint
    from shardscope.widgets.export_dialog import ExportDialog

    ckpt = open_checkpoint(fixtures["fsdp2_r2"])
    dlg = ExportDialog(ckpt, "")
    qtbot.addWidget(dlg)
    dlg.format.setCurrentText("DCP (reshard)")
    dlg.ranks.setValue(3)
    dlg.dst.setText(str(tmp_path / "r3"))
    assert "3 ranks" in dlg.summary.text() and not dlg.dtype.isEnabled()
    with qtbot.waitSignal(dlg.finished_export, timeout=120000) as blocker:
        dlg.export_button.click()
    assert blocker.args[0] is not None and blocker.args[0].verified is True
    assert open_checkpoint(tmp_path / "r3").ranks == [0, 1, 2]


def test_compare_view_lists_changes_and_shows_detail(qtbot, fixtures):
    from shardscope.widgets.compare_view import CompareView

    view = CompareView(str(fixtures["steps_r2"] / "step2"), str(fixtures["steps_r2"] / "step3"))
    qtbot.addWidget(view)
    with qtbot.waitSignal(view.finished, timeout=120000) as blocker:
        view.start()
    result = blocker.args[0]
    assert result is not None and result.differs
    rows = {view.model.rows[i].fqn for i in range(view.model.rowCount())}
    assert "model.emb.weight" in rows and "model.head.bias" not in rows
    rels = [view.proxy.index(r, 3).data(Qt.ItemDataRole.UserRole + 1) for r in range(view.proxy.rowCount())]
    assert rels == sorted(rels, reverse=True)  # biggest change first
    assert view.select("model.emb.weight")
    qtbot.waitUntil(lambda: "elements differ" in view.detail.text(), timeout=120000)
    assert len(view.map_a.chunk_items) == 2 and len(view.map_b.chunk_items) == 2
    view.shutdown()


def test_window_opens_a_checkpoint_on_an_fsspec_url(qtbot, fixtures):
    import fsspec
    from shardscope.app.main_window import MainWindow

    fs = fsspec.filesystem("memory")
    for f in fixtures["ddp_r2"].iterdir():
        fs.pipe(f"/gui-ck/{f.name}", f.read_bytes())
    win = MainWindow()
    qtbot.addWidget(win)
    win.quiet = True
    view = win.open_path("memory://gui-ck")
    wait_loaded(qtbot, view)  # a condition, not the signal: it may have fired already on a fast load
    assert view.path == "memory://gui-ck" and view.data.problems == []
    with qtbot.waitSignal(view.statsReady, timeout=120000):
        assert view.select_path("model.emb.weight")


def test_gui_without_a_display_says_so(fixtures):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    proc = subprocess.run([sys.executable, "-m", "shardscope.app.cli", str(fixtures["nopg"])], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 2 and "no display" in proc.stderr and "Traceback" not in proc.stderr
