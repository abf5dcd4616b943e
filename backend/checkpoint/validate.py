"""The one validation step for what comes out of an unpickled ``.metadata``: every field the checkpoint
model uses is type- and range-checked here, right after unpickling and before anything allocates,
reads or loops on it. A value that fails is bad input: a :class:`CheckpointError` naming the file
and the entry (exit 2), never a traceback. ``planner_data``, which only the nesting of a .pt export needs,
is the exception: a path that fails is a :class:`Problem` of the checkpoint, and the entries stay readable.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import CheckpointError
from .chunks import safe_name
from .model import ITEMSIZE, MAX_INDEX, MAX_NDIM, Checkpoint, Problem
from .safe_pickle import Record


def bad(where: str, text: str, fqn: str | None = None) -> CheckpointError:
    """The error for a metadata field that fails validation."""
    return CheckpointError(f"{where}: {text}; the metadata is damaged or hostile.", path=where, fqn=fqn)


def _short(value: Any) -> str:
    try:
        text = repr(value) if isinstance(value, int | str | float | type(None)) else type(value).__name__
    except (ValueError, RecursionError):  # repr of an int with millions of digits
        text = type(value).__name__
    return text[:60]


def as_fqn(value: Any, where: str) -> str:
    """An entry name: a string."""
    if not isinstance(value, str):
        raise bad(where, f"an entry name is {_short(value)}, not a string")
    return value


def as_index(value: Any, where: str, what: str, fqn: str | None = None) -> int:
    """A byte offset, length or count: an int in [0, 2**62)."""
    if type(value) is not int or not 0 <= value < MAX_INDEX:
        raise bad(where, f"{what} is {_short(value)}, not an integer in [0, 2**62)", fqn)
    return value


def as_dims(value: Any, where: str, what: str, fqn: str | None = None, ndim: int | None = None) -> tuple[int, ...]:
    """A shape, offsets or sizes: a flat sequence of at most 64 ints in [0, 2**62), ``ndim`` long if given."""
    if not isinstance(value, tuple | list) or len(value) > MAX_NDIM:
        raise bad(where, f"{what} is {_short(value)}, not a sequence of at most {MAX_NDIM} integers", fqn)
    if not all(type(v) is int and 0 <= v < MAX_INDEX for v in value):
        raise bad(where, f"{what} {_short_dims(value)} holds something that is not an integer in [0, 2**62)", fqn)
    if ndim is not None and len(value) != ndim:
        raise bad(where, f"{what} has {len(value)} dimensions, the tensor has {ndim}", fqn)
    return tuple(value)


def _short_dims(value: Any) -> str:
    return "[" + ", ".join(_short(v) for v in list(value)[:4]) + (", ...]" if len(value) > 4 else "]")


def as_path(value: Any, where: str, fqn: str | None = None) -> str:
    """A ``relative_path``: a plain file name inside the checkpoint folder."""
    if not isinstance(value, str) or not safe_name(value):
        raise bad(where, f"relative_path {_short(value)} is not a plain file name inside the checkpoint folder", fqn)
    return value


def transforms(value: Any, where: str, fqn: str) -> tuple[str, ...]:
    """An item's ``transform_descriptors``: a short list of short strings (``stream.zstd/1``)."""
    if not isinstance(value, list | tuple) or len(value) > 8 or \
            not all(isinstance(v, str) and 0 < len(v) <= 200 for v in value):
        raise bad(where, f"the stream transforms of an item are {_short(value)}, not a list of at most 8 names", fqn)
    return tuple(value)


def optional_str(value: Any, where: str, what: str) -> str | None:
    """A string field that may be missing (version, save id)."""
    if value is not None and not isinstance(value, str):
        raise bad(where, f"{what} is {_short(value)}, not a string")
    return value


def record(value: Any, where: str, what: str, fqn: str | None = None) -> Record:
    """A field that must be one of the allow-listed record stand-ins."""
    if not isinstance(value, Record):
        raise bad(where, f"{what} is {_short(value)}, not a record", fqn)
    return value


def mapping(value: Any, where: str, what: str) -> dict:
    """A dict field (``storage_data``) a loader cannot do without: torch's reader refuses None too."""
    if value is None:
        raise bad(where, f"it has no {what} (torch's loader refuses it: \"{what} must not be None\")")
    if not isinstance(value, dict):
        raise bad(where, f"{what} is {_short(value)}, not a mapping")
    return value


def dtype_of(props: Any, where: str, fqn: str) -> str:
    """A tensor's dtype from its TensorProperties (torch 2.0 folders may lack them: float32)."""
    if props is None:
        return "float32"
    dtype = record(props, where, "tensor properties", fqn).get("dtype")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise bad(where, f"dtype {_short(dtype)} is not a torch dtype", fqn)
    return str(dtype)


MAX_KEY_PATH = 256  # levels of one planner_data key path (torch.save and torch.load recurse per level)


def planner_data(value: Any, names: list[str], where: str) -> tuple[dict[str, tuple], Problem | None]:
    """``planner_data`` (flat name -> the nested key path ``dcp_to_torch_save`` puts it at with torch's
    ``set_element``) for the checkpoint's entries ``names``, checked so that unflattening neither fails nor
    allocates more than the file holds: (the paths, None), or ({}, the problem) when the nesting cannot be
    rebuilt. Only names the checkpoint holds are looked up; an entry without a path stays flat, as in torch.

    The rules are what torch's ``flatten_state_dict`` writes: a path is a tuple of 1 to 256 str keys and int
    list indices (not bool), starting with a str; its parts joined by dots spell the entry's name; no path is
    a prefix of another; at each level all keys are str (a dict) or all int (a list); and the lists together
    are no longer than the paths have parts (a list torch flattened has an entry per index, bar an empty
    dict's), so a 10**12 index is refused before anything allocates."""
    if value is None:
        return {}, None
    try:
        if not isinstance(value, dict):
            raise _Unnestable(f"planner_data is {_short(value)}, not a mapping of entry names to key paths")
        paths = _key_paths(value, names)
        _check_tree(paths)
    except _Unnestable as exc:
        name = os.path.basename(where)
        return {}, Problem("planner_data", f"{name}: {exc}; the nested state dict cannot be rebuilt from it (a "
                           ".pt export and reshard refuse; the tensors and a .safetensors export are unaffected).",
                           fqn=exc.fqn, file=name)
    return {n: p for n, p in paths.items() if n in value}, None


class _Unnestable(ValueError):
    """A planner_data entry that the nested state dict cannot be rebuilt from."""

    def __init__(self, text: str, fqn: str | None = None) -> None:
        super().__init__(text)
        self.fqn = fqn


def _key_paths(value: dict, names: list[str]) -> dict[str, tuple]:
    """Every name's key path, type-checked, spelling its name ((name,) for a name without one)."""
    out: dict[str, tuple] = {}
    for name in names:
        path = value.get(name)
        if path is None:
            out[name] = (name,)
            continue
        if not isinstance(path, tuple | list) or not 0 < len(path) <= MAX_KEY_PATH:
            raise _Unnestable(f"{_entry(name)} is {_short_path(path)}, not a key path of 1 to {MAX_KEY_PATH} keys",
                              name)
        if {*map(type, path)} == {str}:  # the common case, checked without a loop in Python
            spelled = ".".join(path)
        else:
            for i, p in enumerate(path):
                if type(p) is not str and (type(p) is not int or i == 0 or p < 0):
                    raise _Unnestable(f"{_entry(name)}: key {i} of {_short_path(path)} is {_short(p)}, not "
                                      + ("a string (the top level is a dict)" if i == 0 else
                                         "a string or a list index >= 0"), name)
                if type(p) is int and p >= MAX_INDEX:  # str() of a huge int costs time; no list is that long
                    raise _Unnestable(f"{_entry(name)}: list index {_short(p)} in {_short_path(path)} is beyond "
                                      "any list", name)
            spelled = ".".join(map(str, path))
        if spelled != name:
            raise _Unnestable(f"{_entry(name)}: key path {_short_path(path)} does not spell the entry's name", name)
        out[name] = tuple(path)
    return out


def _check_tree(paths: dict[str, tuple]) -> None:
    """Build the nested dict's shape as a tree of dicts (leaves hold their name) and refuse prefixes,
    dict/list clashes and lists longer than the paths have parts (what ``set_element`` would pad with None)."""
    budget = sum(map(len, paths.values()))
    root: dict = {}
    longest: dict[int, int] = {}  # id(a list's node) -> its largest index so far
    slots = 0
    for name, path in paths.items():
        node = root
        last = len(path) - 1
        for depth, key in enumerate(path):
            child = node.get(key)
            if child is None:  # a new key: the level's kind and the list lengths change only here
                if node and type(next(iter(node))) is not type(key):
                    raise _Unnestable(f"{_entry(name)} puts a {_kind(key)} at "
                                      f"{_short_path(path[:depth])} where {_short(_a_leaf(node))} puts a "
                                      f"{_kind(next(iter(node)))}", name)
                if type(key) is int and key > longest.get(id(node), -1):
                    slots += key - longest.get(id(node), -1)
                    longest[id(node)] = key
                    if slots > budget:
                        raise _Unnestable(f"{_entry(name)}: list index {key} in "
                                          f"{_short_path(path)} makes the nested lists {slots:,} long, more than "
                                          f"the {budget:,} keys of all key paths can fill", name)
                if depth == last:
                    node[key] = name
                    break
                child = node[key] = {}
            elif depth == last:
                other = child if isinstance(child, str) else _a_leaf(child)
                raise _Unnestable(f"{_entry(name)}: key path {_short_path(path)} ends where "
                                  f"the path of {_short(other)} continues", name)
            elif isinstance(child, str):
                raise _Unnestable(f"{_entry(name)}: key path {_short_path(path)} continues "
                                  f"below {_short(child)}, which is a value", name)
            node = child


def _entry(name: str) -> str:
    return f"planner_data entry {_short(name)}"


def _a_leaf(node: dict) -> str:
    """The name of some entry under a tree node."""
    while isinstance(node, dict):
        node = next(iter(node.values()))
    return node


def _kind(key: Any) -> str:
    return "list index" if type(key) is int else "dict key"


def _short_path(path: Any) -> str:
    if not isinstance(path, tuple | list):
        return _short(path)
    text = "(" + ", ".join(_short(p) for p in list(path)[:6]) + (", ...)" if len(path) > 6 else
                                                                  ",)" if len(path) == 1 else ")")
    return text[:120]


def check_table(ckpt: Checkpoint, where: str) -> None:
    """Vectorised checks of the columnar chunk table: ranges and every chunk's rank against its tensor's."""
    t = ckpt.chunk_table
    for name, col in (("chunk offsets/sizes", t.dims), ("byte offsets", t.byte_offset), ("lengths", t.length)):
        if len(col) and (int(col.min()) < 0 or int(col.max()) >= MAX_INDEX):
            j = int(np.argmax((col < 0) | (col >= MAX_INDEX)))
            raise bad(where, f"{name} hold {int(col[j])}, outside [0, 2**62)")
    if not len(t):
        return
    nd = np.fromiter((e.ndim for e in ckpt.tensors), np.int64, len(ckpt.tensors))
    ends = np.append(t.dim_start[1:], len(t.dims))
    bad_rows = np.nonzero(ends - t.dim_start != 2 * nd[t.tensor])[0]
    if len(bad_rows):
        e = ckpt.tensors[int(t.tensor[bad_rows[0]])]
        raise bad(where, f"a chunk of {e.fqn} does not have the tensor's {e.ndim} dimensions", e.fqn)
