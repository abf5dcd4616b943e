"""The inspector (widgets/inspector_view.py): statistics equal to torch's, and errors, long names and narrow
panes that must not widen the window or clip the table."""

from __future__ import annotations

import pytest
from gui_support import min_width, no_thread_left_running, open_view  # noqa: F401  (an autouse fixture)
from torch_reference import flatten, torch_consolidated

pytestmark = pytest.mark.gui


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
    assert name in view.inspector.title.toolTip()  # the whole name; the title cuts it to the room it has
    assert min_width(view) <= max(before, 700)


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


def painted_width(label) -> float:
    """The width of a rich-text label's text as Qt lays it out on one line."""
    from PySide6.QtGui import QTextDocument

    doc = QTextDocument()
    doc.setDefaultFont(label.font())
    doc.setDocumentMargin(0)
    doc.setHtml(label.text())
    return doc.idealWidth()


def test_the_title_end_is_never_clipped_under_the_buttons(qtbot, fixtures):
    """At 1280x720 the title of a deep optimizer tensor ran under "Reload values": its dtype, shape and size
    were cut off. The name is cut in the middle to the room left; what follows it is always whole."""
    from PySide6.QtWidgets import QApplication

    view = open_view(qtbot, fixtures["fsdp2_r2"])
    name = "optimizer.state.blocks.0.fc1.weight.exp_avg_sq"
    with qtbot.waitSignal(view.valuesDone, timeout=120000):
        assert view.select_path(name)
    title, button = view.inspector.title, view.inspector.load_button
    for width in (1280, 1024, 900, 1920):
        view.resize(width, 680)
        for _ in range(5):
            QApplication.processEvents()
        assert title.geometry().right() < button.geometry().left()
        assert painted_width(title) <= title.contentsRect().width(), (width, title.text())
        assert "float32 [" in title.text() and ("KiB" in title.text() or " B" in title.text()), title.text()
        assert name in title.toolTip()
    view.resize(1920, 680)
    for _ in range(5):
        QApplication.processEvents()
    assert name in title.text()  # room enough: the whole name
