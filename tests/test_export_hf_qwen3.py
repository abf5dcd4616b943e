"""``export --hf`` of torchtitan Qwen3, dense and MoE (stacked experts in both name generations), proven by the
trainer's own logits: checkpoints written by torchtitan's model classes and ``dcp.save``
(tests/torchtitan_qwen3_writer.py, in a subprocess) export to folders transformers' ``from_pretrained`` loads with no
missing or unexpected key, whose logits match torchtitan's forward within 1e-4 (fp32) and whose tensors equal
torchtitan's own ``to_hf`` bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli
from test_export_hf import _check_logits, _load, _tensors

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    pytest.importorskip("torchtitan")
    root = tmp_path_factory.mktemp("torchtitan_qwen3")
    proc = subprocess.run([sys.executable, str(HERE / "torchtitan_qwen3_writer.py"), str(root)], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.mark.parametrize("variant,shard", [("dense_untied", None), ("dense_w13", "100KB"), ("moe", "100KB"),
                                           ("moe_old_names", None)])
def test_torchtitan_qwen3_export_runs_as_the_trained_model(qwen, tmp_path, variant, shard):
    import torch
    from safetensors.torch import load_file

    ref, dst = qwen / variant, tmp_path / "hf"
    args = ["export", ref / "ckpt", dst, "--hf", "--config", ref / "config.json"]
    proc = run_cli(*args, *(["--max-shard-size", shard] if shard else []), check=True)
    moe = variant.startswith("moe")
    arch = "Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"
    assert f"torchtitan names -> Hugging Face {arch}" in proc.stdout
    assert "rotary permutation" not in proc.stdout  # torchtitan's Qwen3 rotates halves already, as HF does
    assert ("model.safetensors.index.json" in {p.name for p in dst.iterdir()}) == bool(shard)
    model = _load(dst)
    assert type(model).__name__ == arch
    _check_logits(model, ref)
    written, reference = _tensors(dst), load_file(str(ref / "to_hf.safetensors"))
    assert sorted(written) == sorted(reference)  # tied: no lm_head.weight, as to_hf leaves it out
    for key, value in reference.items():
        assert written[key].dtype == value.dtype and torch.equal(written[key], value), key
    tensors = json.loads(Path(str(dst) + ".shardscope.json").read_text())["model"]["tensors"]
    if moe:
        assert "stacked experts split in 2 layers" in proc.stdout
        bias = "expert_bias" if variant == "moe_old_names" else "expert_bias_E"
        assert f"left out: layers.1.moe.{bias}: torchtitan's load-balancing routing state" in proc.stdout
        assert f"left out: layers.0.moe.{bias} (2 MoE layers): torchtitan's expert_bias is zero in every layer" \
            in proc.stdout
        assert tensors["model.layers.1.mlp.experts.3.down_proj.weight"]["transform"] == "expert 3 of 4 stacked experts"
        tokens = load_file(str(ref / "tokens.safetensors"))["tokens"]
        bf16 = load_file(str(ref / "logits_bf16.safetensors"))["logits"]
        with torch.no_grad():  # torchtitan's stock forward (experts in bf16) is the same model, to bf16's precision
            assert torch.allclose(model(tokens).logits, bf16, atol=2e-2, rtol=0)
    if variant == "dense_w13":
        assert tensors["model.layers.0.mlp.up_proj.weight"]["transform"] == \
            "up half of an interleaved [F, 2, D] gate/up"


def _mapping(ckpt: Path, doc: dict):
    """What ``export --hf`` plans for the checkpoint's model tensors under the config ``doc`` (in process: the
    checks the CLI runs, without a process per case)."""
    from shardscope.backend.export.hf_model import HfConfig, interleaved_rotary, map_names, recognise_scheme
    from shardscope.backend.formats import open_checkpoint

    shapes = {t.fqn: t.shape for t in open_checkpoint(ckpt, use_cache=False).tensors
              if not t.fqn.startswith(("optimizer.", "train_state."))}
    cfg = HfConfig.from_json(doc, "config.json")
    scheme = recognise_scheme(list(shapes))
    return map_names(shapes, scheme, cfg, interleaved_rotary(scheme, cfg))


@pytest.mark.parametrize("variant,changes,words", [
    ("moe", {"num_experts": 8}, "layers.0.moe.routed_experts.inner_experts.w1_EFD: the first dimension (4) is not "
                                "the 8 stacked experts the config gives"),
    ("moe", {"moe_intermediate_size": 48}, "becomes model.layers.0.mlp.experts.0.gate_proj.weight of shape [32, 64], "
                                           "but the config says [48, 64]"),
    ("moe", {"num_experts_per_tok": None}, "the config gives no num_experts_per_tok"),
    ("moe", {"mlp_only_layers": [1]}, "layers.1.moe.routed_experts.inner_experts.w1_EFD: becomes "
                                      "model.layers.1.mlp.experts.0.gate_proj.weight of shape [32, 64], but a name "
                                      "HF's model does not have"),
    ("moe", {"decoder_sparse_step": 2}, "layers.0.moe.routed_experts.inner_experts.w1_EFD: becomes "
                                        "model.layers.0.mlp.experts.0.gate_proj.weight"),
    ("moe", {"model_type": "qwen3"}, "layers.0.moe.routed_experts.inner_experts.w1_EFD: a MoE's stacked experts, but "
                                     "the config (qwen3) has no experts"),
    ("dense_untied", {"model_type": "llama"}, "a torchtitan Qwen3 (q/k norms, rotary halves), but the config's "
                                              "model_type is llama"),
    ("dense_untied", {"head_dim": 16}, "becomes model.layers.0.self_attn.q_proj.weight of shape [96, 64], but the "
                                       "config says [64, 64]"),
])
def test_a_qwen3_config_that_does_not_fit_names_the_tensor(qwen, variant, changes, words):
    from shardscope.backend.export.hf_model import HfModelError

    doc = json.loads((qwen / variant / "config.json").read_text())
    doc = {k: v for k, v in {**doc, **changes}.items() if v is not None}
    with pytest.raises(HfModelError) as exc:
        _mapping(qwen / variant / "ckpt", doc)
    assert words in str(exc.value), exc.value
    good = json.loads((qwen / variant / "config.json").read_text())
    assert _mapping(qwen / variant / "ckpt", good).tensors  # the config the model was made with fits


def test_a_missing_routing_value_is_one_line_exit_2(qwen, tmp_path):
    doc = json.loads((qwen / "moe" / "config.json").read_text())
    del doc["norm_topk_prob"]  # HF's default (false) is not torchtitan's route_norm: never guessed
    (tmp_path / "config.json").write_text(json.dumps(doc))
    proc = run_cli("export", qwen / "moe" / "ckpt", tmp_path / "hf", "--hf", "--config", tmp_path / "config.json")
    assert proc.returncode == 2, proc.stderr
    assert "the config gives no norm_topk_prob" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()


def test_a_llama_checkpoint_with_a_qwen3_config_is_refused_by_name(tmp_path):
    """The converse of the family check: no q/k norms (a torchtitan Llama, whose rotary pairs need the permutation)
    under a Qwen3 config would be exported unpermuted; it is refused by name, before anything is written."""
    import torch
    import torch.distributed.checkpoint as dcp
    from shardscope.backend.export.hf_model import HfModelError

    state = {"tok_embeddings.weight": torch.zeros(16, 8), "norm.weight": torch.ones(8),
             "layers.0.attention.wq.weight": torch.zeros(8, 8)}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    doc = {"model_type": "qwen3", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
           "num_attention_heads": 2, "vocab_size": 16}
    with pytest.raises(HfModelError, match=r"no q_norm/k_norm \(a torchtitan Llama"):
        _mapping(tmp_path / "ckpt", doc)


def test_a_nonzero_routing_bias_is_said(tmp_path):
    """torchtitan's load-balancing bias steers which experts are chosen; HF's Qwen3-MoE router has none, so a
    nonzero one left out is said, with its size (a zero one is the case above)."""
    import torch
    import torch.distributed.checkpoint as dcp

    d, f, e, v = 8, 8, 2, 16
    layer = {"attention.wq.weight": (d, d), "attention.wk.weight": (4, d), "attention.wv.weight": (4, d),
             "attention.wo.weight": (d, d), "attention.q_norm.weight": (4,), "attention.k_norm.weight": (4,),
             "attention_norm.weight": (d,), "ffn_norm.weight": (d,), "moe.router.gate.weight": (e, d),
             "moe.experts.w1": (e, f, d), "moe.experts.w2": (e, d, f), "moe.experts.w3": (e, f, d)}
    state = {f"layers.0.{k}": torch.randn(shape) for k, shape in layer.items()}
    state.update({"tok_embeddings.weight": torch.randn(v, d), "norm.weight": torch.ones(d),
                  "output.weight": torch.randn(v, d), "layers.0.moe.expert_bias": torch.tensor([0.25, -0.5])})
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_moe", "hidden_size": d, "intermediate_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "vocab_size": v, "num_experts": e,
         "moe_intermediate_size": f, "num_experts_per_tok": 1, "norm_topk_prob": True}))
    proc = run_cli("export", tmp_path / "ckpt", tmp_path / "hf", "--hf", "--config", tmp_path / "config.json",
                   check=True)
    assert "layers.0.moe.expert_bias (1 MoE layer): torchtitan's expert_bias is not zero (largest |bias| 0.5)" \
        in proc.stdout, proc.stdout
    assert sorted(_tensors(tmp_path / "hf"))[:3] == ["lm_head.weight", "model.embed_tokens.weight",
                                                      "model.layers.0.input_layernorm.weight"]


def test_renaming_qwen3_rotary_weights_to_hf_names_is_not_called_a_trap(qwen, tmp_path):
    """torchtitan's Qwen3 rotates halves, as HF does: renamed q/k weights need no permutation, so no note says so
    (the Llama's note is tests/test_export_hf.py's)."""
    rules = [r"--rename=^layers\.(\d+)\.attention\.qkv_linear\.w([qk])\.=model.layers.\1.self_attn.\2_proj."]
    proc = run_cli("export", qwen / "dense_untied" / "ckpt", tmp_path / "renamed.safetensors", *rules, check=True)
    assert "rotary permutation" not in proc.stdout, proc.stdout
