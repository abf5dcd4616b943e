"""Hugging Face model output: a folder ``from_pretrained`` loads (``config.json`` and safetensors, sharded with an
index past a maximum shard size), its tensors named and transformed by ``hf_model`` from the plan of the model's
weights. Each output tensor is made from its one source tensor (read with its stored CRC32s checked), written,
and re-read by the verifier against the CRC32 of the transformed bytes."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

from ..filenames import HF_CONFIG
from ..progress import Progress
from .hf_config import check_megatron_args, config_from_megatron_args, megatron_args, unread_args
from .hf_model import (
    LEFT_OUT_BUFFERS,
    ROUTING_BIAS,
    HfConfig,
    HfModelError,
    describe_transforms,
    interleaved_rotary,
    map_names,
    recognise_scheme,
)
from .layouts import transformers_config_path
from .plan import ExportError, ExportItem, ExportPlan
from .safetensors_writer import header_metadata, write_folder
from .source import TensorSource
from .verify import Expectation

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def read_config(path: str) -> dict[str, Any]:
    """An HF config.json given for the export (the planner checked it is JSON)."""
    with open(path, encoding="utf-8") as fh:
        doc = json.load(fh)
    if not isinstance(doc, dict):
        raise ExportError(f"{path}: not an HF config (a JSON object).")
    return doc


_HF_EMBEDDING = "model.embed_tokens.weight"


def hf_container(keys: list[str]) -> str:
    """The container prefix around a Hugging Face model's own names that the layout did not remove (a
    LightningModule's attribute, ``model.``; ``_forward_module.``; DDP's ``module.``): what stands before the one
    ``model.embed_tokens.weight``; "" when the names are HF's as they are, or another scheme's."""
    found = {k[:-len(_HF_EMBEDDING)] for k in keys if k == _HF_EMBEDDING or k.endswith("." + _HF_EMBEDDING)}
    if len(found) != 1:
        return ""
    (prefix,) = found
    if len({k.removeprefix(prefix) for k in keys}) != len(keys):
        raise HfModelError(f"{prefix}{_HF_EMBEDDING}: the names with and without the container '{prefix}' collide.")
    return prefix


def hf_plan(base: ExportPlan, config_path: str | None) -> ExportPlan:
    """``base`` (the model's weights, keys as the model names them) as a Hugging Face model: every tensor named,
    transformed and shape-checked against the config (``hf_model.map_names``) before anything is written."""
    args = megatron_args(base.ckpt)
    own = config_path is None and args is None  # a Trainer's checkpoint-N/ (and save_pretrained) holds config.json
    if own:
        config_path = transformers_config_path(base.ckpt.path)
    if config_path is None and args is None:
        unread = unread_args(base.ckpt)
        if unread:
            raise ExportError(f"{base.ckpt.path}: {unread}; give the HF config.json of the model it trains.")
        raise ExportError(f"{base.ckpt.path}: the checkpoint records no Hugging Face config; give the HF config.json "
                          "of the model it trains (head counts, rotary base and norm epsilon are not in the weights).")
    recorded = f"{base.ckpt.path}: common.pt's args"
    try:
        if args is not None:  # what the model computes, whichever config is given
            check_megatron_args(args, recorded)
        doc = read_config(config_path) if config_path else config_from_megatron_args(args or {}, recorded)
        cfg = HfConfig.from_json(doc, config_path or recorded)
        container = hf_container([it.key for it in base.items])
        by_key = {it.key.removeprefix(container): it for it in base.items}
        shapes = {key: it.entry.shape for key, it in by_key.items()}
        scheme = recognise_scheme(list(shapes))
        mapping = map_names(shapes, scheme, cfg, interleaved_rotary(scheme, cfg, args))
    except HfModelError as exc:
        raise ExportError(str(exc)) from None
    items = tuple(ExportItem(t.name, by_key[t.source].entry, by_key[t.source].dtype, t.transform)
                  for t in mapping.tensors)
    left_out = list(base.left_out) + list(mapping.left_out)
    for key, o in base.objects:
        left_out.append(f"{o.fqn}: " + ("a buffer Hugging Face's model does not load" if LEFT_OUT_BUFFERS.search(key)
                                        else "not a tensor; a Hugging Face model folder holds only its weights"))
    architecture = f"{scheme} names -> Hugging Face {ARCHITECTURES[cfg.model_type]}"
    notes = [*base.notes, f"architecture: {architecture}",
             "config: " + (f"{config_path} (the checkpoint's own)" if own else config_path
                           or "from Megatron's arguments in common.pt (no --config given)"),
             *([f"Hugging Face names under the container '{container}' (removed)"] if container else []),
             "transforms: " + ("; ".join(describe_transforms(mapping.tensors)) or "none (names only)")]
    if "architectures" not in doc:
        doc = {**doc, "architectures": [ARCHITECTURES[cfg.model_type]]}
    model = {"architecture": architecture, "source_names": scheme, "model_type": cfg.model_type,
             "transforms": list(mapping.transforms), "applied": describe_transforms(mapping.tensors),
             "tensors": {t.name: {"source": t.source, "transform": t.transform.describe()}
                         for t in mapping.tensors if t.transform is not None}}
    bias = [by_key[k].entry.fqn for k in shapes if scheme == "torchtitan" and ROUTING_BIAS.match(k)]
    if bias:  # said once read (hf_writer.write): whether leaving it out changes the routing
        model["routing_bias_left_out"] = bias
    return replace(base, items=items, objects=(), left_out=tuple(left_out), notes=tuple(notes), config_file=None,
                   config_text=json.dumps(doc, indent=2, sort_keys=True) + "\n", model=model)


def write(plan: ExportPlan, out_path: str, dst: str, source: TensorSource, progress: Progress | None,
          left_out: list[str]) -> tuple[list[str], list[Expectation]]:
    """The model folder into ``out_path``: weights (sharded past the plan's maximum shard size), then config.json."""
    left_out += _routing_bias(plan, source)
    meta = header_metadata(plan, source.reader, left_out)
    names, expect = write_folder(out_path, list(plan.items), meta, source, progress, plan.max_shard_size)
    with open(os.path.join(out_path, HF_CONFIG), "w", encoding="utf-8") as fh:
        fh.write(plan.config_text or "{}")
    names.append(HF_CONFIG)
    return names, expect


def _routing_bias(plan: ExportPlan, source: TensorSource) -> list[str]:
    """torchtitan's load-balancing expert bias, left out (HF's Qwen3-MoE router has none), read (E numbers a layer)
    to say whether leaving it out changes which experts are chosen: a zero bias changes nothing."""
    fqns = (plan.model or {}).get("routing_bias_left_out") or []
    if not fqns:
        return []
    worst = max(float(source.reader.read_tensor(plan.ckpt.tensor(f)).abs().max()) for f in fqns)
    where = f"{fqns[0]} ({len(fqns)} MoE layer{'s' if len(fqns) > 1 else ''})"
    if worst == 0:
        return [f"{where}: torchtitan's expert_bias is zero in every layer, so Hugging "
                "Face's router, which has none, chooses the experts the trained model chose"]
    return [f"{where}: torchtitan's expert_bias is not zero (largest |bias| {worst:.3g}): "
            "Hugging Face's Qwen3-MoE router has no bias, so the exported model may choose other experts than the "
            "trained one did (torchtitan's own to_hf drops it too)"]


__all__ = ["ARCHITECTURES", "hf_container", "hf_plan", "read_config", "write"]
