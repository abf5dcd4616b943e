"""Nested state dicts to flat entry names, exactly as DCP's ``flatten_state_dict`` names them, so a
consolidated file and a DCP folder name their entries alike (``optimizer.param_groups.0.lr``)."""

from __future__ import annotations

from typing import Any


def is_terminal(value: Any) -> bool:
    """torch's ``_traverse._is_terminal``: a list is a leaf unless it holds tensors or mappings."""
    import torch

    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, dict | list) and not is_terminal(entry):
            return False
        if isinstance(entry, torch.Tensor):
            return False
    return True


def flatten(obj: Any, prefix: tuple = ()) -> dict[tuple, Any]:
    """Nested dicts and lists to {key path: leaf}, as DCP's ``flatten_state_dict`` does."""
    out: dict[tuple, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, (*prefix, str(k))))
    elif prefix and is_terminal(obj):
        out[prefix] = obj
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            out.update(flatten(v, (*prefix, i)))
    return out


def dotted(path: tuple) -> str:
    """A key path as the entry name DCP uses (``("optimizer", "param_groups", 0, "lr")`` -> ``...0.lr``)."""
    return ".".join(map(str, path))
