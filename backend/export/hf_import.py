"""``import HF_FOLDER DST --as torchtitan``: a Hugging Face model folder as a DCP checkpoint in torchtitan's names,
streaming one tensor at a time through the DCP writer. The names are the inverse of the export's torchtitan rules
(``hf_model.SCHEMES``), in their current generation; the transforms are the inverse of the export's
(``Transform.inverse``: HF's rotated halves back to torchtitan's adjacent rotary pairs)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING

from ..filenames import HF_CONFIG
from ..formats import open_source
from ..progress import Progress
from .dcp_writer import SMALL_TENSOR, TensorIn, write_dcp
from .hf_model import LEFT_OUT_BUFFERS, SCHEMES, HfConfig, HfModelError, HfTensor, interleaved_rotary, outputs_of
from .hf_transforms import Transform, TransformError
from .layouts import MAX_HF_CONFIG_BYTES, transformers_config_path
from .lineage import lineage_for
from .output_seal import Origin
from .plan import ExportError
from .result import ExportResult

if TYPE_CHECKING:
    import torch

    from ..checkpoint.sources import CheckpointSource

# what ``--as`` names -> the HF architectures it takes (torchtitan's Llama 3: its state_dict_adapter's from_hf)
IMPORT_TARGETS = {"torchtitan": ("LlamaForCausalLM",)}
_MODEL_TYPES = {"LlamaForCausalLM": "llama"}
_WORDS = {"unrotary": "inverse rotary permutation of q and k (halves to adjacent pairs)"}


def _read_config(path: str) -> dict:
    try:
        if os.path.getsize(path) > MAX_HF_CONFIG_BYTES:
            raise ExportError(f"{path}: larger than {MAX_HF_CONFIG_BYTES >> 20} MiB; not an HF config.")
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except OSError as exc:
        raise ExportError(f"{path}: cannot read the config ({exc.strerror or exc}).") from None
    except (ValueError, RecursionError) as exc:
        raise ExportError(f"{path}: not a JSON file ({exc}).") from None
    if not isinstance(doc, dict):
        raise ExportError(f"{path}: not an HF config (a JSON object).")
    return doc


def _current_name(pattern: re.Pattern) -> str | None:
    """The name a torchtitan rule's pattern matches in torchtitan's current generation, with ``{i}`` (the layer)
    and ``{k}`` (weight or bias) left to fill: an optional part is there (``qkv_linear.``), and of alternatives the
    last is current (``output|lm_head``). None for a pattern this cannot render (it is then not imported)."""
    text = pattern.pattern.removeprefix("^").removesuffix("$")
    text = text.replace(r"(?P<i>\d+)", "{i}").replace("(?P<k>weight|bias)", "{k}")
    text = re.sub(r"\(([^()|?]*)\)\?", r"\1", text)
    text = re.sub(r"\((?:[^()|?]*\|)+([^()|?]*)\)", r"\1", text)
    text = text.replace(r"\.", ".")
    if re.search(r"[\\()|?*+\[\]^$]", text) or not pattern.match(text.format(i=0, k="weight")):
        return None
    return text


def torchtitan_names(hf_names: list[str], cfg: HfConfig) -> tuple[list[HfTensor], list[str]]:
    """Every HF tensor (``hf_names``) as the torchtitan tensor the export's rules would make it from, with the
    inverse transform, and what is left out (with why). :class:`HfModelError` naming an HF tensor no rule makes,
    or a tensor the model needs that the folder lacks."""
    interleaved = interleaved_rotary("torchtitan", cfg)
    inverse: dict[str, tuple[str, Transform | None]] = {}
    for pattern, _ in SCHEMES["torchtitan"]:
        template = _current_name(pattern)
        if template is None:
            continue
        for i in range(cfg.layers) if "{i}" in template else (0,):
            for k in ("weight", "bias") if "{k}" in template else ("weight",):
                name = template.format(i=i, k=k)
                try:
                    made = outputs_of(name, (), SCHEMES["torchtitan"], cfg, interleaved)
                except (HfModelError, TransformError):  # a rule for stacked tensors (experts): not one to one
                    continue
                if made and len(made) == 1:  # a fused source (w13) is not what the current generation writes
                    hf_name, steps = made[0]
                    inverse.setdefault(hf_name, (name, Transform(steps).inverse() if steps else None))
    out: list[HfTensor] = []
    left_out: list[str] = []
    for hf_name in hf_names:
        if LEFT_OUT_BUFFERS.search(hf_name):
            left_out.append(f"{hf_name}: a buffer torchtitan's model does not load (rotary frequencies)")
            continue
        if hf_name not in inverse:
            raise HfModelError(f"{hf_name}: no torchtitan name for this Hugging Face tensor of a "
                               f"{cfg.model_type} model.")
        name, transform = inverse[hf_name]
        out.append(HfTensor(name, hf_name, transform))
    have = {t.source for t in out}
    if cfg.tied and "lm_head.weight" not in have and "model.embed_tokens.weight" in have:
        # torchtitan ties by sharing the parameter: its state dict (and so dcp.load) still names lm_head.weight
        out.append(HfTensor(inverse["lm_head.weight"][0], "model.embed_tokens.weight", None))
        have.add("lm_head.weight")
    missing = [n for n in cfg.required_names() if n not in have]
    if missing:
        raise HfModelError(f"{missing[0]}: the Hugging Face folder lacks it ({len(missing)} tensor"
                           f"{'s' if len(missing) > 1 else ''} missing for the config's {cfg.layers} layers).")
    return out, left_out


def _target_config(doc: dict, where: str, target: str) -> tuple[str, HfConfig]:
    """The architecture and the HF config, refused (one line) when the architecture is not one ``--as target``
    imports (``architectures``, or without it ``model_type``)."""
    names = doc.get("architectures")
    wanted = IMPORT_TARGETS[target]
    if isinstance(names, list) and names:
        arch, said = next((a for a in names if a in wanted), None), ", ".join(map(str, names))
    else:
        arch = next((a for a in wanted if _MODEL_TYPES[a] == doc.get("model_type")), None)
        said = f"model_type {doc.get('model_type')!r}"
    if arch is None or doc.get("model_type") != _MODEL_TYPES[arch]:
        raise ExportError(f"{where}: {said} cannot be imported in {target}'s names (the import takes "
                          f"{', '.join(wanted)}).")
    return arch, HfConfig.from_json(doc, where)


def _checked_names(src: str, entries: dict, cfg: HfConfig) -> tuple[list[HfTensor], list[str]]:
    """:func:`torchtitan_names` with every source shape checked against the config, before anything is written."""
    try:
        plan, left_out = torchtitan_names(list(entries), cfg)
        for t in plan:
            want, shape = cfg.expected_shape(t.source), entries[t.source].shape
            if want is not None and tuple(shape) != want:
                raise HfModelError(f"{t.source}: shape {list(shape)}, but the config says {list(want)}.")
            if t.transform is not None:
                t.transform.shape(shape)
    except (HfModelError, TransformError) as exc:
        raise ExportError(f"{src}: {exc}") from None
    return plan, left_out


def _lineage_model(architecture: str, target: str, cfg: HfConfig, plan: list[HfTensor], left_out: list[str],
                   key: Callable[[str], str]) -> dict:
    """The lineage sidecar's ``model``: the architecture and every transform applied, by output tensor."""
    return {"architecture": architecture, "target_names": target, "model_type": cfg.model_type, "left_out": left_out,
            "transforms": sorted({_WORDS[s.op] for t in plan if t.transform for s in t.transform.steps}),
            "tensors": {key(t.name): {"source": t.source, "transform": t.transform.describe()}
                        for t in plan if t.transform is not None}}


def import_hf(src: str, dst: str, target: str = "torchtitan", ranks: int = 1, prefix: str | None = None,
              force: bool = False, verify: bool = True, progress: Progress | None = None,
              storage_options: dict | None = None) -> ExportResult:
    """The HF model folder (or safetensors file with its ``config.json`` beside it) ``src`` as a DCP checkpoint of
    ``ranks`` ranks in ``target``'s names, every name and shape checked before anything is written."""
    from ..checkpoint.model import itemsize

    where = transformers_config_path(src)
    if where is None:
        raise ExportError(f"{src}: no transformers {HF_CONFIG} (naming its model_type) beside the weights; the "
                          "import needs it to name the tensors and undo the rotary permutation.")
    try:
        arch, cfg = _target_config(_read_config(where), where, target)
    except HfModelError as exc:
        raise ExportError(str(exc)) from None
    source = open_source(src, storage_options)
    try:
        entries = {t.fqn: t for t in source.ckpt.tensors}
        plan, left_out = _checked_names(src, entries, cfg)
        pre = prefix.strip(".") if prefix else ""
        key = (lambda n: f"{pre}.{n}") if pre else (lambda n: n)
        planner = {key(t.name): (pre, t.name) for t in plan} if pre else None

        def tensors() -> Iterator[TensorIn]:
            # one tensor in memory at a time; those copied as stored come in plan order with their bytes when
            # small (read many at a time, as import does), the transformed ones are read and transformed one by one
            plain = source.small_values([entries[t.source] for t in plan if t.transform is None], SMALL_TENSOR)
            for t in plan:
                e = entries[t.source]
                if t.transform is None:
                    raw = next(plain)[1]
                    yield TensorIn(key(t.name), e.dtype, tuple(e.shape), partial(source.tensor, e.fqn), raw)
                else:
                    yield TensorIn(key(t.name), e.dtype, tuple(e.shape), partial(_transformed, t.transform, source,
                                                                                  e.fqn))

        total = sum(entries[t.source].numel * itemsize(entries[t.source].dtype) for t in plan)
        model = _lineage_model(f"Hugging Face {arch} -> {target} names", target, cfg, plan, left_out, key)
        origins = {key(t.name): Origin(t.source, t.transform.describe() if t.transform else None) for t in plan}
        result = write_dcp(tensors(), [], dst, ranks, planner, force, verify, progress, total, storage_options,
                           sources=[src], source_format=source.kind, origins=origins,
                           lineage=lineage_for(src, "dcp", source.kind, model))
    finally:
        source.close()
    result.notes = [*result.notes, model["architecture"],
                    "transforms: " + ("; ".join(model["transforms"]) or "none (names only)")]
    result.left_out = [*result.left_out, *left_out]
    return result



def _transformed(transform: Transform, source: CheckpointSource, fqn: str) -> torch.Tensor:
    """One source tensor read and transformed (what a transformed import tensor's bytes are made from)."""
    return transform.apply(source.tensor(fqn))


__all__ = ["IMPORT_TARGETS", "import_hf", "torchtitan_names"]
