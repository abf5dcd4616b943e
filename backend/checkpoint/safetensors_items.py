"""The parser of safetensors blobs: ``SerializationFormat.SAFETENSORS`` DCP items, ``HuggingFaceStorageWriter``
files and single ``.safetensors`` files. Pure parsing: the header's length, offsets and shapes are checked
against the bytes that exist before anything is allocated or read."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ..errors import CheckpointError
from ..text import count
from .dtypes import MAX_INDEX, MAX_NDIM, SAFETENSORS_DTYPES, contiguous_strides
from .items import ByteSource, ItemFormatError, StoredTensor, checked_dims

if TYPE_CHECKING:
    import numpy as np  # imported where used: a listing's probe parses headers without numpy

MAX_SAFETENSORS_HEADER = 100_000_000  # the safetensors library's own limit (MAX_HEADER_SIZE)


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
    return table if table is not None else _json_table(raw, base, data_limit)


def _header_bytes(src: ByteSource, name: str, start: int, limit: int) -> tuple[bytes, int]:
    """The header's JSON bytes and the absolute offset where its data section starts."""
    if start + 8 > limit:
        raise ItemFormatError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", src.read(name, start, 8))
    if n > MAX_SAFETENSORS_HEADER or start + 8 + n > limit:
        raise ItemFormatError(f"header length {n} is implausible for {limit - start} bytes")
    return src.read(name, start + 8, n), start + 8 + n


def _json_header(raw: bytes, base: int, data_limit: int) -> SafetensorsHeader:
    header, meta = _loads(raw)
    tensors: dict[str, StoredTensor] = {}
    for key, info in header.items():
        tensors[key] = _safetensors_entry(key, info, base, data_limit)
    sts = list(tensors.values())
    _check_layout(list(tensors), [st.data_offset - base for st in sts],
                  [st.data_offset - base + st.nbytes for st in sts])
    return SafetensorsHeader(tensors, meta, max([base, *(st.data_offset + st.nbytes for st in sts)]))


def _loads(raw: bytes) -> tuple[dict, dict[str, str]]:
    """(tensor entries, ``__metadata__``) of a header, JSON read as the safetensors library reads it: UTF-8 only
    (no BOM, no other encoding, no lone surrogate), the last of two tensors of one name kept, an entry naming a
    field twice or a second ``__metadata__`` refused."""
    try:
        text = str(raw, "utf-8")
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ItemFormatError(f"header is not JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ItemFormatError("header is not a JSON object")
    entries = len(header) - ("__metadata__" in header)
    # every entry names its three fields: more of those words means a field (or __metadata__) may be named twice
    if sum(map(text.count, ('"dtype"', '"shape"', '"data_offsets"'))) != 3 * entries or \
            text.count('"__metadata__"') > 1:
        _refuse_duplicate_fields(text)
    if _lone_surrogate(text):
        try:
            json.dumps(header, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ItemFormatError("header holds a lone UTF-16 surrogate escape") from None
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ItemFormatError("__metadata__ is not a map of strings")
    return header, meta


# a \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one, or one of those not preceded by the first kind: a lone
# surrogate (JSON text that merely looks so, an escaped backslash before "u", only costs the exact check)
_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})"
                        r"\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _lone_surrogate(text: str) -> bool:
    """Whether JSON text may escape a lone surrogate (the regex only runs where a \\uD escape is at all)."""
    return ("\\ud" in text or "\\uD" in text) and _SURROGATE.search(text) is not None


def _refuse_duplicate_fields(text: str) -> None:
    """An entry naming a field twice, or ``__metadata__`` given twice: what the library refuses (of two tensors
    of one name, or two ``__metadata__`` keys of one name, it keeps the last, as json does)."""
    repeated: list[tuple[dict, list[str]]] = []

    def pairs_to_dict(pairs: list[tuple[str, Any]]) -> dict:
        d = dict(pairs)
        if len(d) != len(pairs):
            repeated.append((d, [k for k, _ in pairs]))
        return d

    header = json.loads(text, object_pairs_hook=pairs_to_dict)
    entries = {id(v): k for k, v in header.items() if k != "__metadata__"}
    for d, keys in repeated:
        if d is header and keys.count("__metadata__") > 1:
            raise ItemFormatError("header names __metadata__ twice")
        if id(d) in entries:
            raise ItemFormatError(f"header entry {entries[id(d)]!r} names a field twice")


def _check_layout(names: list[str], start: Any, end: Any) -> None:
    """The entries' byte ranges (relative to the data section) must tile it from its first byte, without a hole
    or an overlap: the safetensors library refuses any other layout. Lists (a listing's probe, which imports no
    numpy) are sorted in Python, numpy columns in numpy."""
    order: Any  # as start and end: lists or numpy columns
    s: Any
    e: Any
    if isinstance(start, list):
        order = sorted(range(len(start)), key=lambda i: (start[i], end[i]))
        s, e = [start[i] for i in order], [end[i] for i in order]
        bad = next((i for i in range(len(s)) if s[i] != (e[i - 1] if i else 0)), None)
    else:
        import numpy as np

        order = np.lexsort((end, start))
        s, e = start[order], end[order]
        found = np.flatnonzero(np.r_[s[:1] != 0, s[1:] != e[:-1]])
        bad = int(found[0]) if len(found) else None
    if bad is not None:
        where = "the data's start (0)" if bad == 0 else f"where the previous entry's bytes end ({int(e[bad - 1])})"
        raise ItemFormatError(f"header entry {names[int(order[bad])]!r}: its bytes {int(s[bad])}..{int(e[bad])} do "
                              f"not begin {where}: a hole or an overlap, which the safetensors library refuses")


def trailing_bytes(end: int, size: int) -> str | None:
    """Why a whole file whose tensors' data ends at ``end`` is refused for holding bytes after it, or None."""
    if end >= size:
        return None
    return f"{count(size - end, 'byte')} after the last tensor's data, which the safetensors library refuses"


def _json_table(raw: bytes, base: int, data_limit: int) -> SafetensorsTable:
    """A header in any other spelling as columns, the entries checked column by column (no object per entry);
    any entry failing a check is read again by :func:`_json_header`, which says which and why."""

    header, meta = _loads(raw)
    try:
        columns = _entry_columns(list(header.values()))
    except (KeyError, TypeError, ValueError, OverflowError, IndexError):
        columns = None
    if columns is None:
        _json_header(raw, base, data_limit)  # raises the error of the first bad entry
        raise ItemFormatError("header entries are malformed")
    dtypes, ndim, dims, a, b = columns
    if (base + b > data_limit).any():
        _json_header(raw, base, data_limit)
    names = list(header)
    _check_layout(names, a, b)
    end = max(base, base + int(b.max())) if len(b) else base
    return SafetensorsTable(names, dtypes, ndim, dims, base + a, b - a, meta, end)


def _entry_columns(infos: list) -> tuple | None:
    """(dtypes, ndim, dims, start, end) of JSON entries, or None where one fails :func:`_safetensors_entry`'s
    checks. Lists and ints only (JSON has no tuples; ``True`` is not a size)."""
    from itertools import chain
    from operator import itemgetter

    import numpy as np

    if set(map(type, infos)) - {dict}:
        return None
    codes = list(map(itemgetter("dtype"), infos))
    shapes = list(map(itemgetter("shape"), infos))
    pairs = list(map(itemgetter("data_offsets"), infos))
    if set(map(type, codes)) - {str} or set(map(type, shapes)) - {list} or set(map(type, pairs)) - {list} \
            or set(map(len, pairs)) - {2}:
        return None
    dtypes = list(map(SAFETENSORS_DTYPES.get, codes))
    flat = list(chain.from_iterable(shapes))
    offs = list(chain.from_iterable(pairs))
    if None in dtypes or set(map(type, flat)) - {int} or set(map(type, offs)) - {int}:
        return None
    ndim = np.fromiter(map(len, shapes), np.int64, len(shapes))
    dims = np.array(flat, np.int64) if flat else np.zeros(0, np.int64)
    ab = (np.array(offs, np.int64) if offs else np.zeros(0, np.int64)).reshape(-1, 2)
    a, b = ab[:, 0].copy(), ab[:, 1].copy()
    if (ndim > MAX_NDIM).any() or (dims < 0).any() or (dims >= MAX_INDEX).any() or (a < 0).any() or (a > b).any():
        return None
    return dtypes, ndim, dims, a, b


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
    if _lone_surrogate(text):
        return None
    head = _META.match(text)
    if head is None:  # not after the '{"' checked above; the JSON parser says what is wrong
        return None
    pos = head.end()
    # CPython's Pattern.scanner (matches one after the other from pos), which typeshed does not declare
    match = _ENTRIES.scanner(text, pos).match  # type: ignore[attr-defined]
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
    if len(set(names)) != count or "__metadata__" in names:  # JSON keeps the last of duplicates: its way, as the
        return None  # library's
    try:
        _check_layout(names, a, b)
    except ItemFormatError:
        return None
    meta = json.loads(meta_text) if meta_text else {}
    return SafetensorsTable(names, cast(list[str], dtypes), ndim, dims, base + a, b - a, meta,  # no None: checked
                            max(base, base + int(b.max())))


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
        table = parse_safetensors_table(src, name, 0, size, MAX_INDEX)
        tail = trailing_bytes(table.end, size)
        if tail is not None:
            raise ItemFormatError(tail)
        return table
    except ItemFormatError as exc:
        where = src.where(name)
        raise CheckpointError(f"{where}: not a readable safetensors file ({exc}).", path=where) from None



__all__ = ["MAX_SAFETENSORS_HEADER", "SafetensorsHeader", "SafetensorsTable", "parse_safetensors_file",
           "parse_safetensors_header", "parse_safetensors_table", "trailing_bytes"]
