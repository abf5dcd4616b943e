"""Opening a checkpoint folder (backend/checkpoint/reader.py, the metadata cache, the streaming reader)
against torch's own reader, on real multi-process checkpoints; folders that are no checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import run_cli
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.checkpoint.layout import coverage
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.errors import CheckpointError
from shardscope.backend.formats import open_checkpoint
from shardscope.backend.formats.lightning import trainer_state
from torch_reference import flatten, torch_consolidated, torch_flat_tensors

TORCH_READABLE = ["fsdp2_r2", "fsdp2_r4", "ddp_r2", "nopg", "lightning_r2"]


@pytest.mark.parametrize("name", TORCH_READABLE)
def test_inspect_json_matches_torch_reader(fixtures, name):
    proc = run_cli("inspect", "--json", fixtures[name], check=True)
    report = json.loads(proc.stdout)
    ref = torch_flat_tensors(fixtures[name])
    ours = {t["fqn"]: (t["dtype"], tuple(t["shape"]), sorted(
        (tuple(c["offsets"]), tuple(c["sizes"]), c["file"], c["offset"], c["length"]) for c in t["chunks"]))
        for t in report["tensors"]}
    assert ours == ref
    assert report["problems"] == []
    assert report["version"] == "1.0.0"
    for t in report["tensors"]:
        for c in t["chunks"]:
            assert c["rank"] == int(c["file"].split("_")[2])
    assert {r["rank"] for r in report["ranks"]} == {f["rank"] for f in report["files"] if f["rank"] is not None}


@pytest.mark.parametrize("name", TORCH_READABLE)
def test_values_equal_torch_consolidation(fixtures, name):
    ckpt = open_checkpoint(fixtures[name])
    ref = flatten(torch_consolidated(fixtures[name]))
    with ChunkReader(ckpt) as reader:
        for t in ckpt.tensors:
            assert torch.equal(reader.read_tensor(t), ref[t.fqn]), t.fqn
        for o in ckpt.objects:
            value = reader.read_object(o)
            expected = {k: v for k, v in ref.items() if k == o.fqn or k.startswith(o.fqn + ".")}
            assert flatten({o.fqn: value}) == expected


def test_object_entries_and_planner_data(fixtures):
    ckpt = open_checkpoint(fixtures["fsdp2_r2"])
    assert ckpt.planner_data["model.emb.weight"] == ("model", "emb.weight")
    assert "step" in {o.fqn for o in ckpt.objects}
    assert ckpt.tensor("optimizer.state.emb.weight.exp_avg").shape == (37, 12)


def test_per_rank_metadata_is_merged(fixtures):
    merged = open_checkpoint(fixtures["fsdp_nocoll_r2"])
    collective = open_checkpoint(fixtures["fsdp2_r2"])
    assert merged.metadata_files == ["__0.metadata", "__1.metadata"]
    assert {t.fqn for t in merged.tensors} == {t.fqn for t in collective.tensors}
    for t in merged.tensors:
        assert [(c.offsets, c.sizes, c.rank) for c in t.chunks] == \
            [(c.offsets, c.sizes, c.rank) for c in collective.tensor(t.fqn).chunks]
        assert coverage(merged, t).exact
    with ChunkReader(merged) as a, ChunkReader(collective) as b:
        for t in merged.tensors:
            assert torch.equal(a.read_tensor(t), b.read_tensor(collective.tensor(t.fqn)))


def test_safetensors_serialized_distcp(fixtures):
    st = open_checkpoint(fixtures["fsdp_safetensors_r2"])
    ref = open_checkpoint(fixtures["fsdp2_r2"])  # same seed, same steps, default serialization
    assert verify(st, deep=True) == []
    with ChunkReader(st) as a, ChunkReader(ref) as b:
        for t in st.tensors:
            assert torch.equal(a.read_tensor(t), b.read_tensor(ref.tensor(t.fqn))), t.fqn


def test_lightning_folder(fixtures):
    ckpt = open_checkpoint(fixtures["lightning_r2"])
    assert ckpt.format == "lightning"
    assert trainer_state(ckpt) == {"epoch": 1, "global_step": 2, "hparams": {"lr": 0.01}}
    proc = run_cli("inspect", fixtures["lightning_r2"], "--tensors")
    assert proc.returncode == 0 and "  meta.pt    epoch 1, global_step 2, hparams {'lr': 0.01}" in proc.stdout
    assert "1 chunk, ranks 0" in proc.stdout
    doc = json.loads(run_cli("inspect", fixtures["lightning_r2"], "--json").stdout)
    assert doc["lightning_meta"] == {"epoch": 1, "global_step": 2, "hparams": "{'lr': 0.01}"}


def test_cache_serves_second_open(fixtures):
    a = open_checkpoint(fixtures["fsdp2_r4"])
    b = open_checkpoint(fixtures["fsdp2_r4"])
    assert all(not n.startswith(("cache", "head.json")) for n in os.listdir(fixtures["fsdp2_r4"]))
    assert [t.to_json() for t in a.tensors] == [t.to_json() for t in b.tensors]
    assert len(os.listdir(os.environ["SHARDSCOPE_CACHE_DIR"])) >= 1


def test_garbage_metadata(copy_of):
    ckpt = copy_of("nopg")
    (ckpt / ".metadata").write_bytes(b"this is not a pickle at all")
    proc = run_cli("verify", ckpt)
    assert proc.returncode == 2
    assert ".metadata" in proc.stderr and "Traceback" not in proc.stderr


def test_truncated_metadata(copy_of):
    ckpt = copy_of("fsdp2_r2")
    data = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError):
        open_checkpoint(ckpt, use_cache=False)
    assert run_cli("inspect", ckpt, "--no-cache").returncode == 2


def test_distcp_without_metadata_cannot_be_read(copy_of):
    ckpt = copy_of("fsdp2_r2")
    (ckpt / ".metadata").unlink()
    for cmd in ("inspect", "verify"):
        proc = run_cli(cmd, ckpt)
        assert proc.returncode == 2, proc
        assert "no .metadata" in proc.stderr and "Traceback" not in proc.stderr


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    proc = run_cli("inspect", tmp_path)
    assert proc.returncode == 2 and "not a distributed checkpoint" in proc.stderr
    proc = run_cli("inspect", tmp_path / "nope")
    assert proc.returncode == 2 and "no such" in proc.stderr


@pytest.mark.parametrize("name", ["fsdp2_r4", "ddp_r2", "lightning_r2", "nopg"])
def test_streaming_and_object_graph_readers_agree(fixtures, name, monkeypatch):
    from shardscope.app.cli.inspect import inspect_json
    from shardscope.backend.checkpoint import reader

    fast = open_checkpoint(fixtures[name], use_cache=False)
    monkeypatch.setattr(reader, "STREAMING", False)
    slow = open_checkpoint(fixtures[name], use_cache=False)
    assert inspect_json(fast, []) == inspect_json(slow, [])


OLD_STYLE = textwrap.dedent("""
    # Re-pickle real metadata the way torch 2.0-2.2 wrote it: classes under the old
    # torch.distributed._shard.* module paths (TensorProperties and MEM_FORMAT_ENCODING under
    # _shard.sharded_tensor.metadata), no storage_meta / version / transform_descriptors fields.
    import pickle, sys, types
    import torch.distributed.checkpoint.metadata as md_mod
    import torch.distributed.checkpoint.filesystem as fs_mod
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(sys.argv[1]).read_metadata()
    old_md = types.ModuleType("torch.distributed._shard.checkpoint.metadata")
    old_fs = types.ModuleType("torch.distributed._shard.checkpoint.filesystem")
    old_st = types.ModuleType("torch.distributed._shard.sharded_tensor.metadata")
    sys.modules.update({m.__name__: m for m in (old_md, old_fs, old_st)})
    for cls in (md_mod.Metadata, md_mod.TensorStorageMetadata, md_mod.ChunkStorageMetadata,
                md_mod.BytesStorageMetadata, md_mod.MetadataIndex):
        cls.__module__ = old_md.__name__
        setattr(old_md, cls.__name__, cls)
    md_mod.TensorProperties.__module__ = old_st.__name__
    old_st.TensorProperties = md_mod.TensorProperties
    enc = md_mod._MEM_FORMAT_ENCODING
    enc.__module__, enc.__qualname__, enc.__name__ = old_st.__name__, "MEM_FORMAT_ENCODING", "MEM_FORMAT_ENCODING"
    old_st.MEM_FORMAT_ENCODING = enc
    fs_mod._StorageInfo.__module__ = old_fs.__name__
    old_fs._StorageInfo = fs_mod._StorageInfo
    del fs_mod._StorageInfo.__getstate__
    for info in md.storage_data.values():
        info.__dict__.pop("transform_descriptors", None)
    md.__dict__.pop("storage_meta", None)
    md.__dict__.pop("version", None)
    with open(sys.argv[2], "wb") as f:
        pickle.dump(md, f, protocol=2)
""")


def test_old_torch_module_paths_and_missing_fields(copy_of, fixtures):
    ckpt = copy_of("fsdp2_r2")
    new = open_checkpoint(fixtures["fsdp2_r2"], use_cache=False)
    subprocess.run([sys.executable, "-c", OLD_STYLE, str(fixtures["fsdp2_r2"]), str(ckpt / ".metadata")], check=True)
    raw = (ckpt / ".metadata").read_bytes()
    assert b"torch.distributed._shard.checkpoint.metadata" in raw and b"MEM_FORMAT_ENCODING" in raw
    old = open_checkpoint(ckpt, use_cache=False)
    assert old.version is None and old.save_id is None
    assert [t.to_json() for t in old.tensors] == [t.to_json() for t in new.tensors]
    assert verify(old, deep=True) == []
