"""Tiny torchtitan Qwen3 checkpoints, dense and MoE, written by torchtitan's own model classes and torch's
``dcp.save`` (the model's keys at the top level beside ``optimizer`` and ``train_state``, as torchtitan's
CheckpointManager lays them out), with what the tests compare an export against: the model's own logits (torchtitan's
forward under ``no_grad`` on CPU, fp32) and torchtitan's ``Qwen3StateDictAdapter.to_hf`` output.

    python tests/torchtitan_qwen3_writer.py ROOT

writes, for each variant in VARIANTS, ``ROOT/<name>/ckpt/``, ``config.json`` (the HF config written from the torchtitan
arguments), ``tokens.safetensors``, ``logits.safetensors`` and ``to_hf.safetensors``. Every variant has head_dim !=
dim/heads and GQA. ``dense_w13``: the feed-forward saved as torchtitan's fused ``w13`` (``[F, 2, D]``, its
FusedSwiGLU's native key). ``moe_old_names``: the keys renamed to the older generation (``attention.wq``, ``output``,
``moe.experts.w1``, ``moe.expert_bias``) before the save.

NOTE: torchtitan's GroupedExperts cast activations and weights to bf16 for ``torch._grouped_mm``; the MoE reference
logits run the same grouped matmuls in fp32 (the casts left out, nothing else changed) so a 1e-4 fp32 comparison means
something; ``logits_bf16.safetensors`` holds the unchanged forward's logits too."""

from __future__ import annotations

import json
import os
import sys

from torchtitan_writer import save_reference  # tests/, this script's folder

DIM, LAYERS, VOCAB, HIDDEN, MOE_HIDDEN, SEQ = 64, 2, 128, 96, 32, 12
HEADS, HEAD_DIM, THETA, EPS = 4, 24, 1000000.0, 1e-6
EXPERTS, TOP_K = 4, 2
VARIANTS = {  # name -> (kv heads, tied, MoE, old names, fused w13)
    "dense_untied": (2, False, False, False, False),
    "dense_w13": (1, True, False, False, True),
    "moe": (2, False, True, False, False),
    "moe_old_names": (2, False, True, True, False),
}


def build(kv_heads: int, tied: bool, moe: bool):
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _build_qwen3_moe_layers, _qwen3_norm

    rope = CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=64, theta=THETA)
    common = {"n_layers": LAYERS, "dim": DIM, "n_heads": HEADS, "n_kv_heads": kv_heads, "head_dim": HEAD_DIM,
              "attn_backend": "flex", "rope": rope}
    layers = (_build_qwen3_moe_layers(moe_hidden_dim=MOE_HIDDEN, num_experts=EXPERTS, top_k=TOP_K,
                                      moe_comm_backend="standard", **common)
              if moe else _build_qwen3_layers(hidden_dim=HIDDEN, **common))
    cfg = Qwen3Model.Config(dim=DIM, vocab_size=VOCAB, enable_weight_tying=tied, norm=_qwen3_norm(DIM),
                            tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
                            lm_head=Linear.Config(in_features=DIM, out_features=VOCAB), layers=layers)
    model = cfg.build()
    model.init_states()
    return cfg, model


def hf_config(kv_heads: int, tied: bool, moe: bool) -> dict:
    doc = {"model_type": "qwen3", "hidden_size": DIM, "intermediate_size": HIDDEN, "num_hidden_layers": LAYERS,
           "num_attention_heads": HEADS, "num_key_value_heads": kv_heads, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
           "rms_norm_eps": EPS, "rope_theta": THETA, "max_position_embeddings": 64, "tie_word_embeddings": tied,
           "attention_bias": False, "hidden_act": "silu", "use_sliding_window": False}
    if moe:  # torchtitan's router: softmax, top-k, scores renormalised (route_norm) -> norm_topk_prob
        doc.update(model_type="qwen3_moe", num_experts=EXPERTS, moe_intermediate_size=MOE_HIDDEN,
                   num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return doc


def old_name(key: str) -> str:
    for new, old in (("attention.qkv_linear.", "attention."), ("lm_head.", "output."),
                     ("moe.routed_experts.inner_experts.", "moe.experts."), ("_EFD", ""), ("_EDF", ""),
                     ("expert_bias_E", "expert_bias")):
        key = key.replace(new, old)
    return key


def fp32_experts(self, x_RD, num_tokens_per_expert_E):
    """torchtitan's GroupedExperts.forward without its bf16 casts: the same grouped matmuls in fp32."""
    import torch
    import torch.nn.functional as F

    offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x_RD, self.w1_EFD.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x_RD, self.w3_EFD.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, self.w2_EDF.transpose(-2, -1), offs=offsets).type_as(x_RD)


def forward(model, tokens):
    import torch

    positions = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)
    with torch.no_grad():
        return model(tokens, positions, model.get_attention_masks(positions)).float()


def write(root: str, name: str, kv_heads: int, tied: bool, moe: bool, old: bool, w13: bool) -> None:
    import torch
    from safetensors.torch import save_file
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    torch.manual_seed(len(name))
    cfg, model = build(kv_heads, tied, moe)
    with torch.no_grad():  # norms away from 1, layers' weights that move the logits: a wrong mapping shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.startswith("layers."):
                p.normal_(0, 0.5 if "router" in n else 0.1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # flex attention runs no backward on CPU: one step on set gradients
        p.grad = torch.randn_like(p) * 1e-3
    optim.step()
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    out = os.path.join(root, name)
    os.makedirs(out, exist_ok=True)
    if moe:
        save_file({"logits": forward(model, tokens)}, os.path.join(out, "logits_bf16.safetensors"))
        stock = GroupedExperts.forward
        GroupedExperts.forward = fp32_experts
        try:
            logits = forward(model, tokens)
        finally:
            GroupedExperts.forward = stock
    else:
        logits = forward(model, tokens)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hf = Qwen3StateDictAdapter(cfg, None).to_hf(dict(state))
    if w13:  # FusedSwiGLU's native key: w13[:, 0] the gate (w1), w13[:, 1] the up (w3)
        for i in range(LAYERS):
            p = f"layers.{i}.feed_forward."
            state[p + "w13"] = torch.stack([state.pop(p + "w1.weight"), state.pop(p + "w3.weight")], dim=1)
    if old:
        state = {old_name(k): v for k, v in state.items()}
    save_reference(out, state, optim, tokens, logits, hf, hf_config(kv_heads, tied, moe))
    with open(os.path.join(out, "keys.json"), "w", encoding="utf-8") as fh:
        json.dump(sorted(state), fh, indent=1)


def main(root: str) -> None:
    for name, args in VARIANTS.items():
        write(root, name, *args)


if __name__ == "__main__":
    main(sys.argv[1])
