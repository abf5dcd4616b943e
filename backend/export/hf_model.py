"""A Hugging Face causal-LM export's names: which trainer's naming scheme the model tensors are in (torchtitan in
both of its name generations, Megatron-Core with its local or Transformer Engine layer names, or HF's own names
under a container), the HF config the shapes must fit, and for every source tensor the HF tensors it becomes with
the exact transforms (``hf_transforms``) each needs. Names and shapes only: nothing is read here."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ShardscopeError
from .hf_transforms import Step, Transform

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")  # HF models with q_norm/k_norm per head
# (Megatron's local layers save ``_extra_state`` as one ShardedObject per rank: ``..._extra_state/shard_0_2``)
LEFT_OUT_BUFFERS = re.compile(r"(^|\.)(inv_freq|_extra_state)$|\._extra_state[./]|(^|\.)rotary_emb\.")


class HfModelError(ShardscopeError):
    """A source HF export cannot name exactly (one line, exit 2)."""


@dataclass(frozen=True, slots=True)
class HfConfig:
    """What the HF config says of the shapes: the values every tensor is checked against."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    doc: dict
    experts: int = 0  # a MoE's routed experts per MoE layer (0: a dense model)
    moe_intermediate: int = 0
    moe_layers: frozenset[int] = frozenset()  # the layers whose MLP is the experts (HF's decoder_sparse_step rule)
    biases: tuple[str, ...] = ()  # the per-layer biases HF's model has (``self_attn.q_proj.bias``, ...)

    @classmethod
    def from_json(cls, doc: dict, where: str) -> HfConfig:
        """The config's values; :class:`HfModelError` naming the first value it lacks (never a guess)."""
        def need(key: str) -> Any:
            value = doc.get(key)
            if value is None:
                raise HfModelError(f"{where}: the config gives no {key}; it is needed to name and check the "
                                   "Hugging Face tensors.")
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise HfModelError(f"{where}: {key} is {value!r}, not a positive whole number.")
            return value

        model_type = doc.get("model_type")
        if model_type not in SUPPORTED_TYPES:
            raise HfModelError(f"{where}: model_type {model_type!r} is not one the export names; it writes "
                               f"{', '.join(SUPPORTED_TYPES)}.")
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        kv = need("num_key_value_heads") if "num_key_value_heads" in doc else heads
        head_dim = need("head_dim") if doc.get("head_dim") is not None else hidden // heads
        if heads % kv:
            raise HfModelError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}.")
        cfg = cls(model_type, hidden, need("num_hidden_layers"), heads, kv, head_dim, need("intermediate_size"),
                  need("vocab_size"), bool(doc.get("tie_word_embeddings", False)), doc,
                  biases=_biases(model_type, doc))
        return _with_experts(cfg, need, where) if model_type == "qwen3_moe" else cfg

    def expected_shape(self, hf_name: str) -> tuple[int, ...] | None:
        """The shape HF's model has for ``hf_name`` (None: a name the check does not know)."""
        q, kv, h, f = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        table = {"model.embed_tokens.weight": (self.vocab, h), "lm_head.weight": (self.vocab, h),
                 "model.norm.weight": (h,), "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
                 "self_attn.o_proj.bias": (h,), "mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,),
                 "mlp.down_proj.bias": (h,),
                 "self_attn.q_norm.weight": (self.head_dim,), "self_attn.k_norm.weight": (self.head_dim,),
                 "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
                 "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
        m = re.match(r"model\.layers\.(\d+)\.(.*)$", hf_name)
        if m is None:
            return table.get(hf_name)
        part, moe = m.group(2), int(m.group(1)) in self.moe_layers
        if part.startswith(("self_attn.q_norm.", "self_attn.k_norm.")) and self.model_type not in QK_NORM_TYPES:
            return None
        if part.startswith("mlp."):
            return _moe_shape(self, part) if moe else table.get(part)
        return table.get(part)

    def required_names(self) -> list[str]:
        """Every tensor HF's model loads."""
        per_layer = [*self.biases, "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
        if self.model_type in QK_NORM_TYPES:
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        dense = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
        moe = ["mlp.gate.weight"] + [f"mlp.experts.{e}.{p}.weight" for e in range(self.experts)
                                     for p in ("gate_proj", "up_proj", "down_proj")]
        return (["model.embed_tokens.weight", "model.norm.weight"] + ([] if self.tied else ["lm_head.weight"])
                + [f"model.layers.{i}.{p}" for i in range(self.layers)
                   for p in per_layer + (moe if i in self.moe_layers else dense)])


def _with_experts(cfg: HfConfig, need: Callable[[str], Any], where: str) -> HfConfig:
    """A Qwen3-MoE config's experts: their count and size, and which layers are MoE (HF's rule: not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``, both with HF's defaults). The routing values the
    weights cannot show (``num_experts_per_tok``, ``norm_topk_prob``) must be given: never a guess."""
    doc = cfg.doc
    experts = need("num_local_experts" if "num_local_experts" in doc else "num_experts")
    need("num_experts_per_tok")
    if not isinstance(doc.get("norm_topk_prob"), bool):
        raise HfModelError(f"{where}: the config gives no norm_topk_prob (true or false); it decides how the router "
                           "weighs the chosen experts (torchtitan's route_norm) and the weights cannot say it.")
    step = need("decoder_sparse_step") if "decoder_sparse_step" in doc else 1
    dense = doc.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise HfModelError(f"{where}: mlp_only_layers is {dense!r}, not a list of layer numbers.")
    moe = frozenset(i for i in range(cfg.layers) if i not in dense and (i + 1) % step == 0)
    return replace(cfg, experts=experts, moe_intermediate=need("moe_intermediate_size"), moe_layers=moe)


def _moe_shape(cfg: HfConfig, part: str) -> tuple[int, ...] | None:
    """The shape of a MoE layer's ``mlp.*`` tensor (the router and one expert's projections) in HF's Qwen3-MoE."""
    if part == "mlp.gate.weight":
        return (cfg.experts, cfg.hidden)
    m = re.match(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", part)
    if m is None or int(m.group(1)) >= cfg.experts:
        return None
    f, h = cfg.moe_intermediate, cfg.hidden
    return (h, f) if m.group(2) == "down_proj" else (f, h)


_QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


def _biases(model_type: str, doc: dict) -> tuple[str, ...]:
    """The per-layer biases transformers' model of ``model_type`` builds for the config ``doc``: Qwen2's q/k/v always;
    Llama's and Qwen3's attention with ``attention_bias``, Llama's MLP with ``mlp_bias``; Mistral's none."""
    if model_type == "qwen2":
        return _QKV_BIASES
    out: tuple[str, ...] = ()
    if model_type in ("llama", "qwen3") and doc.get("attention_bias"):
        out += (*_QKV_BIASES, "self_attn.o_proj.bias")
    if model_type == "llama" and doc.get("mlp_bias"):
        out += ("mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")
    return out


@dataclass(frozen=True, slots=True)
class HfTensor:
    """One output tensor: its name (HF's in an export, torchtitan's in an import), the source tensor's key and the
    transform (None: written as stored)."""

    name: str
    source: str
    transform: Transform | None


# A rule: a source name pattern and what it becomes: (HF name template, steps) pairs, where ``{i}`` is the layer
Rule = tuple[re.Pattern, Callable[[HfConfig, bool], list[tuple[str, tuple[Step, ...]]]]]
_L = "model.layers.{i}."


def _one(name: str, *steps: Step) -> Callable[[HfConfig, bool], list[tuple[str, tuple[Step, ...]]]]:
    return lambda cfg, interleaved: [(name, steps)]


def _rotary(name: str, heads: Callable[[HfConfig], int]) -> Callable:
    return lambda cfg, interleaved: [(name, (Step("rotary", (heads(cfg),)),) if interleaved else ())]


def _megatron_qkv(kind: str) -> Callable:
    def parts(cfg: HfConfig, interleaved: bool) -> list[tuple[str, tuple[Step, ...]]]:
        g = cfg.heads // cfg.kv_heads
        n_kv, d = cfg.kv_heads, cfg.head_dim
        out: list[tuple[str, tuple[Step, ...]]] = []
        for proj, (a, b), heads in (("q", (0, g), cfg.heads), ("k", (g, g + 1), n_kv), ("v", (g + 1, g + 2), 0)):
            steps: tuple[Step, ...] = (Step("groups", (n_kv, g + 2, d, a, b)),)
            if interleaved and heads:
                steps += (Step("rotary", (heads,)),)
            out.append((f"{_L}self_attn.{proj}_proj.{kind}", steps))
        return out
    return parts


def _experts(proj: str) -> Callable:
    """torchtitan's stacked experts ``[E, ...]``: one HF tensor per expert (none where the config has no experts)."""
    return lambda cfg, il: [(f"{_L}mlp.experts.{e}.{proj}.weight", (Step("index", (e, cfg.experts)),))
                            for e in range(cfg.experts)]


def _halves(gate: str, up: str) -> Callable:
    f = lambda cfg: cfg.intermediate  # noqa: E731
    return lambda cfg, interleaved: [(gate, (Step("rows", (0, f(cfg))),)),
                                     (up, (Step("rows", (f(cfg), 2 * f(cfg))),))]


_TT_LAYER = r"^layers\.(?P<i>\d+)\."
_TT_EXPERTS = r"moe\.(routed_experts\.inner_experts|experts)\."
TORCHTITAN: list[Rule] = [
    (re.compile(r"^tok_embeddings\.weight$"), _one("model.embed_tokens.weight")),
    (re.compile(r"^norm\.weight$"), _one("model.norm.weight")),
    (re.compile(r"^(output|lm_head)\.weight$"), _one("lm_head.weight")),
    (re.compile(_TT_LAYER + r"attention\.(qkv_linear\.)?wq\.(?P<k>weight|bias)$"),
     _rotary(_L + "self_attn.q_proj.{k}", lambda c: c.heads)),
    (re.compile(_TT_LAYER + r"attention\.(qkv_linear\.)?wk\.(?P<k>weight|bias)$"),
     _rotary(_L + "self_attn.k_proj.{k}", lambda c: c.kv_heads)),
    (re.compile(_TT_LAYER + r"attention\.(qkv_linear\.)?wv\.(?P<k>weight|bias)$"), _one(_L + "self_attn.v_proj.{k}")),
    (re.compile(_TT_LAYER + r"attention\.wo\.weight$"), _one(_L + "self_attn.o_proj.weight")),
    (re.compile(_TT_LAYER + r"attention\.q_norm\.weight$"), _one(_L + "self_attn.q_norm.weight")),
    (re.compile(_TT_LAYER + r"attention\.k_norm\.weight$"), _one(_L + "self_attn.k_norm.weight")),
    (re.compile(_TT_LAYER + r"feed_forward\.w1\.weight$"), _one(_L + "mlp.gate_proj.weight")),
    (re.compile(_TT_LAYER + r"feed_forward\.w3\.weight$"), _one(_L + "mlp.up_proj.weight")),
    (re.compile(_TT_LAYER + r"feed_forward\.w2\.weight$"), _one(_L + "mlp.down_proj.weight")),
    (re.compile(_TT_LAYER + r"feed_forward\.w13(\.weight)?$"),
     lambda cfg, il: [(_L + "mlp.gate_proj.weight", (Step("pair", (0,)),)),
                      (_L + "mlp.up_proj.weight", (Step("pair", (1,)),))]),
    (re.compile(_TT_LAYER + r"attention_norm\.weight$"), _one(_L + "input_layernorm.weight")),
    (re.compile(_TT_LAYER + r"ffn_norm\.weight$"), _one(_L + "post_attention_layernorm.weight")),
    # MoE (Qwen3-MoE), both name generations: moe.experts.w1 and moe.routed_experts.inner_experts.w1_EFD
    (re.compile(_TT_LAYER + r"moe\.router\.gate\.weight$"), _one(_L + "mlp.gate.weight")),
    (re.compile(_TT_LAYER + _TT_EXPERTS + r"w1(_EFD)?$"), _experts("gate_proj")),
    (re.compile(_TT_LAYER + _TT_EXPERTS + r"w3(_EFD)?$"), _experts("up_proj")),
    (re.compile(_TT_LAYER + _TT_EXPERTS + r"w2(_EDF)?$"), _experts("down_proj")),
]
# torchtitan's MoE routing state: the load-balancing bias (used only to choose experts) and the token counts
_TT_ROUTING_STATE = re.compile(_TT_LAYER + r"moe\.(expert_bias|tokens_per_expert)(_E)?$")
ROUTING_BIAS = re.compile(_TT_LAYER + r"moe\.expert_bias(_E)?$")
_TT_SHARED_EXPERTS = re.compile(_TT_LAYER + r"moe\.shared_experts?\.")
_TT_QK_NORM = re.compile(_TT_LAYER + r"attention\.[qk]_norm\.weight$")

# Megatron-Core: layers stacked on a prepended axis (torch_dist: "decoder.layers.X") or numbered ("decoder.layers.3.X")
_MG_LAYER = r"^decoder\.layers\.(?:(?P<i>\d+)\.)?"
MEGATRON: list[Rule] = [
    (re.compile(r"^embedding\.word_embeddings\.weight$"), _one("model.embed_tokens.weight")),
    (re.compile(r"^decoder\.final_(layer)?norm\.weight$"), _one("model.norm.weight")),
    (re.compile(r"^output_layer\.weight$"), _one("lm_head.weight")),
    (re.compile(_MG_LAYER + r"self_attention\.linear_qkv\.(?P<k>weight|bias)$"), _megatron_qkv("{k}")),
    (re.compile(_MG_LAYER + r"(self_attention\.linear_qkv\.layer_norm_weight|input_layernorm\.weight)$"),
     _one(_L + "input_layernorm.weight")),
    (re.compile(_MG_LAYER + r"self_attention\.linear_proj\.(?P<k>weight|bias)$"), _one(_L + "self_attn.o_proj.{k}")),
    (re.compile(_MG_LAYER + r"self_attention\.q_layernorm\.weight$"), _one(_L + "self_attn.q_norm.weight")),
    (re.compile(_MG_LAYER + r"self_attention\.k_layernorm\.weight$"), _one(_L + "self_attn.k_norm.weight")),
    (re.compile(_MG_LAYER + r"(mlp\.linear_fc1\.layer_norm_weight|pre_mlp_layernorm\.weight)$"),
     _one(_L + "post_attention_layernorm.weight")),
    (re.compile(_MG_LAYER + r"mlp\.linear_fc1\.(?P<k>weight|bias)$"),
     _halves(_L + "mlp.gate_proj.{k}", _L + "mlp.up_proj.{k}")),
    (re.compile(_MG_LAYER + r"mlp\.linear_fc2\.(?P<k>weight|bias)$"), _one(_L + "mlp.down_proj.{k}")),
]

_HF_NAME = re.compile(r"^(model\.(embed_tokens|norm|layers\.\d+)\.|lm_head\.)")
HF: list[Rule] = [(_HF_NAME, lambda cfg, il: [])]  # names kept as they are (see map_names)

# scheme name -> (its rules, whether its rotary layout pairs adjacent dimensions (so q and k need the permutation))
SCHEMES = {"torchtitan": TORCHTITAN, "Megatron-Core": MEGATRON, "Hugging Face": HF}


def recognise_scheme(names: list[str]) -> str:
    """The naming scheme of a model's tensor keys; :class:`HfModelError` when it is none of them."""
    if any(n.startswith(("model.embed_tokens.", "model.layers.")) for n in names):
        return "Hugging Face"
    if any(n.startswith(("decoder.layers.", "embedding.word_embeddings.")) for n in names):
        return "Megatron-Core"
    if any(n.startswith(("tok_embeddings.", "layers.")) for n in names):
        return "torchtitan"
    raise HfModelError("the model's tensor names are in no scheme the Hugging Face export knows (torchtitan, "
                       f"Megatron-Core, Hugging Face names); first names: {', '.join(names[:4])}.")


def interleaved_rotary(scheme: str, cfg: HfConfig, recorded: dict | None = None) -> bool:
    """Whether q and k are stored with adjacent rotary pairs (HF rotates halves): torchtitan's Llama (complex RoPE)
    is; its Qwen3 and Megatron's default are not (Megatron's ``rotary_interleaved`` says when it is)."""
    if scheme == "torchtitan":
        return cfg.model_type in ("llama", "mistral")
    if scheme == "Megatron-Core":
        return bool((recorded or {}).get("rotary_interleaved", False))
    return False


@dataclass(frozen=True, slots=True)
class HfMapping:
    """What a source's model tensors become: the output tensors in order, and what is left out, with why."""

    tensors: tuple[HfTensor, ...]
    left_out: tuple[str, ...]
    transforms: tuple[str, ...]  # every kind of transform applied, in words (the notes and the lineage sidecar)


def outputs_of(name: str, shape: tuple[int, ...], rules: list[Rule], cfg: HfConfig,
             interleaved: bool) -> list[tuple[str, tuple[Step, ...]]] | None:
    """The (HF name, steps) a source tensor becomes; None when no rule names it."""
    for pattern, make in rules:
        m = pattern.match(name)
        if m is None:
            continue
        if rules is HF:
            return [(name, ())]
        groups = m.groupdict()
        fill = {"k": groups.get("k") or "weight"}
        made = [(n.replace("{k}", fill["k"]), steps) for n, steps in make(cfg, interleaved)]
        if not made:  # stacked experts, and a config with none
            raise HfModelError(f"{name}: a MoE's stacked experts, but the config ({cfg.model_type}) has no experts; "
                               "give the MoE's config (model_type qwen3_moe with num_experts).")
        if "i" not in groups:  # not a per-layer tensor
            return made
        if groups["i"] is not None:
            return [(n.replace("{i}", groups["i"]), steps) for n, steps in made]
        if not shape or shape[0] != cfg.layers:  # Megatron's stacked layers: one output per layer
            raise HfModelError(f"{name}: shape {list(shape)} is not {cfg.layers} stacked layers (the config's "
                               "num_hidden_layers).")
        return [(n.replace("{i}", str(i)), (Step("index", (i,)), *steps))
                for i in range(cfg.layers) for n, steps in made]
    return None


def _check_torchtitan_family(names: list[str], cfg: HfConfig) -> None:
    """torchtitan's Llama (adjacent rotary pairs: permuted) and Qwen3 (halves already: not permuted) told apart by
    both the names (Qwen3 has q/k norms) and the config's model_type; :class:`HfModelError` where they disagree."""
    qk_norm = next((n for n in names if _TT_QK_NORM.match(n)), None)
    shared = next((n for n in names if _TT_SHARED_EXPERTS.match(n)), None)
    if shared:
        raise HfModelError(f"{shared}: shared experts, which Hugging Face's {cfg.model_type} model does not have "
                           "(Qwen3-MoE has routed experts only); the export cannot write this model exactly.")
    if qk_norm and cfg.model_type not in QK_NORM_TYPES:
        raise HfModelError(f"{qk_norm}: a torchtitan Qwen3 (q/k norms, rotary halves), but the config's model_type "
                           f"is {cfg.model_type} (a Llama's adjacent rotary pairs); give the Qwen3 config.")
    if not qk_norm and cfg.model_type in QK_NORM_TYPES and any(n.startswith("layers.") for n in names):
        first = next(n for n in names if n.startswith("layers."))
        raise HfModelError(f"{first}: the checkpoint has no q_norm/k_norm (a torchtitan Llama, adjacent rotary "
                           f"pairs), but the config's model_type is {cfg.model_type}; give the Llama config.")


def _vocab_rows(hf_name: str, shape: tuple[int, ...], cfg: HfConfig) -> tuple[Step, ...]:
    """Rows past the config's vocab_size removed from the embedding and the output layer (padding)."""
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight") and shape and shape[0] > cfg.vocab:
        return (Step("rows", (0, cfg.vocab)),)
    return ()


def map_names(shapes: dict[str, tuple[int, ...]], scheme: str, cfg: HfConfig, interleaved: bool) -> HfMapping:
    """Every source model tensor (key -> shape) to its HF tensors, every output shape checked against the config
    before anything is written; :class:`HfModelError` naming the first tensor that does not fit, a source tensor no
    rule names, or an HF tensor no source tensor makes."""
    rules = SCHEMES[scheme]
    out: dict[str, HfTensor] = {}
    left_out: list[str] = []
    kinds: set[str] = set()
    if scheme == "torchtitan":
        _check_torchtitan_family(list(shapes), cfg)
    for name, shape in shapes.items():
        if LEFT_OUT_BUFFERS.search(name):
            left_out.append(f"{name}: a buffer Hugging Face's model does not load (rotary frequencies or "
                            "Transformer Engine's extra state)")
            continue
        if scheme == "torchtitan" and _TT_ROUTING_STATE.match(name):
            left_out.append(f"{name}: torchtitan's load-balancing routing state; Hugging Face's {cfg.model_type} "
                            "router has none (torchtitan's to_hf leaves it out too): it routes as if it were zero")
            continue
        made = outputs_of(name, shape, rules, cfg, interleaved)
        if made is None:
            raise HfModelError(f"{name}: no {scheme} rule names this tensor for a Hugging Face {cfg.model_type} "
                               "model; leave it out or rename it.")
        for hf_name, steps in made:
            if hf_name == "lm_head.weight" and cfg.tied:
                left_out.append(f"{name}: the output layer, tied to the embedding (tie_word_embeddings)")
                continue
            steps = tuple(steps)
            transform = Transform(steps) if steps else None
            try:
                shaped = transform.shape(shape) if transform else tuple(shape)
            except ValueError as exc:
                raise HfModelError(f"{name}: {exc} (for {hf_name}).") from None
            padding = _vocab_rows(hf_name, shaped, cfg)
            if padding:
                transform = Transform(steps + padding)
                shaped = transform.shape(shape)
            want = cfg.expected_shape(hf_name)
            if hf_name.endswith(".bias") and hf_name.split(".", 3)[-1] not in cfg.biases:
                raise HfModelError(f"{name}: becomes {hf_name}, a bias the config's {cfg.model_type} model does not "
                                   "have (attention_bias, mlp_bias); check the config against the checkpoint.")
            if want is None or shaped != want:
                why = "a name HF's model does not have" if want is None else f"the config says {list(want)}"
                raise HfModelError(f"{name}: becomes {hf_name} of shape {list(shaped)}, but {why}; check the "
                                   "config against the checkpoint.")
            if hf_name in out:
                raise HfModelError(f"{name} and {out[hf_name].source} both become {hf_name}.")
            out[hf_name] = HfTensor(hf_name, name, transform)
            kinds.update("experts" if s.op == "index" and len(s.args) == 2 else s.op
                         for s in (transform.steps if transform else ()))
    missing = [n for n in cfg.required_names() if n not in out]
    if missing:
        raise HfModelError(f"{missing[0]}: no source tensor makes it ({len(missing)} Hugging Face tensor"
                           f"{'s' if len(missing) > 1 else ''} missing; the config says {cfg.layers} layers"
                           f"{'' if cfg.tied else ', untied embeddings'}).")
    words = {"index": "stacked layers split", "rows": "row ranges (vocabulary padding removed, gate/up halves)",
             "groups": "fused QKV split by KV groups", "pair": "interleaved gate/up split",
             "rotary": "rotary permutation of q and k (adjacent pairs to halves)",
             "experts": "stacked experts split (one tensor per expert)"}
    return HfMapping(tuple(out.values()), tuple(left_out), tuple(words[k] for k in sorted(kinds)))


_QK_NORM_ANYWHERE = re.compile(r"(^|\.)layers\.\d+\.attention\.[qk]_norm\.weight$")


_LAYER_OF = re.compile(r"^model\.layers\.(\d+)\.")


def describe_transforms(tensors: tuple[HfTensor, ...]) -> list[str]:
    """What the mapping does, counted in the user's words ("rotary permutation of q and k in 16 layers"): what the
    Export dialog shows before it starts and the plan's notes say."""
    layers: dict[str, set[str]] = {}
    for t in tensors:
        for step in t.transform.steps if t.transform else ():
            what = {"rotary": "rotary permutation of q and k", "groups": "fused QKV split by KV groups",
                    "pair": "interleaved gate/up (w13) split",
                    "index": "stacked experts split" if ".experts." in t.name else "stacked layers split"}.get(step.op,
                                                                                                           step.op)
            if step.op == "rows":
                vocab = t.name in ("model.embed_tokens.weight", "lm_head.weight")
                what = "vocabulary padding removed" if vocab else "fused gate/up halves split"
            m = _LAYER_OF.match(t.name)
            layers.setdefault(what, set()).add(f"layer {m.group(1)}" if m else t.name)
    out = []
    for what, where in layers.items():
        n = sum(w.startswith("layer ") for w in where)
        out.append(f"{what} in {n} layer{'s' if n != 1 else ''}" if n == len(where) else
                   f"{what} ({', '.join(sorted(where))})")
    return out


def describe_architecture(names: list[str], export: str = "--hf") -> str | None:
    """The architecture a model's tensor keys name, in words (``inspect``, the Export dialog, whose ``export`` names
    the Hugging Face export in its own words); None when the keys are no decoder of a scheme the export knows.
    Names only: no config is needed."""
    has = lambda pattern: any(map(re.compile(pattern).match, names))  # noqa: E731  (one compile, C-speed scan)
    # NOTE: HF's names may come without "model.": a layout takes it for a container where no config.json says that
    # it is the base model
    if has(r"^(model\.)?layers\.\d+\.self_attn\.") and has(r"^(model\.)?embed_tokens\."):
        return f"Hugging Face names ({export} keeps them; no transform)"
    if has(r"^decoder\.layers\.(\d+\.)?self_attention\.linear_qkv\."):
        return (f"Megatron-Core GPT (fused QKV and gate/up: {export} splits them; rotary halves unless the run set "
                "rotary_interleaved)")
    if has(r"^tok_embeddings\.") and has(r"^layers\.\d+\.attention\."):
        moe = " MoE" if has(r"^layers\.\d+\.moe\.") else ""
        if has(r"^layers\.\d+\.attention\.q_norm\."):
            return f"torchtitan Qwen3{moe} (rotary halves: {export} renames, no permutation)"
        return f"torchtitan Llama 3{moe} (interleaved rotary: {export} permutes q/k)"
    return None


_INTERLEAVED_QK = re.compile(r"(^|\.)layers\.\d+\.attention\.(qkv_linear\.)?w[qk]\.weight$")


def rotary_trap(renamed: list[tuple[str, str]]) -> str | None:
    """A note when rename rules gave torchtitan's q and k weights (adjacent rotary pairs) HF's ``q_proj``/``k_proj``
    names (HF rotates halves): such a model loads with every key matched and computes wrong logits. ``renamed``:
    (source key, output key) pairs. torchtitan's Qwen3 (q/k norms) rotates halves already: no note for it."""
    hits = [src for src, out in renamed if _INTERLEAVED_QK.search(src) and re.search(r"[qk]_proj\.weight$", out)]
    if not hits or any(_QK_NORM_ANYWHERE.search(src) for src, _ in renamed):
        return None
    return (f"{hits[0]} renamed to Hugging Face's q_proj/k_proj names without the rotary permutation ({len(hits)} "
            "tensors): torchtitan stores q and k with adjacent rotary pairs and HF rotates halves, so the model "
            "loads but computes wrong logits; a Hugging Face model export (--hf) applies the permutation")


__all__ = ["LEFT_OUT_BUFFERS", "ROUTING_BIAS", "SCHEMES", "HfConfig", "HfMapping", "HfModelError", "HfTensor",
           "describe_architecture", "describe_transforms", "interleaved_rotary", "map_names", "outputs_of",
           "recognise_scheme", "rotary_trap"]
