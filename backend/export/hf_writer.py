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
from .hf_model import LEFT_OUT_BUFFERS, HfConfig, HfModelError, interleaved_rotary, map_names, recognise_scheme
from .plan import ExportError, ExportItem, ExportPlan
from .safetensors_writer import header_metadata, write_folder
from .source import TensorSource
from .verify import Expectation

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


def read_config(path: str) -> dict[str, Any]:
    """An HF config.json given for the export (the planner checked it is JSON)."""
    with open(path, encoding="utf-8") as fh:
        doc = json.load(fh)
    if not isinstance(doc, dict):
        raise ExportError(f"{path}: not an HF config (a JSON object).")
    return doc


def hf_plan(base: ExportPlan, config_path: str | None) -> ExportPlan:
    """``base`` (the model's weights, keys as the model names them) as a Hugging Face model: every tensor named,
    transformed and shape-checked against the config (``hf_model.map_names``) before anything is written."""
    args = megatron_args(base.ckpt)
    if config_path is None and args is None:
        unread = unread_args(base.ckpt)
        if unread:
            raise ExportError(f"{base.ckpt.path}: {unread}; give the model's HF config with --config.")
        raise ExportError(f"{base.ckpt.path}: the checkpoint records no Hugging Face config; give the HF config.json "
                          "of the model it trains (head counts, rotary base and norm epsilon are not in the weights).")
    recorded = f"{base.ckpt.path}: common.pt's args"
    try:
        if args is not None:  # what the model computes, whichever config is given
            check_megatron_args(args, recorded)
        doc = read_config(config_path) if config_path else config_from_megatron_args(args or {}, recorded)
        cfg = HfConfig.from_json(doc, config_path or recorded)
        shapes = {it.key: it.entry.shape for it in base.items}
        scheme = recognise_scheme(list(shapes))
        mapping = map_names(shapes, scheme, cfg, interleaved_rotary(scheme, cfg, args))
    except HfModelError as exc:
        raise ExportError(str(exc)) from None
    by_key = {it.key: it for it in base.items}
    items = tuple(ExportItem(t.name, by_key[t.source].entry, by_key[t.source].dtype, t.transform)
                  for t in mapping.tensors)
    left_out = list(base.left_out) + list(mapping.left_out)
    for key, o in base.objects:
        left_out.append(f"{o.fqn}: " + ("a buffer Hugging Face's model does not load" if LEFT_OUT_BUFFERS.search(key)
                                        else "not a tensor; a Hugging Face model folder holds only its weights"))
    architecture = f"{scheme} names -> Hugging Face {ARCHITECTURES[cfg.model_type]}"
    notes = [*base.notes, f"architecture: {architecture}",
             "config: " + (config_path or "from Megatron's arguments in common.pt (no --config given)"),
             "transforms: " + ("; ".join(mapping.transforms) or "none (names only)")]
    if "architectures" not in doc:
        doc = {**doc, "architectures": [ARCHITECTURES[cfg.model_type]]}
    model = {"architecture": architecture, "source_names": scheme, "model_type": cfg.model_type,
             "transforms": list(mapping.transforms),
             "tensors": {t.name: {"source": t.source, "transform": t.transform.describe()}
                         for t in mapping.tensors if t.transform is not None}}
    return replace(base, items=items, objects=(), left_out=tuple(left_out), notes=tuple(notes), config_file=None,
                   config_text=json.dumps(doc, indent=2, sort_keys=True) + "\n", model=model)


def write(plan: ExportPlan, out_path: str, dst: str, source: TensorSource, progress: Progress | None,
          left_out: list[str]) -> tuple[list[str], list[Expectation]]:
    """The model folder into ``out_path``: weights (sharded past the plan's maximum shard size), then config.json."""
    meta = header_metadata(plan, source.reader, left_out)
    names, expect = write_folder(out_path, list(plan.items), meta, source, progress, plan.max_shard_size)
    with open(os.path.join(out_path, HF_CONFIG), "w", encoding="utf-8") as fh:
        fh.write(plan.config_text or "{}")
    names.append(HF_CONFIG)
    return names, expect


__all__ = ["ARCHITECTURES", "hf_plan", "read_config", "write"]
