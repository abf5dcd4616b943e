"""Huge but legal single files: ``shardscope import`` of a safetensors file with many entries and of a ``.pt``
with many tiny tensors (not timed here: benchmarks/huge_files.py times 300,000 and 100,000 of them; the sizes here
keep the suite short and still cross the limits that mattered: the ``.pt``'s zip directory is over 1 MiB).
Every value round-trips: all of them read back from the written DCP items, and a sample through ``dcp.load``."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_cli
from safetensors.torch import load_file, save_file
from shardscope.backend.checkpoint.sources import CheckpointSource
from shardscope.backend.formats import open_checkpoint

pytestmark = pytest.mark.slow  # two imports of tens of thousands of entries
N_SAFETENSORS = 40_000
N_PT = 25_000


def _every_value(out, expected: dict[str, torch.Tensor]) -> None:
    """Every tensor of the written DCP checkpoint, read back from its items, equals the input's bytes."""
    ckpt = open_checkpoint(str(out), use_cache=False)
    assert sorted(t.fqn for t in ckpt.tensors) == sorted(expected)
    with CheckpointSource(ckpt) as source:
        for e, data in source.small_values([ckpt.tensor(k) for k in expected], 1 << 20):
            got = data.tobytes() if data is not None else _bytes(source.tensor(e.fqn))
            assert got == _bytes(expected[e.fqn]), e.fqn


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _sample_with_dcp_load(out, expected: dict[str, torch.Tensor], keys: list[str]) -> None:
    """torch's own loader reads the sampled keys back equal (the planner loads only what it is given)."""
    sd = {k: torch.empty_like(expected[k]) for k in keys}
    dcp.load(sd, checkpoint_id=str(out))
    bad = [k for k in keys if not torch.equal(sd[k], expected[k])]
    assert not bad, bad[:5]


def test_import_of_a_safetensors_file_with_40000_entries_round_trips(tmp_path):
    src = tmp_path / "many.safetensors"
    n = N_SAFETENSORS
    values = torch.arange(n * 2, dtype=torch.float32).reshape(n, 2)
    save_file({f"layer.{i}.w": values[i].clone() for i in range(n)}, str(src))
    out = tmp_path / "out"
    proc = run_cli("import", src, out, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert f"{N_SAFETENSORS:,} tensors" in proc.stdout and "verified" in proc.stdout
    expected = load_file(str(src))
    _every_value(out, expected)
    keys = sorted(expected)
    _sample_with_dcp_load(out, expected, [keys[0], keys[-1], *random.Random(0).sample(keys, 2000)])


def test_import_of_a_pt_with_25000_tensors_round_trips(tmp_path):
    src = tmp_path / "many.pt"
    g = torch.Generator().manual_seed(0)
    state: dict = {"model": {}, "step": 7}
    for i in range(N_PT):  # several dtypes and shapes: one template each, a scalar, a nested key path
        kind = i % 5
        t = (torch.randn(3, 2, generator=g) if kind == 0 else torch.randint(0, 1000, (4,), generator=g)
             if kind == 1 else torch.randn(2, generator=g).to(torch.bfloat16) if kind == 2 else
             torch.tensor(float(i)) if kind == 3 else torch.randn(1, 5, generator=g))
        state["model"][f"t{i}"] = t
    torch.save(state, str(src))
    out = tmp_path / "out"
    proc = run_cli("import", src, out, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert f"{N_PT:,} tensors" in proc.stdout and "verified" in proc.stdout
    loaded = torch.load(str(src), weights_only=True)
    expected = {f"model.t{i}": t for i, t in enumerate(loaded["model"].values())}
    _every_value(out, expected)
    keys = sorted(expected)
    sample = [*keys[:10], *random.Random(1).sample(keys, 2000)]
    sd = {"model": {k.removeprefix("model."): torch.empty_like(expected[k]) for k in sample}}
    dcp.load(sd, checkpoint_id=str(out))
    bad = [k for k in sample if not torch.equal(sd["model"][k.removeprefix("model.")], expected[k])]
    assert not bad, bad[:5]


def test_items_waiting_to_be_written_stay_under_one_run_at_any_number_of_ranks(tmp_path):
    """Small tensors are split over every rank and each rank's items gathered before they are written: what
    waits, over all the files together, stays about one run (8 MiB) whatever --ranks says."""
    from shardscope.backend.export import dcp_writer

    files = dcp_writer._DataFiles(str(tmp_path), [f"__{r}_0.distcp" for r in range(256)])
    most = 0
    try:
        for i in range(256 * 60):
            files.add(i % 256, bytes(1500), f"t{i}")
            most = max(most, files.held)
    finally:
        files.close(sync=True)
    assert most < dcp_writer.RUN_BYTES + 1500
    assert sum((tmp_path / f"__{r}_0.distcp").stat().st_size for r in range(256)) == 256 * 60 * 1500
    assert sum(e.length for e in files.runs) == 256 * 60 * 1500
