"""The ``gui`` command and ``--screenshot``: a window started in its own process, and without a display."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import run_cli
from gui_support import no_thread_left_running  # noqa: F401  (an autouse fixture)
from safetensors.torch import save_file
from shardscope.widgets.palette import rank_color

pytestmark = pytest.mark.gui


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


def test_gui_without_a_display_says_so(fixtures):

    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    proc = subprocess.run([sys.executable, "-m", "shardscope.app.cli", str(fixtures["nopg"])], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 2 and "no display" in proc.stderr and "Traceback" not in proc.stderr


def test_gui_command_line_renders_a_safetensors_file(tmp_path):
    path = tmp_path / "one.safetensors"
    save_file({"w": torch.ones(40, 30), "b": torch.zeros(30)}, str(path))
    out = tmp_path / "shot.png"
    proc = run_cli("gui", path, "--select", "w", "--screenshot", out, "--size", "1280x720", timeout=300)
    assert proc.returncode == 0, proc.stderr
    from PySide6.QtGui import QImage

    img = QImage(str(out))
    assert (img.width(), img.height()) == (1280, 720)
