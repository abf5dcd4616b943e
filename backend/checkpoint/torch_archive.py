"""A whole ``torch.save`` archive read without running anything from it: its zip records (each checked to lie in
the file as :mod:`.items` checks an item's; data.pkl and the small records by CRC32) and its ``data.pkl`` through
an allow-list unpickler. Tensors become :class:`StoredArray` references (record key, dtype, storage size,
offset, shape, stride: no tensor byte is read); the classes a caller names become inert :class:`StandIn`
records (the class name kept, constructor arguments and pickled state kept as plain data); any other global
(``os.system``, ``builtins.eval``, ...) is refused with a CheckpointError naming the file."""

from __future__ import annotations

import io
import math
import ntpath
import pickle
import posixpath
import re
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import CheckpointError, RefusedPickleError
from .items import (
    STORAGE_DTYPES,
    ByteSource,
    ItemFormatError,
    check_pickle_opcodes,
    checked_dims,
    row_major,
    torch_archive_records,
)
from .model import ITEMSIZE, MAX_INDEX
from .safe_pickle import ELEMENT_ALLOWANCE, gc_paused, with_deep_stack

MAX_ARCHIVE_PICKLE = 64 << 20  # a DeepSpeed model-states data.pkl of a 1,000-parameter model is ~200 KB
_KEY = re.compile(r"[0-9]{1,18}")


def describe(value: Any, limit: int = 80) -> str:
    """A value read from a file (a name, a count) as short, one-line, printable text for a message, whatever
    its nesting."""
    try:
        text = repr(value[:limit] if isinstance(value, str) else value)
    except (RecursionError, ValueError, TypeError, MemoryError):
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True, slots=True)
class StoredArray:
    """A tensor of the archive, located, not read: ``shape``/``stride`` (elements) viewed from element
    ``storage_offset`` of the storage record ``data/<key>``, which holds ``storage_numel`` elements of ``dtype``."""

    key: str
    dtype: str
    storage_numel: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements of the view (1 for a 0-dim tensor)."""
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        """True when the view is row-major, so its elements are one run of the storage."""
        return row_major(self.shape, self.stride)


@dataclass(frozen=True, slots=True)
class RecordInfo:
    """One zip record of the archive: its bytes' absolute offset and length in the file, and its stored CRC32."""

    offset: int
    nbytes: int
    crc32: int


class StandIn:
    """An object of a class the caller allowed, kept inert: ``qualname`` names the class, ``args`` are what the
    pickle called it with (an Enum's value), ``state`` what it set (a dict, usually)."""

    __slots__ = ("args", "state")
    qualname: ClassVar[str] = ""

    def __new__(cls, *args: Any) -> StandIn:
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any) -> None:  # REDUCE calls the class: __new__ kept the arguments
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def value(self) -> Any:
        """An Enum's value (its one constructor argument), else None."""
        return self.args[0] if len(self.args) == 1 else None

    def get(self, name: str, default: Any = None) -> Any:
        """Attribute ``name`` of the pickled state (a dict, or a (dict, slots) pair), or ``default``."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2:
            merged = {**(state[0] if isinstance(state[0], dict) else {}),
                      **(state[1] if isinstance(state[1], dict) else {})}
            return merged.get(name, default)
        return state.get(name, default) if isinstance(state, dict) else default

    def __repr__(self) -> str:
        return f"<{self.qualname}{self.args!r}>"


_STAND_INS: dict[str, type[StandIn]] = {}


def stand_in(qualname: str) -> type[StandIn]:
    """The one stand-in class for ``module.Name`` (made once)."""
    cls = _STAND_INS.get(qualname)
    if cls is None:
        cls = type(qualname.rsplit(".", 1)[-1], (StandIn,), {"__slots__": (), "qualname": qualname})
        _STAND_INS[qualname] = cls
    return cls


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


class _Storage:
    __slots__ = ("dtype", "key", "numel")

    def __init__(self, key: str, numel: int, dtype: str | None) -> None:
        self.key, self.numel, self.dtype = key, numel, dtype


class _StorageType:
    def __init__(self, dtype: str | None) -> None:
        self.dtype = dtype  # None: torch.storage.UntypedStorage (bytes; _rebuild_tensor_v3 names the dtype)


class _DType(str):
    """``torch.float32`` and the like, by short name."""


def _array(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
           dtype: str) -> StoredArray:
    """The checks of torch's own rebuild, and that the view lies inside its storage."""
    if not isinstance(storage, _Storage) or type(requires_grad) is not bool or not isinstance(hooks, dict) or hooks:
        raise ItemFormatError("a tensor is rebuilt with arguments torch refuses")
    if type(offset) is not int or not 0 <= offset < MAX_INDEX:
        raise ItemFormatError("a tensor has an implausible storage offset")
    shape, strides = checked_dims(size, "shape"), checked_dims(stride, "stride")
    if len(shape) != len(strides):
        raise ItemFormatError("a tensor's shape and stride differ in length")
    numel = storage.numel if storage.dtype is not None else storage.numel // max(1, ITEMSIZE.get(dtype, 1))
    if 0 not in shape and offset + 1 + sum((s - 1) * st for s, st in zip(shape, strides, strict=True)) > numel:
        raise ItemFormatError(f"a tensor of shape {shape} at offset {offset} reaches past its storage "
                              f"data/{storage.key} ({numel} elements)")
    return StoredArray(storage.key, dtype, numel, offset, shape, strides)


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                       hooks: Any = None, metadata: Any = None) -> StoredArray:
    if not isinstance(storage, _Storage) or storage.dtype is None or \
            not (metadata is None or isinstance(metadata, dict)):
        raise ItemFormatError("a tensor without a typed storage")
    return _array(storage, offset, size, stride, requires_grad, {} if hooks is None else hooks, storage.dtype)


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any) -> StoredArray:
    return _rebuild_tensor_v2(storage, offset, size, stride)


def _rebuild_tensor_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                       hooks: Any = None, dtype: Any = None, metadata: Any = None) -> StoredArray:
    if not isinstance(storage, _Storage) or storage.dtype is not None or not isinstance(dtype, _DType) or \
            storage.numel % ITEMSIZE[dtype]:
        raise ItemFormatError("a tensor without an untyped storage that fits its dtype")
    return _array(storage, offset, size, stride, requires_grad, {} if hooks is None else hooks, str(dtype))


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any, state: Any = None) -> StoredArray:
    if not isinstance(data, StoredArray) or type(requires_grad) is not bool or not isinstance(hooks, dict) or hooks:
        raise ItemFormatError("a parameter is rebuilt with arguments torch refuses")
    return data


class _TensorType(str):
    """``torch.Tensor`` or ``torch.nn.Parameter`` named as the type a tensor is rebuilt as (never called)."""


_TENSOR_TYPES = {("torch", "Tensor"), ("torch.nn.parameter", "Parameter")}


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> StoredArray:
    """A tensor saved with attributes (ZeRO-3 gives its flat groups a ``ds_id``): ``func(*args)`` of one of the
    rebuilds above, as a plain tensor or parameter; the attributes are dropped."""
    if func not in _REBUILDS or not isinstance(new_type, _TensorType) or not isinstance(args, tuple) or \
            not (state is None or isinstance(state, dict)):
        raise ItemFormatError("a tensor is rebuilt from a type torch.save does not write")
    out = func(*args)
    if not isinstance(out, StoredArray):
        raise ItemFormatError("a tensor is rebuilt from something else than a tensor")
    return out


# Classes any checkpoint's extra state may pickle (a training script's arguments, RNG states, a device), kept
# as inert stand-ins whatever the caller allows
PLAIN_CLASSES = frozenset({"numpy.dtype", "numpy.ndarray", "argparse.Namespace", "torch.device", "pathlib.Path",
                           "pathlib.PosixPath", "pathlib.WindowsPath", "pathlib.PurePosixPath",
                           "pathlib.PureWindowsPath"})


def _numpy_array(cls: Any, shape: Any = None, typecode: Any = None) -> StandIn:
    """``numpy.core.multiarray._reconstruct(numpy.ndarray, (0,), b'b')``: an empty array that BUILD then fills with
    its shape, dtype and raw bytes (kept as they are)."""
    if cls is not stand_in("numpy.ndarray"):
        raise ItemFormatError("a numpy array of another class than numpy.ndarray")
    return cls(shape, typecode)


_NUMPY_CODES = {"f8": "d", "f4": "f", "f2": "e", "i8": "q", "i4": "i", "i2": "h", "i1": "b", "u8": "Q", "u4": "I",
                "u2": "H", "u1": "B", "b1": "?"}


def _numpy_scalar(dtype: Any, data: Any = None) -> Any:
    """``numpy.core.multiarray.scalar(dtype, bytes)`` of a plain number, decoded without numpy."""
    code = dtype.args[0] if isinstance(dtype, StandIn) and dtype.qualname == "numpy.dtype" and dtype.args else None
    order = dtype.state[1] if isinstance(dtype.state, tuple) and len(dtype.state) > 1 else "<"
    if code not in _NUMPY_CODES or order not in ("<", "|", "=") or not isinstance(data, bytes) or \
            len(data) != struct.calcsize("<" + _NUMPY_CODES[code]):
        raise ItemFormatError("a numpy scalar other than a plain little-endian number")
    return struct.unpack("<" + _NUMPY_CODES[code], data)[0]


def _codecs_encode(text: Any, encoding: Any = "latin1") -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise ItemFormatError("a refused _codecs.encode call")
    return text.encode("latin1")


class AttributedDict(dict):
    """``collections.OrderedDict`` as pickled: its attributes too (a module's state_dict carries ``_metadata``)."""

    __slots__ = ("attributes",)

    def __setstate__(self, state: Any) -> None:
        self.attributes = state


# Constructors that copy what they are given: charged for what they build, so that a small pickle cannot make
# a big object many times over (a memo reference costs 2 bytes).
_COPYING = {("collections", "OrderedDict"): AttributedDict, ("builtins", "set"): set,
            ("builtins", "frozenset"): frozenset, ("builtins", "list"): list, ("builtins", "tuple"): tuple,
            ("builtins", "dict"): dict, ("torch", "Size"): tuple}
_REBUILDS = (_rebuild_tensor_v2, _rebuild_tensor, _rebuild_tensor_v3, _rebuild_parameter)
_FUNCTIONS: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("numpy.core.multiarray", "scalar"): _numpy_scalar,
    ("numpy._core.multiarray", "scalar"): _numpy_scalar,
    ("numpy.core.multiarray", "_reconstruct"): _numpy_array,
    ("numpy._core.multiarray", "_reconstruct"): _numpy_array,
    ("_codecs", "encode"): _codecs_encode,
}


class _ArchiveUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, source: str, classes: frozenset[str]) -> None:
        super().__init__(io.BytesIO(data))
        self._source, self._classes = source, classes
        self._budget = len(data) + ELEMENT_ALLOWANCE
        self.storages: dict[str, _Storage] = {}

    def _charged(self, ctor: Callable[..., Any]) -> Callable[..., Any]:
        def build(*args: Any) -> Any:
            out = ctor(*args)
            self._budget -= len(out)
            if self._budget < 0:
                raise RefusedPickleError(f"{self._source}: the pickle builds far more data than the file holds (an "
                                         "allocation bomb); refused.", path=self._source)
            return out

        return build

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _COPYING:
            return self._charged(_COPYING[key])
        if key in _FUNCTIONS:
            return _FUNCTIONS[key]
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        if key in _TENSOR_TYPES:
            return _TensorType(f"{module}.{name}")
        if key == ("torch.storage", "UntypedStorage"):
            return _StorageType(None)
        if module == "torch" and name in ITEMSIZE:
            return _DType(name)
        if f"{module}.{name}" in self._classes or f"{module}.{name}" in PLAIN_CLASSES:
            return stand_in(f"{module}.{name}")
        what = f"{module}.{name}" if f"{module}.{name}".isprintable() else describe(f"{module}.{name}")
        raise RefusedPickleError(
            f"{self._source}: refused to load the pickled global {what[:200]}: it is not one a checkpoint of "
            "this kind holds, so the file is damaged or hostile. Nothing from it was run.", path=self._source)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and isinstance(pid[2], str) and _KEY.fullmatch(pid[2]) and isinstance(pid[3], str)
                and type(pid[4]) is int and 0 <= pid[4] < MAX_INDEX):
            raise ItemFormatError("an unsupported persistent id")
        known = self.storages.get(pid[2])
        if known is None:
            known = self.storages[pid[2]] = _Storage(pid[2], pid[4], pid[1].dtype)
        elif (known.numel, known.dtype) != (pid[4], pid[1].dtype):
            raise ItemFormatError(f"storage data/{pid[2]} is named with two sizes or dtypes")
        return known


def _unpickle(data: bytes, source: str, classes: frozenset[str]) -> tuple[Any, dict[str, _Storage]]:
    check_pickle_opcodes(data)
    unpickler = _ArchiveUnpickler(data, source, classes)

    def load() -> Any:
        with gc_paused():
            return unpickler.load()

    try:
        return with_deep_stack(load, len(data)), unpickler.storages
    except (CheckpointError, ItemFormatError):
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            OverflowError, UnicodeDecodeError, RecursionError, MemoryError, struct.error) as exc:
        raise ItemFormatError(f"data.pkl does not unpickle ({type(exc).__name__}: {str(exc)[:120]})") from None


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
    if isinstance(value, _DType):
        return f"torch.{value}"
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
            want = storage.numel * (ITEMSIZE[storage.dtype] if storage.dtype is not None else 1)
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
