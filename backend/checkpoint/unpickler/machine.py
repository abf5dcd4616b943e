"""The interpreter: torch's weights-only unpickler, opcode for opcode, over a :class:`~.rules.Rules` set."""


from __future__ import annotations

import io
import struct
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from ...errors import RefusedPickleError
from ..dtypes import ITEMSIZE, MAX_INDEX
from ..safe_pickle import (
    gc_paused,
    with_deep_stack,
)
from .objects import (
    ELEMENT_ALLOWANCE,
    Budget,
    Builder,
    BytesIOStandIn,
    NotBuilt,
    NumpyArray,
    NumpyDType,
    StandIn,
    describe,
)
from .rules import Rules, StorageKind, TensorType
from .tensors import DTypeName, StorageRef, TensorRef


# ---------------------------------------------------------------- the interpreter
class _Mark:
    __slots__ = ()


_MARK = _Mark()
_UNPACK_I, _UNPACK_H, _UNPACK_D, _UNPACK_UI = (struct.Struct(f).unpack_from for f in ("<i", "<H", ">d", "<I"))


# opcodes that push a new empty container or a constant, and those that push a number or short string
_EMPTY: dict[int, Callable[[], Any]] = {0x29: tuple, 0x7D: dict, 0x5D: list, 0x8F: set, 0x4E: lambda: None,
                                        0x88: lambda: True, 0x89: lambda: False}
_SCALARS = frozenset({0x4A, 0x4D, 0x47, 0x8A, 0x55})


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
                made_tuple = tuple(stack)
                stack = metastack.pop()
                stack.append(made_tuple)
            elif op == 0x85:  # TUPLE1
                stack[-1] = (stack[-1],)
            elif op == 0x86:  # TUPLE2
                stack[-2:] = [(stack[-2], stack[-1])]
            elif op == 0x87:  # TUPLE3
                stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
            elif op in _EMPTY:  # EMPTY_TUPLE, EMPTY_DICT, EMPTY_LIST, EMPTY_SET, NONE, NEWTRUE, NEWFALSE
                stack.append(_EMPTY[op]())
            elif op in _SCALARS:  # BININT, BININT2, BINFLOAT, LONG1, SHORT_BINSTRING
                value, i = self._scalar(op, i)
                stack.append(value)
            elif op == 0x80:  # PROTO (torch only warns of another protocol)
                i += 1
            elif op == 0x2E:  # STOP
                if metastack or len(stack) != 1:
                    raise NotBuilt("data.pkl stops with items left on its stack")
                return stack.pop()
            else:  # the opcodes that act on objects, each as torch's unpickler allows it
                stack, i = self._act(op, i, stack, metastack)

    def _scalar(self, op: int, i: int) -> tuple[Any, int]:
        """A number or short string read at ``i`` (its bounds checked), and the position after it."""
        data = self.data
        if op == 0x4A:  # BININT
            return _UNPACK_I(data, i)[0], i + 4
        if op == 0x4D:  # BININT2
            return _UNPACK_H(data, i)[0], i + 2
        if op == 0x47:  # BINFLOAT
            return _UNPACK_D(data, i)[0], i + 8
        size = data[i]
        if i + 1 + size > len(data):
            raise NotBuilt("data.pkl ends inside a number" if op == 0x8A else "data.pkl ends inside a string")
        if op == 0x8A:  # LONG1
            return int.from_bytes(data[i + 1:i + 1 + size], "little", signed=True), i + 1 + size
        # SHORT_BINSTRING (torch.load decodes it as UTF-8)
        return data[i + 1:i + 1 + size].decode("utf-8", "strict"), i + 1 + size

    def _act(self, op: int, i: int, stack: list[Any], metastack: list[list[Any]]) -> tuple[list[Any], int]:
        """GLOBAL, REDUCE, NEWOBJ, BUILD, APPEND(S), SETITEM(S), BINPERSID: what torch allows each to do, else
        refused; the stack after it (APPENDS and SETITEMS end a MARK's stack) and the position after its
        arguments."""
        budget = self.budget
        if op == 0x63:  # GLOBAL
            made, i = self._global(i)
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
        else:  # torch's unpickler runs no other opcode ("Unsupported operand")
            raise budget.refused(f"holds opcode {bytes([op])!r}, which its unpickler does not run,")
        return stack, i

    def _global(self, i: int) -> tuple[Any, int]:
        """GLOBAL's module and name lines at ``i``: what the rules make of them (once per pair), and the position
        after them."""
        data = self.data
        a = data.index(b"\n", i)
        b = data.index(b"\n", a + 1)
        key = (data[i:a].decode("utf-8"), data[a + 1:b].decode("utf-8"))
        made = self._globals.get(key)
        if made is None:
            made = self._globals[key] = self.rules.resolve(key[0], key[1], self.budget)
        return made, b + 1

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
        if type(pid) is not tuple:
            if type(pid) is not int:
                raise self.budget.refused("names a persistent id that is neither a tuple nor a number")
            raise self.budget.refused(f"loads a persistent object {describe(None)} that is not a storage")
        tag = pid[0] if pid else None
        if tag != "storage" and tag != b"storage":
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


# ---------------------------------------------------------------- stand-ins made real after the load
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
            # checked when built; BytesIO.__setstate__ is C's, which typeshed does not declare
            out.__setstate__((bytes(value.state[0]), value.state[1], None))  # type: ignore[attr-defined]
        return out
    return value
