"""Closing the window is prompt: a background job in flight is cancelled, or left when it cannot stop (an import of
torch), and the process ends within about a second, leaving no helper process behind (it took ~5 s)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_for

pytestmark = pytest.mark.gui

HERE = Path(__file__).parent
PROMPT_S = 1.5  # generous for a busy machine: it takes 0.4-0.8 s here


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("moment", ["importing", "verifying"])
def test_the_window_closes_promptly_with_a_background_job_in_flight(fixtures, tmp_path, moment):
    # a cache of its own: the metadata is read afresh, by a helper process, which must end with the window
    env = {**os.environ, "SHARDSCOPE_CACHE_DIR": str(tmp_path / "cache")}
    errors = open(tmp_path / "stderr", "w+")  # a file, never a pipe nobody drains while the window runs
    proc = subprocess.Popen([sys.executable, str(HERE / "close_driver.py"), str(fixtures["fsdp2_r2"]), moment],
                            stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line.split())
        if line.startswith("closing"):
            break
    proc.wait(timeout=120)
    ended = time.time()
    proc.stdout.close()
    err = (tmp_path / "stderr").read_text()
    errors.close()
    assert lines and lines[-1][0] == "closing", f"the window never closed: {lines} {err[-3000:]}"
    assert proc.returncode == 0, err[-3000:]
    took = ended - float(lines[-1][1])
    assert took < PROMPT_S, f"closing took {took:.1f} s"
    assert "Exception ignored" not in err and "Traceback" not in err, err[-3000:]
    helpers = [int(p) for p in lines[-2][1:]]
    assert helpers, "the window had no helper process when it closed"
    wait_for(lambda: all(_gone(p) for p in helpers), "the helper processes to end", timeout=10)
