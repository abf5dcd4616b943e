"""The chunk reader (backend/checkpoint/chunks.py) on hostile and damaged items: zip64 claims, oversized
data.pkl, FIFOs, device files and symlinks out of the folder, a flipped bit."""

from __future__ import annotations

import os
import struct

import pytest
from conftest import run_cli
from damaged_metadata import FQN, clean, index_of, run_measured, save_metadata
from shardscope.backend.checkpoint.chunks import ChunkReader, CorruptChunkError
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.errors import CheckpointError
from shardscope.backend.formats import open_checkpoint
from shardscope.backend.progress import Progress
from torch_reference import torch_metadata


def _item(ckpt_path, fqn=FQN):
    ck = open_checkpoint(ckpt_path, use_cache=False)
    chunk = ck.tensor(fqn).chunks[0]
    return ck, chunk


def test_zip64_central_directory_claim(copy_of, tmp_path):
    ckpt = copy_of("fsdp2_r2")
    _ck, chunk = _item(ckpt)
    path = ckpt / chunk.file
    data = bytearray(path.read_bytes())
    item = data[chunk.offset:chunk.offset + chunk.length]
    eocd, z64 = item.rfind(b"PK\x05\x06"), item.rfind(b"PK\x06\x06")
    assert eocd > 0 and z64 > 0
    struct.pack_into("<I", data, chunk.offset + eocd + 16, 0xFFFFFFFF)  # "see the zip64 record"
    struct.pack_into("<Q", data, chunk.offset + z64 + 40, 2**50)  # a 1 PiB central directory
    path.write_bytes(bytes(data))
    proc, mb = run_measured("verify", "--deep", ckpt)
    clean(proc, (1,))
    assert FQN in proc.stdout and mb < 1500
    for args in (("show", ckpt, FQN), ("export", ckpt, tmp_path / "out.safetensors"),
                 ("diff", ckpt, ckpt)):
        clean(run_cli(*args))
    assert not (tmp_path / "out.safetensors").exists()


def test_data_pkl_size_is_bounded_by_the_item(copy_of):
    ckpt = copy_of("fsdp2_r2")
    _ck, chunk = _item(ckpt)
    path = ckpt / chunk.file
    data = bytearray(path.read_bytes())
    item = bytes(data[chunk.offset:chunk.offset + chunk.length])
    cd = item.find(b"PK\x01\x02")
    while cd >= 0:  # every central-directory size of data.pkl claims 3 GB
        nlen = struct.unpack_from("<H", item, cd + 28)[0]
        if item[cd + 46:cd + 46 + nlen].endswith(b"data.pkl"):
            struct.pack_into("<I", data, chunk.offset + cd + 20, 3_000_000_000)
        cd = item.find(b"PK\x01\x02", cd + 4)
    path.write_bytes(bytes(data))
    problems = verify(open_checkpoint(ckpt, use_cache=False), deep=True)
    assert [p.kind for p in problems] == ["unreadable"] and problems[0].fqn == FQN
    clean(run_cli("show", ckpt, FQN))


def test_relative_path_to_a_fifo_in_the_folder_does_not_hang(copy_of):
    ckpt = copy_of("fsdp2_r2")
    os.mkfifo(ckpt / "fifo.distcp")
    md = torch_metadata(ckpt)
    md.storage_data[index_of(md, FQN, (0, 0))].relative_path = "fifo.distcp"
    save_metadata(ckpt, md)
    problems = verify(open_checkpoint(ckpt, use_cache=False), deep=True)
    assert any(p.kind == "missing_file" and p.file == "fifo.distcp" for p in problems)
    clean(run_cli("show", ckpt, FQN, timeout=120))
    with ChunkReader(open_checkpoint(ckpt, use_cache=False)) as reader, pytest.raises(CheckpointError) as exc:
        reader.handles.read("fifo.distcp", 0, 10)
    assert "not a regular file" in str(exc.value)


def test_symlinked_item_to_a_device_is_refused(copy_of):
    ckpt = copy_of("fsdp2_r2")
    _ck, chunk = _item(ckpt)
    os.unlink(ckpt / chunk.file)
    os.symlink("/dev/zero", ckpt / chunk.file)
    proc, mb = run_measured("show", ckpt, FQN, "--no-cache")
    clean(proc)
    assert mb < 1500


def test_symlink_leading_out_of_the_folder_is_never_opened(copy_of, tmp_path):
    """An item or .metadata that is a link to a regular file elsewhere (a secret, another checkpoint) is
    refused by every reading command; a link to a file inside the folder is fine."""
    ckpt = copy_of("fsdp2_r2")
    _ck, chunk = _item(ckpt)
    outside = tmp_path / "outside.distcp"
    os.rename(ckpt / chunk.file, outside)
    os.symlink(outside, ckpt / chunk.file)
    for args in (("show", ckpt, FQN), ("verify", ckpt), ("verify", "--deep", ckpt), ("inspect", ckpt),
                 ("export", ckpt, tmp_path / "o.safetensors")):
        proc = run_cli(*args, timeout=120)
        assert "Traceback" not in proc.stderr and "healthy" not in proc.stdout, (args, proc.stdout, proc.stderr)
        assert proc.returncode in (0, 1, 2) if args[0] == "inspect" else proc.returncode in (1, 2), args
        out = proc.stdout + proc.stderr
        assert "outside the checkpoint folder" in out and "refused" in out, (args, out)
        assert out.count("outside the checkpoint folder") == 1, (args, out)  # said once, not per item
    assert not (tmp_path / "o.safetensors").exists()
    os.unlink(ckpt / chunk.file)
    os.rename(outside, ckpt / "real.bin")
    os.symlink("real.bin", ckpt / chunk.file)  # relative, inside
    assert run_cli("show", ckpt, FQN, timeout=120).returncode == 0
    # a file the user names is not a checkpoint folder: the Hugging Face cache links every file into blobs/
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    assert run_cli("export", ckpt, blobs / "f00d.safetensors", timeout=120).returncode == 0
    os.symlink(os.path.relpath(blobs / "f00d.safetensors", snap), snap / "model.safetensors")
    proc = run_cli("diff", snap / "model.safetensors", blobs / "f00d.safetensors", timeout=120)
    assert proc.returncode == 0 and "15 unchanged" in proc.stdout, proc.stdout + proc.stderr
    meta = tmp_path / "meta"
    os.rename(ckpt / ".metadata", meta)
    os.symlink(meta, ckpt / ".metadata")
    clean(run_cli("inspect", ckpt, "--no-cache", timeout=120))


def _flip_a_value_bit(ckpt):
    ck = open_checkpoint(ckpt, use_cache=False)
    chunk = ck.tensor(FQN).chunks[0]
    with ChunkReader(ck) as reader:
        st = reader.locate(FQN, chunk)
    f = ckpt / chunk.file
    data = bytearray(f.read_bytes())
    data[st.data_offset + 10] ^= 0x40
    f.write_bytes(bytes(data))
    return chunk


def test_flipped_bit_is_an_error_on_every_read(copy_of, tmp_path):
    ckpt = copy_of("fsdp2_r2")
    chunk = _flip_a_value_bit(ckpt)
    ck = open_checkpoint(ckpt, use_cache=False)
    with ChunkReader(ck) as reader, pytest.raises(CorruptChunkError) as exc:
        reader.read_tensor(ck.tensor(FQN))
    assert exc.value.fqn == FQN and chunk.file in str(exc.value)
    proc = run_cli("show", ckpt, FQN)
    clean(proc)
    assert "CRC32" in proc.stderr and FQN in proc.stderr and chunk.file in proc.stderr
    for dst in ("out.safetensors", "out.pt"):
        proc = run_cli("export", ckpt, tmp_path / dst, "--strip-prefix=")
        assert proc.returncode != 0 and "verified" not in proc.stdout, proc.stdout
        assert "Traceback" not in proc.stderr and not (tmp_path / dst).exists()
    kinds = [p.kind for p in verify(ck, deep=True, progress=Progress())]
    assert kinds == ["corrupt"]
