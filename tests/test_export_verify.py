"""The export's verification (backend/export/verify.py): corrupt source bytes fail the export."""

from __future__ import annotations

import os

from conftest import run_cli
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.formats import open_checkpoint


def test_corrupt_source_bytes_fail_the_export(copy_of, tmp_path):
    src = copy_of("ddp_r2")
    ckpt = open_checkpoint(src, use_cache=False)
    entry = max((t for t in ckpt.tensors if t.fqn.startswith("model.")), key=lambda t: t.numel)
    chunk = entry.chunks[0]
    with ChunkReader(ckpt) as reader:
        where = reader.locate(entry.fqn, chunk).data_offset + 3
    data = bytearray((src / chunk.file).read_bytes())
    data[where] ^= 0x01  # one bit of the tensor's stored values
    (src / chunk.file).write_bytes(bytes(data))
    out = tmp_path / "out"
    out.mkdir()
    for name in ("m.safetensors", "m.pt"):
        proc = run_cli("export", src, out / name, "--only", "model")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert chunk.file in proc.stderr and "Traceback" not in proc.stderr
        assert "verified" not in proc.stdout
    assert os.listdir(out) == []


def test_a_run_of_small_tensors_that_fails_names_the_tensor_whose_bytes_differ(tmp_path):
    """Small tensors are written and checked a run at a time; when a run's range fails, the tensors in it are
    checked one by one so the message names the one that differs (not "k0 … k2")."""
    import zlib

    from shardscope.backend.export.verify import Expectation
    from shardscope.backend.export.writers import _one_by_one

    f = tmp_path / "out"
    data = bytearray(os.urandom(300))
    f.write_bytes(data)
    expect = [Expectation(str(f), i * 100, 100, zlib.crc32(data[i * 100:(i + 1) * 100]), f"k{i}") for i in range(3)]
    data[150] ^= 1
    f.write_bytes(data)
    run = Expectation(str(f), 0, 300, zlib.crc32(bytes(300)), "k0 … k2")
    assert _one_by_one(["k0 … k2"], [run], expect, {f"k{i}": i for i in range(3)}) == ["k1"]
