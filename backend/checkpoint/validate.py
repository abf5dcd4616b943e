"""The one validation step for what comes out of an unpickled ``.metadata``: every field the checkpoint
model uses is type- and range-checked here, right after unpickling and before anything allocates,
reads or loops on it. A value that fails is bad input: a :class:`CheckpointError` naming the file
and the entry (exit 2), never a traceback.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CheckpointError
from .chunks import safe_name
from .model import ITEMSIZE, MAX_INDEX, MAX_NDIM, Checkpoint
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
    """A dict field (``storage_data``, ``planner_data``); None is empty."""
    if value is None:
        return {}
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


def planner_data(value: Any) -> dict[str, tuple]:
    """``planner_data`` (flat name -> nested key path) when well formed; {} otherwise (it is only a hint)."""
    if not isinstance(value, dict):
        return {}
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, tuple | list) or len(v) > 256 or \
                not all(isinstance(p, str) or type(p) is int for p in v):
            return {}
        out[k] = tuple(v)
    return out


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
