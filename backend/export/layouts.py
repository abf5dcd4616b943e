"""Which layout a checkpoint was saved in, and so which keys are the model's weights.

Recognised: torch's DCP recipe (``{"model": ..., "optimizer": ...}``), Lightning (Trainer's
``state_dict`` with ``optimizer_0``..., FSDPStrategy/Fabric's ``model`` with ``meta.pt``),
torchtitan (model keys at the top level next to ``optimizer``, ``lr_scheduler``, ``dataloader``,
``train_state``), HF Trainer/accelerate FSDP folders (``pytorch_model_fsdp_0/``, ``optimizer_0/``)
Megatron-style names (``decoder.``/``embedding.``/``output_layer.``) and Hugging Face transformers' names
(``model.*`` beside the heads ``lm_head.*``/``score.*``, or a ``config.json`` of transformers beside ``model.*``):
kept as ``from_pretrained`` loads them. A tensor is left out of a weights export only when it is training state.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..checkpoint.model import Checkpoint
from ..filenames import ACCELERATE_MODEL_DIR, is_url
from ..formats.lightning import has_trainer_state

TRAINING_STATE_ROOTS = frozenset({
    "optimizer", "optimizers", "optim", "optimizer_states", "lr_scheduler", "lr_schedulers", "scheduler",
    "schedulers", "dataloader", "train_state", "rng_state", "rng_states", "rng", "trainer_state", "step",
    "epoch", "global_step", "iteration", "args", "checkpoint_version", "opt_param_scheduler",
    "num_floating_point_operations_so_far", "extra", "loops", "callbacks", "hparams", "hyper_parameters",
    "deepspeed",  # a DeepSpeed save's config, step and versions (formats/deepspeed.py)
})
_OPTIMIZER_N = re.compile(r"optimizer_\d+$")
OPTIMIZER_ROOTS = frozenset({"optimizer", "optimizers", "optim", "optimizer_states"})  # a run resumes from these
MEGATRON_ROOTS = frozenset({"decoder", "encoder", "embedding", "output_layer", "language_model"})
HF_CONFIG = "config.json"  # transformers' save_pretrained (and so its Trainer) writes it beside the weights
MAX_HF_CONFIG_BYTES = 4 << 20
# NOTE: a whole key part only (start of the key or after a dot), so a module named "my_orig_mod" stays.
_WRAPPER_SEGMENT = re.compile(r"(?<![^.])(_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module)\.")


@dataclass(frozen=True, slots=True)
class Layout:
    """A recognised layout: ``model_roots`` are the first key parts holding the model's weights
    (None: every root that is not training state); ``container`` is the prefix a safetensors
    export removes by default so keys load into the module (``model.``), or ''."""

    name: str
    model_roots: tuple[str, ...] | None
    container: str = ""
    optimizer_roots: frozenset[str] = frozenset()  # optimizers found by their shape, under any name
    wrapper: str = ""  # one key every entry sits under (torch's DCP tutorial: {"app": AppState(model, optim)})

    def is_model(self, fqn: str) -> bool:
        """True when entry ``fqn`` belongs to the model's weights, judged by its first key part (below the
        wrapper key, if there is one)."""
        if self.wrapper:
            if not fqn.startswith(self.wrapper):
                return False
            fqn = fqn[len(self.wrapper):]
        root = fqn.split(".", 1)[0]
        if self.model_roots is not None:
            return root in self.model_roots
        return not is_training_state(root) and root not in self.optimizer_roots

    def is_state(self, fqn: str) -> bool:
        """True when entry ``fqn`` is training state (optimizer, scheduler, loader, trainer state; an optimizer
        under any name the layout found): the only tensors an export of the model's weights leaves out."""
        if self.wrapper and fqn.startswith(self.wrapper):
            fqn = fqn[len(self.wrapper):]
        root = fqn.split(".", 1)[0]
        return is_training_state(root) or root in self.optimizer_roots

    def keeps_tensor(self, fqn: str) -> bool:
        """True for a tensor an export of the model's weights writes: the model's, and any other that is not
        training state (a weight is never left out by a guess about the layout)."""
        return self.is_model(fqn) or not self.is_state(fqn)

    def root_key(self, fqn: str) -> str:
        """The first key part of ``fqn`` below the wrapper, with the wrapper (``app.optim``): what a left-out line
        names."""
        inner = fqn[len(self.wrapper):] if self.wrapper and fqn.startswith(self.wrapper) else fqn
        return self.wrapper + inner.split(".", 1)[0]


def is_training_state(root: str) -> bool:
    """True for a first key part that holds optimizer/scheduler/loader/trainer state, not weights."""
    return root in TRAINING_STATE_ROOTS or bool(_OPTIMIZER_N.match(root))


def recognise_layout(ckpt: Checkpoint) -> Layout:
    """The layout of a checkpoint, from its keys, its folder name and its extra files."""
    return layout_of_names([t.fqn for t in ckpt.tensors], os.path.basename(ckpt.path.rstrip("/")),
                           has_trainer_state(ckpt), has_transformers_config(ckpt.path))


def has_transformers_config(path: str) -> bool:
    """True when a transformers ``config.json`` (a JSON object naming ``model_type`` or ``architectures``) lies
    in the checkpoint folder ``path``, or beside the checkpoint file ``path``, as ``save_pretrained`` writes it."""
    return transformers_config_path(path) is not None


def transformers_config_path(path: str) -> str | None:
    """The transformers ``config.json`` of :func:`has_transformers_config` (a Trainer's ``checkpoint-N/`` holds
    the model's), None when there is none."""
    if is_url(path):
        return None
    where = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), HF_CONFIG)
    try:
        if os.path.getsize(where) > MAX_HF_CONFIG_BYTES:
            return None
        with open(where, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    return where if isinstance(config, dict) and ("model_type" in config or "architectures" in config) else None


def layout_of_names(tensor_names: Iterable[str], folder: str = "", has_meta_pt: bool = False,
                    transformers_config: bool = False) -> Layout:
    """The layout from tensor names alone (also a consolidated ``.pt`` or safetensors file's keys), the
    folder's name, whether a Lightning ``meta.pt`` is next to it and whether a transformers ``config.json`` is."""
    names = list(tensor_names)
    tensor_roots = {n.split(".", 1)[0] for n in names}
    wrapped = _wrapped_layout(names, tensor_roots, folder, has_meta_pt)
    if wrapped is not None:
        return wrapped
    shaped = optimizer_shaped_roots(names)
    if "state_dict" in tensor_roots:
        if has_meta_pt or "optimizer_states" in tensor_roots or any(_OPTIMIZER_N.match(r) for r in tensor_roots):
            return Layout("Lightning Trainer (state_dict, optimizer_N, meta.pt)", ("state_dict",), "state_dict.",
                          shaped)
        # a plain torch.save({"state_dict": ..., "optim": ...}): the same choice, without claiming Lightning
        return Layout("model weights under state_dict", ("state_dict",), "state_dict.", shaped)
    if _OPTIMIZER_N.match(folder) and tensor_roots == {"optimizer"}:
        return Layout("HF Trainer / accelerate FSDP optimizer state (optimizer_N: no model weights; they are in "
                      "the sibling pytorch_model_fsdp_N/)", ())
    if "model" in tensor_roots:
        if _transformers_names(names, tensor_roots, shaped, transformers_config):
            return Layout("Hugging Face transformers names (model.* and its heads, as from_pretrained loads them)",
                          None, optimizer_roots=shaped)
        if ACCELERATE_MODEL_DIR.search(folder):
            return Layout("HF Trainer / accelerate FSDP (pytorch_model_fsdp_N)", ("model",), "model.", shaped)
        if has_meta_pt or any(_OPTIMIZER_N.match(r) for r in tensor_roots):
            return Layout("Lightning FSDP / Fabric (model, optimizer_N, meta.pt)", ("model",), "model.", shaped)
        return Layout("torch DCP recipe (model, optimizer, ...)", ("model",), "model.", shaped)
    if has_meta_pt:  # Fabric: fabric.save(path, {"net": model, "opt": optimizer}) keeps the user's names
        models = tuple(sorted(r for r in tensor_roots if r not in shaped and not is_training_state(r)))
        return Layout(f"Lightning Fabric (meta.pt; model under {', '.join(models) or 'no key'}"
                      + (f", optimizer state under {', '.join(sorted(shaped))}" if shaped else "") + ")",
                      models, f"{models[0]}." if len(models) == 1 else "", shaped)
    if tensor_roots & MEGATRON_ROOTS:
        return Layout("Megatron-style names (decoder, embedding, output_layer)", None, optimizer_roots=shaped)
    state = {r for r in tensor_roots if is_training_state(r) or r in shaped}
    if state and state != tensor_roots:
        return Layout("torchtitan-style (model keys at the top level next to optimizer, lr_scheduler, ...)", None,
                      optimizer_roots=shaped)
    return Layout("flat state dict", None)


def _transformers_names(names: list[str], tensor_roots: set[str], shaped: frozenset[str], config: bool) -> bool:
    """True when ``model.*`` is a transformers model's own base model, not a container around a module (the DCP
    recipe's ``{"model": model.state_dict()}``): heads (``lm_head``, ``score``, ...) beside it at the top, or (a
    tied model's keys are all ``model.*``) a transformers config.json beside the weights and no ``model.model.*``,
    which a DCP recipe save of a transformers module holds."""
    heads = {r for r in tensor_roots - {"model"} if not is_training_state(r) and r not in shaped}
    if heads:
        return True
    return config and tensor_roots == {"model"} and not any(n.startswith("model.model.") for n in names)


def _wrapped_layout(names: list[str], tensor_roots: set[str], folder: str, has_meta_pt: bool) -> Layout | None:
    """A model and its training state under one wrapper key: torch's DCP tutorial saves
    ``{"app": AppState(model, optimizer)}``, so every key reads ``app.model.*`` or ``app.optim.*``. None when the
    keys have more than one first part, or the one part is itself a model or state key."""
    if len(tensor_roots) != 1:
        return None
    (wrap,) = tensor_roots
    if wrap in ("model", "state_dict", "module") or is_training_state(wrap) or wrap in MEGATRON_ROOTS:
        return None
    inner_names = [n.split(".", 1)[1] for n in names if "." in n]
    if len(inner_names) != len(names):
        return None
    inner = layout_of_names(inner_names, folder, has_meta_pt)
    inner_roots = {n.split(".", 1)[0] for n in inner_names}
    model = {r for r in inner_roots if inner.is_model(f"{r}.x")}
    if not model or model == inner_roots:  # no training state beside the model: not a model/optimizer pair
        return None
    return Layout(f"{inner.name}, under the wrapper key {wrap!r} (torch's DCP tutorial: {{{wrap!r}: AppState}})",
                  inner.model_roots, f"{wrap}.{inner.container}", inner.optimizer_roots, f"{wrap}.")


def checkpoint_kind(ckpt: Checkpoint) -> str:
    """``resumable`` when the checkpoint holds training state beside the weights (an optimizer's state under
    any name, Lightning's ``optimizer_N``, a trainer's state), else ``weights``: what ``inspect`` says, in the
    words of the library's kinds (``ls``, prune)."""
    layout = recognise_layout(ckpt)
    names = [t.fqn for t in ckpt.tensors] + [o.fqn for o in ckpt.objects]
    if layout.wrapper:
        names = [n[len(layout.wrapper):] for n in names if n.startswith(layout.wrapper)]
    roots = {n.split(".", 1)[0] for n in names}
    optimizer = roots & OPTIMIZER_ROOTS or layout.optimizer_roots or any(_OPTIMIZER_N.match(r) for r in roots)
    return "resumable" if optimizer else "weights"


def optimizer_shaped_roots(tensor_names: Iterable[str]) -> frozenset[str]:
    """First key parts under which every tensor is an optimizer's per-parameter state
    (``<root>.state.<param>.<exp_avg|step|...>``, as ``get_optimizer_state_dict`` writes it): an
    optimizer saved under a name of the user's choosing (``opt``, ``optim_0``, ...)."""
    by_root: dict[str, bool] = {}
    for name in tensor_names:
        parts = name.split(".", 3)
        root = parts[0]
        by_root[root] = by_root.get(root, True) and len(parts) == 4 and parts[1] == "state"
    return frozenset(r for r, shaped in by_root.items() if shaped)


def unwrap_key(key: str) -> tuple[str, set[str]]:
    """``key`` without the key parts wrappers add when a state dict is taken from the wrapper rather than
    through ``get_model_state_dict``: torch.compile's ``_orig_mod`` (accelerate compiles after FSDP1 wrapping,
    so its FSDP1 saves hold ``model._orig_mod.*``), FSDP1's ``_fsdp_wrapped_module``, activation
    checkpointing's ``_checkpoint_wrapped_module``; and the parts removed."""
    found = set(_WRAPPER_SEGMENT.findall(key))
    return _WRAPPER_SEGMENT.sub("", key), found


def model_key(name: str, container: str, unwrap: bool = True) -> tuple[str, set[str]]:
    """The key a model entry goes by once out of its checkpoint's layout: ``container`` (``model.``) removed when
    the name is under it, and (``unwrap``) the wrapper key parts removed; with the wrapper parts found. What
    export writes and what diff pairs by."""
    key = name[len(container):] if container and name.startswith(container) else name
    return unwrap_key(key) if unwrap else (key, set())


def model_keys(ckpt: Checkpoint) -> list[str]:
    """The model weights' keys as an export names them by default (the layout's container and wrapper key parts
    removed): what ``inspect`` and the Export dialog recognise an architecture from."""
    layout = recognise_layout(ckpt)
    return [model_key(t.fqn, layout.container)[0] for t in ckpt.tensors if layout.keeps_tensor(t.fqn)]


__all__ = ["Layout", "checkpoint_kind", "is_training_state", "layout_of_names",
           "model_keys", "optimizer_shaped_roots", "recognise_layout", "transformers_config_path", "unwrap_key"]
