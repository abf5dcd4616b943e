"""What a pickle gets for a global: immutable builders, inert stand-ins of allowed classes (numpy numbers
among them, sizes checked and charged), the budget copying constructors are charged against."""


from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any, ClassVar, Literal, cast

from ...errors import RefusedPickleError
from ..dtypes import ITEMSIZE, MAX_INDEX, MAX_NDIM

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
    name: str
    call: Callable[..., Any] | None
    new: Callable[..., Any] | None
    kind: Any  # a tag of any type the builders compare (DTypeName, TensorType, a stand-in class)

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
    args: tuple[Any, ...]
    state: Any  # what BUILD gave, as the pickle chose it

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
ByteOrder = Literal["<", ">", "|", "="]
_NUMPY_ORDERS: tuple[ByteOrder, ...] = ("<", ">", "|", "=")


class NumpyDType(StandIn):
    """``numpy.dtype(code, False, True)`` and its BUILD state: only the number dtypes torch's weights-only loader
    lets a checkpoint build (an object, void or structured dtype is refused as torch refuses it)."""

    __slots__ = ()

    @property
    def code(self) -> str | None:
        return self.args[0] if self.args and self.args[0] in NUMPY_NUMBER_CODES else None

    @property
    def order(self) -> ByteOrder:
        # build let only one of _NUMPY_ORDERS in
        return cast(ByteOrder, self.state[1]) if isinstance(self.state, tuple) and len(self.state) > 1 else "="

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
        shape, dtype, raw = state[1], cast(NumpyDType, state[2]), state[4]  # its type checked above
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
