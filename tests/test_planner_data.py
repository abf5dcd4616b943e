"""``planner_data``, the nested key paths ``dcp_to_torch_save`` rebuilds the state dict from (issue 19, items 3
and 4): a path that cannot be unflattened, or that would make a list of 10**12 entries, is a problem of the
checkpoint (verify exits 1, inspect lists it), a .pt export and reshard refuse it with one line (exit 2) before
anything allocates, and a .safetensors export, which needs no nesting, goes on. Every attacked checkpoint is
torch's own dcp.save output whose ``.metadata`` is loaded with torch and saved again with one change."""

from __future__ import annotations

import pickle
import time
import warnings

import pytest
import torch
from conftest import run_cli, run_cli_peak
from fuzz.mutators import rename_entry
from shardscope.backend.checkpoint.validate import planner_data as check_planner_data
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.errors import ShardscopeError
from shardscope.backend.export.planner import plan_export
from shardscope.backend.formats import open_checkpoint
from torch_reference import flatten, torch_consolidated, torch_metadata

CAPTURABLE = "optimizer.param_groups.0.capturable"
AMSGRAD = "optimizer.param_groups.0.amsgrad"


def patched(folder, change, meta: str = ".metadata", rank: int | None = None):
    """``folder`` with its metadata file ``meta`` loaded by torch, changed by ``change(md)`` and saved again."""
    md = torch_metadata(folder, rank)
    change(md)
    (folder / meta).write_bytes(pickle.dumps(md))
    return folder


def set_path(name: str, path, spell: bool = False):
    """A change: entry ``name`` gets key path ``path`` (renamed to spell it when ``spell``)."""
    def change(md) -> None:
        md.planner_data[name] = path
        if spell:
            rename_entry(md, name, ".".join(map(str, path)))
    return change


def one_line(proc, *words: str) -> None:
    """Exit 2 with a single stderr line that names every one of ``words``, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-1500:], proc.stderr[-1500:])
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("PEAK_KB")]  # run_cli_peak's
    assert len(lines) == 1 and "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def reports(proc, name: str) -> None:
    """verify/inspect output that lists the planner_data problem of entry ``name``."""
    assert "[planner_data]" in proc.stdout and name in proc.stdout and "healthy" not in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


# ---------------------------------------------------------------- issue 19, item 3: a 10**12 list index
def test_a_list_index_of_10_12_is_a_problem_not_healthy(copy_of):
    folder = patched(copy_of("fsdp2_r2"), set_path(CAPTURABLE, ("optimizer", "param_groups", 10**12, "capturable")))
    for args in (("verify",), ("verify", "--deep")):
        proc = run_cli(*args, folder)
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        reports(proc, CAPTURABLE)
    proc = run_cli("inspect", folder)
    assert proc.returncode == 0, proc.stderr
    reports(proc, CAPTURABLE)


@pytest.mark.parametrize("spell", [False, True], ids=["as in the issue", "entry renamed to spell it"])
def test_a_huge_list_index_is_refused_before_anything_allocates(copy_of, tmp_path, spell):
    """10**8 (not 10**12, so that a regression costs a GB, not the machine): before the fix the export built
    a list of 10**8 Nones; now it is refused from the metadata alone."""
    path = ("optimizer", "param_groups", 10**8, "capturable")
    folder = patched(copy_of("fsdp2_r2"), set_path(CAPTURABLE, path, spell))
    proc, mb = run_cli_peak("export", folder, tmp_path / "out.pt")
    one_line(proc, str(folder / ".metadata"), ".".join(map(str, path)) if spell else CAPTURABLE, "planner_data")
    assert mb < 400, mb
    assert not (tmp_path / "out.pt").exists()


def test_safetensors_export_goes_on_without_the_nesting(copy_of, tmp_path):
    """The flat names are the entries' own: a .safetensors export of the model or of the optimizer works."""
    folder = patched(copy_of("fsdp2_r2"), set_path(CAPTURABLE, ("optimizer", "param_groups", 10**12, "capturable")))
    for args in ((), ("--only", "optimizer")):
        proc = run_cli("export", folder, tmp_path / "out.safetensors", *args, "--force")
        assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- issue 19, item 4: a path that is a prefix
@pytest.mark.parametrize("spell", [False, True], ids=["as in the issue", "entry renamed to spell it"])
def test_a_path_that_is_a_prefix_of_others_is_refused(copy_of, tmp_path, spell):
    folder = patched(copy_of("fsdp2_r2"), set_path(AMSGRAD, ("optimizer", "param_groups", 0), spell))
    name = "optimizer.param_groups.0" if spell else AMSGRAD
    for args in (("verify",), ("verify", "--deep")):
        proc = run_cli(*args, folder)
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        reports(proc, name)
    one_line(run_cli("export", folder, tmp_path / "out.pt"), str(folder / ".metadata"), name)
    assert not (tmp_path / "out.pt").exists()


def test_reshard_refuses_what_it_would_copy_or_lose(copy_of, tmp_path):
    folder = patched(copy_of("fsdp2_r2"), set_path(AMSGRAD, ("optimizer", "param_groups", 0), spell=True))
    one_line(run_cli("reshard", folder, tmp_path / "r1", "--ranks", "1"), str(folder / ".metadata"),
             "optimizer.param_groups.0")
    assert not (tmp_path / "r1").exists()


def test_the_problem_survives_the_metadata_cache(copy_of, tmp_path):
    """The second open reads the cache, which holds the problem, not the paths."""
    folder = patched(copy_of("fsdp2_r2"), set_path(AMSGRAD, ("optimizer", "param_groups", 0), spell=True))
    for _ in range(2):
        proc = run_cli("verify", folder)
        assert proc.returncode == 1, proc.stdout
        reports(proc, "optimizer.param_groups.0")
    one_line(run_cli("export", folder, tmp_path / "out.pt"), "optimizer.param_groups.0")


def test_per_rank_metadata_files_are_checked_together(copy_of):
    """use_collectives=False: each rank's ``__R.metadata`` has its own planner_data, merged; one rank's bad path,
    or a planner_data that is no mapping at all, is a problem of the checkpoint (it was exit 2 or healthy)."""
    folder = copy_of("fsdp_nocoll_r2")
    md = torch_metadata(folder, 1)
    name = next(k for k, v in md.planner_data.items() if len(v) > 2 and k.startswith("optimizer.param_groups"))
    patched(folder, set_path(name, (*md.planner_data[name][:2], 10**12, *md.planner_data[name][3:]), spell=True),
            "__1.metadata", 1)
    proc = run_cli("verify", folder)
    assert proc.returncode == 1, proc.stdout
    assert "[planner_data]" in proc.stdout and "1000000000000" in proc.stdout, proc.stdout

    def not_a_mapping(md) -> None:
        md.planner_data = ["per-rank-data"]
    patched(folder, not_a_mapping, "__1.metadata", 1)
    proc = run_cli("verify", folder)
    assert proc.returncode == 1 and "planner_data is list" in proc.stdout, (proc.stdout, proc.stderr)


# ---------------------------------------------------------------- every variant, in one place
def _spelled(name: str, path: tuple):
    return set_path(name, path, spell=True)


def _planner(value):
    def change(md) -> None:
        md.planner_data = value
    return change


LR = "optimizer.param_groups.0.lr"
VARIANTS = {
    "negative index": (_spelled(LR, ("optimizer", "param_groups", -1, "lr")), "optimizer.param_groups.-1.lr"),
    "bool index": (_spelled(LR, ("optimizer", "param_groups", True, "lr")), "optimizer.param_groups.True.lr"),
    "index past 2**62": (_spelled(LR, ("optimizer", "param_groups", 2**70, "lr")), str(2**70)),
    "index past what the paths fill": (_spelled(LR, ("optimizer", "param_groups", 10**6, "lr")), "1000000"),
    "float key": (_spelled(LR, ("optimizer", "param_groups", 1.5, "lr")), "optimizer.param_groups.1.5.lr"),
    "None key": (set_path(LR, ("optimizer", "param_groups", None, "lr")), LR),
    "bytes key": (set_path(LR, ("optimizer", b"param_groups", 0, "lr")), LR),
    "empty path": (set_path(LR, ()), LR),
    "a string, not a path": (set_path(LR, LR), LR),
    "first key disagrees with the name": (set_path(LR, ("model", "param_groups", 0, "lr")), LR),
    "two names, one path": (set_path("optimizer.param_groups.0.eps", ("optimizer", "param_groups", 0, "lr")),
                            "optimizer.param_groups.0.eps"),
    "list index at the top level": (_spelled("step", (0,)), "'0'"),
    "prefix of other paths": (_spelled(AMSGRAD, ("optimizer", "param_groups", 0)), "optimizer.param_groups.0"),
    "below another entry's value": (_spelled("step", ("model", "emb.weight", "x")), "model.emb.weight"),
    "dict key where a list index is": (set_path(LR, ("optimizer", "param_groups", "0", "lr")), LR),
    "list index where a dict key is": (_spelled("step", ("optimizer", "state", 0)), "optimizer.state.0"),
    "deeper than 256": (_spelled("step", ("extra", *["d"] * 300)), "extra.d.d"),
    "not a mapping": (_planner(["per-rank-data"]), "planner_data is list"),
    "not a mapping (a string)": (_planner("per-rank-data"), "planner_data is 'per-rank-data'"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_is_one_problem_and_refuses_only_the_nested_export(copy_of, variant):
    change, named = VARIANTS[variant]
    folder = patched(copy_of("fsdp2_r2"), change)
    ckpt = open_checkpoint(folder, use_cache=False)
    found = [p for p in verify(ckpt) if p.kind == "planner_data"]
    assert len(found) == 1 and named in found[0].message and found[0].file == ".metadata", found
    assert ckpt.planner_data == {}
    with pytest.raises(ShardscopeError) as err:
        plan_export(ckpt, "torch")
    assert str(err.value).startswith(str(folder / ".metadata")) and named in str(err.value), str(err.value)
    assert plan_export(ckpt, "safetensors", only=["optimizer"]).items


# ---------------------------------------------------------------- what real checkpoints hold stays valid
def _saved(folder, state) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... a single process"
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def test_real_nesting_shapes_stay_healthy_and_export_as_torch_does(tmp_path):
    """Nested lists, int dict keys (flattened to strings), keys with dots, an optimizer's param_groups: healthy,
    and the .pt equals what ``dcp_to_torch_save`` gives."""
    t = torch.arange(6.0).reshape(2, 3)
    _saved(tmp_path / "ck", {"model": {"blocks.0.w": t, "head": {"b": t[0]}}, "lists": [[t, t + 1], [t + 2]],
                             "opt": {"state": {0: {"m": t + 4}}, "param_groups": [
                                 {"lr": 0.1, "params": [0]}, {"lr": 0.2, "params": [1]}]},
                             "rng": [t[0], t[1]], "step": 7})
    proc = run_cli("verify", tmp_path / "ck")
    assert proc.returncode == 0 and "healthy" in proc.stdout, proc.stdout
    proc = run_cli("export", tmp_path / "ck", tmp_path / "out.pt")
    assert proc.returncode == 0, proc.stderr
    got, ref = flatten(torch.load(tmp_path / "out.pt", weights_only=True)), flatten(torch_consolidated(tmp_path / "ck"))
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert (torch.equal(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k]), k


def test_a_list_with_an_empty_dict_before_a_tensor_is_healthy(tmp_path):
    """torch's flatten leaves an empty dict's index out (``groups.1.w`` with no ``groups.0``): a gap that dcp.save
    writes and dcp.load reads, so it is healthy; the .pt holds None there, as torch's ``set_element`` pads (torch's
    own dcp_to_torch_save stops at it: "Missing key in checkpoint state_dict: groups.0")."""
    t = torch.ones(3)
    _saved(tmp_path / "ck", {"groups": [{}, {"w": t}]})
    assert torch_metadata(tmp_path / "ck").planner_data == {"groups.1.w": ("groups", 1, "w")}
    proc = run_cli("verify", tmp_path / "ck")
    assert proc.returncode == 0 and "healthy" in proc.stdout, proc.stdout
    proc = run_cli("export", tmp_path / "ck", tmp_path / "out.pt")
    assert proc.returncode == 0, proc.stderr
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert got["groups"][0] is None and torch.equal(got["groups"][1]["w"], t)


def test_many_entries_are_checked_in_linear_time():
    """200,000 entries (a long list of dicts, a wide dict) in a few seconds; a quadratic check would not end."""
    names, value = [], {}
    for i in range(100_000):
        for name, path in ((f"opt.param_groups.{i}.lr", ("opt", "param_groups", i, "lr")),
                           (f"model.layer{i}.weight", ("model", f"layer{i}.weight"))):
            names.append(name)
            value[name] = path
    t0 = time.monotonic()
    paths, problem = check_planner_data(value, names, "/x/.metadata")
    assert problem is None and len(paths) == len(names)
    assert time.monotonic() - t0 < 30
    big = "opt.param_groups.1000000000000.lr"
    value[big] = ("opt", "param_groups", 10**12, "lr")
    _, problem = check_planner_data(value, [*names, big], "/x/.metadata")
    assert problem is not None and problem.fqn == big and "list index 1000000000000" in problem.message
