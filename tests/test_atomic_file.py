"""backend.atomic_file: the one small-file atomic write."""

import os
import stat

import pytest
from shardscope.backend.atomic_file import write_atomic


def test_write_atomic_replaces_whole_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "status.json"
    target.write_text("old")
    write_atomic(target, '{"state": "running"}')
    assert target.read_text() == '{"state": "running"}'
    write_atomic(target, b"bytes", mode=0o755)
    assert target.read_bytes() == b"bytes"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755
    assert sorted(os.listdir(tmp_path)) == ["status.json"]


def test_write_atomic_failure_keeps_the_old_file(tmp_path):
    target = tmp_path / "config.json"
    target.write_text("old")
    with pytest.raises(TypeError):
        write_atomic(target, 42)  # type: ignore[arg-type]
    assert target.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["config.json"]
