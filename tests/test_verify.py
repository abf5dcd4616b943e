"""verify, quick and deep (backend/checkpoint/verify.py) on damaged checkpoints: truncated and missing
shards, bit rot, leftover temporary files, two chunks reading the same bytes, a data file deleted after opening."""

from __future__ import annotations

import json
import os

from conftest import run_cli
from damaged_metadata import FQN, clean, index_of, save_metadata
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.formats import open_checkpoint
from torch_reference import torch_metadata


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


def test_leftover_tmp_is_reported(copy_of):
    ckpt = copy_of("nopg")
    (ckpt / ".metadata.tmp").write_bytes(b"partial")
    kinds = [p.kind for p in verify(open_checkpoint(ckpt))]
    assert kinds == ["leftover_tmp"]


def test_two_chunks_reading_the_same_bytes_are_reported(copy_of, tmp_path):
    ckpt = copy_of("fsdp2_r2")
    md = torch_metadata(ckpt)
    other = "optimizer.state.blocks.0.fc1.weight.exp_avg"  # same chunk shapes, same file
    a = md.storage_data[index_of(md, FQN, md.state_dict_metadata[FQN].chunks[0].offsets)]
    b = md.storage_data[index_of(md, other, md.state_dict_metadata[other].chunks[0].offsets)]
    assert a.relative_path == b.relative_path
    a.offset, a.length = b.offset, b.length  # FQN's first chunk now reads the exp_avg item
    save_metadata(ckpt, md)
    deep = verify(open_checkpoint(ckpt, use_cache=False), deep=True)
    assert "storage_overlap" in [p.kind for p in deep]
    proc = run_cli("verify", "--deep", ckpt)
    clean(proc, (1,))
    assert "overlap" in proc.stdout
    proc = run_cli("export", ckpt, tmp_path / "out.pt")  # reads both: refused, never "verified"
    clean(proc)
    assert "verified" not in proc.stdout and "one item" in proc.stderr and not (tmp_path / "out.pt").exists()


def test_a_data_file_deleted_after_opening_is_one_problem_not_one_per_entry(copy_of):
    """The window keeps a checkpoint open; its folder may lose files before "Verify contents" runs."""
    path = copy_of("fsdp2_r4")
    ckpt = open_checkpoint(path, use_cache=False)
    entries = sum(1 for t in ckpt.tensors for c in t.chunks if c.file == "__1_0.distcp")
    entries += sum(1 for o in ckpt.objects if o.file == "__1_0.distcp")
    assert entries > 10
    os.remove(path / "__1_0.distcp")
    found = [p for p in verify(ckpt, deep=True) if p.file == "__1_0.distcp"]
    assert len(found) == 1, [p.message for p in found]
    assert "__1_0.distcp" in found[0].message and f"{entries:,} entries stored in it not checked" in found[0].message


def test_a_stale_data_file_of_an_earlier_save_is_no_writer_rank(copy_of, fixtures):
    """A 4-rank save then a 2-rank save into one folder leaves __2_0.distcp of the first: ls, the Library
    and inspect counted it as writer rank 2. Writer ranks are the ranks the .metadata references; verify and
    inspect name the stale file as a problem."""
    ckpt = copy_of("fsdp2_r2")
    (ckpt / "__2_0.distcp").write_bytes((fixtures["fsdp2_r4"] / "__2_0.distcp").read_bytes())
    listed = json.loads(run_cli("ls", "--json", ckpt.parent, check=True).stdout)["checkpoints"]
    assert [c["ranks"] for c in listed] == [[0, 1]]
    shown = json.loads(run_cli("inspect", "--json", ckpt).stdout)
    assert [r["rank"] for r in shown["ranks"]] == [0, 1]
    assert [p["file"] for p in shown["problems"] if p["kind"] == "unused_file"] == ["__2_0.distcp"]
    proc = run_cli("verify", ckpt)
    assert proc.returncode == 1 and "__2_0.distcp is not referenced by the metadata" in proc.stdout
