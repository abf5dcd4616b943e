"""The export plan (backend/export/planner.py): --only/--exclude/--rename/--strip-prefix errors, and the plan is
not mutated."""

from __future__ import annotations

import pytest
from shardscope.backend.export import ExportError, export, plan_export
from shardscope.backend.formats import open_checkpoint


def test_exclude_and_prefix_errors_and_plan_is_not_mutated(fixtures, tmp_path):
    ckpt = open_checkpoint(fixtures["fsdp2_r2"])
    plan = plan_export(ckpt, "safetensors", exclude=["model.head"])
    assert all(not it.entry.fqn.startswith("model.head") for it in plan.items)
    assert any("under model.head, left out as asked" in n for n in plan.left_out)
    with pytest.raises(ExportError, match=r"model\.nosuch \(a prefix to leave out\) matches no entry"):
        plan_export(ckpt, "safetensors", exclude=["model.nosuch"])
    with pytest.raises(ExportError, match="rename rule 'no-equals-sign': write it as REGEX=REPLACEMENT"):
        plan_export(ckpt, "safetensors", rename=["no-equals-sign"])
    before = (plan.items, plan.left_out)
    export(plan, str(tmp_path / "a.safetensors"))
    assert (plan.items, plan.left_out) == before


def test_a_hugging_face_plan_says_its_transforms_counted_in_layers():
    """What the Export dialog and the plan's notes say a Hugging Face export will do, from names and shapes alone:
    Megatron's stacked layers, fused QKV and gate/up split in every layer, the vocabulary padding removed from the
    embedding and the output layer; torchtitan's q and k permuted in every layer."""
    from shardscope.backend.export.hf_model import HfConfig, describe_transforms, map_names

    h, layers, heads, kv, d, f, vocab = 16, 3, 4, 2, 4, 24, 50
    cfg = HfConfig.from_json({"model_type": "llama", "hidden_size": h, "num_hidden_layers": layers,
                              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
                              "intermediate_size": f, "vocab_size": vocab}, "config.json")
    megatron = {"embedding.word_embeddings.weight": (64, h), "output_layer.weight": (64, h),
                "decoder.final_layernorm.weight": (h,),
                "decoder.layers.self_attention.linear_qkv.weight": (layers, (heads + 2 * kv) * d, h),
                "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (layers, h),
                "decoder.layers.self_attention.linear_proj.weight": (layers, h, heads * d),
                "decoder.layers.mlp.linear_fc1.layer_norm_weight": (layers, h),
                "decoder.layers.mlp.linear_fc1.weight": (layers, 2 * f, h),
                "decoder.layers.mlp.linear_fc2.weight": (layers, h, f)}
    said = describe_transforms(map_names(megatron, "Megatron-Core", cfg, False).tensors)
    assert sorted(said) == sorted([
        "stacked layers split in 3 layers", "fused QKV split by KV groups in 3 layers",
        "fused gate/up halves split in 3 layers",
        "vocabulary padding removed (lm_head.weight, model.embed_tokens.weight)"]), said
    titan = {"tok_embeddings.weight": (vocab, h), "norm.weight": (h,), "output.weight": (vocab, h)}
    for i in range(layers):
        p = f"layers.{i}."
        titan |= {p + "attention.wq.weight": (heads * d, h), p + "attention.wk.weight": (kv * d, h),
                  p + "attention.wv.weight": (kv * d, h), p + "attention.wo.weight": (h, heads * d),
                  p + "feed_forward.w1.weight": (f, h), p + "feed_forward.w2.weight": (h, f),
                  p + "feed_forward.w3.weight": (f, h), p + "attention_norm.weight": (h,), p + "ffn_norm.weight": (h,)}
    said = describe_transforms(map_names(titan, "torchtitan", cfg, True).tensors)
    assert said == ["rotary permutation of q and k in 3 layers"]
