"""The one place that decides what a pickle from a checkpoint may build: every global it may name (the allow-lists
of every reader), and what the opcodes that act on objects (REDUCE, NEWOBJ, BUILD, SETITEM(S), APPEND(S)) may do,
exactly as ``torch.load(weights_only=True)``'s unpickler (``torch/_weights_only_unpickler.py``) permits them:

- REDUCE and NEWOBJ call only a :class:`Builder` this module made for an allowed global;
- BUILD acts only on an ``OrderedDict``/``Counter`` (its attributes) and on the inert :class:`StandIn` of a class a
  reader allows (numpy dtypes and arrays among them: only numbers, their sizes checked and charged); BUILD on a
  tensor (torch's legacy ``set_``) is left to torch; on anything else (a function, a record of ours, a set, a
  torch dtype) it is refused as torch refuses it;
- APPEND(S) only on a ``list``, SETITEM(S) only on a ``dict``/``OrderedDict``/``Counter``;
- only the opcodes torch's unpickler runs (protocol 2, what ``torch.save`` writes), read by a Python interpreter
  here, so no C code sizes anything from a number in the file (memo indexes are dict keys).

Nothing of Shardscope's is reachable from a pickle: globals resolve to immutable :class:`Builder` objects, numpy
and other allowed classes to :class:`StandIn` records that only keep what they were given, tensors to frozen
:class:`TensorRef` views checked as torch checks them. Copying constructors are charged against a budget set by
the pickle's size (a memo reference costs 2 bytes, so a small pickle could otherwise build big things many times).

Readers choose a :class:`Rules` set here (torch files, DCP items, DeepSpeed/Megatron/Lightning archives) and get
``RefusedPickleError`` (one line naming the file and what it asked for) for what torch refuses, :class:`NotBuilt`
for what torch would build and this module does not (a torch file's reader then lets ``torch.load(weights_only=
True)`` read it). The DCP ``.metadata`` unpickler (:mod:`.metadata_pickle`) takes its globals from here too, and
``torch.load``'s extra safe globals are :func:`torch_safe_globals`."""

from __future__ import annotations

import functools
import io
import math
import pickle
import struct
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, ClassVar

from ..errors import RefusedPickleError
from .dtypes import DTYPE_NAMES, ITEMSIZE, MAX_INDEX, MAX_NDIM
from .safe_pickle import (
    MEMO_ALLOWANCE,
    BytesStorageRecord,
    ChunkRecord,
    MetadataIndexRecord,
    MetadataRecord,
    Record,
    SavePlanRecord,
    ShardMetadataRecord,
    StorageInfoRecord,
    StorageMetaRecord,
    StoragePrefixRecord,
    TensorPropertiesRecord,
    TensorStorageRecord,
    WriteItemRecord,
    _quiet_bytearray_noise,
    address_space_limit,
    gc_paused,
    stream_size,
    with_deep_stack,
)

ELEMENT_ALLOWANCE = 1 << 20  # elements any pickle may build through copying constructors on top of its size
_HIDDEN = "\x00<shardscope tensor>\x00"  # what a tensor or storage prints as: found in a name, it was a key

# torch.save's Python 2 names, renamed as torch's unpickler renames them (torch._utils' copies of these tables)
_NAME_MAPPING = {("__builtin__", "xrange"): ("builtins", "range"), ("__builtin__", "reduce"): ("functools", "reduce"),
                 ("__builtin__", "intern"): ("sys", "intern"), ("__builtin__", "unichr"): ("builtins", "chr"),
                 ("__builtin__", "unicode"): ("builtins", "str"), ("__builtin__", "long"): ("builtins", "int"),
                 ("__builtin__", "basestring"): ("builtins", "str")}
_IMPORT_MAPPING = {"__builtin__": "builtins", "copy_reg": "copyreg", "Queue": "queue", "repr": "reprlib",
                   "_abcoll": "collections.abc", "UserDict": "collections", "UserList": "collections",
                   "UserString": "collections", "whichdb": "dbm", "StringIO": "io", "cStringIO": "io"}

# torch's storage classes by the dtype of their elements (torch.FloatStorage ...)
STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64", "QInt8Storage": "qint8", "QUInt8Storage": "quint8", "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
}
# dtypes whose tensors torch lets require gradients; dense dtypes this module rebuilds tensors of
_GRAD_DTYPES = frozenset({"float16", "float32", "float64", "bfloat16", "complex64", "complex128"})
_DENSE = frozenset(d for d in ITEMSIZE if not d.startswith("q"))


class NotBuilt(Exception):
    """torch's weights-only unpickler would build this (or fails on it itself) and this module does not; the message
    says what. A torch file's reader then leaves the file to ``torch.load(weights_only=True)``."""


# ---------------------------------------------------------------- what a pickle gets for a global
class Builder:
    """An allowed global as the pickle sees it: immutable, no attributes to set, no state to build. ``call`` is what
    REDUCE runs, ``new`` what NEWOBJ runs (None: torch refuses NEWOBJ of it), ``kind`` a tag other builders check
    (a storage kind's dtype, a tensor type, a numpy class)."""

    __slots__ = ("call", "kind", "name", "new")

    def __init__(self, name: str, call: Callable[..., Any] | None, new: Callable[..., Any] | None = None,
                 kind: Any = None) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "call", call)
        object.__setattr__(self, "new", new)
        object.__setattr__(self, "kind", kind)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("read-only")

    def __repr__(self) -> str:
        return _HIDDEN

    def __reduce__(self) -> Any:
        raise TypeError("a global of a pickle being read is not pickled")


class StandIn:
    """An object of a class a reader allows, kept inert: ``qualname`` names the class, ``args`` are what the pickle
    called it with (an Enum's value), ``state`` what BUILD gave it (a dict, usually)."""

    __slots__ = ("args", "state")
    qualname: ClassVar[str] = ""

    def __init__(self, *args: Any) -> None:
        self.args, self.state = args, None

    def build(self, state: Any, budget: Budget) -> None:
        """BUILD: keep ``state`` (subclasses check it)."""
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

    def __reduce__(self) -> Any:
        raise TypeError("an object of a pickle being read is not pickled")


_STAND_INS: dict[str, type[StandIn]] = {}


def stand_in(qualname: str) -> type[StandIn]:
    """The one stand-in class for ``module.Name`` (made once)."""
    cls = _STAND_INS.get(qualname)
    if cls is None:
        base = _CHECKED_STAND_INS.get(qualname, StandIn)
        cls = type(qualname.rsplit(".", 1)[-1], (base,), {"__slots__": (), "qualname": qualname})
        _STAND_INS[qualname] = cls
    return cls


# ---------------------------------------------------------------- numpy: numbers only, sizes charged
# numpy dtypes torch's BUILD may set the state of (the classes chunks of checkpoints hold: RNG states), by the code
# numpy pickles them with
NUMPY_NUMBER_CODES = {"b1": "Bool", "i1": "Int8", "i2": "Int16", "i4": "Int32", "i8": "Int64", "u1": "UInt8",
                      "u2": "UInt16", "u4": "UInt32", "u8": "UInt64", "f2": "Float16", "f4": "Float32",
                      "f8": "Float64"}
_NUMPY_ORDERS = ("<", ">", "|", "=")


class NumpyDType(StandIn):
    """``numpy.dtype(code, False, True)`` and its BUILD state: only the number dtypes torch's weights-only loader
    lets a checkpoint build (an object, void or structured dtype is refused as torch refuses it)."""

    __slots__ = ()

    @property
    def code(self) -> str | None:
        return self.args[0] if self.args and self.args[0] in NUMPY_NUMBER_CODES else None

    @property
    def order(self) -> str:
        return self.state[1] if isinstance(self.state, tuple) and len(self.state) > 1 else "="

    def build(self, state: Any, budget: Budget) -> None:
        # numpy keeps a number dtype's size and alignment whatever the state says (only its byte order is set)
        if self.code is None or not (isinstance(state, tuple) and len(state) == 8 and state[0] == 3
                                     and state[1] in _NUMPY_ORDERS and state[2:5] == (None, None, None)
                                     and type(state[5]) is int and type(state[6]) is int and state[7] == 0):
            raise budget.refused(f"sets the state of a numpy dtype {describe(self.args)} to {describe(state)}")
        self.state = state

    @property
    def itemsize(self) -> int:
        return int(self.args[0][1:])


class NumpyArray(StandIn):
    """``numpy.core.multiarray._reconstruct(numpy.ndarray, (0,), b'b')`` filled by BUILD with (version, shape, dtype,
    fortran order, raw bytes): a number dtype, its bytes exactly its shape's, charged for them."""

    __slots__ = ()

    def build(self, state: Any, budget: Budget) -> None:
        if not (isinstance(state, tuple) and len(state) == 5 and state[0] == 1 and type(state[1]) is tuple
                and type(state[2]) is stand_in("numpy.dtype") and state[2].state is not None
                and type(state[3]) is bool and type(state[4]) is bytes):
            raise budget.refused(f"builds a numpy array from {describe(state)}")
        shape, dtype, raw = state[1], state[2], state[4]
        if len(shape) > MAX_NDIM or not all(type(d) is int and 0 <= d < MAX_INDEX for d in shape) or \
                math.prod(shape) * dtype.itemsize != len(raw):
            raise budget.refused(f"builds a numpy array of shape {describe(shape)} from {len(raw)} bytes")
        budget.charge(len(raw))  # the array copies them (a memo reference gives one string to many arrays)
        self.state = state


class BytesIOStandIn(StandIn):
    """``io.BytesIO`` (DCP pickles a Stateful's BytesIO: torchtitan's train_state): made with nothing or bytes, its
    state (value, position, dict) checked as ``BytesIO.__setstate__`` checks it."""

    __slots__ = ()

    def __init__(self, *args: Any) -> None:
        if len(args) > 1 or (args and args[0] is not None and type(args[0]) not in (bytes, bytearray)):
            raise NotBuilt("an io.BytesIO made from something else than bytes")
        super().__init__(*args)

    def build(self, state: Any, budget: Budget) -> None:
        if not (type(state) is tuple and len(state) == 3 and type(state[0]) in (bytes, bytearray)
                and type(state[1]) is int and state[1] >= 0 and (state[2] is None or type(state[2]) is dict)):
            raise NotBuilt("an io.BytesIO is given a state BytesIO.__setstate__ refuses")
        self.state = state


_CHECKED_STAND_INS: dict[str, type[StandIn]] = {"numpy.dtype": NumpyDType, "numpy.ndarray": NumpyArray,
                                              "_io.BytesIO": BytesIOStandIn}


def _numpy_reconstruct(budget: Budget) -> Callable[..., StandIn]:
    def reconstruct(cls: Any, shape: Any = None, typecode: Any = None) -> StandIn:
        if not (isinstance(cls, Builder) and cls.kind is stand_in("numpy.ndarray")) or shape != (0,) or \
                typecode != b"b":
            dims = (shape,) if type(shape) is int else shape
            if type(dims) not in (tuple, list) or not all(type(d) is int and d >= 0 for d in dims):
                raise budget.refused(f"makes a numpy array of shape {describe(shape)}")
            budget.charge(math.prod(dims) * 64)  # numpy would allocate it (64: its largest item)
            raise NotBuilt("a numpy array is reconstructed in a way numpy's pickle does not write")
        return stand_in("numpy.ndarray")(shape, typecode)
    return reconstruct


def _numpy_dtype(code: Any, align: Any = False, copy: Any = True) -> StandIn:
    if not isinstance(code, str):
        raise NotBuilt("a numpy dtype named by something else than a code")
    return stand_in("numpy.dtype")(code, align, copy)


def _numpy_scalar(dtype: Any, data: Any = None) -> Any:
    """``numpy.core.multiarray.scalar(dtype, bytes)`` of a plain number, decoded without numpy."""
    codes = {"f8": "d", "f4": "f", "f2": "e", "i8": "q", "i4": "i", "i2": "h", "i1": "b", "u8": "Q", "u4": "I",
             "u2": "H", "u1": "B", "b1": "?"}
    code = dtype.code if isinstance(dtype, NumpyDType) else None
    if code is None or dtype.order not in ("<", "|", "=") or not isinstance(data, bytes) or \
            len(data) != struct.calcsize("<" + codes[code]):
        raise NotBuilt("a numpy scalar other than a plain little-endian number")
    return struct.unpack("<" + codes[code], data)[0]


def realize(value: Any) -> Any:
    """A loaded value with its numpy and ``io.BytesIO`` stand-ins made real (numbers only: their dtype and bytes
    were checked when built), as torch.load would give them; everything else as it is. Each object is visited once
    (a pickle's shared references stay shared, and a structure referenced twice at each of 40 levels costs 40
    visits, not 2**40)."""
    return _realize(value, {}, 0)


def _realize(value: Any, done: dict[int, Any], depth: int) -> Any:
    if depth > 512 or value is None or type(value) in (str, int, float, bool, bytes, TensorRef):
        return value
    known = done.get(id(value), done)
    if known is not done:
        return known
    out = done[id(value)] = _made_real(value)
    if out is not value:
        return out
    if type(value) in (dict, OrderedDict, Counter):
        for k, v in value.items():
            r = _realize(v, done, depth + 1)
            if r is not v:
                value[k] = r
    elif type(value) is list:
        for i, v in enumerate(value):
            r = _realize(v, done, depth + 1)
            if r is not v:
                value[i] = r
    elif type(value) is tuple:
        items = [_realize(v, done, depth + 1) for v in value]
        if any(r is not v for r, v in zip(items, value, strict=True)):
            out = done[id(value)] = tuple(items)
    return out


def _made_real(value: Any) -> Any:
    """The real object a stand-in is (the value itself for anything else)."""
    if isinstance(value, NumpyArray) and value.state is not None:
        import numpy as np

        _, shape, dtype, fortran, raw = value.state
        dt = np.dtype(dtype.code).newbyteorder(dtype.order if dtype.order != "|" else "=")
        # numpy's own unpickling gives the values in the machine's byte order (a '>i8' array comes back '<i8')
        return np.frombuffer(raw, dtype=dt).reshape(shape, order="F" if fortran else "C").astype(
            dt.newbyteorder("="), order="F" if fortran else "C")
    if isinstance(value, NumpyDType) and value.state is not None:
        import numpy as np

        return np.dtype(value.code).newbyteorder(value.order if value.order != "|" else "=")
    if type(value) is Builder and isinstance(value.kind, DTypeName):  # a torch dtype as a value
        import torch

        return getattr(torch, value.kind)
    if isinstance(value, BytesIOStandIn):
        out = io.BytesIO(value.args[0] if value.args and value.args[0] is not None else b"")
        if value.state is not None:
            out.__setstate__((bytes(value.state[0]), value.state[1], None))  # checked when built
        return out
    return value


# ---------------------------------------------------------------- tensors: one rebuild, torch's checks
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class StorageRef:
    """A storage of a torch.save archive (its record ``data/<key>``), as a pickle names it: ``nbytes`` bytes of
    ``dtype`` elements (``uint8`` for an untyped storage)."""

    key: str
    dtype: str
    nbytes: int

    def __repr__(self) -> str:
        return _HIDDEN

    def __reduce__(self) -> Any:
        raise TypeError("a storage of a pickle being read is not pickled")


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class TensorRef:
    """A dense tensor of an archive, located, not read: ``shape``/``stride`` (elements) from element
    ``storage_offset`` of the storage ``storage`` (its record key; its address where torch.load read the file),
    which holds ``nbytes`` bytes. Checked as torch checks a rebuild, and to lie inside its storage."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage: Any
    nbytes: int

    @property
    def key(self) -> Any:
        """The storage's record key (``"0"`` for ``data/0``)."""
        return self.storage

    @property
    def storage_numel(self) -> int:
        """Elements of the tensor's dtype the storage holds."""
        return self.nbytes // ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        """Elements of the view (1 for a 0-dim tensor)."""
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        """True when the view is row-major, so its elements are one run of the storage."""
        return row_major(self.shape, self.stride)

    def __repr__(self) -> str:
        return _HIDDEN

    def __reduce__(self) -> Any:
        raise TypeError("a tensor of a pickle being read is not pickled")


def row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True when ``stride`` is the C-contiguous stride of ``shape`` (size-1 dimensions may have any stride)."""
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def _dims(value: Any) -> tuple[int, ...]:
    if type(value) is not tuple:
        if type(value) is not list:
            raise NotBuilt("a tensor has an implausible shape or stride")
        value = tuple(value)
    if len(value) > MAX_NDIM or not all(type(v) is int and 0 <= v < MAX_INDEX for v in value):
        raise NotBuilt("a tensor has an implausible shape or stride")
    return value


def _empty(value: Any) -> bool:
    return value is None or (type(value) in (dict, OrderedDict) and not value)


def _view(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, metadata: Any,
          dtype: str) -> TensorRef:
    """torch's ``t.set_(storage, offset, size, stride)`` and the attributes its rebuilds set, checked as torch
    checks them; NotBuilt where torch would fail or make something else than a plain dense tensor."""
    if type(storage) is not StorageRef or dtype not in _DENSE:
        raise NotBuilt("a tensor is rebuilt from something else than a storage of a dense dtype")
    if requires_grad is not False and (requires_grad is not True or dtype not in _GRAD_DTYPES):
        raise NotBuilt("a tensor is rebuilt with a requires_grad torch refuses")
    if not _empty(hooks) or not _empty(metadata):
        raise NotBuilt("a tensor is rebuilt with hooks or metadata (conj/neg bits)")
    if type(offset) is not int or not 0 <= offset < MAX_INDEX:
        raise NotBuilt("a tensor has an implausible storage offset")
    shape, strides = _dims(size), _dims(stride)
    if len(shape) != len(strides):
        raise NotBuilt("a tensor's shape and stride differ in length")
    if 0 not in shape:
        last = offset + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
        if (last + 1) * ITEMSIZE[dtype] > storage.nbytes:
            raise NotBuilt(f"a tensor of shape {shape} reaches past its storage data/{storage.key}")
    return TensorRef(dtype, shape, strides, offset, storage.key, storage.nbytes)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> TensorRef:
    return _view(storage, storage_offset, size, stride, False, None, None, getattr(storage, "dtype", ""))


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                       backward_hooks: Any = None, metadata: Any = None) -> TensorRef:
    return _view(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata,
                 getattr(storage, "dtype", ""))


def _rebuild_tensor_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                       backward_hooks: Any, dtype: Any, metadata: Any = None) -> TensorRef:
    if not isinstance(dtype, Builder) or not isinstance(dtype.kind, DTypeName):
        raise NotBuilt("a tensor is rebuilt with a dtype that is not a torch dtype")
    return _view(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata, str(dtype.kind))


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> TensorRef:
    """``nn.Parameter(data, requires_grad)``: the same view."""
    if type(data) is not TensorRef or type(requires_grad) is not bool or \
            (requires_grad and data.dtype not in _GRAD_DTYPES) or not _empty(backward_hooks):
        raise NotBuilt("a parameter is rebuilt with arguments torch refuses")
    return data


class DTypeName(str):
    """A torch dtype (``torch.float32``) by its short name."""


_TENSOR_REBUILDS = {"_rebuild_tensor": _rebuild_tensor, "_rebuild_tensor_v2": _rebuild_tensor_v2,
                    "_rebuild_tensor_v3": _rebuild_tensor_v3, "_rebuild_parameter": _rebuild_parameter}


# ---------------------------------------------------------------- the budget
class Budget:
    """Elements a pickle may still build through copying constructors: its size plus an allowance."""

    __slots__ = ("left", "source")

    def __init__(self, left: int, source: str) -> None:
        self.left, self.source = left, source

    def charge(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise RefusedPickleError(f"{self.source}: the pickle builds far more data than the file holds (an "
                                     "allocation bomb); refused.", path=self.source)

    def refused(self, what: str) -> RefusedPickleError:
        """The one line for what torch's weights-only unpickler refuses: ``what`` the pickled data does."""
        return RefusedPickleError(f"{self.source}: cannot be loaded safely with weights_only=True (its pickled data "
                                  f"{what}, which weights_only refuses; nothing from the file was run).",
                                  path=self.source)


def _charged(ctor: Callable[..., Any]) -> Callable[[Budget], Callable[..., Any]]:
    """``ctor`` charged for the size of what it builds (``bytearray(n)`` before it allocates)."""
    def bind(budget: Budget) -> Callable[..., Any]:
        def build(*args: Any) -> Any:
            if ctor is bytearray and args and type(args[0]) is int:
                budget.charge(max(0, args[0]))
                return bytearray(*args)
            out = ctor(*args)
            budget.charge(len(out))
            return out
        return build
    return bind


def _codecs_encode(text: Any, encoding: Any = "latin1") -> bytes:
    # protocol 2 writes bytes as _codecs.encode(str, "latin1")
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise NotBuilt("a _codecs.encode call other than torch.save's bytes")
    return text.encode("latin1")


def describe(value: Any, limit: int = 80) -> str:
    """A value read from a file as short, one-line, printable text for a message, whatever its nesting."""
    try:
        text = repr(value[:limit] if isinstance(value, str) else value)
    except (RecursionError, ValueError, TypeError, MemoryError):
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------- the allow-lists
class StorageKind(str):
    """A storage class (``torch.FloatStorage``; ``torch.storage.UntypedStorage`` holds ``uint8``) by its elements'
    dtype."""


class TensorType(str):
    """``torch.Tensor`` or ``torch.nn.Parameter`` named as the type a tensor is rebuilt as (never called)."""


# What torch.load(weights_only=True) accepts beyond its own list when Shardscope loads checkpoint data with it
# (torch.serialization.add_safe_globals): io.BytesIO (DCP pickles a Stateful's BytesIO: torchtitan's train_state) and
# numpy arrays of numbers (RNG states: Megatron's rng_state, a Trainer's rng_state.pth), as torch's refusal message
# advises and Megatron-Core itself does. An object array stays refused: its dtype's class is not allowed.
SAFE_NUMPY_GLOBALS = ("numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
                      "numpy._core.multiarray._reconstruct",
                      *(f"numpy.dtypes.{n}DType" for n in NUMPY_NUMBER_CODES.values()))
# Classes any archive's extra state may pickle (a training script's arguments, RNG states, a device), kept inert
PLAIN_CLASSES = frozenset({"numpy.dtype", "numpy.ndarray", "argparse.Namespace", "torch.device", "pathlib.Path",
                           "pathlib.PosixPath", "pathlib.WindowsPath", "pathlib.PurePosixPath",
                           "pathlib.PureWindowsPath"})
# What Megatron-Core's common.pt may hold besides plain data: the classes Megatron-Core registers for torch.load's
# weights_only (megatron/core/safe_globals.py) and the numpy RNG state's dtype class
MEGATRON_CLASSES = ("types.SimpleNamespace", "numpy.dtypes.UInt32DType", "_io.BytesIO", "signal.Signals",
                    "megatron.core.enums.ModelType", "megatron.core.transformer.enums.ModelType",
                    "megatron.core.transformer.enums.AttnBackend", "megatron.core.transformer.enums.CudaGraphScope",
                    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
                    "megatron.core.rerun_state_machine.RerunDiagnostic",
                    "megatron.core.rerun_state_machine.RerunMode", "megatron.core.rerun_state_machine.RerunState")
# The DeepSpeed classes a ZeRO checkpoint pickles (nothing of deepspeed is imported)
DEEPSPEED_CLASSES = ("deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.utils.tensor_fragment.fragment_address")


def _not_built(what: str) -> Callable[..., Any]:
    def refuse(*args: Any) -> Any:
        raise NotBuilt(what)
    return refuse


def _new_empty(cls: type) -> Callable[..., Any]:
    return lambda *args: cls()  # NEWOBJ: cls.__new__(cls, *args) of a container is an empty one


@dataclass(frozen=True)
class Rules:
    """What one kind of pickle may name. ``torch_values``: torch.Size/device/dtypes as torch's own objects (torch
    is imported) rather than plain stand-ins; ``classes``: globals kept as inert :class:`StandIn`s; ``lenient``:
    tensors saved with attributes (ZeRO-3's ``ds_id``) read as plain tensors, numpy scalars decoded; ``strict``:
    a global this module does not list is refused in a checkpoint's own words (else classified by torch's list)."""

    what: str
    torch_values: bool = False
    classes: frozenset[str] = frozenset()
    lenient: bool = False
    strict: bool = True
    containers: frozenset[str] = frozenset({"collections.OrderedDict", "collections.Counter", "builtins.set",
                                            "builtins.bytearray", "builtins.complex"})

    def resolve(self, module: str, name: str, budget: Budget) -> Builder:
        """The :class:`Builder` a pickle gets for global ``module.name`` (Python 2 names renamed as torch renames
        them); RefusedPickleError or NotBuilt for any other."""
        written = f"{module}.{name}"
        if (module, name) in _NAME_MAPPING:
            module, name = _NAME_MAPPING[(module, name)]
        elif module in _IMPORT_MAPPING:
            module = _IMPORT_MAPPING[module]
        full = f"{module}.{name}"
        made = self._builder(full, budget)
        if made is not None:
            return made
        what = written if written.isprintable() else describe(written)
        if not self.strict and _torch_accepts(full):
            raise NotBuilt(f"it names {what[:200]}, which torch's weights-only loader reads and this reader does not")
        if self.strict:
            raise RefusedPickleError(
                f"{budget.source}: refused to load the pickled global {what[:200]}: it is not one {self.what} holds, "
                "so the file is damaged or hostile. Nothing from it was run.", path=budget.source)
        raise budget.refused(f"names the global {what[:200]}")

    def _builder(self, full: str, budget: Budget) -> Builder | None:
        module, _, name = full.rpartition(".")
        if module == "torch._utils" and name in _TENSOR_REBUILDS:
            return Builder(full, _TENSOR_REBUILDS[name])
        if full == "torch._utils._rebuild_parameter_with_state":
            return Builder(full, self._parameter_with_state)
        if full == "torch._tensor._rebuild_from_type_v2":
            return Builder(full, self._from_type)
        if module == "torch" and name in STORAGE_DTYPES and STORAGE_DTYPES[name] in _DENSE:
            return Builder(full, None, kind=StorageKind(STORAGE_DTYPES[name]))
        if full == "torch.storage.UntypedStorage":
            return Builder(full, None, kind=StorageKind("uint8"))  # torch.load makes a uint8 storage of it
        if module == "torch" and name in _DENSE:
            return Builder(full, None, kind=DTypeName(name))
        if full in ("torch.Tensor", "torch.nn.parameter.Parameter"):
            return Builder(full, None, kind=TensorType(full))
        if full in self.containers:
            ctor = _CONTAINERS[full]
            return Builder(full, _charged(ctor)(budget) if ctor is not complex else complex,
                           new=_new_empty(ctor) if ctor is not complex else complex)
        if full == "_codecs.encode":
            return Builder(full, _charged(_codecs_encode)(budget))
        if full == "torch.Size":
            return Builder(full, _charged(self._size_type())(budget))
        if full == "torch.device" and self.torch_values:
            import torch

            return Builder(full, torch.device)
        if full in ("numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct"):
            return Builder(full, _numpy_reconstruct(budget))
        if full == "numpy.dtype":
            return Builder(full, _numpy_dtype, kind=stand_in("numpy.dtype"))
        if module == "numpy.dtypes" and name.removesuffix("DType") in NUMPY_NUMBER_CODES.values():
            code = next(c for c, n in NUMPY_NUMBER_CODES.items() if n == name.removesuffix("DType"))
            return Builder(full, lambda: _numpy_dtype(code), new=lambda: _numpy_dtype(code))
        if full in ("numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar") and self.lenient:
            return Builder(full, _numpy_scalar)
        if full == "numpy.ndarray":  # only the class _reconstruct is given; torch would allocate a called one
            cls = stand_in(full)
            return Builder(full, _not_built("an array made by calling numpy.ndarray"), kind=cls)
        if full in self.classes or (self.lenient and full in PLAIN_CLASSES) or full in _SAFE_CLASSES:
            cls = stand_in(full)
            return Builder(full, cls, new=cls, kind=cls)
        return None

    def _size_type(self) -> Callable[..., Any]:
        if self.torch_values:
            import torch

            return torch.Size
        return tuple

    def _parameter_with_state(self, data: Any, requires_grad: Any, hooks: Any, state: Any = None) -> TensorRef:
        if not (self.lenient or _empty(state)):
            raise NotBuilt("a parameter is saved with attributes")
        return _rebuild_parameter(data, requires_grad, hooks)

    def _from_type(self, func: Any, new_type: Any, args: Any, state: Any) -> TensorRef:
        """A tensor saved with attributes (ZeRO-3 gives its flat groups a ``ds_id``): ``func(*args)`` of a rebuild,
        as a plain tensor; the attributes are dropped where the rules are lenient."""
        if not (isinstance(func, Builder) and func.call in _TENSOR_REBUILDS.values()) or \
                not (isinstance(new_type, Builder) and isinstance(new_type.kind, TensorType)) or \
                type(args) is not tuple or not (self.lenient or _empty(state) or new_type.kind != "torch.Tensor"):
            raise NotBuilt("a tensor is rebuilt from a type, with attributes")
        if not self.lenient and not _empty(state):
            raise NotBuilt("a tensor is saved with attributes")
        out = func.call(*args)
        if type(out) is not TensorRef:
            raise NotBuilt("a tensor is rebuilt from something else than a tensor")
        return out


_CONTAINERS: dict[str, type] = {"collections.OrderedDict": OrderedDict, "collections.Counter": Counter,
                                "builtins.set": set, "builtins.bytearray": bytearray, "builtins.complex": complex}
_SAFE_CLASSES = frozenset({"_io.BytesIO"})

TORCH_FILE = Rules("a torch file", torch_values=True, strict=False)
"""A whole torch.save file (``.pt``): what weights_only reads, with :data:`SAFE_NUMPY_GLOBALS` and BytesIO."""
TORCH_ITEM = Rules("a DCP tensor item")
"""The data.pkl of one tensor in a DCP item (torch.save of a tensor)."""


def archive_rules(what: str, classes: Iterable[str] = ()) -> Rules:
    """The rules for a torch.save archive of training state (DeepSpeed's files, Megatron's ``common.pt``,
    Lightning's ``meta.pt``): ``classes`` kept as inert stand-ins besides :data:`PLAIN_CLASSES`."""
    return Rules(what, classes=frozenset(classes), lenient=True,
                 containers=frozenset({"collections.OrderedDict", "builtins.set", "builtins.bytearray"}))


def _torch_accepts(full: str) -> bool:
    """Whether ``torch.load(weights_only=True)`` with :func:`torch_safe_globals` accepts global ``full`` (already
    renamed); True when torch's private list cannot be read (torch.load then decides)."""
    try:
        from torch import _weights_only_unpickler as wo

        if full.partition(".")[0] in wo._blocklisted_modules or full.rpartition(".")[0] in wo._blocklisted_modules:
            return False
        return full in wo._get_allowed_globals() or full in SAFE_NUMPY_GLOBALS or full == "_io.BytesIO"
    except (ImportError, AttributeError, TypeError, ValueError):
        return True


def allow_torch_safe_globals() -> None:
    """Let ``torch.load(weights_only=True)`` accept :func:`torch_safe_globals` (every weights-only load of checkpoint
    data calls this; add_safe_globals is a set: adding them again is free). NOTE: not torch's ``safe_globals``
    context manager, whose exit removes them for every other load too."""
    import torch

    torch.serialization.add_safe_globals(torch_safe_globals())


def torch_safe_globals() -> list[Any]:
    """What ``torch.load(weights_only=True)`` needs beyond its own list to read what this module reads in a torch
    file (``torch.serialization.safe_globals(...)`` takes it): a class, or a (function, name) pair."""
    import numpy as np

    reconstruct = getattr(np, "_core", np).multiarray._reconstruct
    return ([io.BytesIO, np.ndarray, np.dtype, (reconstruct, "numpy.core.multiarray._reconstruct"),
             (reconstruct, "numpy._core.multiarray._reconstruct")]
            + [c for n in NUMPY_NUMBER_CODES.values()
               if (c := getattr(getattr(np, "dtypes", None), f"{n}DType", None))])


# ---------------------------------------------------------------- the interpreter
class _Mark:
    __slots__ = ()


_MARK = _Mark()
_UNPACK_I, _UNPACK_H, _UNPACK_D, _UNPACK_UI = (struct.Struct(f).unpack_from for f in ("<i", "<H", ">d", "<I"))


class Unpickler:
    """torch's weights-only unpickler, opcode for opcode, over :class:`Rules`: a pickle read from ``data`` builds
    only what the rules allow. ``storages`` holds each storage the pickle named, by key."""

    def __init__(self, data: bytes, source: str, rules: Rules) -> None:
        self.data, self.rules = data, rules
        self.budget = Budget(len(data) + ELEMENT_ALLOWANCE, source)
        self.storages: dict[str, StorageRef] = {}
        self._globals: dict[tuple[str, str], Builder] = {}

    def load(self) -> Any:
        """The object the pickle builds. RefusedPickleError for what torch's weights-only unpickler refuses (or an
        allocation bomb), NotBuilt for what it would build and this module does not, or a malformed pickle."""
        try:
            return self._run()
        except (RefusedPickleError, NotBuilt):
            raise
        except (IndexError, KeyError, TypeError, ValueError, AttributeError, UnicodeDecodeError, OverflowError,
                struct.error, RecursionError, MemoryError, RuntimeError) as exc:  # RuntimeError: torch.device("x")
            raise NotBuilt(f"data.pkl does not unpickle ({type(exc).__name__}: {str(exc)[:120]})") from None

    def _run(self) -> Any:  # one dispatch, as torch's; each branch is one opcode
        data, n = self.data, len(self.data)
        stack: list[Any] = []
        metastack: list[list[Any]] = []  # as torch's: MARK starts a new stack, the ones below are out of reach
        memo: dict[int, Any] = {}
        budget = self.budget
        i = 0
        while True:
            if i >= n:
                raise NotBuilt("data.pkl ends without a STOP opcode")
            op = data[i]
            i += 1
            if op == 0x71:  # BINPUT
                memo[data[i]] = stack[-1]
                i += 1
            elif op == 0x68:  # BINGET
                stack.append(memo[data[i]])
                i += 1
            elif op == 0x58:  # BINUNICODE
                size = _UNPACK_UI(data, i)[0]
                i += 4
                if i + size > n:
                    raise NotBuilt("data.pkl ends inside a string")
                stack.append(str(data[i:i + size], "utf-8", "surrogatepass"))
                i += size
            elif op == 0x4B:  # BININT1
                stack.append(data[i])
                i += 1
            elif op == 0x28:  # MARK
                metastack.append(stack)
                stack = []
            elif op == 0x72:  # LONG_BINPUT
                memo[_UNPACK_UI(data, i)[0]] = stack[-1]
                i += 4
            elif op == 0x6A:  # LONG_BINGET
                stack.append(memo[_UNPACK_UI(data, i)[0]])
                i += 4
            elif op == 0x74:  # TUPLE
                items = tuple(stack)
                stack = metastack.pop()
                stack.append(items)
            elif op == 0x85:  # TUPLE1
                stack[-1] = (stack[-1],)
            elif op == 0x86:  # TUPLE2
                stack[-2:] = [(stack[-2], stack[-1])]
            elif op == 0x87:  # TUPLE3
                stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
            elif op == 0x7D:  # EMPTY_DICT
                stack.append({})
            elif op == 0x5D:  # EMPTY_LIST
                stack.append([])
            elif op == 0x8F:  # EMPTY_SET
                stack.append(set())
            elif op == 0x4E:  # NONE
                stack.append(None)
            elif op == 0x88:  # NEWTRUE
                stack.append(True)
            elif op == 0x89:  # NEWFALSE
                stack.append(False)
            elif op == 0x4A:  # BININT
                stack.append(_UNPACK_I(data, i)[0])
                i += 4
            elif op == 0x4D:  # BININT2
                stack.append(_UNPACK_H(data, i)[0])
                i += 2
            elif op == 0x47:  # BINFLOAT
                stack.append(_UNPACK_D(data, i)[0])
                i += 8
            elif op == 0x8A:  # LONG1
                size = data[i]
                if i + 1 + size > n:
                    raise NotBuilt("data.pkl ends inside a number")
                stack.append(int.from_bytes(data[i + 1:i + 1 + size], "little", signed=True))
                i += 1 + size
            elif op == 0x55:  # SHORT_BINSTRING (torch.load decodes it as UTF-8)
                size = data[i]
                if i + 1 + size > n:
                    raise NotBuilt("data.pkl ends inside a string")
                stack.append(data[i + 1:i + 1 + size].decode("utf-8", "strict"))
                i += 1 + size
            elif op == 0x63:  # GLOBAL
                a = data.index(b"\n", i)
                b = data.index(b"\n", a + 1)
                key = (data[i:a].decode("utf-8"), data[a + 1:b].decode("utf-8"))
                i = b + 1
                made = self._globals.get(key)
                if made is None:
                    made = self._globals[key] = self.rules.resolve(key[0], key[1], budget)
                stack.append(made)
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                func = stack[-1]
                if type(func) is not Builder or func.call is None:
                    raise budget.refused(f"calls {_kind(func)}")
                if type(args) is not tuple:
                    raise NotBuilt("a call's arguments are not a tuple")
                stack[-1] = func.call(*args)
            elif op == 0x81:  # NEWOBJ
                args = stack.pop()
                cls = stack.pop()
                if type(cls) is not Builder or cls.new is None:
                    raise (NotBuilt("a parameter is made by NEWOBJ")
                           if type(cls) is Builder and isinstance(cls.kind, TensorType) else
                           budget.refused(f"makes a new object of {_kind(cls)}"))
                if type(args) is not tuple:
                    raise NotBuilt("a new object's arguments are not a tuple")
                stack.append(cls.new(*args))
            elif op == 0x62:  # BUILD
                state = stack.pop()
                self._build(stack[-1], state)
            elif op == 0x61:  # APPEND
                item = stack.pop()
                if type(stack[-1]) is not list:
                    raise budget.refused(f"appends to {_kind(stack[-1])}")
                stack[-1].append(item)
            elif op == 0x65:  # APPENDS
                items = stack
                stack = metastack.pop()
                if type(stack[-1]) is not list:
                    raise budget.refused(f"appends to {_kind(stack[-1])}")
                stack[-1].extend(items)
            elif op == 0x73:  # SETITEM
                value, key = stack.pop(), stack.pop()
                if type(stack[-1]) not in (dict, OrderedDict, Counter):
                    raise budget.refused(f"sets an item of {_kind(stack[-1])}")
                stack[-1][key] = value
            elif op == 0x75:  # SETITEMS
                items = stack
                stack = metastack.pop()
                target = stack[-1]
                if type(target) not in (dict, OrderedDict, Counter):
                    raise budget.refused(f"sets an item of {_kind(target)}")
                for j in range(0, len(items) - 1, 2):
                    target[items[j]] = items[j + 1]
                if len(items) % 2:
                    raise NotBuilt("SETITEMS of an odd number of items")
            elif op == 0x51:  # BINPERSID
                stack.append(self._storage(stack.pop()))
            elif op == 0x80:  # PROTO (torch only warns of another protocol)
                i += 1
            elif op == 0x2E:  # STOP
                if metastack or len(stack) != 1:
                    raise NotBuilt("data.pkl stops with items left on its stack")
                return stack.pop()
            else:  # torch's unpickler runs no other opcode ("Unsupported operand")
                raise budget.refused(f"holds opcode {bytes([op])!r}, which its unpickler does not run,")

    def _build(self, inst: Any, state: Any) -> None:
        """BUILD as torch's weights-only unpickler allows it."""
        kind = type(inst)
        if kind is OrderedDict or kind is Counter:
            inst.__dict__.update(state)
        elif isinstance(inst, StandIn):
            inst.build(state, self.budget)
        elif kind is TensorRef:
            raise NotBuilt("BUILD sets the state of a tensor (torch's legacy set_)")
        elif kind in (StorageRef, set, bytearray, complex) or (self.rules.torch_values and _torch_value(inst)):
            # allowed types without __setstate__: torch updates their __dict__ only for a true state (they have none)
            if state:
                raise NotBuilt(f"BUILD gives {_kind(inst)} a state it cannot hold")
        else:
            raise self.budget.refused(f"sets the state of {_kind(inst)} (BUILD)")

    def _storage(self, pid: Any) -> StorageRef:
        """``persistent_load`` of a storage: ('storage', kind, key, location, numel), as torch.save writes it."""
        if type(pid) is not tuple and type(pid) is not int:
            raise self.budget.refused("names a persistent id that is neither a tuple nor a number")
        tag = pid[0] if type(pid) is tuple and pid else None
        if type(pid) is int or (tag != "storage" and tag != b"storage"):
            raise self.budget.refused(f"loads a persistent object {describe(tag)} that is not a storage")
        if len(pid) != 5:
            raise NotBuilt("data.pkl names a storage in a form torch.save does not write")
        _, kind, key, location, numel = pid
        if type(kind) is not Builder or not isinstance(kind.kind, StorageKind) or type(key) is not str or \
                not (key.isascii() and key.isdigit() and len(key) <= 18) or type(location) not in (str, bytes) or \
                type(numel) is not int or not 0 <= numel < MAX_INDEX:
            raise NotBuilt("data.pkl names a storage in a form torch.save does not write")
        nbytes = numel * ITEMSIZE[kind.kind]
        known = self.storages.get(key)
        if known is None:
            known = self.storages[key] = StorageRef(key, str(kind.kind), nbytes)
        elif (known.dtype, known.nbytes) != (kind.kind, nbytes):
            raise NotBuilt(f"storage data/{key} is named with two sizes or dtypes")  # torch keeps the first
        return known


def _torch_value(value: Any) -> bool:
    """A torch.Size or torch.device (torch's own objects in a torch file's values)."""
    torch = sys.modules.get("torch")
    return torch is not None and type(value) in (torch.Size, torch.device)


def _kind(value: Any) -> str:
    """What a pickle acted on, for a message: a type's name (a stand-in's class, a global's name)."""
    if type(value) is Builder:
        return f"the global {value.name[:120]}"
    if isinstance(value, StandIn):
        return f"a {value.qualname}"
    if type(value) is TensorRef:
        return "a tensor"
    return f"a {type(value).__module__}.{type(value).__qualname__}".replace("builtins.", "")


def unpickle(data: bytes, source: str, rules: Rules) -> tuple[Any, dict[str, StorageRef]]:
    """``data`` (a pickle) loaded under ``rules``, with the storages it names; the cyclic GC paused while it runs
    and nesting given a stack deep enough for it (:func:`.safe_pickle.with_deep_stack`)."""
    unpickler = Unpickler(data, source, rules)

    def load() -> Any:
        with gc_paused():
            return unpickler.load()

    return with_deep_stack(load, len(data)), unpickler.storages


# ---------------------------------------------------------------- DCP .metadata: the C unpickler over inert records
# A ``.metadata`` is torch's own plain pickle (protocol 4/5, a million chunks): read with Python's C unpickler (speed)
# over the records of :mod:`.safe_pickle`. Every global resolves to a record class (BUILD fills its ``__dict__``, as
# plain pickle fills torch's dataclasses), a builtin container, or a frozen callable (no ``__dict__``: BUILD on it
# fails); nothing else is reachable.


class FrozenCall:
    """A function a pickle may call, with nothing to set on it (BUILD on a plain function sets its attributes)."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        object.__setattr__(self, "_fn", fn)

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("read-only")

    def __reduce__(self) -> Any:
        raise TypeError("a global of a pickle being read is not pickled")


def _write_item_type(value: Any) -> int:
    # WriteItemType(2): an Enum pickles as a call of its class with its value
    if type(value) is not int:
        raise RefusedPickleError("refused WriteItemType value in pickle")
    return value


DTYPE_ALIASES = {
    "float": "float32", "double": "float64", "half": "float16", "cfloat": "complex64",
    "cdouble": "complex128", "short": "int16", "int": "int32", "long": "int64",
    "chalf": "complex32",
}
MEMORY_FORMATS = ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")
LAYOUTS = ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged")


class DType(str):
    """A dtype name (``float32``) standing in for ``torch.float32``; no attributes (a BUILD on it fails)."""

    __slots__ = ()


def _get_layout(name: str) -> str:
    # torch.serialization._get_layout("torch.strided")
    if not isinstance(name, str) or name.removeprefix("torch.") not in LAYOUTS:
        raise RefusedPickleError(f"unknown tensor layout {name!r} in pickle")
    return name.removeprefix("torch.")


def _mem_format_encoding(value: Any) -> Any:
    return value


def _posix_path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise RefusedPickleError("path parts in pickle are not strings")
    return str(PurePosixPath(*parts))


def _windows_path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise RefusedPickleError("path parts in pickle are not strings")
    return str(PureWindowsPath(*parts))


def _metadata_codecs_encode(text: Any, encoding: str = "latin1") -> bytes:
    # protocol <= 2 writes bytes as _codecs.encode(str, "latin1")
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise RefusedPickleError("refused _codecs.encode call in pickle")
    return text.encode("latin1")


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    # protocol 0/1 objects: copyreg._reconstructor(cls, object, None)
    if not (isinstance(cls, type) and issubclass(cls, Record) and base is object and state is None):
        raise RefusedPickleError("refused copyreg._reconstructor call in pickle")
    return cls.__new__(cls)


_CHECKPOINT_CLASSES: dict[str, type] = {
    "Metadata": MetadataRecord,
    "TensorStorageMetadata": TensorStorageRecord,
    "ChunkStorageMetadata": ChunkRecord,
    "BytesStorageMetadata": BytesStorageRecord,
    "MetadataIndex": MetadataIndexRecord,
    "TensorProperties": TensorPropertiesRecord,
    "StorageMeta": StorageMetaRecord,
    "_MEM_FORMAT_ENCODING": _mem_format_encoding,  # type: ignore[dict-item]
}

METADATA_GLOBALS: dict[tuple[str, str], Any] = {}
for _module in ("torch.distributed.checkpoint.metadata", "torch.distributed._shard.checkpoint.metadata"):
    for _name, _cls in _CHECKPOINT_CLASSES.items():
        METADATA_GLOBALS[(_module, _name)] = _cls
for _module in ("torch.distributed.checkpoint.filesystem", "torch.distributed._shard.checkpoint.filesystem"):
    METADATA_GLOBALS[(_module, "_StorageInfo")] = StorageInfoRecord
    METADATA_GLOBALS[(_module, "_StoragePrefix")] = StoragePrefixRecord
for _name, _cls in (
    ("TensorProperties", TensorPropertiesRecord),
    ("MEM_FORMAT_ENCODING", _mem_format_encoding),
    ("ShardMetadata", ShardMetadataRecord),
):
    METADATA_GLOBALS[("torch.distributed._shard.sharded_tensor.metadata", _name)] = _cls
METADATA_GLOBALS[("torch.distributed._shard.metadata", "ShardMetadata")] = ShardMetadataRecord
# what Megatron-Core's torch_dist save adds to the Metadata: the plans of every rank (all_local_plans)
for _name, _cls in (("SavePlan", SavePlanRecord), ("WriteItem", WriteItemRecord), ("TensorWriteData", WriteItemRecord),
                    ("WriteItemType", _write_item_type)):
    METADATA_GLOBALS[("torch.distributed.checkpoint.planner", _name)] = _cls
METADATA_GLOBALS[("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan")] = SavePlanRecord
METADATA_GLOBALS[("torch", "Size")] = tuple  # NOTE: the builtin itself: a million calls, no Python frame each
METADATA_GLOBALS[("torch.serialization", "_get_layout")] = _get_layout
for _name in DTYPE_NAMES:
    METADATA_GLOBALS[("torch", _name)] = DType(_name)
for _alias, _name in DTYPE_ALIASES.items():
    METADATA_GLOBALS[("torch", _alias)] = DType(_name)
for _name in MEMORY_FORMATS:
    METADATA_GLOBALS[("torch", _name)] = _name
for _name in LAYOUTS:
    METADATA_GLOBALS[("torch", _name)] = _name
for _name in ("PosixPath", "PurePosixPath", "Path"):
    METADATA_GLOBALS[("pathlib", _name)] = _posix_path
for _name in ("WindowsPath", "PureWindowsPath"):
    METADATA_GLOBALS[("pathlib", _name)] = _windows_path
for _module in ("collections", "builtins", "__builtin__"):
    METADATA_GLOBALS[(_module, "OrderedDict")] = dict
for _module in ("builtins", "__builtin__"):
    for _name, _obj in (("set", set), ("frozenset", frozenset), ("tuple", tuple), ("list", list),
                        ("dict", dict), ("slice", slice), ("bytearray", bytearray)):
        METADATA_GLOBALS[(_module, _name)] = _obj
METADATA_GLOBALS[("_codecs", "encode")] = _metadata_codecs_encode
METADATA_GLOBALS[("copy_reg", "_reconstructor")] = _reconstructor
METADATA_GLOBALS[("copyreg", "_reconstructor")] = _reconstructor
METADATA_GLOBALS[("builtins", "object")] = object
METADATA_GLOBALS[("__builtin__", "object")] = object
for _key, _obj in list(METADATA_GLOBALS.items()):  # our functions, with nothing a BUILD could set
    if callable(_obj) and getattr(_obj, "__module__", None) == __name__ and not isinstance(_obj, type):
        METADATA_GLOBALS[_key] = FrozenCall(_obj) if _obj is not _metadata_codecs_encode else _obj


# Constructors a pickle may call whose result can be far larger than the bytes that asked for it
# (``bytearray(5_000_000_000)`` is 12 bytes of pickle): every call is charged against a budget set by
# the file's size.
# ``tuple`` is left unwrapped: it is torch.Size's stand-in, called for every chunk, and tuple(t) is t; what a
# tuple of a big list can cost is bounded by the address-space limit below.
_SIZED = (bytearray, list, set, frozenset, dict, _metadata_codecs_encode)


class MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, source: str, allowed: dict | None = None, budget: int = 0) -> None:
        super().__init__(file)
        self._source = source
        self._allowed = allowed or METADATA_GLOBALS
        self._budget = budget + ELEMENT_ALLOWANCE

    def _charge(self, n: int) -> None:
        self._budget -= n
        if self._budget < 0:
            raise RefusedPickleError(
                f"{self._source}: the pickle builds far more data than the file holds (an allocation bomb); "
                "refused.", path=self._source)

    def _bounded(self, ctor: Any) -> Any:
        """``ctor`` charged for the size of what it builds (a ``bytearray(n)`` before it allocates; the others
        copy objects that already exist, so they are charged after)."""
        if ctor is bytearray:
            def build_bytes(*args: Any) -> Any:
                if args and isinstance(args[0], int):
                    self._charge(max(0, args[0]))
                return bytearray(*args)

            return build_bytes

        def build(*args: Any) -> Any:
            out = ctor(*args)
            self._charge(len(out))
            return out

        return build

    def find_class(self, module: str, name: str) -> Any:
        try:
            obj = self._allowed[(module, name)]
        except (KeyError, TypeError):
            raise RefusedPickleError(
                f"{self._source}: refused to load the pickled global {module}.{name}; a DCP .metadata file "
                "never contains it, so the file is damaged or hostile. Nothing from it was run.",
                path=self._source,
            ) from None
        if any(obj is c for c in _SIZED):
            return FrozenCall(self._bounded(obj))
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickleError(f"{self._source}: unexpected persistent id in metadata pickle", path=self._source)



class ShippedUnpickler(pickle.Unpickler):
    """Reads a reply of Shardscope's own metadata helper process (:mod:`.reader_process`): the record classes and
    plain containers only."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in shippable_globals():
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a metadata reply")
        return super().find_class(module, name)


@functools.lru_cache(maxsize=1)
def shippable_globals() -> frozenset[tuple[str, str]]:
    from . import safe_pickle

    helper = __name__.rpartition(".")[0] + ".reader_process"  # named, not imported: it imports this module
    records = {(safe_pickle.__name__, n) for n, v in vars(safe_pickle).items()
               if isinstance(v, type) and issubclass(v, Record)}
    return frozenset(records | {(__name__, "DType"), (helper, "_rebuild_record"), (helper, "_gone"),
                                ("shardscope.backend.checkpoint.streaming", "Events"),
                                ("array", "_array_reconstructor"), ("array", "array"), ("builtins", "slice"),
                                ("builtins", "object"), ("builtins", "bytearray")})


def unpickle_metadata(data: bytes | io.BufferedIOBase, source: str, overrides: dict[str, Any] | None = None) -> Any:
    """Unpickle DCP metadata with the allow-list, in this process; return the tree of :class:`Record` objects.

    ``overrides`` replaces the stand-ins of some DCP classes by name (the streaming reader's hooks).
    Memory is bounded by the file's size (sized constructors are charged against it, the rest by an
    address-space limit) and nesting by a stack sized for it. Where another thread could be hurt by that
    limit, call :func:`.reader_process.load_metadata_pickle`, which runs this in a helper process."""
    stream = io.BytesIO(data) if isinstance(data, bytes | bytearray | memoryview) else data
    allowed = METADATA_GLOBALS
    if overrides:
        allowed = dict(METADATA_GLOBALS)
        for key in allowed:
            if key[1] in overrides and key[0].startswith("torch.distributed"):
                allowed[key] = overrides[key[1]]  # the streaming reader's record classes
    size = stream_size(stream)

    def load() -> Any:
        with gc_paused(), address_space_limit(MEMO_ALLOWANCE + 16 * size), _quiet_bytearray_noise():
            return MetadataUnpickler(stream, source, allowed, size).load()

    try:
        return with_deep_stack(load, size)
    except RefusedPickleError:
        raise
    except MemoryError:
        raise RefusedPickleError(f"{source}: the pickle asks for far more memory than a {size}-byte file can "
                                 "need (an allocation bomb); refused.", path=source) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, OverflowError, UnicodeDecodeError, RecursionError) as exc:
        raise RefusedPickleError(
            f"{source}: not a readable DCP metadata pickle ({type(exc).__name__}: {str(exc)[:200]}).", path=source
        ) from None


__all__ = [
    "DEEPSPEED_CLASSES",
    "ELEMENT_ALLOWANCE",
    "MEGATRON_CLASSES",
    "PLAIN_CLASSES",
    "SAFE_NUMPY_GLOBALS",
    "STORAGE_DTYPES",
    "TORCH_FILE",
    "TORCH_ITEM",
    "Budget",
    "Builder",
    "DTypeName",
    "NotBuilt",
    "NumpyArray",
    "NumpyDType",
    "Rules",
    "StandIn",
    "StorageRef",
    "TensorRef",
    "Unpickler",
    "allow_torch_safe_globals",
    "archive_rules",
    "describe",
    "realize",
    "row_major",
    "stand_in",
    "torch_safe_globals",
    "unpickle",
]
