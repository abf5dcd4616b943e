"""The Compare pickers (app/compare_picker.py): they start on the checkpoints open in the window."""

from __future__ import annotations

from gui_support import no_thread_left_running  # noqa: F401  (an autouse fixture)

SLOW = 120000  # ms: a checkpoint load or a background read on a loaded 2-core machine


def test_compare_pickers_start_on_the_checkpoints_open_in_the_window(qtbot, window, fixtures, tmp_path):
    """With two checkpoints open, Ctrl+D's pickers offered them but preselected the Library's two newest
    checkpoints instead; OK compared two checkpoints the user was not looking at."""
    import shutil

    ckpts = tmp_path / "root" / "runA" / "checkpoints"
    for i, name in enumerate(("fsdp2_r2", "ddp_r2")):
        shutil.copytree(fixtures[name], ckpts / f"step_{i:06d}")
    window.library.user_roots = [str(tmp_path / "root")]
    window.library.poll(force=True)
    qtbot.waitUntil(lambda: len(window.library.known_paths()) >= 2, timeout=SLOW)
    a, b = (window.open_path(str(fixtures[n])) for n in ("fsdp2_r4", "ddp_r2"))
    qtbot.waitUntil(lambda: a.data is not None and b.data is not None, timeout=SLOW)
    picker = window.compare_dialog()
    try:
        assert [box.currentText() for box in picker.boxes] == [a.path, b.path]
        offered = [picker.boxes[0].itemText(i) for i in range(picker.boxes[0].count())]
        assert set(window.library.known_paths()) <= set(offered)  # the Library's are still offered
    finally:
        picker.reject()
        window.library.shutdown()
