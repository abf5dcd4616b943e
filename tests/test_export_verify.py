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
