"""Dtype names and sizes, and the bounds every number read from a file is checked against. Plain Python (no
numpy): the probes a listing runs use these without importing the checkpoint model."""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError

ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex32": 4, "complex64": 8,
    "complex128": 16, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "int8": 1, "int16": 2,
    "int32": 4, "int64": 8, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1, "qint8": 1, "quint8": 1,
    "qint32": 4, "quint4x2": 1, "quint2x4": 1, "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1,
    "bits4x2": 1,
}
DTYPE_NAMES = tuple(ITEMSIZE)  # every torch dtype by its short name, which is how we report them

FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                          "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"})

# The one safetensors dtype table (torch name -> safetensors code); the reverse map is derived from it,
# so whatever can be read can also be written.
SAFETENSORS_CODES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "uint16": "U16", "uint32": "U32",
    "uint64": "U64", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "complex64": "C64", "float8_e8m0fnu": "F8_E8M0",
}  # NOTE: no complex128: the safetensors library has no C128 and refuses a header that names it
SAFETENSORS_DTYPES = {code: name for name, code in SAFETENSORS_CODES.items()}

MAX_NDIM = 64  # torch's own limit on tensor dimensions
MAX_INDEX = 2**62  # any offset, size, byte offset or length read from a file must be below this


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype by its short name (0 when unknown)."""
    return ITEMSIZE.get(dtype, 0)


def contiguous_strides(shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Row-major strides (in elements) of a contiguous tensor of ``shape``."""
    stride = []
    acc = 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def torch_dtype(name: str) -> Any:
    """The ``torch.dtype`` for a short dtype name, or a CheckpointError when this torch lacks it."""
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"dtype {name} is not known to this torch ({torch.__version__}).")
    return dt
