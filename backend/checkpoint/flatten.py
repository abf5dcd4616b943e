"""Nested state dicts to flat entry names, exactly as DCP's ``flatten_state_dict`` names them, so a
consolidated file and a DCP folder name their entries alike (``optimizer.param_groups.0.lr``)."""

from __future__ import annotations

from typing import Any


class FlattenError(ValueError):
    """A nested object that cannot be flattened: it contains itself, or expands past the budget."""


MAX_FLAT_VISITS = 10_000_000  # containers and leaves visited; a pickle reaches more only through shared references
MAX_FLAT_DEPTH = 1000  # torch.save itself cannot pickle deeper (Python's recursion limit)
_EXIT = object()


def flatten(obj: Any, prefix: tuple = (), limit: int = MAX_FLAT_VISITS, tensors: Any = None) -> dict[tuple, Any]:
    """Nested dicts and lists to {key path: leaf}, as DCP's ``flatten_state_dict`` does. Iterative; raises
    FlattenError on a container that holds itself (pickle memo references make cycles), nesting deeper
    than torch.save writes, or more than ``limit`` visits (a dict referenced twice at each of 40 levels
    expands to 2**40 paths from a few hundred bytes). ``tensors``: the type (or types) that count as tensors
    in :func:`is_terminal` (torch.Tensor by default)."""
    out: dict[tuple, Any] = {}
    stack: list[tuple[Any, tuple]] = [(obj, prefix)]
    active: set[int] = set()  # containers on the current path
    visits = 0
    while stack:
        node, path = stack.pop()
        if node is _EXIT:
            active.discard(path[0])
            continue
        visits += 1
        if visits > limit:
            raise FlattenError(f"expands to more than {limit:,} entries (containers referenced many times)")
        container = isinstance(node, dict) or \
            (isinstance(node, list | tuple) and not (path and is_terminal(node, tensors)))
        if not container:
            if path:
                visits += _leaf_size(node, limit - visits)
                out[path] = node
            continue
        if id(node) in active:
            raise FlattenError(f"{dotted(path) or 'the top level'} contains itself")
        if len(path) > MAX_FLAT_DEPTH:
            raise FlattenError(f"nests deeper than {MAX_FLAT_DEPTH} levels")
        active.add(id(node))
        stack.append((_EXIT, (id(node),)))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        stack.extend((v, (*path, str(k) if isinstance(node, dict) else k)) for k, v in reversed(list(items)))
    return out


def _leaf_size(value: Any, budget: int) -> int:
    """Elements inside a leaf value (a list, tuple or set of plain values), walked iteratively: a leaf nested
    deeper than torch.save writes, or larger than ``budget``, raises FlattenError (``repr`` and
    ``torch.save`` recurse into it)."""
    if not isinstance(value, list | tuple | set | frozenset | dict):
        return 0
    stack, n = [(value, 0)], 0
    while stack:
        node, depth = stack.pop()
        if depth > MAX_FLAT_DEPTH:
            raise FlattenError(f"holds a value nested deeper than {MAX_FLAT_DEPTH} levels")
        for entry in (node.values() if isinstance(node, dict) else node):
            n += 1
            if n > budget:
                raise FlattenError("expands to too many entries (containers referenced many times)")
            if isinstance(entry, list | tuple | set | frozenset | dict):
                stack.append((entry, depth + 1))
    return n


def is_terminal(value: Any, tensors: Any = None) -> bool:
    """torch's ``_traverse._is_terminal``: a list is a leaf unless it holds tensors or mappings (also inside
    lists it holds). Iterative, and safe on lists that hold themselves. ``tensors``: the type (or types) that
    count as tensors, torch.Tensor by default (torch is then imported)."""
    if tensors is None:
        import torch

        tensors = torch.Tensor
    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    stack, seen = [value], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for entry in node:
            if isinstance(entry, dict) or isinstance(entry, tensors):
                return False
            if isinstance(entry, list):
                stack.append(entry)
    return True


def dotted(path: tuple) -> str:
    """A key path as the entry name DCP uses (``("optimizer", "param_groups", 0, "lr")`` -> ``...0.lr``)."""
    return ".".join(map(str, path))
