"""The compare view (widgets/compare_view.py): changes and their detail, errors that must not widen the
window, a checkpoint compared with its own export."""

from __future__ import annotations

import pytest
from gui_support import min_width, no_thread_left_running  # noqa: F401  (an autouse fixture)
from PySide6.QtCore import Qt

pytestmark = pytest.mark.gui


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


def test_compare_with_its_own_export_says_why_nothing_paired(qtbot, fixtures, tmp_path):
    """A checkpoint compared with its own default safetensors export listed "75 only in A, 15 only in B"
    and "differences found", with no word that the export had dropped ``model.`` from every name.
    Now the names pair without the container prefix, and the view says so."""
    from shardscope.backend.export import export, plan_export
    from shardscope.backend.formats import open_checkpoint
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


def test_compare_progress_text_is_not_clipped(qtbot, fixtures):
    """The progress bar (at most 220 px) held "37 %  optimizer.state.model.blocks.0…" and clipped it: the bar says
    the percentage, and the line below it what is being compared, whole (it wraps)."""
    from shardscope.widgets.compare_view import CompareView

    view = CompareView(str(fixtures["steps_r2"] / "step2"), str(fixtures["steps_r2"] / "step3"))
    qtbot.addWidget(view)
    view.resize(1280, 720)
    view.show()
    qtbot.waitExposed(view)
    seen: list[tuple[str, int, str]] = []
    view.progress.valueChanged.connect(lambda _v: seen.append((view.progress.text(), view.progress.width(),
                                                               view.summary.text())))
    with qtbot.waitSignal(view.finished, timeout=120000):
        view.start()
    fm = view.progress.fontMetrics()
    assert len(seen) > 2
    for text, width, _summary in seen:
        assert fm.horizontalAdvance(text) <= width - 8, (text, width)
    assert [s for s in seen if "Comparing … " in s[2] and "model." in s[2]], seen  # the name, whole
    view.shutdown()


def test_compare_of_sealed_copies_says_identical_by_digest(qtbot, copy_of, tmp_path):
    """Two sealed copies: the diff takes every pair by its digests without reading, and the view says so."""
    import shutil

    from conftest import run_cli
    from shardscope.widgets.compare_view import CompareView

    a = copy_of("fsdp2_r2")
    b = tmp_path / "copy"
    shutil.copytree(a, b)
    for path in (a, b):
        assert run_cli("seal", path).returncode == 0
    view = CompareView(str(a), str(b))
    qtbot.addWidget(view)
    with qtbot.waitSignal(view.finished, timeout=120000) as sig:
        view.start()
    assert 0 < sig.args[0].by_digest <= sig.args[0].unchanged  # every tensor (the other entries are read)
    assert "identical (same digests)" in view.summary.text() and "identical (same digests)" in view.detail.text()
    view.shutdown()
