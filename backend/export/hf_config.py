"""The Hugging Face config a checkpoint records: Megatron-LM's training arguments (``args`` in ``common.pt``, read by
the allow-list archive reader into the ``common.args`` entry) as the HF config of the model they built (a Llama, with
biases where ``add_bias_linear`` puts them; a Qwen2 where only q/k/v have biases), so that
``export --hf`` needs no ``--config``. Only what the arguments state is used; an argument whose model no HF class
computes (learned positions, LayerNorm, partial rotary, MoE, ...) is one line naming it, whatever the config."""

from __future__ import annotations

from typing import Any

from ..filenames import MEGATRON_COMMON
from .hf_model import HfModelError

MEGATRON_ARGS = "common.args"
# Megatron-LM's argument -> (its default when the arguments lack it, what the export needs, the need in words)
_SUPPORTED: dict[str, tuple[Any, Any, str]] = {
    "position_embedding_type": ("learned_absolute", "rope", "rotary position embeddings (rope)"),
    "normalization": ("LayerNorm", "RMSNorm", "RMSNorm"),
    "swiglu": (False, True, "a SwiGLU MLP (swiglu)"),
    "rotary_percent": (1.0, 1.0, "rotary embeddings over the whole head (rotary_percent 1.0)"),
    "use_rope_scaling": (False, False, "no rotary scaling (use_rope_scaling False)"),
    "apply_layernorm_1p": (False, False, "norm weights as stored (apply_layernorm_1p False)"),
    "qk_layernorm": (False, False, "no q/k norm (qk_layernorm False)"),
    "multi_latent_attention": (False, False, "standard attention (multi_latent_attention False)"),
    "num_experts": (None, None, "a dense MLP (num_experts None)"),
    "squared_relu": (False, False, "a SwiGLU MLP (squared_relu False)"),
}


def megatron_args(ckpt: Any) -> dict[str, Any] | None:
    """Megatron's training arguments as ``common.pt`` records them (plain data), or None when it records none."""
    try:
        value = ckpt.object(MEGATRON_ARGS).value
    except KeyError:
        return None
    if not isinstance(value, dict):
        return None
    return {k: v for k, v in value.items() if k != "__class__"}


def unread_args(ckpt: Any) -> str | None:
    """Why ``common.pt`` (and so Megatron's arguments) could not be read, as the checkpoint's problem says; None."""
    return next((p.message for p in ckpt.problems if p.file == MEGATRON_COMMON and p.kind == "unreadable"), None)


def check_megatron_args(args: dict[str, Any], where: str) -> None:
    """:class:`HfModelError` naming the first argument whose model a Hugging Face Llama/Qwen2 does not compute."""
    for key, (default, want, words) in _SUPPORTED.items():
        value = args.get(key, default)
        if value != want and not (want is False and value is None):
            raise HfModelError(f"{where}: {key} is {value!r:.80}; the Hugging Face export writes models with {words}.")


def _positive(args: dict[str, Any], key: str, where: str) -> int:
    value = args.get(key)
    if value is None:
        raise HfModelError(f"{where}: gives no {key}; give the HF config.json of the model it trains.")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise HfModelError(f"{where}: {key} is {value!r:.80}, not a positive whole number.")
    return value


def _number(args: dict[str, Any], key: str, default: float, where: str) -> float:
    value = args.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise HfModelError(f"{where}: {key} is {value!r:.80}, not a positive number.")
    return value


def _vocab(args: dict[str, Any], where: str) -> int:
    """The tokenizer's vocabulary (what the padding is removed to): Megatron records only the padded size and, for
    its NullTokenizer, ``vocab_size`` before the EOD token that tokenizer adds."""
    padded = _positive(args, "padded_vocab_size", where)
    tokenizer = args.get("tokenizer_type")
    if tokenizer != "NullTokenizer" or args.get("vocab_size") is None:
        raise HfModelError(f"{where}: records the padded vocabulary ({padded}) but not the "
                           f"{tokenizer or 'tokenizer'}'s vocab_size; give the HF config.json of the model it trains "
                           "(its vocab_size).")
    vocab = _positive(args, "vocab_size", where) + 1  # NullTokenizer: vocab_size plus its EOD token
    if vocab > padded:
        raise HfModelError(f"{where}: vocab_size {vocab} is more than padded_vocab_size {padded}.")
    return vocab


def config_from_megatron_args(args: dict[str, Any], where: str) -> dict[str, Any]:
    """The HF config (``config.json``'s content) of the GPT model Megatron's arguments built: a Llama (with biases on
    every linear layer: ``add_bias_linear``), or a Qwen2 where only q/k/v have biases (``add_qkv_bias``).
    :class:`HfModelError` naming the first value the arguments lack."""
    check_megatron_args(args, where)
    heads = _positive(args, "num_attention_heads", where)
    hidden = _positive(args, "hidden_size", where)
    kv_heads = _positive(args, "num_query_groups", where) if args.get("group_query_attention") else heads
    head_dim = _positive(args, "kv_channels", where) if args.get("kv_channels") is not None else hidden // heads
    positions = args.get("max_position_embeddings") or args.get("seq_length")
    doc: dict[str, Any] = {
        "model_type": "qwen2" if args.get("add_qkv_bias") and not args.get("add_bias_linear", True) else "llama",
        "hidden_size": hidden, "num_hidden_layers": _positive(args, "num_layers", where),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": _positive(args, "ffn_hidden_size", where), "vocab_size": _vocab(args, where),
        "rope_theta": float(_number(args, "rotary_base", 10000, where)),
        "rms_norm_eps": float(_number(args, "norm_epsilon", 1e-5, where)),
        "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False), "hidden_act": "silu"}
    if positions is not None:
        doc["max_position_embeddings"] = _positive({"max_position_embeddings": positions},
                                                   "max_position_embeddings", where)
    if doc["model_type"] == "llama":  # Megatron's default: a bias on every linear layer (add_bias_linear)
        biased = bool(args.get("add_bias_linear", True))
        doc.update(attention_bias=biased, mlp_bias=biased)
    return doc


__all__ = ["MEGATRON_ARGS", "check_megatron_args", "config_from_megatron_args", "megatron_args", "unread_args"]
