"""A whole ``torch.save`` archive read without running anything from it: its zip records (each checked to lie in
the file as :mod:`.items` checks an item's; data.pkl and the small records by CRC32) and its ``data.pkl`` through
an allow-list unpickler. Tensors become :class:`StoredArray` references (record key, dtype, storage size,
offset, shape, stride: no tensor byte is read); the classes a caller names become inert :class:`StandIn`
records (the class name kept, constructor arguments and pickled state kept as plain data); any other global
(``os.system``, ``builtins.eval``, ...) is refused with a CheckpointError naming the file."""

from __future__ import annotations

import ntpath
import posixpath
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, RefusedPickleError
from .items import ByteSource, ItemFormatError, torch_archive_records
from .model import ITEMSIZE
from .unpickler import (
    PLAIN_CLASSES,
    Builder,
    DTypeName,
    NotBuilt,
    StandIn,
    TensorRef,
    archive_rules,
    describe,
    stand_in,
    unpickle,
)

MAX_ARCHIVE_PICKLE = 64 << 20  # a DeepSpeed model-states data.pkl of a 1,000-parameter model is ~200 KB


StoredArray = TensorRef
"""A tensor of the archive, located, not read (:class:`.unpickler.TensorRef`): ``shape``/``stride`` (elements)
viewed from element ``storage_offset`` of the storage record ``data/<key>``, which holds ``storage_numel`` elements
of ``dtype``."""


@dataclass(frozen=True, slots=True)
class RecordInfo:
    """One zip record of the archive: its bytes' absolute offset and length in the file, and its stored CRC32."""

    offset: int
    nbytes: int
    crc32: int


@dataclass(slots=True)
class TorchArchive:
    """A parsed ``torch.save`` archive: ``root`` is the unpickled object tree (plain containers, :class:`StandIn`,
    :class:`StoredArray`), ``records`` its zip records by key (``data.pkl``, ``data/0``, ...)."""

    file: str
    size: int
    records: dict[str, RecordInfo]
    root: Any

    def record_of(self, array: StoredArray) -> RecordInfo:
        """The storage record holding ``array`` (its size was checked against the storage when parsed)."""
        return self.records[f"data/{array.key}"]

    def byte_offset(self, array: StoredArray, element: int) -> int:
        """Absolute file offset of flat element ``element`` of a contiguous ``array``."""
        return self.record_of(array).offset + (array.storage_offset + element) * ITEMSIZE[array.dtype]


def _unpickle(data: bytes, source: str, classes: frozenset[str]) -> tuple[Any, dict]:
    try:
        return unpickle(data, source, archive_rules("a checkpoint of this kind", classes))
    except NotBuilt as exc:
        raise ItemFormatError(str(exc)) from None


MAX_PLAIN_DEPTH = 64


def plain(value: Any, depth: int = 0) -> Any:
    """An unpickled value as plain data (dicts, lists, numbers, strings): a stand-in as ``{"__class__": name,
    ...state}`` (an Enum's with its ``value``), a path as its text, a tensor or numpy array as a short
    description."""
    if depth > MAX_PLAIN_DEPTH:
        return "<nested too deep>"
    if isinstance(value, dict):
        return {k if isinstance(k, str | int | float | bool) or k is None else _short(k): plain(v, depth + 1)
                for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v, depth + 1) for v in value]
    if isinstance(value, StandIn):
        return _plain_stand_in(value, depth)
    if isinstance(value, StoredArray):
        return f"<tensor {value.dtype} {list(value.shape)}>"
    if isinstance(value, Builder):
        return f"torch.{value.kind}" if isinstance(value.kind, DTypeName) else f"<{value.name}>"
    if value is None or isinstance(value, str | int | float | bool | bytes):
        return value
    return _short(value)


def _plain_stand_in(value: StandIn, depth: int) -> Any:
    args, state = value.args, value.state
    if value.qualname.startswith("pathlib.") and args and all(isinstance(a, str) for a in args):
        return (ntpath if "Windows" in value.qualname else posixpath).join(*args)  # its parts: ("/", "runs", "a")
    if value.qualname == "numpy.dtype" and args and isinstance(args[0], str):
        return f"numpy.dtype({args[0][:16]!r})"
    if value.qualname == "numpy.ndarray" and isinstance(state, tuple) and len(state) == 5:
        dtype = plain(state[2], depth + 1)
        shape = list(state[1]) if isinstance(state[1], tuple) else "?"
        return f"<numpy array {dtype if isinstance(dtype, str) else '?'} {shape}>"
    fields = state if isinstance(state, dict) else {}
    return {"__class__": value.qualname, **({"value": plain(value.value, depth + 1)} if args else {}),
            **{str(k): plain(v, depth + 1) for k, v in fields.items()}}


def _short(value: Any) -> str:
    try:
        return repr(value)[:200]
    except (RecursionError, ValueError, TypeError):  # a key nested deeper than repr goes
        return f"<{type(value).__name__}>"


def load_torch_archive(src: ByteSource, name: str, size: int, classes: Iterable[str] = ()) -> TorchArchive:
    """Parse file ``name`` (``size`` bytes) of ``src`` as a ``torch.save`` archive; ``classes`` are the
    ``module.Name`` globals that become :class:`StandIn` records besides :data:`PLAIN_CLASSES` (torch's tensor
    rebuilds, containers and numpy scalars are always read). CheckpointError naming the file for anything else
    (RefusedPickleError for a refused global)."""
    where = src.where(name)
    try:
        if size < 22 or src.read(name, 0, 4) != b"PK\x03\x04":
            raise ItemFormatError("not a zip archive (torch.save's legacy format is not read)")
        records = {k: RecordInfo(*v) for k, v in torch_archive_records(src, name, size).items()}
        pkl = records["data.pkl"]
        if pkl.nbytes > MAX_ARCHIVE_PICKLE:
            raise ItemFormatError(f"data.pkl claims {pkl.nbytes} bytes; at most {MAX_ARCHIVE_PICKLE} are plausible")
        data = src.read(name, pkl.offset, pkl.nbytes)
        if zlib.crc32(data) != pkl.crc32:
            raise ItemFormatError("data.pkl fails its CRC32 check")
        root, storages = _unpickle(data, where, frozenset(classes))
        for key, storage in storages.items():
            rec = records.get(f"data/{key}")
            want = storage.nbytes
            if rec is None or rec.nbytes != want:
                raise ItemFormatError(f"storage record data/{key} is {'missing' if rec is None else rec.nbytes} "
                                      f"{'' if rec is None else 'bytes'}; the pickle names {want} bytes")
    except RefusedPickleError:
        raise
    except ItemFormatError as exc:
        raise CheckpointError(f"{where}: not a readable torch.save archive ({exc}).", path=where) from None
    return TorchArchive(name, size, records, root)


__all__ = ["PLAIN_CLASSES", "RecordInfo", "StandIn", "StoredArray", "TorchArchive", "describe", "load_torch_archive",
           "plain", "stand_in"]
