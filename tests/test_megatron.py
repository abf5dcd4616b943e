"""Megatron-Core ``torch_dist`` checkpoints (backend/formats/megatron.py) through the real CLI, on a save dir that
Megatron-Core 0.16.1's own ``dist_checkpointing.save`` wrote (tests/make_megatron_fixtures.py: tensor parallel 2
over 2 gloo ranks, three iterations): the tensors and their tensor-parallel chunks, ``common.pt`` as values read
without running anything from it, an export equal to what torch's own DCP loader assembles, ``ls`` and a prune
that never removes the iteration ``latest_checkpointed_iteration.txt`` names; a hostile ``common.pt`` is a problem
of the checkpoint (its tensors still read), another sharded backend one line and exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from make_megatron_fixtures import ITERATIONS, OPTIMIZER_STATES, TENSORS, full_tensor, stored_key

pytestmark = pytest.mark.slow

ITER = "iter_0000100"
FC1 = "decoder.layers.mlp.linear_fc1.weight"


@pytest.fixture
def run_copy(megatron_run, tmp_path) -> Path:
    """A writable copy of the save dir, for tests that change it."""
    dst = tmp_path / "run"
    shutil.copytree(megatron_run, dst)
    return dst


def _aged(folder: Path) -> Path:
    """Every file under ``folder`` an hour old: a listing takes files changed seconds ago as a save in progress."""
    then = os.path.getmtime(folder) - 3600
    for p in [folder, *folder.rglob("*")]:
        os.utime(p, (then, then))
    return folder


def _json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _model_key(name: str) -> str:
    """The model tensor a stored name is (or holds an optimizer state of)."""
    return next(k for k in TENSORS if name.endswith(k))


def test_inspect_and_show_list_the_tensors_and_their_tensor_parallel_chunks(megatron_run):
    ckpt = megatron_run / ITER
    info = _json(run_cli("inspect", ckpt, "--json", "--tensors"))
    assert info["format"] == "megatron" and info["kind"] == "resumable", info
    names = {t["fqn"] for t in info["tensors"]}
    assert names == {stored_key(k, s) for k in TENSORS for s in ("", *OPTIMIZER_STATES)}
    shown = _json(run_cli("show", ckpt, FC1, "--json"))["tensor"]
    chunks = sorted((tuple(c["offsets"]), tuple(c["sizes"]), c["rank"]) for c in shown["chunks"])
    # two layers stacked on a prepended axis, each split in two on its output dimension by the two TP ranks
    assert chunks == [((0, 0, 0), (1, 8, 8), 0), ((0, 8, 0), (1, 8, 8), 1), ((1, 0, 0), (1, 8, 8), 0),
                      ((1, 8, 0), (1, 8, 8), 1)], chunks
    fc2 = _json(run_cli("show", ckpt, "decoder.layers.mlp.linear_fc2.weight", "--no-values", "--json"))["tensor"]
    assert sorted(tuple(c["offsets"]) for c in fc2["chunks"]) == [(0, 0, 0), (0, 0, 8), (1, 0, 0), (1, 0, 8)]
    proc = run_cli("verify", "--deep", ckpt)
    assert proc.returncode == 0 and "healthy" in proc.stdout, proc.stdout + proc.stderr


def test_common_pt_entries_show_as_values(megatron_run):
    """``common.pt`` (args as an argparse.Namespace holding Megatron's enums, a torch dtype and a signal) and
    ``metadata.json`` are non-tensor entries with their values; the RNG states Megatron shards per rank read too."""
    ckpt = megatron_run / ITER
    proc = run_cli("show", ckpt, "common.args")
    assert proc.returncode == 0, proc.stderr
    for text in ("'tensor_model_parallel_size': 2", "'lr': 0.0003", "'params_dtype': 'torch.float32'",
                 "megatron.core.enums.ModelType", "'exit_signal': {'__class__': 'signal.Signals', 'value': 15}",
                 "'data_path': ['/data/tiny_text_document']"):
        assert text in proc.stdout, (text, proc.stdout)
    for fqn, value in (("common.iteration", "100"), ("common.checkpoint_version", "3.0"),
                       ("common.optimizer.param_groups.0.betas", "[0.9, 0.95]"),
                       ("config.sharded_backend", "'torch_dist'")):
        proc = run_cli("show", ckpt, fqn)
        assert proc.returncode == 0 and f"value  {value}" in proc.stdout, (fqn, proc.stdout, proc.stderr)
    proc = run_cli("show", ckpt, "rng_state/shard_0.1_1.2")
    assert proc.returncode == 0 and "value  [[{'random_rng_state': (3, (" in proc.stdout, proc.stdout + proc.stderr


def test_export_equals_the_tensors_torch_dcp_assembles(megatron_run, tmp_path):
    """The safetensors export holds the model's full tensors, equal to what torch's own DCP loader assembles from
    the shards and to what the ranks were cut from; the optimizer state is left out, and a .pt export has it."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    ckpt = megatron_run / ITER
    out = tmp_path / "model.safetensors"
    proc = run_cli("export", ckpt, out)
    assert proc.returncode == 0 and "verified" in proc.stdout, proc.stdout + proc.stderr
    exported = load_file(out)
    names = {stored_key(k, s) for k in TENSORS for s in ("", *OPTIMIZER_STATES)}
    # torch's loader into the full tensors (its _load_state_dict_from_keys needs the planner_data Megatron's save
    # leaves None); a trusted folder: torch unpickles its .metadata
    reference = {n: torch.empty(TENSORS[_model_key(n)][0]) for n in names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        dcp.load(reference, checkpoint_id=str(ckpt))
    assert set(exported) == set(TENSORS)
    for key, value in exported.items():
        assert torch.equal(value, reference[key]) and torch.equal(value, full_tensor(key, 100)), key
    proc = run_cli("export", ckpt, tmp_path / "all.pt")
    assert proc.returncode == 0, proc.stderr
    everything = torch.load(tmp_path / "all.pt", weights_only=False)  # ours, just written
    state = stored_key(FC1, "exp_avg_sq")
    assert torch.equal(everything[state], reference[state]) and everything["common.iteration"] == 100


def test_reshard_keeps_every_entry_and_diff_compares_them(megatron_run, tmp_path):
    """A reshard to 3 ranks equals the save entry by entry, the numpy RNG states of Megatron's rng_state entries
    and the common.* values included; two iterations differ in values."""
    ckpt = megatron_run / ITER
    proc = run_cli("reshard", ckpt, tmp_path / "r3", "--ranks", "3")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("diff", ckpt, tmp_path / "r3")
    assert proc.returncode == 0 and "only the layout differs" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli("diff", ckpt, megatron_run / "iter_0000200")
    assert proc.returncode == 1 and "common.iteration" in proc.stdout, proc.stdout + proc.stderr


def test_ls_lists_each_iteration_and_the_save_dir_is_the_run(megatron_run):
    listing = _json(run_cli("ls", megatron_run, "--json"))
    cks = sorted(listing["checkpoints"], key=lambda c: c["step"])
    assert [(Path(c["path"]).name, c["step"], c["format"], c["ranks"], c["state"], c["kind"]) for c in cks] == [
        (f"iter_{i:07d}", i, "megatron", [0, 1], "complete", "resumable") for i in ITERATIONS], cks
    assert {c["run"] for c in cks} == {str(megatron_run)}
    assert [bool(c["pinned"]) for c in cks] == [False, False, True]  # the tracker file names 300
    proc = run_cli("ls", megatron_run)
    assert proc.returncode == 0 and "megatron" in proc.stdout and "iter_0000100" in proc.stdout, proc.stdout


def test_prune_never_removes_the_iteration_the_tracker_names(run_copy):
    """A resume loads the iteration ``latest_checkpointed_iteration.txt`` names (here an older one, as after
    rolling a run back): the plan keeps it and says why, whatever the rules; the others go by the rules."""
    (run_copy / "latest_checkpointed_iteration.txt").write_text("100")
    plan = _json(run_cli("prune", run_copy, "--keep-last", "1", "--json"))
    actions = {Path(c["path"]).name: (c["action"], "; ".join(c["reasons"])) for c in plan["checkpoints"]}
    assert actions["iter_0000100"][0] == "keep" and "latest_checkpointed_iteration.txt" in actions["iter_0000100"][1]
    assert actions["iter_0000200"][0] == "remove" and actions["iter_0000300"][0] == "keep", actions
    proc = run_cli("prune", run_copy, "--keep-last", "1")
    line = next(ln for ln in proc.stdout.splitlines() if "iter_0000100" in ln)
    assert line.strip().startswith("KEEP") and "pinned: latest_checkpointed_iteration.txt names it" in line, line
    proc = run_cli("prune", run_copy, "--keep-last", "1", "--keep-every", "1000", "--yes", "--delete")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in run_copy.glob("iter_*")) == ["iter_0000100", "iter_0000300"]


def test_a_hostile_common_pt_is_a_problem_and_nothing_runs(run_copy, tmp_path):
    """A ``common.pt`` whose pickle calls ``os.system``: refused by name, nothing runs, the checkpoint reports it
    (verify exits 1) and its tensors still read."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    ckpt = run_copy / ITER
    torch.save({"args": Evil(), "iteration": 100}, ckpt / "common.pt")
    proc = run_cli("verify", ckpt)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    problem = next(ln for ln in proc.stdout.splitlines() if "common.pt" in ln)
    assert "[unreadable]" in problem and "system" in problem and "Nothing from it was run" in problem, problem
    proc = run_cli("show", ckpt, FC1)
    assert proc.returncode == 0 and "tile the tensor exactly" in proc.stdout, proc.stderr
    proc = run_cli("show", ckpt, "common.iteration")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not marker.exists()
    (ckpt / "common.pt").write_bytes(b"\x80\x02}q\x00.")  # a bare pickle: not a torch.save archive
    proc = run_cli("verify", ckpt)
    assert proc.returncode == 1 and "not a zip archive" in proc.stdout, proc.stdout


def test_a_legacy_style_common_pt_with_rng_states_reads(run_copy):
    """What older Megatron releases keep in ``common.pt`` besides args: the RNG states as a list (random's tuple,
    numpy's state array, torch's ByteTensor), paths and namespaces: inert values, described."""
    import argparse
    import pathlib
    import random
    import types

    import numpy as np

    ckpt = run_copy / ITER
    torch.save({"args": argparse.Namespace(save=pathlib.PosixPath("/runs/a"), tokenizer=types.SimpleNamespace(n=3)),
                "iteration": 100, "rng_state": [{"random_rng_state": random.getstate(),
                                                 "np_rng_state": np.random.RandomState(1).get_state(),
                                                 "torch_rng_state": torch.get_rng_state()}]}, ckpt / "common.pt")
    proc = run_cli("show", ckpt, "common.rng_state.0.np_rng_state")
    assert proc.returncode == 0 and """['MT19937', "<numpy array numpy.dtype('u4') [624]>", 624""" in proc.stdout, \
        proc.stdout
    proc = run_cli("show", ckpt, "common.rng_state.0.torch_rng_state")
    assert proc.returncode == 0 and "<tensor uint8 [5056]>" in proc.stdout, proc.stdout
    proc = run_cli("show", ckpt, "common.args")
    assert "'save': '/runs/a'" in proc.stdout and "'types.SimpleNamespace', 'n': 3" in proc.stdout, proc.stdout


def test_another_sharded_backend_is_listed_and_refused_in_one_line(run_copy):
    """A zarr save (metadata.json names it; the tensors are zarr arrays, no DCP files): ``ls`` lists it by its
    backend, the commands refuse it in one line, exit 2."""
    ckpt = run_copy / ITER
    for p in ckpt.iterdir():
        if p.name not in ("common.pt", "metadata.json"):
            p.unlink()
    (ckpt / FC1).mkdir()
    (ckpt / FC1 / ".zarray").write_text("{}")
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    for args in (("inspect", ckpt), ("verify", ckpt), ("export", ckpt, run_copy / "x.safetensors")):
        proc = run_cli(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "'zarr'" in proc.stderr and "torch_dist" in proc.stderr
    listing = _json(run_cli("ls", _aged(run_copy), "--json"))
    rec = next(c for c in listing["checkpoints"] if c["path"].endswith(ITER))
    assert (rec["format"], rec["state"], rec["step"]) == ("megatron-zarr", "complete", 100), rec


def test_missing_or_damaged_common_pt_or_metadata_json(run_copy):
    """metadata.json is written last: without it the save did not finish; without common.pt there is nothing to
    resume with; a metadata.json that is not Megatron's config is unreadable. Each is named by health (the tensors
    still read) and by ls."""
    (run_copy / "iter_0000100" / "metadata.json").unlink()
    (run_copy / "iter_0000200" / "common.pt").unlink()
    (run_copy / "iter_0000300" / "metadata.json").write_text('{"backend": "torch_dist"}')
    for name, problem in (("iter_0000100", "[missing_file] metadata.json is missing"),
                          ("iter_0000200", "[missing_file] common.pt is missing"),
                          ("iter_0000300", "[unreadable] metadata.json: does not name a sharded_backend")):
        proc = run_cli("verify", run_copy / name)
        assert proc.returncode == 1 and problem in proc.stdout, proc.stdout
    states = {Path(c["path"]).name: (c["state"], c["format"]) for c in
              _json(run_cli("ls", _aged(run_copy), "--json"))["checkpoints"]}
    assert states == {"iter_0000100": ("incomplete", "megatron"), "iter_0000200": ("incomplete", "megatron"),
                      "iter_0000300": ("unreadable", "megatron")}, states


def test_detect_and_probe_read_names_and_small_files_only(megatron_run):
    """`ls` decides with names and a few bytes: detecting and probing a Megatron folder imports no numpy or torch;
    the legacy layout (iter_N/mp_rank_NN/ torch files) is not this format."""
    code = (
        "import sys, os\n"
        "from shardscope.backend.formats import detect_folder\n"
        f"d = {str(megatron_run / ITER)!r}\n"
        "names = set(os.listdir(d))\n"
        "f = detect_folder('iter_0000100', names, [])\n"
        "facts = f.probe_folder(d, names, [])\n"
        "print(f.name, facts.state, facts.kind, facts.step, facts.ranks, repr(facts.pinned))\n"
        "assert detect_folder('iter_0000100', set(), ['mp_rank_00', 'mp_rank_01']) is None\n"
        "assert 'numpy' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["megatron", "complete", "resumable", "100", "[0,", "1]", "''"]


def test_the_legacy_layout_is_still_one_megatron_checkpoint(tmp_path):
    """Megatron-LM's legacy torch format (iter_N/mp_rank_NN/model_optim_rng.pt) stays one composite checkpoint."""
    run = tmp_path / "legacy"
    for tp in (0, 1):
        part = run / "iter_0000100" / f"mp_rank_{tp:02d}"
        part.mkdir(parents=True)
        torch.save({"model": {"w": torch.ones(2)}, "optimizer": {"param_groups": []}, "iteration": 100},
                   part / "model_optim_rng.pt")
    (run / "latest_checkpointed_iteration.txt").write_text("100")
    cks = _json(run_cli("ls", run, "--json"))["checkpoints"]
    assert [(Path(c["path"]).name, c["format"], c["ranks"], c["step"]) for c in cks] == [
        ("iter_0000100", "megatron", [0, 1], 100)], cks
