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


def test_a_mistyped_command_is_named_with_the_command_meant(tmp_path):
    """`shardscope exprot` opened a window on a "checkpoint" called exprot; `inspcet PATH` blamed the path."""
    from conftest import run_cli

    proc = run_cli("exprot")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "shardscope: unknown command 'exprot'; did you mean 'export'?"
    proc = run_cli("inspcet", tmp_path)
    assert proc.returncode == 2
    assert "did you mean 'inspect'?" in proc.stderr and "unrecognized" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_mistyped_flag_prints_the_subcommands_usage(fixtures):
    from conftest import run_cli

    proc = run_cli("inspect", fixtures["fsdp2_r2"], "--jsno")
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: shardscope inspect ")
    assert "unrecognized arguments: --jsno" in proc.stderr
