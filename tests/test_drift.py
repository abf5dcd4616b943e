"""``drift``, ``bisect`` and ``average`` on a real run of the built-in trainer (2 FSDP ranks on gloo, a checkpoint
every 5 steps, 20 steps), checked against float64 values computed from torch's own ``dcp`` loads; NaNs and
perturbations planted with ``dcp.save`` of the loaded state dict."""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_cli
from shardscope.backend.filenames import MANIFEST_NAME
from shardscope.backend.runs.launcher import RunConfig, RunLauncher
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

pytestmark = pytest.mark.slow

STEPS = (5, 10, 15, 20)
PLANTED = "model.blocks.0.mlp.0.weight"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("drift") / "run"
    model = {"width": 32, "depth": 1, "heads": 2, "seq_len": 16, "batch_size": 2}
    cfg = RunConfig(strategy="fsdp", nproc=2, steps=20, checkpoint_every=5, model=model)
    status = RunLauncher(run_dir, cfg).start().wait(300)
    assert status["state"] == "finished", (run_dir / "logs" / "launcher.log").read_text()
    return run_dir


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def load(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors by their flattened DCP name, loaded by torch in one process."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        sd = _load_state_dict_from_keys(checkpoint_id=str(path))
    out: dict[str, torch.Tensor] = {}

    def flatten(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                flatten(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            out[prefix] = value
    flatten("", sd)
    return out


def rewrite(path: Path, change) -> None:
    """Load a checkpoint with torch, ``change(state_dict)`` it, and save it again in its place with dcp.save."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = _load_state_dict_from_keys(checkpoint_id=str(path))
        change(sd)
        shutil.rmtree(path)
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)


def copy_run(run_dir: Path, dst: Path) -> Path:
    shutil.copytree(run_dir / "checkpoints", dst / "checkpoints")
    return dst


def test_drift_json_equals_float64_from_dcp_loads(run):
    proc = run_cli("drift", run, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["steps"] == list(STEPS) and out["first_nonfinite"] is None
    loaded = [load(step_dir(run, s)) for s in STEPS]
    assert set(out["tensors"]) == set(loaded[0])
    for fqn, d in out["tensors"].items():
        assert d["rel_change"][0] is None and d["nonfinite"] == [0, 0, 0, 0]
        for i, sd in enumerate(loaded):
            w = sd[fqn].double()
            assert d["norm"][i] == pytest.approx(float(w.norm()), rel=1e-6, abs=1e-12)
            if i:
                prev = loaded[i - 1][fqn].double()
                want = float((w - prev).norm() / prev.norm()) if float(prev.norm()) else 0.0
                assert d["rel_change"][i] == pytest.approx(want, rel=1e-6, abs=1e-12), (fqn, i)
        if fqn.endswith(".exp_avg_sq"):  # a second moment: never negative
            assert d["negatives"] == [0, 0, 0, 0] and len(d["zeros"]) == 4
    moved = out["tensors"][PLANTED]["rel_change"]
    assert all(v > 0 for v in moved[1:])


def test_drift_reports_a_nan_planted_at_step_20_in_its_tensor(run, tmp_path):
    copy = copy_run(run, tmp_path / "nan")

    def plant(sd: dict) -> None:
        sd["model"]["blocks.0.mlp.0.weight"][3, 7] = math.nan
        sd["model"]["blocks.0.mlp.0.weight"][4, 1] = math.inf
    rewrite(step_dir(copy, 20), plant)
    proc = run_cli("drift", copy, "--json")
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["first_nonfinite"] == {"step": 20, "fqn": PLANTED}
    d = out["tensors"][PLANTED]
    assert d["nonfinite"] == [0, 0, 0, 2]
    clean = load(step_dir(run, 20))[PLANTED].double()  # the norm of the finite elements
    clean[3, 7] = clean[4, 1] = 0.0
    assert d["norm"][3] == pytest.approx(float(clean.norm()), rel=1e-6)
    text = run_cli("drift", copy)
    assert text.returncode == 1 and f"first non-finite value: step 20, {PLANTED}" in text.stdout


def test_drift_of_checkpoints_named_one_by_one_and_bad_input(run, tmp_path):
    proc = run_cli("drift", step_dir(run, 15), step_dir(run, 5), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"] == [5, 15]
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = run_cli("drift", empty)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no complete checkpoint" in bad.stderr


def perturbed_copy(run_dir: Path, dst: Path, from_step: int) -> Path:
    """A copy of the run whose one tensor (PERTURBED) is changed at every checkpoint from ``from_step`` on."""
    copy = copy_run(run_dir, dst)

    def perturb(sd: dict) -> None:
        sd["model"]["blocks.0.attn.out_proj.weight"][0, 0] += 1e-3
    for step in STEPS:
        if step >= from_step:
            rewrite(step_dir(copy, step), perturb)
    return copy


PERTURBED = "model.blocks.0.attn.out_proj.weight"


@pytest.mark.parametrize("from_step", [20, 10])
def test_bisect_finds_the_step_and_tensor_a_copy_parted_in_log_n_plus_one_pairs(run, tmp_path, from_step):
    copy = perturbed_copy(run, tmp_path / "copy", from_step)
    proc = run_cli("bisect", run, copy, "--json")
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["first_step"] == from_step and out["tensors"][0] == PERTURBED
    assert out["tensors"] == [PERTURBED] and out["parted_first"] == "weights"  # layouts differ, values do not
    assert out["steps"] == list(STEPS) and len(out["compared"]) <= math.ceil(math.log2(len(STEPS))) + 1
    assert out["compared"][0] == 20
    # within the tolerance nothing differs; a run against itself does not either
    loose = run_cli("bisect", run, copy, "--atol", "1e-2", "--json")
    assert loose.returncode == 0 and json.loads(loose.stdout)["first_step"] is None
    same = run_cli("bisect", run, run)
    assert same.returncode == 0 and "no difference" in same.stdout


def test_bisect_of_series_with_no_common_step_cannot_compare(run, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(step_dir(run, 5), a / "step_000005")
    shutil.copytree(step_dir(run, 10), b / "step_000010")
    proc = run_cli("bisect", a, b)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no step is held by both" in proc.stderr


def flip_a_byte_keeping_time(ckpt: Path, fqn: str) -> None:
    """One byte of ``fqn``'s stored bytes flipped behind the file system's back (size and mtime kept), so that
    only a read of the bytes, not the sealed manifest, would see it."""
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    chunk = manifest["tensors"][fqn]["chunks"][0]
    path = ckpt / chunk["file"]
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(chunk["offset"] + chunk["length"] // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_bisect_of_sealed_series_compares_equal_digests_without_reading(run, tmp_path):
    a = copy_run(run, tmp_path / "a")
    b = perturbed_copy(run, tmp_path / "b", 10)
    for step in STEPS:
        for side in (a, b):
            assert run_cli("seal", step_dir(side, step)).returncode == 0
    untouched = "model.blocks.0.mlp.0.weight"
    for step in STEPS:  # a read of B's bytes would find this tensor parted at step 5 already
        flip_a_byte_keeping_time(step_dir(b, step), untouched)
    proc = run_cli("bisect", a, b, "--json")
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["first_step"] == 10 and out["tensors"] == [PERTURBED]
    tensors = len(json.loads((step_dir(a, 5) / MANIFEST_NAME).read_text())["tensors"])
    # every pair compared: all its tensors by digest but the perturbed one (from step 10 on)
    assert out["by_digest"] == sum(tensors - (s >= 10) for s in out["compared"])
    text = run_cli("bisect", a, b)
    assert f"{out['by_digest']} tensor pairs by their sealed digests" in text.stdout


def reference(run_dir: Path, steps: list[int], shares: list[float] | None = None, beta: float | None = None
              ) -> dict[str, torch.Tensor]:
    """The float64 mean (weighted by ``shares``) or EMA of the model weights, from torch's own loads."""
    models = [{k[len("model."):]: v.double() for k, v in load(step_dir(run_dir, s)).items()
               if k.startswith("model.")} for s in steps]
    out = {}
    for key in models[0]:
        if beta is not None:
            e = models[0][key]
            for m in models[1:]:
                e = beta * e + (1 - beta) * m[key]
        else:
            w = shares or [1.0] * len(models)
            e = sum(wi * m[key] for wi, m in zip(w, models)) / sum(w)
        out[key] = e
    return out


@pytest.mark.parametrize("how", ["uniform", "weighted", "ema"])
def test_average_equals_the_float64_reference(run, tmp_path, how):
    from safetensors.torch import load_file

    steps = [5, 10, 20]
    args, ref = {"uniform": ([], reference(run, steps)),
                 "weighted": (["--weights", "1,2,5"], reference(run, steps, [1, 2, 5])),
                 "ema": (["--ema", "0.9"], reference(run, steps, beta=0.9))}[how]
    inputs = [step_dir(run, s) for s in (steps if how != "ema" else [20, 5, 10])]  # EMA: in step order
    out = tmp_path / "avg.safetensors"
    proc = run_cli("average", *inputs, out, *args)
    assert proc.returncode == 0, proc.stderr
    assert "verified" in proc.stdout
    got = load_file(str(out))
    assert set(got) == set(ref)
    for key, want in ref.items():
        assert got[key].dtype == torch.float32
        err = float((got[key].double() - want).norm() / want.norm())
        assert err <= 1e-6, (key, err)
        assert torch.equal(got[key], want.float())  # rounded once from the float64 result
    lineage = json.loads((tmp_path / "avg.safetensors.shardscope.json").read_text())
    sources = lineage["average"]["sources"]
    assert [s["step"] for s in sources] == steps
    shares = [s["weight"] for s in sources]
    assert sum(shares) == pytest.approx(1.0)
    if how == "weighted":
        assert shares == pytest.approx([1 / 8, 2 / 8, 5 / 8])
    if how == "ema":
        assert shares == pytest.approx([0.81, 0.09, 0.1]) and lineage["average"]["beta"] == 0.9


def test_average_written_as_dcp_is_read_by_dcp_load(run, tmp_path):
    steps = [5, 10, 20]
    ref = reference(run, steps, [1, 2, 5])
    out = tmp_path / "avg_dcp"
    proc = run_cli("average", *(step_dir(run, s) for s in steps), out, "--weights", "1,2,5", "--format", "dcp",
                   "--ranks", "2", "--prefix", "model")
    assert proc.returncode == 0, proc.stderr
    assert "verified" in proc.stdout
    state = {"model": {k: torch.empty_like(v, dtype=torch.float32) for k, v in ref.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=str(out), no_dist=True)
    for key, want in ref.items():
        assert torch.equal(state["model"][key], want.float()), key  # the float64 result rounded once
    # two ranks' files, the metadata, and the manifest every output carries (issue 33)
    assert {f.name for f in out.iterdir()} == {"__0_0.distcp", "__1_0.distcp", ".metadata", "shardscope-manifest.json"}
    lineage = json.loads(Path(f"{out}.shardscope.json").read_text())  # beside the folder
    assert lineage["export_format"] == "dcp" and lineage["average"]["method"] == "weighted"
    sources = lineage["average"]["sources"]
    assert [s["step"] for s in sources] == steps
    assert [s["weight"] for s in sources] == pytest.approx([1 / 8, 2 / 8, 5 / 8])
    bad = run_cli("average", step_dir(run, 5), step_dir(run, 10), tmp_path / "x", "--format", "dcp", "--hf")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and not (tmp_path / "x").exists()


def test_average_of_different_models_or_unequal_integers_exits_2(run, tmp_path, fixtures):
    other = fixtures["fsdp2_r2"]  # another model: other names and shapes
    proc = run_cli("average", step_dir(run, 5), other, tmp_path / "x.safetensors")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "different models" in proc.stderr
    assert not (tmp_path / "x.safetensors").exists()
    copy = copy_run(run, tmp_path / "ints")

    def add_int(value: int):
        def change(sd: dict) -> None:
            sd["model"]["counter"] = torch.tensor([value, 1], dtype=torch.int64)
        return change
    rewrite(step_dir(copy, 5), add_int(3))
    rewrite(step_dir(copy, 10), add_int(4))
    proc = run_cli("average", step_dir(copy, 5), step_dir(copy, 10), tmp_path / "y.pt")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "counter" in proc.stderr and "must be equal" in proc.stderr
    assert not (tmp_path / "y.pt").exists()
    bad = run_cli("average", step_dir(run, 5), step_dir(run, 10), tmp_path / "z.pt", "--weights", "1")
    assert bad.returncode == 2 and "one weight per checkpoint" in bad.stderr
