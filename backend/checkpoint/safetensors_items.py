"""The parser of safetensors blobs: ``SerializationFormat.SAFETENSORS`` DCP items, ``HuggingFaceStorageWriter``
files and single ``.safetensors`` files. Pure parsing: the header's length, offsets and shapes are checked
against the bytes that exist before anything is allocated or read."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError
from .dtypes import MAX_INDEX, SAFETENSORS_DTYPES, contiguous_strides
from .items import ByteSource, ItemFormatError, StoredTensor, checked_dims

MAX_SAFETENSORS_HEADER = 100 * 2**20  # the safetensors library's own limit


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """A parsed safetensors header: tensors by name (absolute byte ranges) and the ``__metadata__`` strings."""

    tensors: dict[str, StoredTensor]
    metadata: dict[str, str]
    end: int  # absolute offset where the data section ends (the largest data offset)


def parse_safetensors_header(src: ByteSource, name: str, start: int, limit: int,
                             data_limit: int | None = None) -> SafetensorsHeader:
    """The one safetensors header parser: the blob at ``start`` of ``name``, whose header must end by
    ``limit`` (the file size, or the end of the item holding it). Every entry is checked to lie before
    ``data_limit`` (default ``limit``; a folder reader passes a larger one so that a truncated file is
    reported as short rather than unreadable, and reads are range-checked later)."""
    if start + 8 > limit:
        raise ItemFormatError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", src.read(name, start, 8))
    if n > MAX_SAFETENSORS_HEADER or start + 8 + n > limit:
        raise ItemFormatError(f"header length {n} is implausible for {limit - start} bytes")
    try:
        header = json.loads(src.read(name, start + 8, n))
    except (ValueError, RecursionError) as exc:
        raise ItemFormatError(f"header is not JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ItemFormatError("header is not a JSON object")
    base = start + 8 + n
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ItemFormatError("__metadata__ is not a map of strings")
    tensors: dict[str, StoredTensor] = {}
    end = base
    for key, info in header.items():
        tensors[key] = st = _safetensors_entry(key, info, base, limit if data_limit is None else data_limit)
        end = max(end, st.data_offset + st.nbytes)
    return SafetensorsHeader(tensors, meta, end)


def _safetensors_entry(key: str, info: Any, base: int, limit: int) -> StoredTensor:
    try:
        code = info["dtype"]
        shape = checked_dims(info["shape"], f"shape for {key!r}")
        a, b = info["data_offsets"]
    except (KeyError, TypeError, ValueError, ItemFormatError):
        raise ItemFormatError(f"header entry {key!r} is malformed") from None
    dtype = SAFETENSORS_DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise ItemFormatError(f"header entry {key!r} has unknown dtype {str(code)[:20]!r}")
    if type(a) is not int or type(b) is not int or not 0 <= a <= b or base + b > limit:
        raise ItemFormatError(f"header entry {key!r}: bytes {a}..{b} lie outside the {limit - base}-byte data")
    return StoredTensor(dtype, shape, contiguous_strides(shape), 0, base + a, b - a, None)


def parse_safetensors_file(src: ByteSource, name: str, size: int) -> SafetensorsHeader:
    """A whole safetensors file's header, as a CheckpointError naming the file when it does not parse.
    Entries past the end of the file are kept (verify reports the file as short)."""
    try:
        return parse_safetensors_header(src, name, 0, size, MAX_INDEX)
    except ItemFormatError as exc:
        where = src.where(name)
        raise CheckpointError(f"{where}: not a readable safetensors file ({exc}).", path=where) from None



__all__ = ["MAX_SAFETENSORS_HEADER", "SafetensorsHeader", "parse_safetensors_file", "parse_safetensors_header"]
