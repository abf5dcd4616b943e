"""The restricted unpickler for ``.metadata`` (backend/checkpoint/safe_pickle.py): hostile pickles run
nothing, and bombs (bytearrays, nesting, memo tables) are refused without allocating what they claim."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
from conftest import run_cli
from damaged_metadata import FQN, clean, memo_bomb, run_measured, save_metadata, write_evil_metadata
from shardscope.backend.errors import RefusedPickleError
from shardscope.backend.formats import open_checkpoint
from torch_reference import torch_metadata


def test_hostile_metadata_is_refused_and_never_runs(copy_of, tmp_path):
    ckpt = copy_of("nopg")
    marker = tmp_path / "pwned"
    write_evil_metadata(ckpt, marker)
    with pytest.raises(RefusedPickleError, match="system"):
        open_checkpoint(ckpt, use_cache=False)
    proc = run_cli("inspect", ckpt)
    assert proc.returncode == 2
    assert "refused" in proc.stderr and ".metadata" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()


def test_dotted_name_through_allowed_module_is_refused(copy_of, tmp_path):
    ckpt = copy_of("nopg")
    marker = tmp_path / "pwned2"
    # STACK_GLOBAL('torch.distributed.checkpoint.filesystem', 'os.system')('touch marker')
    def payload(target) -> bytes:
        cmd = f"touch {target}".encode()
        mod, name = b"torch.distributed.checkpoint.filesystem", b"os.system"
        return (b"\x80\x04" + b"\x8c" + bytes([len(mod)]) + mod + b"\x8c" + bytes([len(name)]) + name + b"\x93"
                + b"\x8c" + bytes([len(cmd)]) + cmd + b"\x85R.")

    (ckpt / ".metadata").write_bytes(payload(marker))
    # plain pickle would run it: prove the same payload is live (with another marker) without our reader
    live = tmp_path / "live"
    subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(bytes.fromhex(sys.argv[1]))",
                    payload(live).hex()], check=True, timeout=300)
    assert live.exists()
    with pytest.raises(RefusedPickleError, match=r"os\.system"):
        open_checkpoint(ckpt, use_cache=False)
    assert not marker.exists()


def test_bytearray_bomb_is_refused_without_allocating(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    bomb = b"\x80\x02cbuiltins\nbytearray\n\x8a\x05" + (5_000_000_000).to_bytes(5, "little") + b"\x85R."
    (tmp_path / ".metadata").write_bytes(bomb)
    assert len(bomb) < 40
    proc, mb = run_measured("inspect", tmp_path)
    clean(proc)
    assert "allocation bomb" in proc.stderr and mb < 1500, mb


class _Bytes:
    def __reduce__(self):
        return bytearray, (20_000_000,)


class _ListOfBytes:
    def __reduce__(self):
        return list, (_Bytes(),)


def test_shape_built_from_a_huge_bytearray_is_refused(copy_of):
    ckpt = copy_of("fsdp2_r2")
    md = torch_metadata(ckpt)
    md.state_dict_metadata[FQN].size = _ListOfBytes()
    assert len(save_metadata(ckpt, md)) < 100_000
    proc, mb = run_measured("inspect", ckpt, "--no-cache")
    clean(proc)
    assert mb < 1500, mb


def test_deeply_nested_version_and_dict_key(copy_of):
    ckpt = copy_of("fsdp2_r2")
    md = torch_metadata(ckpt)
    md.version = "VERSIONMARK"
    data = pickle.dumps(md, protocol=2)
    marker = b"X\x0b\x00\x00\x00VERSIONMARK"
    assert data.count(marker) == 1
    # a dict whose key is a tuple nested 200,000 deep: hashing it recurses in C
    nested = b"}" + b")" + b"\x85" * 200_000 + b"K\x01s"
    (ckpt / ".metadata").write_bytes(data.replace(marker, nested))
    for cmd in ("inspect", "verify"):
        clean(run_cli(cmd, ckpt, "--no-cache"))


def test_memo_table_bomb_is_refused(tmp_path):
    assert len(memo_bomb(tmp_path)) < 10
    proc, mb = run_measured("inspect", tmp_path, "--no-cache")
    clean(proc)
    assert "allocation bomb" in proc.stderr and mb < 1500, (proc.stderr, mb)


def test_huge_bytearray8_leaves_no_stray_line(monkeypatch):
    """Found by fuzzing: a BYTEARRAY8 opcode with a huge length makes CPython 3.11 free a half-made bytearray
    whose export count was never set, which may print "SystemError: deallocated bytearray object has exported
    buffers". The load is refused and nothing else reaches stderr (in this process, as the CLI loads)."""
    import io

    from shardscope.backend.checkpoint import reader_process, unpickler
    from shardscope.backend.errors import RefusedPickleError

    monkeypatch.setattr(reader_process, "ISOLATE", False)
    bomb = b"\x80\x05\x96" + (2**62).to_bytes(8, "little") + b"."
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    for _ in range(5):
        garbage = [(object(), object()) for _ in range(50_000)]  # freed 56-byte blocks whose last word is set
        del garbage
        with pytest.raises(RefusedPickleError, match="allocation bomb"):
            unpickler.unpickle_metadata(bomb, "bomb")
    assert err.getvalue() == ""
