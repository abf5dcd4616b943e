"""formats/deepspeed.py through the door: DeepSpeed ZeRO saves written by DeepSpeed itself (stages 1-3, fp32 and
bf16, 2 and 3 ranks; tests/make_deepspeed_fixtures.py) opened, inspected, verified, shown, exported, diffed, listed
and pruned with the real CLI, compared with DeepSpeed's own consolidation; damaged saves give one line and the
documented exit code. The parser itself (pieces, padding, hostile pickles) is tests/test_deepspeed_state.py's."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import cli_in_process as cli
from safetensors.torch import load_file
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.formats import open_checkpoint
from shardscope.backend.formats.deepspeed import flat_boxes

pytestmark = pytest.mark.slow

VARIANTS = ["z1-fp32-2r", "z2-bf16-2r", "z2-fp32-3r", "z3-bf16-3r", "z3-fp32-2r"]


def reference(deepspeed_checkpoints, name: str) -> dict:
    """DeepSpeed's own consolidation, written by the fixture's reference process (trusted: the test wrote it)."""
    return torch.load(deepspeed_checkpoints[name] / "reference.pt", weights_only=False)


@pytest.mark.parametrize("name", VARIANTS)
def test_export_is_bit_identical_to_deepspeeds_own_consolidation(capsys, tmp_path, deepspeed_checkpoints, name):
    """The save folder (its latest tag) exports to safetensors with every tensor of DeepSpeed's
    get_fp32_state_dict_from_zero_checkpoint, equal bit for bit and in its dtype; ZeRO-1 also keeps the frozen
    parameters DeepSpeed's own tool drops. --only optimizer gives exp_avg and exp_avg_sq per parameter."""
    save = deepspeed_checkpoints[name] / "ckpt"
    ref = reference(deepspeed_checkpoints, name)
    out = tmp_path / "model.safetensors"
    rc, text, err = cli(capsys, "export", save, out)
    assert rc == 0 and "verified" in text, (text, err)
    got = load_file(out)
    for k, v in ref["fp32"].items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    extra = set(got) - set(ref["fp32"])
    if name.startswith("z1"):  # zero_to_fp32 leaves frozen parameters out at stage 1; they are in the module
        module = next(iter(ref["module"].values()))
        assert extra == {"frozen.weight", "frozen.bias"}
        assert all(torch.equal(got[k], module[k]) for k in extra)
    else:
        assert extra == set()
    opt = tmp_path / "optim.safetensors"
    rc, text, err = cli(capsys, "export", save, opt, "--only", "optimizer")
    assert rc == 0, err
    states = load_file(opt)
    assert states and all(k.startswith("optimizer.state.") for k in states)
    for k, v in states.items():
        param, which = k.removeprefix("optimizer.state.").rsplit(".", 1)
        assert torch.equal(v, ref[which][param]), k


def test_commands_on_a_save_folder(capsys, tmp_path, deepspeed_checkpoints):
    """inspect (JSON: format, the tag chosen, ranks, kind), verify --deep, show, a .pt export, diff against the
    export, and ls (a save folder is a run, global_step2 a resumable checkpoint at step 2 on 3 ranks)."""
    save = deepspeed_checkpoints["z3-bf16-3r"] / "ckpt"
    rc, out, _ = cli(capsys, "inspect", "--json", save)
    doc = json.loads(out)
    assert rc == 0 and doc["format"] == "deepspeed" and doc["kind"] == "resumable"
    assert doc["path"].endswith("global_step2") and "global_step2" in doc["notes"][0]
    assert sorted(r["rank"] for r in doc["ranks"] if r["rank"] is not None) == [0, 1, 2]
    names = {t["fqn"] for t in doc["tensors"]}
    assert {"emb.weight", "head.weight", "optimizer.state.emb.weight.exp_avg"} <= names
    assert {o["fqn"] for o in doc["objects"]} >= {"deepspeed.config", "deepspeed.zero_stage", "deepspeed.global_steps"}
    rc, out, _ = cli(capsys, "verify", "--deep", save)
    assert rc == 0 and "healthy" in out, out
    rc, out, _ = cli(capsys, "show", save, "emb.weight")
    assert (rc == 0 and "ranks 0-2" in out) or "rank" in out, out
    pt = tmp_path / "model.pt"
    assert cli(capsys, "export", save, pt)[0] == 0
    ref = reference(deepspeed_checkpoints, "z3-bf16-3r")["fp32"]
    loaded = torch.load(pt, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in ref.items())
    rc, out, _ = cli(capsys, "diff", save, pt)
    assert (rc == 1 and " 0 changed" in out) or "0 changed" in out, out  # the export lacks the optimizer: only in A
    run = tmp_path / "saves"
    shutil.copytree(save, run)
    _age(run)
    rc, out, _ = cli(capsys, "ls", "--json", run)
    ck = next(c for c in json.loads(out)["checkpoints"] if c["format"] == "deepspeed")
    assert ck["step"] == 2 and ck["ranks"] == [0, 1, 2] and ck["kind"] == "resumable" and ck["state"] == "complete"
    assert ck["pinned"] and ck["run"] == str(run)


def _age(root) -> None:
    """Files older than a listing's "still being written" window."""
    old = os.path.getmtime(root) - 3600
    for p in [root, *root.rglob("*")]:
        os.utime(p, (old, old))


def test_window_opens_a_save_folder(deepspeed_checkpoints):
    """What the window loads (compare.browse_file.load_any) for a save folder: the tag's tree and values through
    the chunk reader, equal to DeepSpeed's consolidation."""
    from shardscope.backend.compare.browse_file import analyse_any, load_any, stats_any

    data = analyse_any(load_any(str(deepspeed_checkpoints["z2-fp32-3r"] / "ckpt")))
    assert data.problems == [] and data.values["deepspeed.zero_stage"] == "2"
    ref = reference(deepspeed_checkpoints, "z2-fp32-3r")["fp32"]
    stats = stats_any(data, "emb.weight")
    assert stats.numel == ref["emb.weight"].numel()


def test_damaged_saves(capsys, tmp_path, deepspeed_checkpoints):
    """A flipped byte in an optimizer partition is a named CRC32 failure (verify --deep exit 1, export exit 2 with
    nothing written); a missing rank's file is incomplete in ls and a problem for verify; prune never removes the
    tag latest names."""
    save = tmp_path / "ckpt"
    shutil.copytree(deepspeed_checkpoints["z2-fp32-3r"] / "ckpt", save)
    ckpt = open_checkpoint(save)
    chunk = ckpt.tensor("up.weight").chunks[0]
    with open(save / "global_step2" / chunk.file, "r+b") as f:
        f.seek(chunk.offset + 3)
        b = f.read(1)
        f.seek(chunk.offset + 3)
        f.write(bytes([b[0] ^ 0x10]))
    rc, out, _ = cli(capsys, "verify", "--deep", save)
    assert rc == 1 and "[corrupt]" in out, out
    dst = tmp_path / "x.safetensors"
    rc, out, err = cli(capsys, "export", save, dst)
    assert rc != 0 and "CRC32" in err and len(err.strip().splitlines()) == 1 and not dst.exists(), (out, err)
    with ChunkReader(open_checkpoint(save)) as reader, pytest.raises(Exception, match="CRC32"):
        reader.read_tensor(reader.ckpt.tensor("up.weight"))

    broken = tmp_path / "run"
    shutil.copytree(deepspeed_checkpoints["z2-fp32-3r"] / "ckpt", broken)
    shutil.copytree(broken / "global_step2", broken / "global_step1")
    shutil.copytree(broken / "global_step2", broken / "global_step3")
    os.remove(next((broken / "global_step3").glob("*zero_pp_rank_1_*optim_states.pt")))
    _age(broken)
    rc, out, _ = cli(capsys, "ls", "--json", broken)
    states = {os.path.basename(c["path"]): c["state"] for c in json.loads(out)["checkpoints"]}
    assert states == {"global_step1": "complete", "global_step2": "complete", "global_step3": "incomplete"}
    rc, out, _ = cli(capsys, "verify", broken / "global_step3")
    assert rc == 1, out
    rc, out, _ = cli(capsys, "prune", broken, "--keep-last", "1", "--json")
    plan = {os.path.basename(d["path"]): d for d in json.loads(out)["checkpoints"]}
    assert plan["global_step2"]["action"] == "keep" and any("latest" in r for r in plan["global_step2"]["reasons"])


def test_a_foreign_global_is_one_line(capsys, tmp_path, deepspeed_checkpoints):
    """A model-states pickle that names os.system: inspect refuses it in one line (exit 2); nothing runs."""
    import zipfile

    save = tmp_path / "ckpt"
    shutil.copytree(deepspeed_checkpoints["z1-fp32-2r"] / "ckpt", save)
    model = next((save / "global_step2").glob("*model_states.pt"))
    with zipfile.ZipFile(model) as z:
        items = {i.filename: z.read(i) for i in z.infolist()}
    pkl = next(k for k in items if k.endswith("data.pkl"))
    marker = tmp_path / "ran"
    items[pkl] = b"\x80\x02cos\nsystem\nq\x00X" + len(f"touch {marker}").to_bytes(4, "little") + \
        f"touch {marker}".encode() + b"\x85R."
    with zipfile.ZipFile(model, "w", zipfile.ZIP_STORED) as z:
        for k, v in items.items():
            z.writestr(k, v)
    rc, _, err = cli(capsys, "inspect", save)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "os" in err and not marker.exists(), err


def test_flat_ranges_become_contiguous_boxes():
    """Every flat range of every small shape is covered exactly, in order, by at most two boxes per dimension."""
    import itertools
    import math
    import random

    rnd = random.Random(0)
    for _ in range(2000):
        shape = tuple(rnd.randint(1, 5) for _ in range(rnd.randint(0, 4)))
        total = math.prod(shape)
        start = rnd.randrange(total)
        count = rnd.randint(1, total - start)
        boxes = flat_boxes(shape, start, count)
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        flat = [sum(i * s for i, s in zip(ix, strides)) for o, sz in boxes
                for ix in itertools.product(*[range(a, a + b) for a, b in zip(o, sz)])]
        assert flat == list(range(start, start + count)) and len(boxes) <= max(1, 2 * len(shape) - 1)
