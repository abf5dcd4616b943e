"""The DeepSpeed ZeRO parser (backend/checkpoint/deepspeed_state.py and its layout, model and read modules) on
saves written by DeepSpeed itself (the ``deepspeed_checkpoints`` session fixture): every tensor assembled from its
pieces equals DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint`` bit for bit, every Adam state equals
DeepSpeed's reconstruction run over that state; hostile and damaged files are refused or reported, and nothing
from them runs; the parser never imports deepspeed."""

from __future__ import annotations

import json
import pickle
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from deepspeed_damage import edit_model_states, evil_pickle, flip_tensor_byte, with_evil_pickle
from make_deepspeed_fixtures import TAG, VARIANTS
from shardscope.backend.checkpoint.deepspeed_read import check_record, read_tensor, verify_records
from shardscope.backend.checkpoint.deepspeed_state import read_deepspeed_state, step_folder
from shardscope.backend.errors import CheckpointError, RefusedPickleError
from shardscope.backend.filenames import is_deepspeed_save_dir, is_deepspeed_step_folder
from shardscope.backend.filenames import parse_ds_latest as parse_latest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def references(deepspeed_checkpoints) -> dict[str, dict]:
    return {n: torch.load(p / "reference.pt", weights_only=True) for n, p in deepspeed_checkpoints.items()}


@pytest.fixture
def save_copy(deepspeed_checkpoints, tmp_path):
    """A writable copy of a variant's save folder (its ``ckpt``), for tests that damage it."""

    def make(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(deepspeed_checkpoints[name] / "ckpt", dst)
        return dst

    return make


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("name", VARIANTS)
def test_every_tensor_equals_deepspeeds_own_consolidation(deepspeed_checkpoints, references, name):
    stage, dtype, world = VARIANTS[name]
    state = read_deepspeed_state(str(deepspeed_checkpoints[name] / "ckpt"))
    ref = references[name]["fp32"]
    assert (state.stage, state.dp_world_size, state.tag, state.global_steps) == (stage, world, TAG, 2)
    assert state.model_dtype == {"fp32": "float32", "bf16": "bfloat16"}[dtype] and state.master_dtype == "float32"
    assert state.problems == [] and state.optimizer_states == ("exp_avg", "exp_avg_sq")
    assert state.ds_version == version("deepspeed") and state.ds_config["zero_optimization"]["stage"] == stage
    assert state.shared == {"head.weight": "emb.weight"}
    assert [r.rank for r in state.ranks] == list(range(world)) and all(r.optim_file for r in state.ranks)
    # ZeRO-1 saves no frozen fragments (DeepSpeed's consolidation drops those parameters): the module has them
    assert state.names() == (list(ref) if stage > 1 else [*list(ref)[:2], "frozen.weight", "frozen.bias",
                                                           *list(ref)[2:]])
    for key in state.names():
        value = read_tensor(state, key, check_crc=True)
        if key in ref:
            assert _same(value, ref[key]), key
        else:  # ZeRO-1's frozen parameters: the model file's module holds them whole
            module = references[name]["module"]["mp_rank_00_model_states.pt"]
            assert _same(value, module[key]), key
    kinds = {k: state.tensor(k).kind for k in state.names()}
    assert kinds["scale"] == kinds["seen"] == "buffer" and kinds["frozen.bias"] == "frozen"
    assert kinds["emb.weight"] == kinds["head.weight"] == "trainable"
    assert state.tensor("frozen.weight").dtype == {"fp32": "float32", "bf16": "bfloat16"}[dtype]


@pytest.mark.parametrize("name", VARIANTS)
def test_adam_states_equal_deepspeeds_reconstruction_of_them(deepspeed_checkpoints, references, name):
    state = read_deepspeed_state(str(deepspeed_checkpoints[name] / "ckpt" / TAG))
    for key in state.names():
        if state.tensor(key).kind != "trainable":
            assert state.tensor(key).optimizer == {}
            continue
        for which in ("exp_avg", "exp_avg_sq"):
            assert _same(read_tensor(state, key, which), references[name][which][key]), (key, which)


@pytest.mark.parametrize("name", ["z2-fp32-3r", "z3-bf16-3r"])
def test_pieces_are_flat_ranges_of_the_rank_files(deepspeed_checkpoints, name):
    """A ZeRO-2 parameter is a range of the flat vector (straddling ranks); a ZeRO-3 one is cut across all ranks."""
    state = read_deepspeed_state(str(deepspeed_checkpoints[name] / "ckpt"))
    emb = state.tensor("emb.weight")
    assert sum(p.numel for p in emb.pieces) == 91 and emb.complete
    if name.startswith("z3"):
        assert [(p.rank, p.start, p.numel) for p in emb.pieces] == [(0, 0, 31), (1, 31, 31), (2, 62, 29)]
        assert all(p.file == f"zero_pp_rank_{p.rank}_mp_rank_00_optim_states.pt".replace("zero", "bf16_zero", 1)
                   for p in emb.pieces)
    else:  # group 0 (the weights): 147 elements aligned to 2 * 3, partitions of 50; emb.weight straddles ranks 0-1
        assert [(p.rank, p.start, p.numel) for p in emb.pieces] == [(0, 0, 50), (1, 50, 41)]
        # group 1 (biases and norms, no weight decay): 22 elements in partitions of 8
        assert [(p.rank, p.start, p.numel) for p in state.tensor("up.bias").pieces] == [(1, 0, 1), (2, 1, 6)]
        assert state.tensor("up.bias").group == 1 and emb.group == 0
    for p in emb.pieces:
        rec = state.records[p.file][p.key]
        assert rec.offset <= p.byte_offset and p.byte_offset + 4 * p.numel <= rec.offset + rec.nbytes


def test_save_folder_tag_folder_and_names(deepspeed_checkpoints, tmp_path):
    save = deepspeed_checkpoints["z3-fp32-2r"] / "ckpt"
    assert step_folder(str(save)) == (str(save / TAG), TAG)
    assert step_folder(str(save / TAG)) == (str(save / TAG), TAG)
    names = [p.name for p in (save / TAG).iterdir()]
    assert is_deepspeed_step_folder(names) and not is_deepspeed_step_folder(["latest", "x.pt"])
    assert is_deepspeed_save_dir([p.name for p in save.iterdir() if p.is_file()], [TAG])
    assert not is_deepspeed_save_dir(["model.pt"], ["global_step2"])
    assert parse_latest(b"global_step2\n") == "global_step2"
    for bad in (b"../../etc", b"a/b", b"..", b"", b"x\x00y", b"\xff", b"a\\b", b"x" * 300):
        assert parse_latest(bad) is None, bad
    bad = tmp_path / "save"
    shutil.copytree(save, bad)
    (bad / "latest").write_text("../../../etc")
    with pytest.raises(CheckpointError, match="does not name a tag folder"):
        read_deepspeed_state(str(bad))
    (bad / "latest").write_text("global_step9")
    with pytest.raises(CheckpointError, match="not a folder of this save folder"):
        read_deepspeed_state(str(bad))
    assert read_deepspeed_state(str(bad), tag=TAG).stage == 3


def test_the_parser_imports_no_deepspeed(deepspeed_checkpoints):
    """Parsing and reading every tensor in a fresh process: deepspeed is never imported, and parsing alone imports
    no torch; the name rules import neither numpy nor torch."""
    save = deepspeed_checkpoints["z3-bf16-3r"] / "ckpt"
    script = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("names", {str(REPO / 'backend' / 'filenames.py')!r})
names = importlib.util.module_from_spec(spec); spec.loader.exec_module(names)
assert "numpy" not in sys.modules and "torch" not in sys.modules
from shardscope.backend.checkpoint.deepspeed_state import read_deepspeed_state
state = read_deepspeed_state({str(save)!r})
assert "torch" not in sys.modules, "parsing imported torch"
from shardscope.backend.checkpoint.deepspeed_read import read_tensor
total = sum(read_tensor(state, n).numel() for n in state.names())
assert "deepspeed" not in sys.modules and not any(m.startswith("deepspeed.") for m in sys.modules)
print(total)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == 7 + 3 + 15 + 3 + 91 + 35 + 5 * 3 + 21 + 7 + 91


# ---------------------------------------------------------------- hostile and damaged files
@pytest.mark.parametrize(("module", "name"), [("os", "system"), ("posix", "system"), ("builtins", "eval"),
                                              ("subprocess", "Popen"), ("builtins", "exec")])
@pytest.mark.parametrize("which", ["model", "optim"])
def test_a_pickle_that_would_run_a_command_is_refused_and_nothing_runs(save_copy, tmp_path, module, name, which):
    save = save_copy("z2-bf16-2r")
    target = save / TAG / ("mp_rank_00_model_states.pt" if which == "model" else
                           "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    marker = tmp_path / "ran"
    if (module, name) == ("os", "system"):  # the payload is real: plain pickle runs it
        pickle.loads(evil_pickle(module, name, marker))
        assert marker.exists()
        marker.unlink()
    with_evil_pickle(target, module, name, marker)
    with pytest.raises(RefusedPickleError) as err:
        read_deepspeed_state(str(save))
    assert str(target) in str(err.value) and f"{module}.{name}" in str(err.value)
    assert "Nothing from it was run" in str(err.value) and not marker.exists()


@pytest.mark.parametrize("cut", [0.5, 0.99, 10])
def test_a_truncated_file_is_one_clear_error(save_copy, cut):
    save = save_copy("z3-fp32-2r")
    target = save / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = target.read_bytes()
    target.write_bytes(data[:int(len(data) * cut)] if cut < 1 else data[:cut])
    with pytest.raises(CheckpointError, match=re.escape(str(target))):
        read_deepspeed_state(str(save))


def test_a_legacy_or_foreign_file_is_one_clear_error(save_copy):
    save = save_copy("z1-fp32-2r")
    target = save / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    target.write_bytes(b"\x80\x02}q\x00." + b"\x00" * 100)  # the legacy (non-zip) torch.save format
    with pytest.raises(CheckpointError, match="legacy format"):
        read_deepspeed_state(str(save))


@pytest.mark.parametrize("name", ["z2-fp32-3r", "z3-fp32-2r"])
def test_param_shapes_claiming_more_than_the_partitions_hold(save_copy, name):
    save = save_copy(name)
    model = save / TAG / ("mp_rank_00_model_states.pt" if name.startswith("z2") else
                          "zero_pp_rank_0_mp_rank_00_model_states.pt")
    def grow(sd: dict) -> None:
        next(g for g in sd["param_shapes"] if "up.bias" in g)["up.bias"] = torch.Size([7000])

    edit_model_states(model, grow)
    state = read_deepspeed_state(str(save))
    kinds = {(p.kind, p.fqn) for p in state.problems}
    assert ("incomplete", "up.bias") in kinds and ("size", None) in kinds, state.problems
    with pytest.raises(CheckpointError, match=r"hold .* of its 7000 elements"):
        read_tensor(state, "up.bias")
    assert read_tensor(state, "emb.weight").shape == (13, 7)  # what lies before it still reads


def test_negative_or_huge_shapes_are_refused(save_copy):
    save = save_copy("z2-fp32-3r")
    model = save / TAG / "mp_rank_00_model_states.pt"
    edit_model_states(model, lambda sd: sd["param_shapes"][0].update({"up.bias": (2**40, 2**40)}))
    with pytest.raises(CheckpointError, match="not a plausible shape"):
        read_deepspeed_state(str(save))
    edit_model_states(model, lambda sd: sd["param_shapes"][0].update({"up.bias": (-7,)}))
    with pytest.raises(CheckpointError, match="not a plausible shape"):
        read_deepspeed_state(str(save))


def test_a_missing_rank_is_a_problem_and_what_it_held_is_unreadable(save_copy, references):
    save = save_copy("z2-fp32-3r")
    (save / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    state = read_deepspeed_state(str(save))
    assert any(p.kind == "missing_file" and "rank 1" in p.message for p in state.problems), state.problems
    incomplete = {p.fqn for p in state.problems if p.kind == "incomplete"}
    assert incomplete == {"emb.weight", "proj.weight", "norm.weight", "norm.bias", "up.bias"}
    with pytest.raises(CheckpointError, match="the files hold 50 of its 91 elements"):
        read_tensor(state, "emb.weight")
    # rank 2's partitions are still placed (each partition plus its padding is one size): what it holds alone, or
    # with rank 0, reads
    ref = references["z2-fp32-3r"]["fp32"]
    for key in ("proj.bias", "up.weight", "frozen.weight", "scale"):
        assert _same(read_tensor(state, key), ref[key]), key
        assert _same(read_tensor(state, key, "exp_avg"), references["z2-fp32-3r"]["exp_avg"][key]) \
            if state.tensor(key).kind == "trainable" else True


def test_a_partition_count_that_disagrees_with_the_files(save_copy):
    save = save_copy("z3-fp32-2r")
    shutil.copy(save / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                save / TAG / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    state = read_deepspeed_state(str(save))
    assert [p.kind for p in state.problems] == ["extra_file"] and state.dp_world_size == 2
    (save / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt").unlink()
    state = read_deepspeed_state(str(save))
    assert {"missing_file", "incomplete"} <= {p.kind for p in state.problems}


def test_a_flipped_byte_fails_the_crc_check(save_copy, references):
    save = save_copy("z2-bf16-2r")
    target = save / TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    state = read_deepspeed_state(str(save))
    master = state.tensor("up.bias").pieces[0]  # a part of rank 1's flat fp32 partition
    flip_tensor_byte(target, master.key, at=8)
    damaged = read_deepspeed_state(str(save))  # the structure is intact: parsing reads no tensor byte
    problems = verify_records(damaged)
    assert [(p.kind, p.file) for p in problems] == [("corrupt", target.name)]
    assert "fails its CRC32 check" in problems[0].message
    from shardscope.backend.checkpoint.storage import LocalHandles

    handles = LocalHandles(str(save / TAG))
    assert check_record(handles, damaged, target.name, master.key).kind == "corrupt"
    assert check_record(handles, damaged, target.name, "data.pkl") is None
    handles.close()
    with pytest.raises(CheckpointError, match="CRC32"):
        read_tensor(damaged, "up.bias", check_crc=True)
    # the byte flipped lies in element 2 of the partition, not in up.bias: without the check its values are right
    assert _same(read_tensor(damaged, "up.bias"), references["z2-bf16-2r"]["fp32"]["up.bias"])


def test_ds_config_and_counters_are_plain_data(deepspeed_checkpoints):
    state = read_deepspeed_state(str(deepspeed_checkpoints["z2-bf16-2r"] / "ckpt"))
    assert json.loads(json.dumps(state.ds_config))["bf16"] == {"enabled": True}
    assert (state.global_samples, state.skipped_steps, state.mp_world_size) == (8, 0, 1)


def test_a_training_scripts_extra_state_is_kept_as_plain_data(save_copy, references):
    """What client_state commonly holds (a script's argparse arguments with a path, numpy's RNG state, a numpy
    scalar, a device) is kept inert; an unknown class in it still refuses the file."""
    import argparse
    import collections
    import pathlib

    import numpy as np
    from shardscope.backend.checkpoint.deepspeed_state import plain
    from shardscope.backend.checkpoint.storage import LocalHandles
    from shardscope.backend.checkpoint.whole_archive import load_torch_archive

    save = save_copy("z1-fp32-2r")
    model = save / TAG / "mp_rank_00_model_states.pt"
    state = torch.load(model, weights_only=True)
    state.update(args=argparse.Namespace(lr=0.5, out=pathlib.PurePosixPath("/runs/a")), loss=np.float64(1.25),
                 np_rng_state=np.random.RandomState(3).get_state(), device=torch.device("cpu"))
    torch.save(state, model)
    parsed = read_deepspeed_state(str(save))
    assert parsed.problems == []
    assert _same(read_tensor(parsed, "up.bias"), references["z1-fp32-2r"]["fp32"]["up.bias"])
    handles = LocalHandles(str(save / TAG))
    root = load_torch_archive(handles, model.name, model.stat().st_size).root
    handles.close()
    assert root["loss"] == 1.25 and plain(root["args"])["lr"] == 0.5
    assert plain(root["np_rng_state"])[0] == "MT19937" and plain(root["device"])["__class__"] == "torch.device"
    state["hook"] = collections.Counter(a=1)
    torch.save(state, model)
    with pytest.raises(RefusedPickleError, match=r"collections\.Counter"):
        read_deepspeed_state(str(save))
