"""Folders written by accelerate's own FSDP writer (``save_fsdp_model``/``save_fsdp_optimizer``/
``save_accelerator_state``, what ``Accelerator.save_state`` calls for FSDP) from 2 gloo processes, for FSDP2
and for FSDP1 + torch.compile (keys ``model._orig_mod.*``), read back with the real CLI: recognised as
accelerate, the model's weights by default under the module's own names, bit for bit, and a sharded export
that transformers' ``from_pretrained`` loads with the original logits. See tests/accelerate_writer.py for
why accelerate's writer is called directly rather than through ``save_state`` on this CPU-only machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate_writer import VOCAB, tiny_llama_config
from conftest import run_cli
from safetensors import safe_open

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """OUT with fsdp2/ and fsdp1_compiled/ (each: checkpoint/ as accelerate wrote it, reference.pt: the
    gathered weights) and config.json."""
    out = tmp_path_factory.mktemp("accelerate")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "accelerate_writer.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _reference_model(run: Path):
    """A Llama built from the config, holding the weights accelerate's ranks held (gathered on rank 0);
    ``strict=True``: the gathered names are the module's own."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config()).eval()
    model.load_state_dict(torch.load(run / "reference.pt", weights_only=True), strict=True)
    return model


@pytest.mark.parametrize("run", ["fsdp2", "fsdp1_compiled"])
def test_accelerate_wrote_the_layout_users_have(written, run):
    ckpt = written / run / "checkpoint"
    assert sorted(os.listdir(ckpt)) == ["optimizer_0", "pytorch_model_fsdp_0", "random_states_0.pkl",
                                        "random_states_1.pkl"]
    for sub in ("optimizer_0", "pytorch_model_fsdp_0"):
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(ckpt / sub))


def test_inspect_opens_the_save_state_folder_as_export_does(written):
    """The save_state folder is opened as its model's folder, by inspect as by export (one door)."""
    parent = run_cli("inspect", written / "fsdp2" / "checkpoint")
    assert parent.returncode == 0, parent.stderr
    assert "pytorch_model_fsdp_0" in parent.stdout.splitlines()[0] and "Traceback" not in parent.stderr
    model = run_cli("inspect", written / "fsdp2" / "checkpoint" / "pytorch_model_fsdp_0", "--tensors")
    assert model.returncode == 0, model.stderr
    assert "healthy" in model.stdout and "model.model.embed_tokens.weight" in model.stdout
    assert "rank 0" in model.stdout and "rank 1" in model.stdout  # both ranks wrote shards


@pytest.mark.parametrize(("run", "src"), [("fsdp2", "checkpoint"), ("fsdp2", "checkpoint/pytorch_model_fsdp_0"),
                                         ("fsdp1_compiled", "checkpoint")])
def test_default_export_is_the_model_weights_bit_for_bit(written, tmp_path, run, src):
    dst = tmp_path / "model.safetensors"
    out = run_cli("export", written / run / src, dst)
    assert out.returncode == 0, out.stderr
    assert "layout: HF Trainer / accelerate FSDP" in out.stdout and "keys without the 'model.' prefix" in out.stdout
    if src == "checkpoint":
        assert "left out optimizer_0, random_states_0.pkl, random_states_1.pkl" in out.stdout
    assert ("wrapper key parts removed: _orig_mod" in out.stdout) == (run == "fsdp1_compiled")
    model = _reference_model(written / run)
    expected = model.state_dict()
    with safe_open(str(dst), framework="pt") as h:
        assert set(h.keys()) == set(expected)  # the module's own names: no optimizer state, no prefixes
        for k, v in expected.items():
            got = h.get_tensor(k)
            assert got.dtype == v.dtype and torch.equal(got, v), k


def test_sharded_export_loads_with_from_pretrained_and_gives_the_logits(written, tmp_path):
    from transformers import LlamaForCausalLM

    dst = tmp_path / "hf"
    out = run_cli("export", written / "fsdp2" / "checkpoint", dst, "--max-shard-size", "20KB", "--config",
                  written / "config.json")
    assert out.returncode == 0, out.stderr
    assert len(list(dst.glob("model-*.safetensors"))) > 2
    loaded = LlamaForCausalLM.from_pretrained(dst).eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, _reference_model(written / "fsdp2")(ids).logits)


def test_optimizer_folder_says_where_the_model_is(written, tmp_path):
    opt = written / "fsdp2" / "checkpoint" / "optimizer_0"
    bad = run_cli("export", opt, tmp_path / "o.safetensors")
    assert bad.returncode == 2 and "pytorch_model_fsdp_N" in bad.stderr
    assert "choose the entries to export by prefix" in bad.stderr
    assert not (tmp_path / "o.safetensors").exists()
    full = run_cli("export", opt, tmp_path / "o.pt")
    assert full.returncode == 0, full.stderr
    moments = torch.load(tmp_path / "o.pt", weights_only=True)["optimizer"]["state"]
    assert set(moments) == set(torch.load(written / "fsdp2" / "reference.pt", weights_only=True))  # AdamW, per param
    assert all(set(m) == {"step", "exp_avg", "exp_avg_sq"} for m in moments.values())


def test_keep_stored_keys_with_an_empty_strip_prefix(written):
    from shardscope.backend.export import plan_export
    from shardscope.backend.formats import open_checkpoint

    ckpt = open_checkpoint(written / "fsdp1_compiled" / "checkpoint" / "pytorch_model_fsdp_0", use_cache=False)
    stored = plan_export(ckpt, "safetensors", strip_prefix="")
    assert {it.key for it in stored.items} == {t.fqn for t in ckpt.tensors}
    assert all(it.key.startswith("model._orig_mod.") for it in stored.items)
    default = plan_export(ckpt, "safetensors")
    assert {it.key for it in default.items} == {t.fqn.removeprefix("model._orig_mod.") for t in ckpt.tensors}
    assert default.keys_renamed and not stored.keys_renamed
