"""diff's streamed comparison (one reader thread per side, windows of BLOCK elements read straight from the chunks)
on checkpoints written by ``dcp.save`` from a 2-process gloo run: a single changed element in a tensor split over
two chunks and two windows is found with the numbers of the one-pair-in-memory comparison, and a flipped byte
is still a CRC32 failure naming the file and the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from conftest import run_cli
from shardscope.backend.checkpoint.chunks import CorruptChunkError
from shardscope.backend.compare.diff import BLOCK, diff, unreadable_reason, value_change
from shardscope.backend.formats import open_checkpoint, open_source
from torch_reference import flatten, torch_consolidated

ROWS, COLS = 3000, 1500  # 4.5 M float32: more than one window (BLOCK elements); each rank's chunk 1500 rows
CHANGED = 4_300_000  # in rank 1's chunk and in the second window, so the first window's bytes are equal


def _values(changed: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(ROWS, COLS, generator=g)
    if changed:
        w.view(-1)[CHANGED] += 0.25
    return {"w": w, "cols": torch.randn(6, 10, generator=g), "small": torch.randn(4, 3, generator=g)}


def _writer(rank: int, world: int, store: str, a: str, b: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        for out, changed in ((a, False), (b, True)):
            v = _values(changed)
            state = {"w": distribute_tensor(v["w"], mesh, [Shard(0)]),  # FSDP's layout: runs of the bytes
                     "cols": distribute_tensor(v["cols"], mesh, [Shard(1)]),  # not runs: assembled
                     "small": distribute_tensor(v["small"], mesh, [Shard(0)])}
            dcp.save(state, checkpoint_id=out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("streams")
    a, b = root / "a", root / "b"
    mp.start_processes(_writer, args=(2, str(root / "store"), str(a), str(b)), nprocs=2, start_method="spawn")
    return a, b


def test_a_single_changed_element_in_a_tensor_over_two_chunks_and_windows(pair, tmp_path):
    a, b = pair
    assert ROWS * COLS > BLOCK and CHANGED > BLOCK and CHANGED > ROWS // 2 * COLS
    ck = open_checkpoint(a)
    assert len(ck.tensor("w").chunks) == 2
    ref_a, ref_b = flatten(torch_consolidated(a)), flatten(torch_consolidated(b))
    want = value_change(ref_a["w"], ref_b["w"])  # the one-pair-in-memory numbers
    back = value_change(ref_b["w"], ref_a["w"])
    assert want is not None and want[2] == 1 / (ROWS * COLS)
    pt = tmp_path / "a.pt"
    assert run_cli("export", a, pt).returncode == 0
    for x, y in ((a, b), (b, a), (pt, b)):
        proc = run_cli("diff", "--json", x, y)
        assert proc.returncode == 1, proc.stderr
        report = json.loads(proc.stdout)
        assert report["unchanged"] == 2 and report["unreadable"] == [] and len(report["changed"]) == 1
        c = report["changed"][0]
        assert c["fqn"] == "w" and c["kind"] == "values" and c["frac_changed"] == 1 / (ROWS * COLS)
        assert (c["max_abs_diff"], c["rel_l2"], c["frac_changed"]) == (want if x != b else back)
    same = run_cli("diff", a, pt)
    assert same.returncode == 0 and "0 changed, 3 unchanged" in same.stdout


def test_a_flipped_byte_is_a_crc32_failure_naming_file_and_tensor(pair, tmp_path):
    a, _ = pair
    bad = tmp_path / "bad"
    shutil.copytree(a, bad)
    ck = open_checkpoint(bad)
    entry = ck.tensor("w")
    chunk = next(c for c in entry.chunks if c.offsets[0] > 0)  # rank 1's: read over both windows
    with open_source(bad) as src:
        st = src.reader.locate("w", chunk)
    with open(bad / chunk.file, "r+b") as f:
        f.seek(st.data_offset + 100)
        byte = f.read(1)
        f.seek(st.data_offset + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    with open_source(bad) as src, pytest.raises(CorruptChunkError) as exc:
        src.tensor("w")  # what the one-pair-in-memory read says
    expect = unreadable_reason(exc.value, "w")
    assert chunk.file in expect and "tensor w" in expect and "CRC32" in expect
    proc = run_cli("diff", "--json", bad, a)
    assert proc.returncode == 2
    report = json.loads(proc.stdout)
    assert [(u["fqn"], u["side"], u["detail"]) for u in report["unreadable"]] == [("w", "A", expect)]
    assert report["unchanged"] == 2 and report["changed"] == []
    text = run_cli("diff", a, bad)
    assert text.returncode == 2
    assert "unreadable in B: " + expect in text.stdout
    assert "1 of 3 paired entries could not be read" in text.stderr and "fails its CRC32 check" in text.stderr


def test_streamed_numbers_are_those_of_the_whole_tensors(fixtures):
    a, b = fixtures["steps_r2"] / "step2", fixtures["steps_r2"] / "step3"
    ra, rb = flatten(torch_consolidated(a)), flatten(torch_consolidated(b))
    with open_source(a) as sa, open_source(b) as sb:
        result = diff(sa, sb)
    values = [c for c in result.changed if c.kind == "values" and c.rel_l2 is not None]
    assert values and result.unreadable == []
    for c in values:
        assert (c.max_abs_diff, c.rel_l2, c.frac_changed) == value_change(ra[c.fqn_a], rb[c.fqn_b]), c.fqn


def test_diff_of_a_checkpoint_and_its_reshard_counts_layout_only_changes_apart(fixtures, tmp_path):
    """`diff CKPT its_reshard` printed "60 changed" for chunks moved between ranks, values untouched; the
    Compare view splits them, and so does the CLI."""
    resharded = tmp_path / "r3"
    assert run_cli("reshard", fixtures["fsdp2_r2"], resharded, "--ranks", "3").returncode == 0
    proc = run_cli("diff", fixtures["fsdp2_r2"], resharded)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = proc.stdout.splitlines()[3]
    assert counts.startswith("0 only in A, 0 only in B, 0 changed, ") and " layout only (same values), " in counts
