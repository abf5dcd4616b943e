"""``export --hf``: a Hugging Face model folder from a trainer's checkpoint, proven by the trainer's own logits.

torchtitan Llama 3 checkpoints are written by torchtitan's own model class and ``dcp.save`` (tests/torchtitan_writer.py,
in a subprocess); the export is loaded by transformers' ``from_pretrained`` with no missing or unexpected key, its
logits match torchtitan's forward within 1e-4 (fp32), and its tensors equal torchtitan's own ``to_hf`` bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def titan(tmp_path_factory) -> Path:
    pytest.importorskip("torchtitan")
    root = tmp_path_factory.mktemp("torchtitan")
    proc = subprocess.run([sys.executable, str(HERE / "torchtitan_writer.py"), str(root)], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def _load(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    return model.eval()


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(str(folder / name)))
    return out


def _check_logits(model, ref: Path) -> None:
    import torch
    from safetensors.torch import load_file

    tokens = load_file(str(ref / "tokens.safetensors"))["tokens"]
    want = load_file(str(ref / "logits.safetensors"))["logits"]
    with torch.no_grad():
        got = model(tokens).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("variant,shard", [("gqa_untied", None), ("gqa_tied", "100KB"), ("old_names", None)])
def test_torchtitan_llama_export_runs_as_the_trained_model(titan, tmp_path, variant, shard):
    import torch
    from safetensors.torch import load_file

    ref = titan / variant
    dst = tmp_path / "hf"
    args = ["export", ref / "ckpt", dst, "--hf", "--config", ref / "config.json"]
    proc = run_cli(*args, *(["--max-shard-size", shard] if shard else []), check=True)
    assert "torchtitan names -> Hugging Face LlamaForCausalLM" in proc.stdout
    assert "rotary permutation of q and k" in proc.stdout
    names = sorted(os.listdir(dst))
    assert "config.json" in names
    assert ("model.safetensors.index.json" in names) == bool(shard), names
    _check_logits(_load(dst), ref)
    written, reference = _tensors(dst), load_file(str(ref / "to_hf.safetensors"))
    assert sorted(written) == sorted(reference)  # tied: no lm_head.weight, as to_hf leaves it out
    for key, value in reference.items():
        assert written[key].dtype == value.dtype and torch.equal(written[key], value), key
    sidecar = json.loads(Path(str(dst) + ".shardscope.json").read_text())
    assert sidecar["export_format"] == "hf" and sidecar["model"]["source_names"] == "torchtitan"
    assert sidecar["model"]["tensors"]["model.layers.1.self_attn.k_proj.weight"]["transform"] == \
        f"rotary permutation over {json.loads((ref / 'config.json').read_text())['num_key_value_heads']} heads " \
        "(adjacent pairs to halves)"


def _config(titan: Path, tmp_path: Path, **changes) -> Path:
    doc = json.loads((titan / "gqa_untied" / "config.json").read_text())
    doc.update(changes)
    doc = {k: v for k, v in doc.items() if v is not None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("changes,words", [
    ({"num_attention_heads": None}, "config gives no num_attention_heads"),
    ({"intermediate_size": 80}, "layers.0.feed_forward.w1.weight: becomes model.layers.0.mlp.gate_proj.weight of "
                                "shape [96, 64], but the config says [80, 64]"),
    ({"num_hidden_layers": 3}, "model.layers.2.self_attn.q_proj.weight: no source tensor makes it"),
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not one the export names"),
])
def test_a_config_that_does_not_fit_is_one_line_exit_2(titan, tmp_path, changes, words):
    config = _config(titan, tmp_path, **changes)
    proc = run_cli("export", titan / "gqa_untied" / "ckpt", tmp_path / "hf", "--hf", "--config", config)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "hf").exists()


def test_torchtitan_without_a_config_is_one_line_exit_2(titan, tmp_path):
    proc = run_cli("export", titan / "gqa_untied" / "ckpt", tmp_path / "hf", "--hf")
    assert proc.returncode == 2 and "records no Hugging Face config" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "hf").exists()


def test_renaming_rotary_weights_to_hf_names_without_hf_says_the_permutation_is_missing(titan, tmp_path):
    rules = [r"--rename=^layers\.(\d+)\.attention\.qkv_linear\.w([qk])\.=model.layers.\1.self_attn.\2_proj.",
             r"--rename=^layers\.(\d+)\.attention\.qkv_linear\.wv\.=model.layers.\1.self_attn.v_proj."]
    proc = run_cli("export", titan / "gqa_untied" / "ckpt", tmp_path / "renamed.safetensors", *rules, check=True)
    lines = [x for x in proc.stdout.splitlines() if "without the rotary permutation" in x]
    assert len(lines) == 1 and "(4 tensors)" in lines[0] and "(--hf) applies the permutation" in lines[0], proc.stdout
    plain = run_cli("export", titan / "gqa_untied" / "ckpt", tmp_path / "plain.safetensors", check=True)
    assert "rotary permutation" not in plain.stdout  # names as stored: nothing claims to be HF's
