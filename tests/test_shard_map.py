"""The shard map (widgets/shard_map.py): one rectangle per chunk, the hover tooltip and its index, the chunk
budget of a large module stack, wheel zoom kept."""

from __future__ import annotations

import pytest
from gui_support import min_width, no_thread_left_running, open_view  # noqa: F401  (an autouse fixture)
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication
from shardscope.widgets.palette import rank_color

pytestmark = pytest.mark.gui


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
    from shardscope.backend.formats import open_checkpoint
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


def wheel(view, steps: int = 1) -> None:
    """A real wheel event on the shard map's viewport (one notch per step, up = zoom in)."""
    from PySide6.QtCore import QPoint, QPointF
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


def test_a_non_tensor_entry_draws_no_stack_and_no_legend(qtbot, fixtures):
    """Selecting the non-tensor `step` said "0 tensors stacked" above a legend of rank colours, over an empty
    map: it says what the entry is, and the map says there is nothing sharded to draw."""
    view = open_view(qtbot, fixtures["fsdp2_r2"])
    for path in ("step", "optimizer.param_groups.0"):  # one value, and a branch of values only
        assert view.select_path(path)
        caption = view.map_caption.text()
        assert "0 tensors" not in caption and "stacked" not in caption and "■" not in caption, caption
        assert "non-tensor" in caption
        assert not view.map.chunk_items
        texts = [it.text() for it in view.map.scene().items() if hasattr(it, "text")]
        assert any("Nothing is sharded" in t for t in texts), texts
    assert view.select_path("model.blocks.0")  # a module still stacks its tensors, with the legend
    assert "tensors stacked" in view.map_caption.text() and "■" in view.map_caption.text()
    qtbot.waitUntil(lambda: view._stats_worker is None, timeout=120000)


def test_a_modules_stack_is_legible_or_named_on_hover(qtbot, fixtures):
    """A module's stack was fitted whole: 12 tensors at 1920x1080 were labelled in 3-4 px text, and a 72-tensor
    module was a 25-35 px strip. A stack fills the map's width (it scrolls down); a name too small to read is
    hidden, and hovering its band names the tensor."""
    view = open_view(qtbot, fixtures["fsdp2_r2"])
    m = view.map
    for size in ((1280, 720), (1920, 1080), (700, 500)):
        view.resize(*size)
        min_width(view)
        for module in ("optimizer", "model"):
            assert view.select_path(module)
            qtbot.waitUntil(lambda: view._stats_worker is None, timeout=120000)
            min_width(view)
            frames = [ci.item for ci in m.chunk_items]
            left = min(m.mapFromScene(f.sceneBoundingRect()).boundingRect().left() for f in frames)
            right = max(m.mapFromScene(f.sceneBoundingRect()).boundingRect().right() for f in frames)
            assert right - left >= 0.8 * m.viewport().width(), (size, module, left, right)  # not a strip
            labels = [it for it in m.scene().items() if hasattr(it, "text") and it.text().startswith(module + ".")]
            assert len(labels) == len({ci.fqn for ci in m.chunk_items}) > 3
            for label in labels:
                tall = m.mapFromScene(label.sceneBoundingRect()).boundingRect().height()
                assert not label.isVisible() or tall >= 9, (size, module, label.text(), tall)
                if not label.isVisible():  # its room names it on hover
                    fqn = label.text().split("  ")[0]
                    assert hover_tooltip(qtbot, m, label.sceneBoundingRect().center()).startswith(fqn + "\n")
        if size == (1920, 1080):
            assert all(label.isVisible() for label in labels)  # a wide map reads its names


def test_a_scalar_is_one_square_cell(qtbot, fixtures):
    """A 0-d tensor (an optimizer's step) was drawn as a strip as wide as a matrix: it is one square cell, alone
    and in a module's stack."""
    import pytest

    view = open_view(qtbot, fixtures["fsdp2_r2"])
    fqn = "optimizer.state.blocks.0.fc1.weight.step"
    assert view.data.ckpt.tensor(fqn).shape == ()
    for path in (fqn, "optimizer.state.blocks.0.fc1.weight"):
        assert view.select_path(path)
        qtbot.waitUntil(lambda: view._stats_worker is None, timeout=120000)
        (cell,) = [ci.rect for ci in view.map.chunk_items if ci.fqn == fqn]
        assert cell.width() == pytest.approx(cell.height())
        widest = max(ci.rect.width() for ci in view.map.chunk_items)
        assert path == fqn or cell.width() < widest / 4


def test_arrow_keys_draw_the_map_once_the_selection_rests(qtbot, fixtures):
    """Each Down over the modules of a 512-rank checkpoint redrew the whole map, the chunk table and the values
    at once (about 200 ms a step: the key repeat fell behind). The tree moves at once; the map, the Inspector and
    the values follow once the selection rests."""
    from PySide6.QtTest import QTest

    view = open_view(qtbot, fixtures["fsdp2_r4"])
    assert view.select_path("model.emb")
    view.tree.expandAll()
    view.tree.setFocus()
    drawn: list[int] = []
    real = view.map.show_tensors

    def counted(ckpt, entries):
        drawn.append(len(entries))
        real(ckpt, entries)

    view.map.show_tensors = counted
    paths = []
    for _ in range(12):  # as fast as a held key: no rest in between
        QTest.keyClick(view.tree, Qt.Key.Key_Down)
        paths.append(view.selected_node().path)
    assert len(set(paths)) == 12, paths  # the tree moved on every key
    assert view.map_caption.text() and len(drawn) <= 1, drawn
    qtbot.waitUntil(lambda: not view.detail_pending(), timeout=10000)
    assert len(drawn) == 1  # once, for where the selection came to rest
    last = view.selected_node()
    assert {ci.fqn for ci in view.map.chunk_items} == {t.fqn for t in last.iter_tensors()}
    qtbot.waitUntil(lambda: not view.values_pending(), timeout=120000)


def test_a_long_name_in_the_caption_does_not_move_the_map(qtbot, fixtures):
    """At 1280 px a long tensor name wrapped the map's caption onto a second line and pushed the map down a
    line as the selection moved: the caption keeps room for three lines (a wrapped name, the legend)."""
    view = open_view(qtbot, fixtures["fsdp2_r2"])
    view.resize(1280, 680)
    tensors = sorted((t.fqn for t in view.data.ckpt.tensors), key=len)
    tops = []
    for path in (tensors[0], tensors[-1], tensors[0]):
        assert view.select_path(path)
        qtbot.wait(50)
        QApplication.processEvents()
        tops.append(view.map.mapTo(view, view.map.rect().topLeft()).y())
    caption = view.map_caption
    assert caption.heightForWidth(caption.width()) > caption.fontMetrics().lineSpacing() * 1.5, caption.text()
    assert tops[0] == tops[1] == tops[2], tops
