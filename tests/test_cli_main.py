"""Global options of the command line (app/cli/main.py): --no-cache leaves the cache alone."""

from __future__ import annotations

import os
import subprocess
import sys


def test_global_no_cache_leaves_the_cache_alone(fixtures, tmp_path):
    env = {**os.environ, "SHARDSCOPE_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("SHARDSCOPE_NO_CACHE", None)
    cmd = [sys.executable, "-m", "shardscope.app.cli"]
    proc = subprocess.run([*cmd, "--no-cache", "inspect", str(fixtures["fsdp2_r2"])], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    proc = subprocess.run([*cmd, "inspect", str(fixtures["fsdp2_r2"])], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert any((tmp_path / "cache").iterdir())  # without it the same command fills the cache
    assert "--no-cache" in subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120).stdout
