"""A checkpoint laid out as torchtitan saves a Llama 3 (the model's keys at the top level, in its newer names, beside
``optimizer`` and ``train_state``), by names and shapes only: random values, written by torch's ``dcp.save`` in
this process, with the HF config its shapes fit. For the front ends of ``export --hf`` (the Export dialog, watch,
inspect), whose tests compare what they write with the CLI's export; the logits are tests/test_export_hf.py's,
with torchtitan itself."""

from __future__ import annotations

import json
from pathlib import Path

DIM, LAYERS, HEADS, KV_HEADS, HIDDEN, VOCAB = 32, 2, 4, 2, 48, 64
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": DIM,
          "intermediate_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
          "num_key_value_heads": KV_HEADS, "head_dim": DIM // HEADS, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": False}


def shapes() -> dict[str, tuple[int, ...]]:
    hd = DIM // HEADS
    out = {"tok_embeddings.weight": (VOCAB, DIM), "norm.weight": (DIM,), "lm_head.weight": (VOCAB, DIM)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        out.update({p + "attention.qkv_linear.wq.weight": (HEADS * hd, DIM),
                    p + "attention.qkv_linear.wk.weight": (KV_HEADS * hd, DIM),
                    p + "attention.qkv_linear.wv.weight": (KV_HEADS * hd, DIM),
                    p + "attention.wo.weight": (DIM, HEADS * hd), p + "feed_forward.w1.weight": (HIDDEN, DIM),
                    p + "feed_forward.w2.weight": (DIM, HIDDEN), p + "feed_forward.w3.weight": (HIDDEN, DIM),
                    p + "attention_norm.weight": (DIM,), p + "ffn_norm.weight": (DIM,)})
    return out


def write(ckpt: Path, seed: int = 0) -> None:
    """A DCP checkpoint at ``ckpt`` (resumable: Adam-like state beside the weights)."""
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(seed)
    model = {k: torch.randn(s, generator=g) for k, s in shapes().items()}
    optimizer = {f"state.{k}.exp_avg": torch.randn(s, generator=g) for k, s in list(shapes().items())[:3]}
    dcp.save({**model, "optimizer": optimizer, "train_state": {"step": torch.tensor(seed)}}, checkpoint_id=str(ckpt))


def write_config(path: Path) -> Path:
    path.write_text(json.dumps(CONFIG, indent=2))
    return path


def same_model_folder(a: Path, b: Path) -> None:
    """Two model folders hold the same files, the weights, their index and config.json byte for byte (our manifest
    aside: it says when it was written)."""
    from shardscope.backend.filenames import MANIFEST_NAME

    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and "config.json" in names, names
    for name in names:
        if name.endswith((".safetensors", ".json")) and name != MANIFEST_NAME:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
