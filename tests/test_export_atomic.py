"""Atomic export outputs (backend/export/atomic.py): a signal or a kill mid-export leaves no temporary
files and the destination untouched, long destination names, a really full disk."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_cli
from shardscope.backend.export.atomic import TMP_PREFIX


def _save(state: dict, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # no_dist=True says so on purpose
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def _tmp_leftovers(folder: Path) -> list[str]:
    return [n for n in os.listdir(folder) if n.startswith(TMP_PREFIX)]


@pytest.fixture(scope="session")
def many_tensors(tmp_path_factory) -> Path:
    """2,000 tensors, 128 MiB: an export that takes long enough to be stopped in the middle."""
    path = tmp_path_factory.mktemp("many") / "ckpt"
    gen = torch.Generator().manual_seed(0)
    return _save({"model": {f"w{i}": torch.randn(128, 128, generator=gen) for i in range(2000)}}, path)


def _start_export(src: Path, dst: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shardscope.app.cli", "export", str(src), str(dst), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ})


def _stop_when_writing(proc: subprocess.Popen, folder: Path, deadline: float = 120) -> None:
    """SIGSTOP the export as soon as its temporary exists (it then has 128 MiB still to write)."""
    end = time.monotonic() + deadline
    while not _tmp_leftovers(folder):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "the export never created its temporary"
        time.sleep(0.0005)
    proc.send_signal(signal.SIGSTOP)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_export_removes_temp_and_keeps_destination(many_tensors, tmp_path, sig):
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "m.safetensors"
    dst.write_text("the previous export")
    proc = _start_export(many_tensors, dst, "--force", "--dtype", "bf16")
    _stop_when_writing(proc, out)
    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)
    _stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert sorted(os.listdir(out)) == ["m.safetensors"] and dst.read_text() == "the previous export"


def test_kill_leftover_is_removed_by_the_next_run(many_tensors, fixtures, tmp_path):
    proc = _start_export(many_tensors, tmp_path / "m.pt")
    _stop_when_writing(proc, tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)  # reaped: its pid is gone, as after a real kill -9
    left = _tmp_leftovers(tmp_path)
    assert left and not (tmp_path / "m.pt").exists()
    again = run_cli("export", fixtures["nopg"], tmp_path / "small.pt")
    assert again.returncode == 0, again.stderr
    assert sorted(os.listdir(tmp_path)) == ["small.pt", "small.pt.shardscope-manifest.json",
                                           "small.pt.shardscope.json"]  # no leftover


def test_long_destination_name(fixtures, tmp_path):
    dst = tmp_path / ("x" * 240 + ".safetensors")
    out = run_cli("export", fixtures["nopg"], dst)
    assert out.returncode == 0, out.stderr
    assert os.listdir(tmp_path) == [dst.name]  # its sidecar's name would be too long: none written


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_disk_full_up_front_and_mid_write(many_tensors, tmp_path, small_disk):
    # up front: 128 MiB do not fit in 20 MiB
    up = run_cli("export", many_tensors, small_disk / "m.safetensors")
    assert up.returncode == 2 and "only" in up.stderr and "free" in up.stderr and "Traceback" not in up.stderr
    assert os.listdir(small_disk) == []
    # mid-write: 16 MiB fit when the export starts; the disk fills up while it writes
    src = _save({"model": {f"w{i}": torch.randn(16, 128) for i in range(2000)}}, tmp_path / "mid")
    dst = small_disk / "m.pt"
    dst.write_text("keep me")
    proc = _start_export(src, dst, "--force")
    _stop_when_writing(proc, small_disk)
    fd = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * (1 << 16)):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    proc.send_signal(signal.SIGCONT)
    _stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr
    assert "disk full" in stderr and len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    os.unlink(small_disk / "filler")
    assert sorted(os.listdir(small_disk)) == ["m.pt"] and dst.read_text() == "keep me"
