"""The parser of safetensors blobs: ``SerializationFormat.SAFETENSORS`` DCP items, ``HuggingFaceStorageWriter``
files and single ``.safetensors`` files. Pure parsing: the header's length, offsets and shapes are checked
against the bytes that exist before anything is allocated or read."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from .dtypes import MAX_INDEX, MAX_NDIM, SAFETENSORS_DTYPES, contiguous_strides
from .items import ByteSource, ItemFormatError, StoredTensor, checked_dims

if TYPE_CHECKING:
    import numpy as np  # imported where used: a listing's probe parses headers without numpy

MAX_SAFETENSORS_HEADER = 100 * 2**20  # the safetensors library's own limit


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """A parsed safetensors header: tensors by name (absolute byte ranges) and the ``__metadata__`` strings."""

    tensors: dict[str, StoredTensor]
    metadata: dict[str, str]
    end: int  # absolute offset where the data section ends (the largest data offset)


@dataclass(frozen=True, slots=True)
class SafetensorsTable:
    """A parsed safetensors header as columns, one row per tensor in header order: what opening a file of
    300,000 entries keeps instead of a JSON dict and a :class:`StoredTensor` per entry."""

    names: list[str]
    dtypes: list[str]  # Shardscope dtype names
    ndim: np.ndarray  # int64, per row
    dims: np.ndarray  # int64, every row's shape, concatenated
    data_offset: np.ndarray  # int64, absolute in the file
    nbytes: np.ndarray  # int64
    metadata: dict[str, str]
    end: int  # absolute offset where the data section ends (the largest data offset)

    def __len__(self) -> int:
        return len(self.names)

    def dim_start(self) -> np.ndarray:
        """Where each row's shape starts in ``dims``."""
        import numpy as np

        starts = np.zeros(len(self.names), np.int64)
        np.cumsum(self.ndim[:-1], out=starts[1:])
        return starts


def parse_safetensors_header(src: ByteSource, name: str, start: int, limit: int,
                             data_limit: int | None = None) -> SafetensorsHeader:
    """The one safetensors header parser: the blob at ``start`` of ``name``, whose header must end by
    ``limit`` (the file size, or the end of the item holding it). Every entry is checked to lie before
    ``data_limit`` (default ``limit``; a folder reader passes a larger one so that a truncated file is
    reported as short rather than unreadable, and reads are range-checked later)."""
    raw, base = _header_bytes(src, name, start, limit)
    return _json_header(raw, base, limit if data_limit is None else data_limit)


def parse_safetensors_table(src: ByteSource, name: str, start: int, limit: int,
                            data_limit: int | None = None) -> SafetensorsTable:
    """:func:`parse_safetensors_header` as columns: the layout safetensors' own writer produces is read by
    :func:`_canonical_table` without a Python object per entry; any other spelling (whitespace, key order,
    duplicate names, ...) and any entry failing a check goes through the JSON parser, so results and error
    messages are the same whichever way a header is read."""
    raw, base = _header_bytes(src, name, start, limit)
    data_limit = limit if data_limit is None else data_limit
    table = _canonical_table(raw, base, data_limit)
    return table if table is not None else _table_of(_json_header(raw, base, data_limit))


def _header_bytes(src: ByteSource, name: str, start: int, limit: int) -> tuple[bytes, int]:
    """The header's JSON bytes and the absolute offset where its data section starts."""
    if start + 8 > limit:
        raise ItemFormatError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", src.read(name, start, 8))
    if n > MAX_SAFETENSORS_HEADER or start + 8 + n > limit:
        raise ItemFormatError(f"header length {n} is implausible for {limit - start} bytes")
    return src.read(name, start + 8, n), start + 8 + n


def _json_header(raw: bytes, base: int, data_limit: int) -> SafetensorsHeader:
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ItemFormatError(f"header is not JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ItemFormatError("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ItemFormatError("__metadata__ is not a map of strings")
    tensors: dict[str, StoredTensor] = {}
    end = base
    for key, info in header.items():
        tensors[key] = st = _safetensors_entry(key, info, base, data_limit)
        end = max(end, st.data_offset + st.nbytes)
    return SafetensorsHeader(tensors, meta, end)


def _table_of(header: SafetensorsHeader) -> SafetensorsTable:
    import numpy as np

    sts = list(header.tensors.values())
    dims = [d for st in sts for d in st.shape]
    return SafetensorsTable(list(header.tensors), [st.dtype for st in sts],
                            np.array([len(st.shape) for st in sts], np.int64), np.array(dims, np.int64),
                            np.array([st.data_offset for st in sts], np.int64),
                            np.array([st.nbytes for st in sts], np.int64), header.metadata, header.end)


# The layout of safetensors' own writer: {"__metadata__":{...},"name":{"dtype":"F32","shape":[4],
# "data_offsets":[0,16]},...} then padding spaces. Strings as JSON spells them (no control characters, only
# JSON's escapes), integers as JSON spells them (no leading zeros), at most 18 digits (below MAX_INDEX).
_STR = r'"[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*"'
_INT = r"(?:0|[1-9][0-9]{0,17})"
_ENTRY = ("(" + _STR + r'):\{"dtype":"[^"\\\x00-\x1f]*","shape":\[(?:' + _INT + "(?:," + _INT + r")*)?\],"
          r'"data_offsets":\[' + _INT + "," + _INT + r"\]\}")
_META = re.compile(r'\{(?:"__metadata__":(\{(?:' + _STR + ":" + _STR + "(?:," + _STR + ":" + _STR + r")*)?\}),)?")
_ENTRIES = re.compile(_ENTRY + r"(?:,|(\})[ \t\n\r]*\Z)")  # one entry (its name) and what follows it
# the columns, found from the first entry on (in a header _ENTRIES covers whole, each matches once per entry:
# a quote inside a name is escaped, so none of these can start or end inside a name); names after the first
_NAMES = re.compile(r'\},"([^"\\]*(?:\\.[^"\\]*)*)":\{"dtype":"')
_CODES = re.compile(r'\{"dtype":"([^"]*)","shape":\[')
_SHAPES = re.compile(r'"shape":\[([0-9,]*)\],"data_offsets')
_OFFSETS = re.compile(r'"data_offsets":\[([0-9]+,[0-9]+)\]\}')


def _canonical_table(raw: bytes, base: int, data_limit: int) -> SafetensorsTable | None:
    """The table of a header in the canonical layout whose every entry passes :func:`_safetensors_entry`'s
    checks, or None (the JSON parser then reads it, and says what is wrong)."""
    import numpy as np

    if raw[:2] != b'{"':
        return None
    try:
        text = str(raw, "utf-8")
    except UnicodeDecodeError:
        return None
    head = _META.match(text)
    pos = head.end()
    match = _ENTRIES.scanner(text, pos).match
    first = last = match()
    count = 1
    if first is None:
        return None
    while (m := match()) is not None:  # validates that the entries cover the header exactly, in O(1) memory
        count, last = count + 1, m
    if last.group(2) is None:
        return None
    first_name, meta_text = first.group(1)[1:-1], head.group(1)
    # one column at a time, each list dropped once it is an array: the peak stays near the header's size
    dtypes = [SAFETENSORS_DTYPES.get(c) for c in _CODES.findall(text, pos)]
    if len(dtypes) != count or None in dtypes:
        return None
    shapes = _SHAPES.findall(text, pos)
    if len(shapes) != count:
        return None
    ndim = np.fromiter((s.count(",") + 1 if s else 0 for s in shapes), np.int64, count)
    dims = _ints(",".join(s for s in shapes if s))
    del shapes
    offsets = _OFFSETS.findall(text, pos)
    if len(offsets) != count:
        return None
    ab = _ints(",".join(offsets)).reshape(count, 2)
    del offsets
    a, b = ab[:, 0], ab[:, 1]
    if (ndim > MAX_NDIM).any() or (dims >= MAX_INDEX).any() or (a > b).any() or (base + b > data_limit).any():
        return None
    names = _NAMES.findall(text, pos + 1)
    del text
    names.insert(0, first_name)
    if len(names) != count:
        return None
    if any("\\" in s for s in names):
        names = [json.loads(f'"{s}"') if "\\" in s else s for s in names]  # escapes decoded exactly as JSON does
    if len(set(names)) != count or "__metadata__" in names:  # JSON keeps the last of duplicates: its way
        return None
    meta = json.loads(meta_text) if meta_text else {}
    return SafetensorsTable(names, dtypes, ndim, dims, base + a, b - a, meta, max(base, base + int(b.max())))


def _ints(text: str) -> np.ndarray:
    """Comma-separated decimal integers (checked by the grammar) as int64."""
    import numpy as np

    return np.fromstring(text, np.int64, sep=",") if text else np.zeros(0, np.int64)


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


def parse_safetensors_file(src: ByteSource, name: str, size: int) -> SafetensorsTable:
    """A whole safetensors file's header as columns, as a CheckpointError naming the file when it does not
    parse. Entries past the end of the file are kept (verify reports the file as short)."""
    try:
        return parse_safetensors_table(src, name, 0, size, MAX_INDEX)
    except ItemFormatError as exc:
        where = src.where(name)
        raise CheckpointError(f"{where}: not a readable safetensors file ({exc}).", path=where) from None



__all__ = ["MAX_SAFETENSORS_HEADER", "SafetensorsHeader", "SafetensorsTable", "parse_safetensors_file",
           "parse_safetensors_header", "parse_safetensors_table"]
