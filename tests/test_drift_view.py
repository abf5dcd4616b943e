"""The Drift view (widgets/drift_view.py) offscreen: 2,000 tensors x 100 checkpoints of synthetic drift drawn
without blocking the window, rendered at 1280x720 and 1920x1080; a run's drift computed in the background; a long
one cancelled from the window."""

from __future__ import annotations

import os
import time
import warnings

import numpy as np
import pytest
from PySide6.QtCore import Qt
from shardscope.backend.compare.drift import DriftResult, TensorDrift
from shardscope.widgets.drift_view import DriftView

pytestmark = pytest.mark.gui


def synthetic(tensors: int = 2000, steps: int = 100) -> DriftResult:
    rng = np.random.default_rng(0)
    res = DriftResult(list(range(0, steps * 10, 10)), [f"/ckpt/step_{s:06d}" for s in range(0, steps * 10, 10)])
    for t in range(tensors):
        change = (10.0 ** rng.uniform(-7, -1, steps)).tolist()
        nonfinite = [0] * steps
        if t == 1234:
            nonfinite[57] = 3
        res.tensors[f"model.layers.{t // 10}.block.w{t % 10}"] = TensorDrift([1.0] * steps, [None, *change[1:]],
                                                                             nonfinite)
    res.first_nonfinite = (570, "model.layers.123.block.w4") if tensors > 1234 else None
    return res


@pytest.mark.parametrize("size", [(1280, 720), (1920, 1080)])
def test_drift_view_draws_2000_tensors_by_100_steps_without_blocking(qtbot, tmp_path, size):
    view = DriftView()
    qtbot.addWidget(view)
    view.resize(*size)
    view.show()
    result = synthetic()
    t0 = time.monotonic()
    view.show_result(result)
    qtbot.wait(50)
    drawn = time.monotonic() - t0
    assert drawn < 2.0, f"drawing took {drawn:.2f} s on the GUI thread"
    assert view.image.image.shape == (100, 2000)  # x = step, y = tensor
    assert "first non-finite value: step 570, model.layers.123.block.w4" in view.status.text()
    assert view.marker.data["x"].tolist() == [57] and view.marker.data["y"].tolist() == [1234]
    view.depth.setValue(2)  # modules collapsed: model.layers
    assert view.image.image.shape == (100, 1)
    view.depth.setValue(3)
    assert view.image.image.shape == (100, 200) and view.marker.data["y"].tolist() == [123]
    view.depth.setValue(0)
    png = tmp_path / f"drift_{size[0]}.png"
    assert view.grab().save(str(png))
    assert png.stat().st_size > 10_000


def test_a_click_asks_to_compare_the_tensor_between_the_two_checkpoints(qtbot):
    view = DriftView()
    qtbot.addWidget(view)
    view.resize(1280, 720)
    view.show()
    view.show_result(synthetic(20, 10))
    qtbot.wait(50)
    vb = view.plot.getPlotItem().vb
    pos = vb.mapViewToScene(vb.mapToView(vb.rect().center()))
    cell = view._cell_at(pos)
    assert cell is not None
    row, col = cell

    class Click:
        def scenePos(self):
            return pos
    with qtbot.waitSignal(view.compareRequested, timeout=2000) as sig:
        view._clicked(Click())
    assert sig.args == [f"/ckpt/step_{(col - 1) * 10:06d}", f"/ckpt/step_{col * 10:06d}",
                        list(view.result.tensors)[row]]


def test_the_library_opens_a_runs_drift_computed_in_the_background(qtbot, fixtures):
    from shardscope.widgets.library_view import LibraryView

    library = LibraryView([])
    qtbot.addWidget(library)
    view = library.drift_window(str(fixtures["steps_r2"]))  # step2/, step3/: two DCP checkpoints by dcp.save
    qtbot.addWidget(view)
    assert "reading" in view.status.text()  # returned before the reading is done
    qtbot.waitUntil(lambda: view.result is not None, timeout=60_000)
    assert view.result.steps == [2, 3] and view.image.image.shape[0] == 2
    assert "checkpoints" in view.status.text()


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """A run of 30 checkpoints of 200 tensors each: one written by ``dcp.save``, the others hard links to its
    files (no disk, but every checkpoint is read): a drift of 6,000 tensor reads, seconds long."""
    import torch
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("long_run")
    first = root / "step_000001"
    with warnings.catch_warnings():  # torch: "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save({f"model.layers.{i}.weight": torch.full((256, 256), float(i)) for i in range(200)},
                 checkpoint_id=str(first), no_dist=True)
    for step in range(2, 31):
        folder = root / f"step_{step:06d}"
        folder.mkdir()
        for f in first.iterdir():
            os.link(f, folder / f.name)
    return root


def _done(view: DriftView) -> tuple[int, int]:
    text = view.status.text()
    if "/" not in text:
        return 0, 1
    done, total = text.rsplit(" ", 1)[1].split("/")
    return int(done), int(total)


def test_cancel_stops_a_long_drift_promptly_and_leaves_the_view_usable(qtbot, long_run, fixtures):
    """Cancel while the drift reads: the work stops within seconds, well before its end, nothing is drawn, and the
    same view then computes and draws another run's drift."""
    view = DriftView()
    qtbot.addWidget(view)
    view.resize(1280, 720)
    view.show()
    view.load([str(long_run)])
    assert view.cancel_button.isVisible() and view.worker is not None
    qtbot.waitUntil(lambda: _done(view)[0] >= 20, timeout=120_000)  # reading, the window answering
    done, total = _done(view)
    assert total == 6000 and done < total // 2
    started = time.monotonic()
    qtbot.mouseClick(view.cancel_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: view.worker is None, timeout=30_000)
    stopped = time.monotonic() - started
    assert view.status.text().startswith("cancelled"), view.status.text()
    assert stopped < 10, stopped  # one tensor of 256 KiB in flight: milliseconds on an idle machine
    assert view.result is None and not view.cancel_button.isVisible()

    view.load([str(fixtures["steps_r2"])])  # usable: the next drift runs and is drawn
    qtbot.waitUntil(lambda: view.result is not None, timeout=60_000)
    assert view.result.steps == [2, 3] and view.image.image.shape[0] == 2
    assert not view.cancel_button.isVisible()
