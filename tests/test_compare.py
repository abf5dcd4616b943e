"""diff, import, reshard and remote (fsspec) checkpoints, on real torch-written checkpoints."""

from __future__ import annotations

import json
import os

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from conftest import run_cli
from make_fixtures import TinyNet
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.compare import diff
from shardscope.backend.export import export, plan_export
from shardscope.backend.formats import open_checkpoint, open_source
from torch_reference import flatten, torch_consolidated


def test_diff_one_step_apart_finds_exactly_the_changed_tensors(fixtures):
    a, b = fixtures["steps_r2"] / "step2", fixtures["steps_r2"] / "step3"
    ra, rb = flatten(torch_consolidated(a)), flatten(torch_consolidated(b))
    truly_changed = {k for k, v in ra.items() if isinstance(v, torch.Tensor) and not torch.equal(v, rb[k])}
    assert "model.head.bias" not in truly_changed and "model.head.weight" in truly_changed  # frozen bias
    proc = run_cli("diff", "--json", a, b)
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    changed = {c["fqn"] for c in report["changed"] if c["kind"] == "values" and c["rel_l2"] is not None}
    assert changed == truly_changed
    assert report["only_a"] == [] and report["only_b"] == []
    for c in report["changed"]:
        if c["fqn"] == "model.emb.weight":
            d = (ra["model.emb.weight"] - rb["model.emb.weight"]).double()
            assert c["max_abs_diff"] == pytest.approx(d.abs().max().item())
            assert c["rel_l2"] == pytest.approx((d.norm() / ra["model.emb.weight"].double().norm()).item())
            assert c["frac_changed"] == pytest.approx((d != 0).double().mean().item())
    # "step" is a non-tensor entry that changed from 2 to 3
    assert any(c["fqn"] == "step" and c["kind"] == "values" for c in report["changed"])


def test_same_model_at_two_and_four_ranks_has_no_value_changes(fixtures):
    proc = run_cli("diff", "--json", fixtures["init_r2"], fixtures["init_r4"])
    assert proc.returncode == 0, proc.stdout
    report = json.loads(proc.stdout)
    assert report["changed"] and {c["kind"] for c in report["changed"]} == {"layout"}
    assert report["only_a"] == report["only_b"] == []


def test_diff_between_dcp_and_consolidated_files(fixtures, tmp_path):
    pt, st = tmp_path / "all.pt", tmp_path / "model.safetensors"
    assert run_cli("export", fixtures["fsdp2_r4"], pt).returncode == 0
    # keep the "model." prefix (the safetensors default strips it) so names match the DCP folder's
    assert run_cli("export", fixtures["fsdp2_r4"], st, "--strip-prefix=").returncode == 0
    assert run_cli("diff", fixtures["fsdp2_r4"], pt).returncode == 0
    with open_source(st) as a, open_source(fixtures["fsdp2_r4"]) as b:
        result = diff(a, b)
    assert not result.changed and result.only_a == []
    assert all(not k.startswith("model.") for k in result.only_b)  # the optimizer is not in model-only output
    assert run_cli("diff", fixtures["fsdp2_r4"], tmp_path / "missing.pt").returncode == 2


def test_import_then_export_round_trips(fixtures, tmp_path):
    original = tmp_path / "orig.pt"
    assert run_cli("export", fixtures["ddp_r2"], original).returncode == 0
    for ranks in (1, 3):
        dst = tmp_path / f"imported{ranks}"
        proc = run_cli("import", original, dst, "--ranks", str(ranks))
        assert proc.returncode == 0, proc.stderr
        assert open_checkpoint(dst).ranks == list(range(ranks))
        back = tmp_path / f"back{ranks}.pt"
        assert run_cli("export", dst, back).returncode == 0
        a, b = flatten(torch.load(original, weights_only=True)), flatten(torch.load(back, weights_only=True))
        assert a.keys() == b.keys()
        for k, v in a.items():
            assert torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k], k
    # safetensors in, prefixed so dcp.load({"model": ...}) finds the keys
    st = tmp_path / "w.safetensors"
    assert run_cli("export", fixtures["ddp_r2"], st, "--strip-prefix", "model.").returncode == 0
    assert run_cli("import", st, tmp_path / "from_st", "--ranks", "2", "--prefix", "model").returncode == 0
    model = TinyNet()
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(tmp_path / "from_st"))
    ref = torch_consolidated(fixtures["ddp_r2"])["model"]
    for k, v in ref.items():
        assert torch.equal(sd["model"][k], v), k


def _load_worker(rank: int, world: int, store: str, path: str, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(123)  # different from the checkpoint's weights
        model = TinyNet()
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=path)  # DCP reshards: the files say 3 ranks, so does this group
        set_model_state_dict(model, state["model"])
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(full, out)
    finally:
        dist.destroy_process_group()


def test_resharded_checkpoint_loads_with_dcp_at_new_world_size(fixtures, tmp_path):
    dst = tmp_path / "r3"
    proc = run_cli("reshard", fixtures["fsdp2_r2"], dst, "--ranks", "3")
    assert proc.returncode == 0, proc.stderr
    ck = open_checkpoint(dst)
    assert ck.ranks == [0, 1, 2] and verify(ck, deep=True) == []
    d = run_cli("diff", "--json", fixtures["fsdp2_r2"], dst)
    assert d.returncode == 0 and {c["kind"] for c in json.loads(d.stdout)["changed"]} <= {"layout"}
    out = tmp_path / "loaded.pt"
    mp.start_processes(_load_worker, args=(3, str(tmp_path / "store"), str(dst), str(out)), nprocs=3,
                       start_method="spawn")
    loaded = torch.load(out, weights_only=True)
    ref = torch_consolidated(fixtures["fsdp2_r2"])["model"]
    assert loaded.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.equal(loaded[k], v), k


def _to_memory(src, name) -> str:
    fs = fsspec.filesystem("memory")
    for f in os.listdir(src):
        fs.pipe(f"/{name}/{f}", (src / f).read_bytes())
    return f"memory://{name}"


def test_memory_filesystem_inspects_and_exports_like_disk(fixtures, tmp_path, monkeypatch):
    url = _to_memory(fixtures["lightning_r2"], "ck-lightning")
    disk = json.loads(run_cli("inspect", "--json", fixtures["lightning_r2"]).stdout)
    mem_ck = open_checkpoint(url)
    from shardscope.app.cli.inspect import inspect_json

    mem = json.loads(json.dumps(inspect_json(mem_ck, verify(mem_ck))))
    for key in ("format", "version", "tensors", "objects", "ranks", "problems"):
        assert mem[key] == disk[key], key
    assert verify(mem_ck, deep=True) == []
    # reading one tensor fetches only from the files that hold it (small files whole: remote_plans.WHOLE_FILE)
    fetched = []
    fs_cls = type(fsspec.filesystem("memory"))
    orig = fs_cls.cat_file

    def counting(self, path, start=None, end=None, **kw):
        data = orig(self, path, start=start, end=end, **kw)
        fetched.append(len(data))
        return data

    monkeypatch.setattr(fs_cls, "cat_file", counting)
    entry = mem_ck.tensor("model.head.bias")
    with ChunkReader(mem_ck) as reader:
        reader.read_tensor(entry)
    holding = sum(f.bytes or 0 for f in mem_ck.files if f.name in {c.file for c in entry.chunks})
    assert 0 < sum(fetched) <= holding < sum(f.bytes or 0 for f in mem_ck.files)
    monkeypatch.undo()
    out_mem, out_disk = tmp_path / "mem.pt", tmp_path / "disk.pt"
    export(plan_export(mem_ck, "torch"), str(out_mem))
    export(plan_export(open_checkpoint(fixtures["lightning_r2"]), "torch"), str(out_disk))
    a, b = flatten(torch.load(out_mem, weights_only=True)), flatten(torch.load(out_disk, weights_only=True))
    assert a.keys() == b.keys() and all(torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k]
                                        for k, v in a.items())


def test_missing_fsspec_backend_is_named():
    proc = run_cli("inspect", "az://some-container/ckpt")  # adlfs is not a dependency (s3fs is)
    assert proc.returncode == 2 and "adlfs" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("inspect", "nosuchproto://x")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
