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

pytestmark = pytest.mark.slow

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


def _megatron_state(hf_model, cfg: dict, te_names: bool, pad: int) -> dict:
    """An HF Llama's weights in Megatron-Core's torch_dist names and layouts: layers stacked on a prepended axis,
    q/k/v fused by KV groups (``[n_kv, g+2, d, D]``), ``linear_fc1`` = ``[gate; up]``, the vocabulary padded by
    ``pad`` rows, Transformer Engine's fused norm names (``te_names``) or the local spec's, and ``_extra_state``."""
    import io

    import torch

    sd = hf_model.state_dict()
    n, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    g = n // kv

    def stack(name: str) -> torch.Tensor:
        return torch.stack([sd[f"model.layers.{i}.{name}"] for i in range(cfg["num_hidden_layers"])])

    def qkv(i: int) -> torch.Tensor:
        q, k, v = (sd[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv")
        parts = [q.view(kv, g, d, -1), k.view(kv, 1, d, -1), v.view(kv, 1, d, -1)]
        return torch.cat(parts, dim=1).reshape(-1, q.shape[1])

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.full((pad, t.shape[1]), 7.0)])

    layers = "decoder.layers."
    norm1 = "self_attention.linear_qkv.layer_norm_weight" if te_names else "input_layernorm.weight"
    norm2 = "mlp.linear_fc1.layer_norm_weight" if te_names else "pre_mlp_layernorm.weight"
    return {"embedding.word_embeddings.weight": padded(sd["model.embed_tokens.weight"]),
            "output_layer.weight": padded(sd["lm_head.weight"]),
            "decoder.final_layernorm.weight": sd["model.norm.weight"],
            layers + "self_attention.linear_qkv.weight": torch.stack([qkv(i) for i in range(cfg["num_hidden_layers"])]),
            layers + "self_attention.linear_proj.weight": stack("self_attn.o_proj.weight"),
            layers + "mlp.linear_fc1.weight": torch.cat([stack("mlp.gate_proj.weight"), stack("mlp.up_proj.weight")],
                                                        dim=1),
            layers + "mlp.linear_fc2.weight": stack("mlp.down_proj.weight"),
            layers + norm1: stack("input_layernorm.weight"), layers + norm2: stack("post_attention_layernorm.weight"),
            layers + "self_attention.linear_qkv._extra_state": io.BytesIO(b"te fp8 meta")}


@pytest.mark.parametrize("te_names", [False, True])
def test_megatron_names_export_to_the_hf_model_they_came_from(tmp_path, te_names):
    """Megatron-Core's names and layouts (fused QKV by groups, ``[gate; up]``, stacked layers, padded vocabulary,
    ``_extra_state``), saved by ``dcp.save``, export to the HF model they were made from: same tensors, same logits.
    (The logits against Megatron's own GPTModel forward are still to come.)"""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {"model_type": "llama", "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
           "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
    torch.manual_seed(3)
    ref = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    dcp.save(_megatron_state(ref, cfg, te_names, pad=28), checkpoint_id=str(tmp_path / "iter_0000010"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    proc = run_cli("export", tmp_path / "iter_0000010", tmp_path / "hf", "--hf", "--config", tmp_path / "config.json",
                   check=True)
    assert "Megatron-Core names -> Hugging Face LlamaForCausalLM" in proc.stdout
    assert "fused QKV split by KV groups" in proc.stdout and "rotary permutation" not in proc.stdout
    assert "linear_qkv._extra_state: a buffer Hugging Face's model does not load" in proc.stdout
    written = _tensors(tmp_path / "hf")
    assert sorted(written) == sorted(ref.state_dict())
    for key, value in ref.state_dict().items():
        assert torch.equal(written[key], value), key
    tokens = torch.randint(0, cfg["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.allclose(_load(tmp_path / "hf")(tokens).logits, ref(tokens).logits, atol=1e-4, rtol=0)
