"""Tiny torchtitan Llama 3 checkpoints, written by torchtitan's own model class and torch's ``dcp.save`` (the state
dict as torchtitan's CheckpointManager lays it out: the model's keys at the top level beside ``optimizer`` and
``train_state``), with what the tests compare an export against: the model's own logits (torchtitan's forward under
``no_grad`` on CPU, fp32) and torchtitan's ``Llama3StateDictAdapter.to_hf`` output.

    python tests/torchtitan_writer.py ROOT

writes, for each variant in VARIANTS, ``ROOT/<name>/ckpt/`` (the DCP checkpoint), ``ROOT/<name>/config.json`` (an HF
LlamaConfig written from the torchtitan arguments), ``ROOT/<name>/tokens.safetensors``, ``logits.safetensors`` and
``to_hf.safetensors``. ``old_names``: the keys renamed to torchtitan's older generation (``attention.wq``,
``output``) before the save, as checkpoints written before the rename hold them."""

from __future__ import annotations

import json
import os
import sys

DIM, LAYERS, VOCAB, HIDDEN, SEQ = 64, 2, 128, 96, 12
THETA, EPS = 10000.0, 1e-5
VARIANTS = {  # name -> (heads, kv heads, tied, old names)
    "gqa_untied": (4, 2, False, False),
    "gqa_tied": (4, 1, True, False),
    "old_names": (4, 2, False, True),
}


def build(heads: int, kv_heads: int, tied: bool):
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    cfg = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB, enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM, eps=EPS),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_llama3_layers(n_layers=LAYERS, dim=DIM, n_heads=heads, n_kv_heads=kv_heads, hidden_dim=HIDDEN,
                                    rope=ComplexRoPE.Config(dim=DIM // heads, max_seq_len=64, theta=THETA),
                                    attn_backend="flex"))
    model = cfg.build()
    model.init_states()
    return cfg, model


def hf_config(heads: int, kv_heads: int, tied: bool) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": DIM,
            "intermediate_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": DIM // heads, "vocab_size": VOCAB, "rms_norm_eps": EPS,
            "rope_theta": THETA, "max_position_embeddings": 64, "tie_word_embeddings": tied,
            "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}


def old_name(key: str) -> str:
    return key.replace("attention.qkv_linear.", "attention.").replace("lm_head.", "output.")


def write(root: str, name: str, heads: int, kv_heads: int, tied: bool, old: bool) -> None:
    import torch
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    torch.manual_seed(len(name))
    cfg, model = build(heads, kv_heads, tied)
    with torch.no_grad():  # norms away from 1, so a wrong norm mapping shows in the logits
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # flex attention runs no backward on CPU: one step on set gradients
        p.grad = torch.randn_like(p) * 1e-3
    optim.step()
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    positions = torch.arange(SEQ).repeat(2, 1)
    with torch.no_grad():
        logits = model(tokens, positions, model.get_attention_masks(positions)).float()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hf = Llama3StateDictAdapter(cfg, None).to_hf(dict(state))
    out = os.path.join(root, name)
    os.makedirs(out, exist_ok=True)
    if old:
        state = {old_name(k): v for k, v in state.items()}
    save_reference(out, state, optim, tokens, logits, hf, hf_config(heads, kv_heads, tied))


def save_reference(out: str, state: dict, optim, tokens, logits, hf: dict, config: dict) -> None:
    """What a test compares an export with, under ``out``: the model and its optimizer's state saved as torchtitan
    saves them (``ckpt/``, by ``dcp.save``), the tokens and torchtitan's logits, its own ``to_hf`` tensors and the
    HF config the shapes fit."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    optim_state = {f"state.{i}.{k}": v for i, s in enumerate(optim.state.values()) for k, v in s.items()}
    dcp.save({**state, "optimizer": optim_state, "train_state": {"step": torch.tensor(1)}},
             checkpoint_id=os.path.join(out, "ckpt"))
    save_file({"tokens": tokens}, os.path.join(out, "tokens.safetensors"))
    save_file({"logits": logits}, os.path.join(out, "logits.safetensors"))
    save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(out, "to_hf.safetensors"))
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)


def main(root: str) -> None:
    for name, (heads, kv_heads, tied, old) in VARIANTS.items():
        write(root, name, heads, kv_heads, tied, old)


if __name__ == "__main__":
    main(sys.argv[1])
