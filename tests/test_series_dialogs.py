"""The window's ways into a run's series (app/main_window.py, widgets/series_dialogs.py), offscreen on real DCP
checkpoints written by dcp.save (the ``steps_r2`` fixture: step2/, step3/): a Drift cell opens Compare with that
tensor selected; Bisect of two runs from the Library computed in the background, its differing entry compared;
Average of checkpoints written as DCP and read back by dcp.load."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from gui_support import no_thread_left_running  # noqa: F401  (an autouse fixture)
from PySide6.QtCore import QPointF
from shardscope.widgets.compare_view import CompareView
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

pytestmark = pytest.mark.gui
SLOW = 120_000  # ms: a background read on a loaded 2-core machine
PERTURBED = "model.blocks.1.fc1.weight"


def loaded(path: Path) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        return _load_state_dict_from_keys(checkpoint_id=str(path))


def compare_tabs(win) -> list[CompareView]:
    return [p.widget(i) for p in (win.tabs, win.side_tabs) for i in range(p.count())
            if isinstance(p.widget(i), CompareView)]


def selected_entry(view: CompareView) -> str:
    return view.table.currentIndex().siblingAtColumn(0).data()


def test_a_drift_cell_opens_compare_with_that_tensor_selected(qtbot, window, fixtures):
    run = str(fixtures["steps_r2"])
    drift = window.library.drift_window(run)
    qtbot.addWidget(drift)
    qtbot.waitUntil(lambda: drift.result is not None, timeout=SLOW)
    drift.resize(1280, 720)
    qtbot.wait(50)
    vb = drift.plot.getPlotItem().vb
    row = list(drift.result.tensors).index(PERTURBED)
    pos = vb.mapViewToScene(QPointF(1, row))  # the tensor's row, step 3's column (cells centred on integers)
    assert drift._cell_at(pos) == (row, 1)

    class Click:
        def scenePos(self):
            return pos
    drift._clicked(Click())
    views = compare_tabs(window)
    assert len(views) == 1 and (views[0].path_a, views[0].path_b) == (f"{run}/step2", f"{run}/step3")
    qtbot.waitUntil(lambda: selected_entry(views[0]) == PERTURBED, timeout=SLOW)


@pytest.fixture
def two_runs(fixtures, tmp_path) -> tuple[Path, Path]:
    """Two copies of the steps_r2 run; B's step3 has one tensor perturbed (saved again by dcp.save)."""
    a, b = tmp_path / "run_a", tmp_path / "run_b"
    shutil.copytree(fixtures["steps_r2"], a)
    shutil.copytree(fixtures["steps_r2"], b)
    sd = loaded(b / "step3")
    sd["model"]["blocks.1.fc1.weight"][0, 0] += 1.0
    shutil.rmtree(b / "step3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(b / "step3"), no_dist=True)
    return a, b


def test_bisect_from_two_library_runs_and_compare_at_the_step_found(qtbot, window, two_runs):
    a, b = map(str, two_runs)
    window.library.bisectRequested.emit(a, b)  # the Library's "Bisect the two runs…"
    dlg = window.series_dialog
    qtbot.waitUntil(lambda: dlg.result is not None and dlg.worker is None, timeout=SLOW)
    assert dlg.result.first_step == 3 and dlg.result.tensors == [PERTURBED]
    assert "First step that differs: 3" in dlg.status.text()
    assert dlg.table.item(0, 0).text() == PERTURBED and not dlg.cancel_button.isEnabled()
    dlg.compare_button.click()
    views = compare_tabs(window)
    assert [(v.path_a, v.path_b) for v in views] == [(f"{a}/step3", f"{b}/step3")]
    qtbot.waitUntil(lambda: selected_entry(views[0]) == PERTURBED, timeout=SLOW)
    png = Path(a).parent / "bisect.png"
    window.resize(1280, 720)
    assert dlg.grab().save(str(png))


def test_average_from_the_library_writes_dcp_that_dcp_load_reads(qtbot, window, fixtures, tmp_path):
    run = fixtures["steps_r2"]
    paths = [str(run / "step2"), str(run / "step3")]
    window.library.averageRequested.emit(paths)  # the Library's "Average…" over the selected checkpoints
    dlg = window.series_dialog
    dlg.method.setCurrentIndex(1)
    dlg.weights.setText("1,3")
    dlg.format.setCurrentText("dcp")
    dst = tmp_path / "avg"
    dlg.dst.setText(str(dst))
    dlg.run_button.click()
    qtbot.waitUntil(lambda: dlg.result is not None and dlg.worker is None, timeout=SLOW)
    assert dlg.result.verified and "weighted" in dlg.status.text()
    models = [loaded(Path(p))["model"] for p in paths]
    state = {k: torch.empty_like(v) for k, v in models[0].items() if v.is_floating_point()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(dst), no_dist=True)
    for k, got in state.items():
        want = (models[0][k].double() + 3 * models[1][k].double()) / 4
        assert torch.equal(got, want.to(got.dtype)), k
