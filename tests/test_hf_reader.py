"""Folders written by torch's ``HuggingFaceStorageWriter`` (backend/checkpoint/hf_reader.py): read like any
checkpoint, and a shard header that claims more than the file holds."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from damaged_metadata import clean, run_measured
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.formats import open_checkpoint


def test_huggingface_storage_writer_folder(fixtures):
    """torch's HuggingFaceStorageWriter(save_distributed=True): per-rank safetensors, JSON headers only."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    ckpt = open_checkpoint(fixtures["hf_r2"])
    assert ckpt.format == "hf-safetensors"
    assert ckpt.ranks == [0, 1]
    assert verify(ckpt, deep=True) == []
    ref: dict = {}
    _load_state_dict(ref, storage_reader=HuggingFaceStorageReader(str(fixtures["hf_r2"])),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert {t.fqn for t in ckpt.tensors} == set(ref)
    with ChunkReader(ckpt) as reader:
        for t in ckpt.tensors:
            assert torch.equal(reader.read_tensor(t), ref[t.fqn]), t.fqn


def test_hf_shard_claiming_more_than_exists(copy_of):
    ckpt = copy_of("hf_r2")
    name = sorted(p.name for p in ckpt.iterdir() if p.suffix == ".safetensors")[0]
    path = ckpt / name
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + n])
    # the entry whose bytes end the file (another one's would overlap its neighbours: refused as the library does)
    key = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    a = header[key]["data_offsets"][0]
    header[key]["data_offsets"][1] = a + 5_000_000_000
    raw = json.dumps(header).encode()
    raw += b" " * (n - len(raw)) if len(raw) <= n else b""
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    proc, mb = run_measured("verify", "--deep", ckpt)
    clean(proc, (1,))
    assert "short_file" in proc.stdout and name in proc.stdout and key in proc.stdout and mb < 1500
    clean(run_cli("show", ckpt, key))


def _index_naming(tmp_path, shard: str) -> Path:
    """A folder with ``save_file``'s shard and an HF index whose weight_map places its tensor in ``shard``."""
    from safetensors.torch import save_file

    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": torch.ones(2)}, tmp_path / "outside.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {"w": shard}}))
    return folder


@pytest.mark.parametrize("how", ["parent", "absolute", "symlink out"])
def test_index_naming_a_shard_outside_says_which_entry_and_path(tmp_path, how):
    """Issue 29, item 10: the refusal names the index entry and the path, not "safetensors files hold no tensors"."""
    shard = {"parent": "../outside.safetensors", "absolute": str(tmp_path / "outside.safetensors"),
             "symlink out": "link.safetensors"}[how]
    folder = _index_naming(tmp_path, shard)
    if how == "symlink out":
        (folder / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    proc = run_cli("inspect", folder)
    clean(proc, (2,))
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "hold no tensors" not in line, line
    assert "'w'" in line and shard in line, line
