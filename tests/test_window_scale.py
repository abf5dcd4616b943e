"""The window as a user sees it (issue 14): legible at 2 and 512 ranks, nothing moves under the pointer,
sizes that fit a 1280x720 screen, help inside the app, Verify contents in the Health tab."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from PySide6.QtCore import QPoint, QPointF, QRect, QSettings, Qt, QThreadPool
from PySide6.QtWidgets import QApplication
from scale_checkpoint import write_scale_checkpoint
from shardscope.backend.text import byte_unit, natural_key
from shardscope.widgets.checkpoint_view import CheckpointView, summary_html
from shardscope.widgets.plot_style import CategoryAxis, nice_step

pytestmark = pytest.mark.gui


@pytest.fixture(autouse=True)
def no_thread_left_running():
    yield
    assert QThreadPool.globalInstance().waitForDone(20000), "a background worker was left running"


@pytest.fixture(scope="session")
def scale512(tmp_path_factory):
    """2,001 tensors saved by 512 FSDP2-style ranks (88,000 chunks; ranks 0-31 write most)."""
    return write_scale_checkpoint(tmp_path_factory.mktemp("scale") / "r512", ranks=512, layers=250, dim=32)


@pytest.fixture(autouse=True)
def _settings_isolated(tmp_path, monkeypatch):
    """QSettings in a temporary folder, so remembered widths and geometry never leak between tests."""
    from PySide6.QtCore import QSettings as S

    S.setPath(S.Format.NativeFormat, S.Scope.UserScope, str(tmp_path / "settings"))
    S.setPath(S.Format.IniFormat, S.Scope.UserScope, str(tmp_path / "settings"))
    yield


def open_view(qtbot, path, size=(1280, 680)) -> CheckpointView:
    view = CheckpointView(str(path))
    qtbot.addWidget(view)
    view.resize(*size)
    view.show()
    with qtbot.waitSignal(view.loaded, timeout=120000):
        view.load()
    return view


def tree_rect(view: CheckpointView) -> QRect:
    return QRect(view.tree.mapTo(view, QPoint(0, 0)), view.tree.size())


# ------------------------------------------------------------------ sorting, units, header
def test_files_sort_naturally():
    names = [f"__{r}_0.distcp" for r in (100, 0, 10, 2, 1, 101, 11)]
    assert sorted(names, key=natural_key) == [f"__{r}_0.distcp" for r in (0, 1, 2, 10, 11, 100, 101)]


def test_byte_units_need_no_multiplier():
    for n in (0, 3, 1000, 4096, 5e6, 3e9):
        div, _unit = byte_unit(n)
        assert n == 0 or 1 <= n / div < 1024


def test_header_says_only_what_is_known(fixtures):
    from shardscope.backend.formats import open_checkpoint

    ck = open_checkpoint(fixtures["fsdp2_r2"])
    assert "?" not in summary_html(ck) and "format version" in summary_html(ck)
    ck.version = None
    text = summary_html(ck)
    assert "?" not in text and "version" not in text


def test_category_axis_labels_never_run_together(qapp):
    axis = CategoryAxis("bottom")
    axis.set_categories(512, str, 30.0)
    for pixels in (300, 700, 1500):
        (spacing, _offset), = axis.tickSpacing(-0.5, 511.5, pixels)
        assert spacing * pixels / 512 >= 30.0, (pixels, spacing)
        assert spacing == nice_step(spacing)
    assert axis.tickStrings([0.0, 0.5, 7.0, 600.0], 1, 1) == ["0", "", "7", ""]


# ------------------------------------------------------------------ the ranks view at 2 and 512 ranks
def test_ranks_view_at_512_ranks(qtbot, scale512):
    view = open_view(qtbot, scale512)
    ranks = view.ranks
    assert ranks.data.ranks == list(range(512))
    assert ranks.log_box.isChecked(), "one group of ranks dominates: the scale is logarithmic"
    assert ranks.data.heat.shape == (2001, 512)
    assert "(log)" in ranks.heat_bar.axis.labelText
    files = [ranks.files.item(i, 0).text() for i in range(ranks.files.rowCount())]
    assert files[:12] == [f"__{r}_0.distcp" for r in range(12)]
    # no per-bar text at this scale (it cannot fit); the x axis labels are spaced by pixels
    assert not [i for i in ranks.bars.getPlotItem().items if type(i).__name__ == "TextItem"]
    view.tabs.setCurrentWidget(ranks)
    qtbot.waitUntil(lambda: ranks.bars.isVisible() and ranks.bars.width() > 100, timeout=10000)
    axis = ranks.bar_axis
    values = [v for _spacing, vs in axis.tickValues(-0.6, 511.6, axis.width()) for v in vs]
    px_per_rank = axis.width() / 512
    assert min(np.diff(values)) * px_per_rank >= axis.min_pixels


def test_heat_map_hover_names_the_exact_cell(qtbot, scale512):
    view = open_view(qtbot, scale512)
    ranks = view.ranks
    view.tabs.setCurrentWidget(ranks)
    qtbot.waitUntil(lambda: ranks.heat.isVisible() and ranks.heat.height() > 50, timeout=10000)
    ck = view.data.ckpt
    row = [t.fqn for t in ck.tensors].index("model.layers.3.mlp.up.weight")
    vb = ranks.heat.getPlotItem().vb
    vb.setRange(xRange=(30, 50), yRange=(row - 5, row + 5), padding=0)
    scene = vb.mapViewToScene(QPointF(41.2, row + 0.3))
    assert ranks.cell_at(scene) == (row, 41)
    ranks._hover_heat(scene)
    expected = ranks.data.heat[row, 41]
    text = ranks.hover.text()
    assert text.startswith("model.layers.3.mlp.up.weight · rank 41:")
    up = ck.tensor("model.layers.3.mlp.up.weight")
    chunk = [c for c in up.chunks if c.rank == 41]
    assert expected == sum(int(np.prod(c.sizes)) * 4 for c in chunk) > 0
    assert ranks.cell_at(vb.mapViewToScene(QPointF(600, row))) is None


def test_bars_at_2_ranks_have_units_and_uncut_labels(qtbot, fixtures):
    view = open_view(qtbot, fixtures["fsdp2_r2"])
    ranks = view.ranks
    view.tabs.setCurrentWidget(ranks)
    qtbot.waitUntil(lambda: ranks.bars.isVisible() and ranks.bars.height() > 50, timeout=10000)
    left = ranks.bars.getAxis("left")
    assert left.labelText == "KiB written" and left.autoSIPrefixScale == 1.0
    assert "x0.001" not in left.labelString() and "(x" not in left.labelString()
    vb = ranks.bars.getPlotItem().vb
    labels = [i for i in ranks.bars.getPlotItem().items if type(i).__name__ == "TextItem"]
    assert len(labels) == 2
    _px_w, px_h = vb.viewPixelSize()  # data units per screen pixel
    top = vb.viewRange()[1][1]
    for t in labels:
        assert t.pos().y() + t.boundingRect().height() * px_h <= top, "chunk-count label cut at the top"
    i = 1
    scene = vb.mapViewToScene(QPointF(i, 1.0))
    ranks._hover_bars(scene)
    assert ranks.hover.text().startswith("rank 1:") and "chunks" in ranks.hover.text()


# ------------------------------------------------------------------ nothing moves; sizes fit
def test_progress_and_rank_filter_do_not_move_the_tree(qtbot, fixtures):
    view = CheckpointView(str(fixtures["fsdp2_r4"]))
    qtbot.addWidget(view)
    view.resize(1280, 680)
    view.show()
    qtbot.waitExposed(view)
    view.load()
    assert view.progress.isVisible()
    before = tree_rect(view)
    qtbot.waitUntil(view.verify_button.isEnabled, timeout=120000)  # analysis shown
    assert not view.progress.isVisible()
    assert tree_rect(view) == before
    view.set_rank_filter(1)
    assert view.rank_chip.isVisible()
    QApplication.processEvents()
    assert tree_rect(view) == before
    view.set_rank_filter(None)
    with qtbot.waitSignal(view.contentsVerified, timeout=120000):
        view.verify_contents()
        assert view.progress.isVisible()
        QApplication.processEvents()
        assert tree_rect(view) == before
    assert tree_rect(view) == before


def test_tree_columns_fit_their_text(qtbot, fixtures):
    view = open_view(qtbot, fixtures["fsdp2_r4"], size=(1280, 680))
    fm = view.tree.fontMetrics()
    for col, text in ((3, "1023.9 MiB"), (1, "bfloat16"), (2, "4096×4096"), (2, "10,000 tensors")):
        assert fm.horizontalAdvance(text) < view.tree.columnWidth(col)
    total = sum(view.tree.columnWidth(c) for c in range(6))
    assert total <= view.tree.viewport().width(), "the tree scrolls sideways at 1280 px: numbers are cut"


def test_placeholder_is_drawn_at_normal_size_after_an_empty_node(qtbot, fixtures):
    view = open_view(qtbot, fixtures["fsdp2_r2"])
    assert view.select_path("model.emb.weight")
    qtbot.waitUntil(lambda: not view.values_pending(), timeout=120000)
    assert view.select_path("optimizer.param_groups")  # a module without tensors
    items = [i for i in view.map.scene().items() if type(i).__name__ == "QGraphicsSimpleTextItem"]
    assert items
    on_screen = view.map.mapFromScene(items[0].sceneBoundingRect()).boundingRect()
    assert on_screen.height() >= 0.8 * view.map.fontMetrics().height()


def test_module_selection_clears_the_histogram(qtbot, fixtures):
    view = open_view(qtbot, fixtures["fsdp2_r2"])
    with qtbot.waitSignal(view.valuesDone, timeout=120000):
        view.select_path("model.emb.weight")
    assert view.inspector.hist.isVisible()
    view.select_path("model.blocks")
    assert not view.inspector.hist.isVisible()


def test_load_values_again_is_visible(qtbot, fixtures):
    view = open_view(qtbot, fixtures["fsdp2_r2"])
    with qtbot.waitSignal(view.valuesDone, timeout=120000):
        view.select_path("model.emb.weight")
    first = view.inspector.read_note.text()
    assert first.startswith("Read from disk") and view.inspector.load_button.text() == "Reload values"
    with qtbot.waitSignal(view.valuesDone, timeout=120000):
        view.inspector.load_button.click()
        assert view.inspector.read_note.text().startswith("Reading the values again")
    assert view.inspector.read_note.text().startswith("Read again from disk")


def test_window_fits_1280x720_and_1366x768_also_split(qtbot, fixtures, scale512):
    from shardscope.app.main_window import MainWindow

    win = MainWindow()
    qtbot.addWidget(win)
    win.show()
    a = win.open_path(str(fixtures["fsdp2_r2"]))
    qtbot.waitUntil(lambda: a.data is not None and a.data.problems is not None, timeout=120000)
    b = win.open_path(str(scale512))
    qtbot.waitUntil(lambda: b.data is not None and b.data.problems is not None, timeout=120000)
    win.move_to_other_side()  # two checkpoints side by side
    win.training_panel()
    QApplication.processEvents()  # the layouts take in what was just added
    for w, h in ((1280, 720), (1366, 768)):
        hint = win.minimumSizeHint()
        assert hint.width() <= w and hint.height() <= h - 40, f"minimum {hint} does not fit {w}x{h}"
        win.resize(w, h - 40)  # minus a title bar and a panel
        QApplication.processEvents()
        assert (win.width(), win.height()) == (w, h - 40)


# ------------------------------------------------------------------ compare table
def test_compare_names_elide_in_the_middle_and_widths_are_remembered(qtbot, fixtures):
    from shardscope.widgets.compare_view import CompareView

    a, b = str(fixtures["steps_r2"] / "step2"), str(fixtures["steps_r2"] / "step3")
    view = CompareView(a, b)
    qtbot.addWidget(view)
    view.resize(1280, 680)
    view.show()
    with qtbot.waitSignal(view.finished, timeout=120000):
        view.start()
    assert view.table.textElideMode() == Qt.TextElideMode.ElideMiddle
    idx = view.proxy.index(0, 0)
    assert idx.data(Qt.ItemDataRole.ToolTipRole) == idx.data()
    view.table.setColumnWidth(0, 333)
    view.shutdown()
    again = CompareView(a, b)
    qtbot.addWidget(again)
    assert again.table.columnWidth(0) == 333
    with qtbot.waitSignal(again.finished, timeout=120000):
        again.start()
    assert again.table.columnWidth(0) == 333, "a model reset must not forget the user's width"
    again.shutdown()


# ------------------------------------------------------------------ verify contents
def test_verify_contents_findings_show_in_health(qtbot, copy_of):
    path = copy_of("ddp_r2")
    view = open_view(qtbot, path)
    with qtbot.waitSignal(view.contentsVerified, timeout=120000) as sig:
        view.verify_button.click()
    assert sig.args[0] == []
    assert "Contents verified" in view.health.item(0).text()
    # flip one byte inside a stored tensor's values: the CRC check names it
    from shardscope.backend.checkpoint.chunks import ChunkReader

    ckpt = view.data.ckpt
    chunk = ckpt.tensor("model.emb.weight").chunks[0]
    with ChunkReader(ckpt) as reader:
        stored = reader.locate("model.emb.weight", chunk)
    f = path / chunk.file
    raw = bytearray(f.read_bytes())
    raw[stored.data_offset + 10] ^= 0xFF  # inside the tensor's stored values
    f.write_bytes(bytes(raw))
    with qtbot.waitSignal(view.contentsVerified, timeout=120000) as sig:
        view.verify_contents()
    problems = sig.args[0]
    assert problems, "a flipped byte went unnoticed"
    assert view.tabs.currentWidget() is view.health
    texts = [view.health.item(i).text() for i in range(view.health.count())]
    assert any(re.search(r"corrupt|unreadable", t) for t in texts), texts


# ------------------------------------------------------------------ help
def test_help_topics_are_inside_the_app(qtbot):
    from shardscope.app.main_window import MainWindow
    from shardscope.widgets.help import help_text, help_topics

    win = MainWindow()
    qtbot.addWidget(win)
    keys = [t.key for t in help_topics()]
    assert keys == ["shortcuts", "shard_map", "export", "runs", "readme"]
    shortcuts = help_text("shortcuts", win)[1]
    for key in ("Ctrl+O", "Ctrl+E", "Ctrl+Shift+V", "F5"):
        assert key in shortcuts
    assert "writer" in help_text("shard_map")[1].lower() and "gap" in help_text("shard_map")[1].lower()
    assert "--strip-prefix" in help_text("export")[1]
    assert "metrics/rank_N.jsonl" in help_text("runs")[1] and "shardscope.log" in help_text("runs")[1]
    _title, readme, markdown = help_text("readme")
    assert markdown and "## Quick start" in readme
    from shardscope import __version__

    about = help_text("about")[1]
    assert f"Version {__version__}" in about and "torch " in about and "shardscope.log" in about
    help_menu = next(a for a in win.menuBar().actions() if a.text() == "&Help").menu()
    assert len([a for a in help_menu.actions() if not a.isSeparator()]) == 6


def test_settings_are_isolated():
    assert QSettings("Shardscope", "Shardscope").value("compare/column_widths") is None


# ------------------------------------------------------------------ the first minute
def test_demo_opens_at_once_on_training_then_offers_its_last_checkpoint(qtbot, tmp_path):
    from shardscope.app.first_run import demo_config, start_demo
    from shardscope.app.main_window import MainWindow

    win = MainWindow()
    qtbot.addWidget(win)
    win.show()
    config = demo_config()
    config.steps, config.checkpoint_every = 6, 3
    guide = start_demo(win, config, str(tmp_path / "demo-run"))
    assert guide is not None
    panel = win.training_panel()
    assert win.tabs.currentWidget() is panel, "the Training tab is in front at once, before any step ran"
    qtbot.waitUntil(lambda: guide.state in ("running", "finished"), timeout=240000)
    qtbot.waitUntil(lambda: guide.view is not None and guide.view.selected_node() is not None, timeout=300000)
    node = guide.view.selected_node()
    assert node.entry is not None and node.path.startswith("model.")
    assert guide.view.path.endswith("step_000006")
    assert win.tabs.currentWidget() is guide.view
    assert win.statusBar().currentMessage().startswith("Demo finished")
    win.close()


def test_screenshot_mode_waits_for_the_comparison_and_its_detail(tmp_path, fixtures):
    from conftest import run_cli

    out = tmp_path / "compare.png"
    a, b = fixtures["steps_r2"] / "step2", fixtures["steps_r2"] / "step3"
    proc = run_cli("gui", "--compare", a, b, "--select", "model.emb.weight", "--screenshot", out,
                   "--size", "1280x720")
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 10000
    proc = run_cli("gui", "--compare", a, b, "--select", "no.such.entry", "--screenshot", out)
    assert proc.returncode == 2 and "no changed entry" in proc.stderr


def test_window_scales_on_a_high_dpi_screen(tmp_path, fixtures):
    """Qt's scale factor (as on a 200 % screen): the same layout in twice the pixels."""
    import struct
    import subprocess
    import sys

    out = tmp_path / "hidpi.png"
    env = {**os.environ, "QT_SCALE_FACTOR": "2", "QT_QPA_PLATFORM": "offscreen"}
    proc = subprocess.run([sys.executable, "-m", "shardscope.app.cli", "gui", str(fixtures["fsdp2_r2"]),
                           "--screenshot", str(out), "--size", "1100x600"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    width, height = struct.unpack(">II", out.read_bytes()[16:24])
    assert (width, height) == (2200, 1200)


def test_chunk_count_labels_never_overlap_at_8_ranks(qtbot, tmp_path):
    path = write_scale_checkpoint(tmp_path / "r8", ranks=8, layers=4, dim=32)
    view = open_view(qtbot, path)
    ranks = view.ranks
    view.tabs.setCurrentWidget(ranks)
    qtbot.waitUntil(lambda: ranks.bars.isVisible() and ranks.bars.width() > 100, timeout=10000)
    vb = ranks.bars.getPlotItem().vb
    bar_px = vb.width() / 8
    shown = [t for t in ranks.bar_labels if t.isVisible()]
    assert len(ranks.bar_labels) == 8 and shown, "8 bars have room for their chunk counts"
    for t in shown:
        assert t.boundingRect().width() <= bar_px, "a chunk-count label is wider than its bar: they run together"
    assert not ranks.log_box.isChecked(), "an even split is drawn on a linear scale"


def test_verify_contents_can_be_cancelled(qtbot, scale512):
    view = open_view(qtbot, scale512)
    view.verify_contents()
    assert view.progress.isVisible() and view.progress.cancel_button.isVisible()
    with qtbot.waitSignal(view.contentsVerified, timeout=120000) as sig:
        view.progress.cancel_button.click()
    assert sig.args[0] is None
    assert "cancelled" in view.health.item(0).text()
    assert not view.progress.isVisible() and view.verify_button.isEnabled()
