"""The checkpoint core against torch's own reader, on real multi-process checkpoints."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from shardscope.backend.checkpoint import open_checkpoint
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.checkpoint.layout import coverage, rank_balance
from shardscope.backend.checkpoint.values import read_lightning_meta, tensor_stats
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.errors import CheckpointError, RefusedPickleError
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
    assert read_lightning_meta(ckpt) == {"epoch": 1, "global_step": 2, "hparams": {"lr": 0.01}}
    proc = run_cli("inspect", fixtures["lightning_r2"], "--tensors")
    assert proc.returncode == 0 and "  meta.pt    epoch 1, global_step 2, hparams {'lr': 0.01}" in proc.stdout
    assert "1 chunk, ranks 0" in proc.stdout
    doc = json.loads(run_cli("inspect", fixtures["lightning_r2"], "--json").stdout)
    assert doc["lightning_meta"] == {"epoch": 1, "global_step": 2, "hparams": "{'lr': 0.01}"}


def test_rank_balance_counts_every_chunk(fixtures):
    ckpt = open_checkpoint(fixtures["fsdp2_r4"])
    bal = rank_balance(ckpt)
    assert [b.rank for b in bal] == [0, 1, 2, 3]
    assert sum(b.chunks for b in bal) == len(ckpt.chunk_table)
    assert sum(b.bytes for b in bal) == ckpt.total_bytes


def test_stats_match_torch(fixtures):
    ckpt = open_checkpoint(fixtures["fsdp2_r4"])
    ref = flatten(torch_consolidated(fixtures["fsdp2_r4"]))["model.head.weight"]
    with ChunkReader(ckpt) as reader:
        t = reader.read_tensor(ckpt.tensor("model.head.weight"))
    st = tensor_stats(t)
    assert st.min == pytest.approx(ref.min().item())
    assert st.max == pytest.approx(ref.max().item())
    assert st.mean == pytest.approx(ref.double().mean().item())
    assert st.std == pytest.approx(ref.double().std().item())
    assert sum(st.hist_counts) == ref.numel() and st.nan == 0


def test_cache_serves_second_open(fixtures):
    a = open_checkpoint(fixtures["fsdp2_r4"])
    b = open_checkpoint(fixtures["fsdp2_r4"])
    assert all(not n.startswith(("cache", "head.json")) for n in os.listdir(fixtures["fsdp2_r4"]))
    assert [t.to_json() for t in a.tensors] == [t.to_json() for t in b.tensors]
    assert len(os.listdir(os.environ["SHARDSCOPE_CACHE_DIR"])) >= 1


# ------------------------------------------------------------------ hostile and damaged input
def _write_pickle(path, payload: bytes):
    path.write_bytes(payload)


def test_hostile_metadata_is_refused_and_never_runs(copy_of, tmp_path):
    ckpt = copy_of("nopg")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
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


def test_truncated_shard(copy_of):
    ckpt = copy_of("fsdp2_r2")
    f = ckpt / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[:5000])
    proc = run_cli("verify", "--json", ckpt)
    assert proc.returncode == 1
    kinds = {p["kind"] for p in json.loads(proc.stdout)["problems"]}
    assert "short_file" in kinds
    problem = next(p for p in json.loads(proc.stdout)["problems"] if p["kind"] == "short_file")
    assert problem["file"] == "__1_0.distcp" and problem["fqn"]


def test_missing_shard(copy_of):
    ckpt = copy_of("fsdp2_r4")
    (ckpt / "__2_0.distcp").unlink()
    problems = verify(open_checkpoint(ckpt))
    missing = [p for p in problems if p.kind == "missing_file"]
    assert len(missing) == 1 and missing[0].file == "__2_0.distcp" and missing[0].fqn
    proc = run_cli("show", ckpt, "model.emb.weight")
    assert proc.returncode == 2 and "__2_0.distcp" in proc.stderr and "Traceback" not in proc.stderr


def test_bit_rot_caught_by_deep_verify(copy_of):
    ckpt_path = copy_of("fsdp2_r2")
    ckpt = open_checkpoint(ckpt_path)
    chunk = ckpt.tensor("model.blocks.0.fc1.weight").chunks[0]
    with ChunkReader(ckpt) as reader:
        st = reader.locate("model.blocks.0.fc1.weight", chunk)
    f = ckpt_path / chunk.file
    data = bytearray(f.read_bytes())
    data[st.data_offset + 10] ^= 0x40
    f.write_bytes(bytes(data))
    assert verify(open_checkpoint(ckpt_path)) == []  # shallow check cannot see it
    deep = verify(open_checkpoint(ckpt_path), deep=True)
    assert [(p.kind, p.fqn, p.file) for p in deep] == [("corrupt", "model.blocks.0.fc1.weight", chunk.file)]
    proc = run_cli("verify", "--deep", ckpt_path)
    assert proc.returncode == 1 and "CRC32" in proc.stdout


def test_distcp_without_metadata_cannot_be_read(copy_of):
    ckpt = copy_of("fsdp2_r2")
    (ckpt / ".metadata").unlink()
    for cmd in ("inspect", "verify"):
        proc = run_cli(cmd, ckpt)
        assert proc.returncode == 2, proc
        assert "no .metadata" in proc.stderr and "Traceback" not in proc.stderr


def test_leftover_tmp_is_reported(copy_of):
    ckpt = copy_of("nopg")
    (ckpt / ".metadata.tmp").write_bytes(b"partial")
    kinds = [p.kind for p in verify(open_checkpoint(ckpt))]
    assert kinds == ["leftover_tmp"]


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    proc = run_cli("inspect", tmp_path)
    assert proc.returncode == 2 and "not a distributed checkpoint" in proc.stderr
    proc = run_cli("inspect", tmp_path / "nope")
    assert proc.returncode == 2 and "no such" in proc.stderr


def test_gap_and_overlap_are_found(copy_of):
    """Rewrite the metadata with torch's own classes so one tensor has a hole and another an overlap."""
    ckpt = copy_of("fsdp2_r2")
    script = textwrap.dedent(f"""
        import pickle, torch
        from torch.distributed.checkpoint import FileSystemReader
        md = FileSystemReader({str(ckpt)!r}).read_metadata()
        w = md.state_dict_metadata["model.emb.weight"]
        w.chunks = w.chunks[:1]                      # rows 19..37 now belong to no chunk
        b = md.state_dict_metadata["model.head.weight"]
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        c = b.chunks[1]
        b.chunks[1] = ChunkStorageMetadata(torch.Size([c.offsets[0] - 2, 0]), torch.Size([c.sizes[0] + 2, c.sizes[1]]))
        md.storage_meta = None
        pickle.dump(md, open({str(ckpt / '.metadata')!r}, "wb"))
    """)
    subprocess.run([sys.executable, "-c", script], check=True)
    problems = verify(open_checkpoint(ckpt, use_cache=False))
    gap = [p for p in problems if p.kind == "gap"]
    over = [p for p in problems if p.kind == "overlap"]
    assert gap and gap[0].fqn == "model.emb.weight" and "[19:37, 0:12]" in gap[0].message
    assert over and over[0].fqn == "model.head.weight" and "[17:19, 0:12]" in over[0].message


def test_backend_imports_without_qt(fixtures):
    """Every backend module imports and works where importing PySide6, shiboken6 or pyqtgraph fails."""
    code = textwrap.dedent(f"""
        import importlib, json, pkgutil, sys

        BLOCKED = ("PySide6", "shiboken6", "pyqtgraph")
        tried = []

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    tried.append(name)
                    raise ImportError(f"{{name}} is blocked in this test")
                return None

        sys.meta_path.insert(0, Block())
        import shardscope.backend as backend

        modules = []
        def failed(name):
            raise SystemExit(f"cannot import {{name}}: {{sys.exc_info()[1]!r}}")
        for info in pkgutil.walk_packages(backend.__path__, "shardscope.backend.", onerror=failed):
            importlib.import_module(info.name)
            modules.append(info.name)
        from shardscope import report
        from shardscope.backend.checkpoint import open_checkpoint
        from shardscope.backend.checkpoint.verify import verify
        problems = verify(open_checkpoint({str(fixtures['nopg'])!r}), deep=True)
        print(json.dumps({{"modules": modules, "tried": tried, "problems": len(problems),
                          "qt_loaded": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["tried"] == [] and out["qt_loaded"] == [] and out["problems"] == 0
    # the walk reached every module file under backend/ (a package left out would be missed here)
    src = Path(__file__).parent.parent / "backend"
    on_disk = {".".join(("shardscope", "backend", *f.relative_to(src).with_suffix("").parts)).removesuffix(".__init__")
               for f in src.rglob("*.py") if f.name != "__main__.py"} - {"shardscope.backend"}
    assert on_disk <= set(out["modules"]), on_disk - set(out["modules"])


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


def test_show_json_for_objects_and_without_values(fixtures):
    obj = run_cli("show", fixtures["fsdp2_r2"], "extra.ints", "--json")
    assert obj.returncode == 0, obj.stderr
    rec = json.loads(obj.stdout.splitlines()[-1])["object"]
    assert rec["fqn"] == "extra.ints" and rec["type"] == "list" and rec["value"] == "[1, 2]" and rec["length"] > 0
    bare = run_cli("show", fixtures["fsdp2_r2"], "model.emb.weight", "--json", "--no-values")
    assert bare.returncode == 0, bare.stderr
    rec = json.loads(bare.stdout.splitlines()[-1])
    assert rec["stats"] is None and rec["tensor"]["shape"] == [37, 12]
