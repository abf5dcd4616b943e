"""A torch.save file read safely and flattened to dotted names with their nested key paths; the torch-file format
(:mod:`..formats.torch_file`) turns the leaves into the checkpoint model, and the chunk reader then reads values
from the file's records.

Its ``data.pkl`` is read without torch: its opcodes are walked first (only those ``torch.load(weights_only=True)``
runs, a memo index bounded by the pickle's size) and its globals checked before anything is unpickled; then
Python's C unpickler builds the object tree with exactly the globals weights_only accepts that this reader
builds itself (torch's tensor rebuilds, legacy storage types, containers, torch.Size/device/dtype, and what
:func:`.chunks.safe_globals` adds). A tensor becomes a :class:`TensorView` (dtype, shape, stride, storage
offset, storage record): no torch tensor is made and no tensor byte read. A global weights_only refuses is
refused here with one line naming the file, before anything is unpickled.

NOTE the fallback: a file this reader does not read the way torch.load would (a global weights_only accepts but
it does not build: sparse, quantized or meta tensors, a tensor saved with attributes, a ``_rebuild_parameter_
with_state``; a legacy (pre-zip) file; records torch's own checks would refuse; a storage whose record has
another size; a tensor or storage used as a key or inside a non-tensor leaf; anything its rebuilds refuse) is
loaded as before, ``torch.load(weights_only=True, mmap=True)`` after the checks torch's own loader lacks, and
``TorchFileLoad.fallback`` says why. The values are then torch's own, exactly as before this reader existed.

NOTE: past its globals and opcodes, Python's unpickler is more lenient than torch's in what a hand-made pickle
may do with the objects it made: SETITEM on a list, bytearray or numpy array, APPEND on a bytearray (torch's
refuses those opcodes on anything but a dict or list). That changes values a pickle built, never what runs: no
global outside weights_only's is ever reached, and the reader's own callables have no attributes to set."""

from __future__ import annotations

import io
import logging
import os
import pickle
import pickletools
import re
import sys
import warnings
import zlib
from _codecs import encode
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, RefusedPickleError
from .flatten import FlattenError, dotted, flatten
from .items import STORAGE_DTYPES, ItemFormatError, torch_archive_records, zip_records
from .model import ITEMSIZE, MAX_INDEX, MAX_NDIM
from .safe_pickle import ELEMENT_ALLOWANCE, gc_paused, with_deep_stack
from .storage import LocalHandles

log = logging.getLogger(__name__)

_HIDDEN = "\x00<shardscope tensor>\x00"  # what a TensorView or storage prints as: found in a name, it was a key


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class TensorView:
    """A dense tensor of the file, not read: ``shape``/``stride`` (elements) from element ``storage_offset`` of
    its storage, which holds ``nbytes`` bytes. ``storage``: the storage's record key (``"0"`` for ``data/0``)
    when this module's reader read the file; its address when torch.load did (the fallback)."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage: Any
    nbytes: int

    def __repr__(self) -> str:
        return _HIDDEN

    def __reduce__(self) -> Any:
        raise TypeError("a tensor of a torch file being read is not pickled")


class TorchFileLoad:
    """A torch ``.pt`` file's leaves by dotted name (tensors as :class:`TensorView`), read without torch, or with
    ``torch.load(weights_only=True, mmap=True)`` where that reader leaves it to torch (``fallback`` says why)."""

    def __init__(self, path: str, name: str | None = None) -> None:
        self.name = name or path  # a URL's name: the copy it was loaded from is temporary
        size = os.path.getsize(path)
        self.records, checked, data = _archive(path, size)
        _refuse_bytearray_bomb(data, size, self.name)
        budget = (len(data) or size) + 10_000
        self.fallback: str | None = None  # why torch.load read the file (None: this module's reader did)
        self.storage_records: dict[Any, tuple[int, int, int | None]] | None = None  # storage key -> its record
        try:
            if not checked:
                raise _Fallback("its zip records are not ones torch.save writes (or not checked as torch checks them)")
            self._leaves, self._paths, self.storage_records = _read(data, self.records or {}, self.name, budget)
        except _Fallback as why:
            self.fallback = str(why)
            log.debug("%s: read by torch.load: %s", self.name, why)
            self._leaves, self._paths = _torch_load(path, self.name, budget)

    def tensors(self) -> dict[str, TensorView]:
        """The tensor leaves by dotted name, in the file's order."""
        return {k: v for k, v in self._leaves.items() if type(v) is TensorView}

    def objects(self) -> dict[str, Any]:
        """The non-tensor leaves by dotted name."""
        return {k: v for k, v in self._leaves.items() if type(v) is not TensorView}

    def paths(self) -> dict[str, tuple]:
        """Each leaf's nested key path (what a ``.pt`` export nests it back into)."""
        return dict(self._paths)


class _Fallback(Exception):
    """This reader leaves the file to torch.load; the message says why."""


# ---------------------------------------------------------------- the archive and the checks torch lacks
def _archive(path: str, size: int) -> tuple[dict[str, tuple[int, int, int]] | None, bool, bytes]:
    """The file's zip records (:func:`zip_records`; None when they cannot be read), whether they pass the checks
    torch's zip reader makes (:func:`torch_archive_records`: versions, byte order, small records' CRC32) with
    ``data.pkl``'s CRC32 too, and ``data.pkl``'s bytes (b"" when there is none). A file of 100,000 tensors has
    100,000 records; the format reuses them to locate the tensors."""
    handles = LocalHandles(os.path.dirname(os.path.abspath(path)), confined=False)
    base = os.path.basename(path)
    blocks = _BlockReads(handles, size)
    records: dict[str, tuple[int, int, int]] | None = None
    checked = False
    try:
        try:
            records, checked = torch_archive_records(blocks, base, size), True
        except ItemFormatError:
            records = zip_records(blocks, base, size)
        pkl = records.get("data.pkl")
        data = handles.read(base, pkl[0], pkl[1]) if pkl and pkl[1] <= size else b""
        checked = checked and pkl is not None and zlib.crc32(data) == pkl[2]
    except (ItemFormatError, CheckpointError):
        data, checked = b"", False  # not a zip archive torch maps: torch.load says why
    finally:
        handles.close()
    return records, checked, data


class _BlockReads:
    """One local file's reads through a block buffer: the zip reader asks for every record's local header, in
    the file's order (100,000 reads of 40 bytes for a file of 100,000 tensors: a few hundred reads this way)."""

    BLOCK = 256 << 10

    def __init__(self, handles: LocalHandles, size: int) -> None:
        self._handles, self._size = handles, size
        self._start, self._buf = 0, b""

    def where(self, name: str) -> str:
        return self._handles.where(name)

    def read(self, name: str, offset: int, length: int) -> bytes:
        start = offset - self._start
        if 0 <= start and start + length <= len(self._buf):
            return self._buf[start:start + length]
        if length >= self.BLOCK or offset < 0 or offset + length > self._size:
            return self._handles.read(name, offset, length)  # and its error past the end
        self._start, self._buf = offset, self._handles.read(name, offset, min(self.BLOCK, self._size - offset))
        return self._buf[:length]


def _refuse_bytearray_bomb(data: bytes, size: int, name: str) -> None:
    """Refuse a ``data.pkl`` that builds a ``bytearray`` from a number larger than the file (``weights_only``
    allows ``bytearray(5_000_000_000)``: a 100-byte pickle that allocates 5 GB)."""
    if b"bytearray" not in data:
        return
    largest = 0
    try:
        for _, arg, _ in pickletools.genops(data):
            if type(arg) is int:
                largest = max(largest, arg)
    except Exception:  # a malformed tail: judge what comes before it (the load fails there)
        pass
    if largest > size:
        raise CheckpointError(f"{name}: its pickled data asks for a {largest:,}-byte bytearray, more than the "
                              f"{size:,}-byte file holds; refused.", path=name)


def _flattened(data: Any, name: str, budget: int, tensors: Any = None) -> tuple[dict[str, Any], dict[str, tuple]]:
    """Leaves by dotted name and their key paths; CheckpointError (one line naming the file) for what cannot be
    flattened or is named twice."""
    if not isinstance(data, dict):
        raise CheckpointError(f"{name}: does not hold a dict of tensors.", path=name)
    try:
        flat = flatten(data, limit=budget, tensors=tensors)
    except FlattenError as exc:
        if _HIDDEN in str(exc):
            raise _Fallback("a tensor or storage is a key") from None
        raise CheckpointError(f"{name}: its pickled data {exc}.", path=name) from None
    names = list(map(dotted, flat))
    leaves, paths = dict(zip(names, flat.values(), strict=True)), dict(zip(names, flat, strict=True))
    if tensors is not None and any(_HIDDEN in n for n in leaves):
        raise _Fallback("a tensor or storage is a key")  # torch names it by its values
    if len(leaves) != len(flat):  # torch's flatten_state_dict refuses these too
        seen: set[str] = set()  # NOTE: one pass; a scan of the names before each one was quadratic
        twice = next(n for n in names if n in seen or seen.add(n))
        raise CheckpointError(f"{name}: two entries are both named {twice!r} once flattened "
                              "(a key with a dot next to a nested one).", path=name, fqn=twice)
    return leaves, paths


# ---------------------------------------------------------------- the fallback: torch.load, as before
def _torch_load(path: str, name: str, budget: int) -> tuple[dict[str, Any], dict[str, tuple]]:
    """``torch.load(weights_only=True, mmap=True)``, flattened; dense tensors as views whose ``storage`` is the
    storage's address in the memory-mapped file."""
    import torch

    from .chunks import allow_safe_globals

    allow_safe_globals()  # what an export of a DCP checkpoint may hold (io.BytesIO)
    try:
        with warnings.catch_warnings():  # torch warns on stderr about what a file holds (TypedStorage, CSR)
            warnings.simplefilter("ignore")
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointError(f"{name}: cannot be loaded safely with weights_only=True "
                              f"({str(exc).splitlines()[0][:200]}).", path=name) from None
    leaves, paths = _flattened(data, name, budget)
    odd = next((k for k, v in leaves.items() if isinstance(v, torch.Tensor) and not _dense(v)), None)
    if odd is not None:
        v = leaves[odd]
        what = ("a quantized tensor" if v.is_quantized else "a tensor on the meta device (no values)"
                if v.device.type == "meta" else f"a {str(v.layout).removeprefix('torch.')} tensor")
        raise CheckpointError(f"{name} (tensor {odd}): {what}; only dense tensors are read.", path=name, fqn=odd)
    for k, v in leaves.items():
        if isinstance(v, torch.Tensor):
            storage = v.untyped_storage()
            leaves[k] = TensorView(str(v.dtype).removeprefix("torch."), tuple(v.shape), tuple(v.stride()),
                                   v.storage_offset(), storage.data_ptr(), storage.nbytes())
    return leaves, paths


def _dense(t: Any) -> bool:
    """A tensor whose values exist as a strided CPU buffer (not sparse, quantized or on the meta device)."""
    import torch

    return t.layout == torch.strided and not t.is_quantized and t.device.type != "meta"


# ---------------------------------------------------------------- the reader
def _read(data: bytes, records: dict[str, tuple[int, int, int]], name: str, budget: int
          ) -> tuple[dict[str, Any], dict[str, tuple], dict[Any, tuple[int, int, int | None]]]:
    """Leaves, key paths and each storage key's record (offset, length, CRC32; (0, 0, None) when empty) of a
    ``data.pkl`` read by this module's reader. RefusedPickleError for a global weights_only refuses or an
    allocation bomb, CheckpointError for what cannot be flattened, _Fallback for what it leaves to torch."""
    found = _walk(data, name)

    def load() -> tuple[Any, dict[str, _Storage]]:
        unpickler = _FileUnpickler(data, name, found)  # and its memo, gone once loaded
        with gc_paused():
            root = unpickler.load()
            unpickler._budget.settle()  # the last numpy array's bytes
            return root, unpickler.storages

    try:
        root, storages = with_deep_stack(load, len(data))
    except (RefusedPickleError, _Fallback):
        raise
    except Exception as exc:  # whatever torch's loader makes of it, it says so
        raise _Fallback(f"data.pkl does not unpickle here ({type(exc).__name__}: {str(exc)[:120]})") from None
    with gc_paused():
        leaves, paths = _flattened(root, name, budget, TensorView)
        located = _storage_records(leaves, storages, records)
        if any(type(v) is not TensorView and _opaque(v) for v in leaves.values()):
            raise _Fallback("a non-tensor entry holds a tensor, a storage or an object this reader does not see into")
    return leaves, paths, located


def _storage_records(leaves: dict[str, Any], storages: dict[str, _Storage],
                     records: dict[str, tuple[int, int, int]]) -> dict[Any, tuple[int, int, int | None]]:
    """Each storage key -> its record, when every storage's record has the storage's size and every non-empty
    ``data/`` record holds the storage of a tensor entry (as the fallback locates them: else its tensors would
    not be located)."""
    out: dict[Any, tuple[int, int, int | None]] = {}
    for s in storages.values():
        rec = records.get(f"data/{s.key}")
        if rec is None or rec[1] != s.nbytes:
            raise _Fallback(f"storage data/{s.key} has no record of its {s.nbytes} bytes")
    used = {v.storage for v in leaves.values() if type(v) is TensorView}
    for key in used:
        rec = records[f"data/{key}"]
        out[key] = rec if rec[1] else (0, 0, None)
    stored = sum(1 for k, r in records.items() if k.startswith("data/") and r[1])
    if stored != sum(1 for r in out.values() if r[1]):
        raise _Fallback("a storage record holds no tensor entry's storage")
    return out


_PLAIN = (str, int, float, bool, type(None), bytes, bytearray, complex)


def _opaque(value: Any) -> bool:
    """True when a non-tensor leaf holds a tensor or storage of this reader (torch.load's would hold a tensor)
    or an object whose insides it does not know (a numpy object or structured array)."""
    stack, seen = [value], set()
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    while stack:
        v = stack.pop()
        if isinstance(v, _PLAIN):
            continue
        if id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, list | tuple | set | frozenset):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
            stack.extend(getattr(v, "__dict__", {}).values())
        elif isinstance(v, io.BytesIO):
            stack.extend(vars(v).values())
        elif np is not None and isinstance(v, np.ndarray | np.dtype):
            dt = v if isinstance(v, np.dtype) else v.dtype
            if dt.hasobject or dt.fields is not None or dt.subdtype is not None:
                return True
        elif not (torch is not None and isinstance(v, torch.Size | torch.device | torch.dtype)):
            return True
    return False


# Opcodes torch's weights-only unpickler runs (torch/_weights_only_unpickler.py), with their fixed argument
# lengths; BINUNICODE, SHORT_BINSTRING, LONG1, GLOBAL, LONG_BINPUT and STOP are walked one by one.
_FIXED = {b"\x81": 0, b"R": 0, b"b": 0, b"a": 0, b"e": 0, b"s": 0, b"u": 0, b"(": 0, b"t": 0, b"\x85": 0,
          b"\x86": 0, b"\x87": 0, b"N": 0, b"\x89": 0, b"\x88": 0, b")": 0, b"]": 0, b"}": 0, b"\x8f": 0,
          b"Q": 0, b"J": 4, b"K": 1, b"M": 2, b"G": 8, b"h": 1, b"j": 4, b"q": 1, b"\x80": 1}
# A run of fixed-length opcodes, and LONG_BINPUTs below 2**20, matched in C; the walk stops at any other byte.
_RUN = re.compile(b"(?:[" + b"".join(re.escape(k) for k, n in _FIXED.items() if n == 0) + b"]|[" +
                  b"".join(re.escape(k) for k, n in _FIXED.items() if n == 1) + b"].|M..|[Jj]....|G.{8}|"
                  b"r..[\\x00-\\x0f]\\x00)*", re.S)


def _walk(data: bytes, name: str) -> dict[str, Any]:
    """Walk ``data.pkl``'s opcodes before anything is unpickled: _Fallback unless each is one torch's weights-only
    unpickler runs (and a LONG_BINPUT's memo index is below the pickle's size: Python's unpickler sizes its memo
    table by it); each global checked (:func:`_native`). Returns what each global resolves to."""
    found: dict[str, Any] = {}
    n, i = len(data), 0
    match = _RUN.match
    while True:
        i = match(data, i).end()
        if i >= n:
            raise _Fallback("data.pkl ends without a STOP opcode")
        op = data[i]
        if op == 0x58:  # BINUNICODE
            i += 5 + int.from_bytes(data[i + 1:i + 5], "little")
        elif op == 0x72:  # LONG_BINPUT
            if int.from_bytes(data[i + 1:i + 5], "little") >= n:
                raise _Fallback("data.pkl has a memo index past its size")
            i += 5
        elif op in (0x55, 0x8A):  # SHORT_BINSTRING, LONG1
            if i + 1 >= n:
                raise _Fallback("data.pkl ends inside an opcode")
            i += 2 + data[i + 1]
        elif op == 0x63:  # GLOBAL
            try:
                a = data.index(b"\n", i + 1)
                b = data.index(b"\n", a + 1)
                module, attr = data[i + 1:a].decode("utf-8"), data[a + 1:b].decode("utf-8")
            except (ValueError, UnicodeDecodeError):
                raise _Fallback("data.pkl has a malformed GLOBAL opcode") from None
            full = f"{module}.{attr}"
            if full not in found:
                found[full] = _native(module, attr, name)
            i = b + 1
        elif op == 0x2E:  # STOP
            return found
        else:
            raise _Fallback(f"data.pkl holds opcode {bytes([op])!r}, which torch's weights-only unpickler does not run")


def _native(module: str, attr: str, name: str) -> Any:
    """What global ``module.attr`` is to this reader; _Fallback when it is one weights_only accepts but this
    reader does not build, RefusedPickleError when weights_only refuses it."""
    full = f"{module}.{attr}"
    if full in _REBUILDS:
        return _REBUILDS[full]
    if full in _STORAGE_KINDS:
        return _STORAGE_KINDS[full]
    if full in _CONTAINERS:
        return _CONTAINERS[full]
    if full in _TORCH_VALUES:
        import torch

        value = getattr(torch, attr, None)
        if value is not None:
            return value
    user = _safe_globals()
    if full in user:
        return user[full]
    if _torch_accepts(module, attr):
        raise _Fallback(f"it names {full[:200]}, which torch's weights-only loader reads and this reader does not")
    what = full if full.isprintable() else repr(full)
    raise RefusedPickleError(
        f"{name}: cannot be loaded safely with weights_only=True (its pickled data names the global {what[:200]}, "
        "which weights_only refuses; nothing from the file was run).", path=name)


def _torch_accepts(module: str, attr: str) -> bool:
    """Whether ``torch.load(weights_only=True)`` accepts global ``module.attr`` (torch's own list and what
    :func:`.chunks.allow_safe_globals` adds, after torch's Python 2 renames); True when torch's list cannot be
    read (torch.load then decides)."""
    try:
        from torch import _weights_only_unpickler as wo
        from torch._utils import IMPORT_MAPPING, NAME_MAPPING

        from .chunks import allow_safe_globals

        allow_safe_globals()
        if (module, attr) in NAME_MAPPING:
            module, attr = NAME_MAPPING[(module, attr)]
        elif module in IMPORT_MAPPING:
            module = IMPORT_MAPPING[module]
        full = f"{module}.{attr}"
        if module in wo._blocklisted_modules:
            return False
        return full in wo._get_allowed_globals() or full in wo._get_user_allowed_globals()
    except (ImportError, AttributeError, TypeError, ValueError):  # torch's private list moved: let it decide
        log.debug("torch's weights-only allow-list cannot be read", exc_info=True)
        return True


def _safe_globals() -> dict[str, Any]:
    """:func:`.chunks.safe_globals` by the names torch's weights-only unpickler knows them by."""
    from .chunks import safe_globals

    out = {}
    for g in safe_globals():
        obj, full = g if isinstance(g, tuple) else (g, f"{g.__module__}.{g.__qualname__}")
        out[full] = obj
    return out


class _Frozen:
    """An object a pickle may reach but not change: no ``__dict__``, no attribute set (BUILD on a plain function
    would set attributes on it; weights_only refuses BUILD on anything but the classes it allows)."""

    __slots__ = ()

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("read-only")

    def __repr__(self) -> str:
        return _HIDDEN


def _call(fn: Any) -> _Frozen:
    """``fn`` as a callable :class:`_Frozen` (called straight through its class: no frame of its own)."""
    return type(getattr(fn, "__name__", "call"), (_Frozen,), {"__slots__": (), "__call__": staticmethod(fn)})()


class _Marker(_Frozen):
    """A storage kind (``torch.FloatStorage``, ``torch.storage.UntypedStorage``: the dtype its storages hold)."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: str) -> None:
        object.__setattr__(self, "dtype", dtype)


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class _Storage:
    key: str
    dtype: str
    nbytes: int

    def __repr__(self) -> str:
        return _HIDDEN

    def __reduce__(self) -> Any:
        raise TypeError("a storage of a torch file being read is not pickled")


# dtypes whose tensors torch lets require gradients (others: torch.load fails, so the fallback says why)
_GRAD_DTYPES = frozenset({"float16", "float32", "float64", "bfloat16", "complex64", "complex128"})
# dtypes of dense tensors read here (not the quantized ones: their tensors are refused, in the fallback's words)
_DENSE = frozenset(d for d in ITEMSIZE if not d.startswith("q"))


def _view(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, metadata: Any,
          dtype: str) -> TensorView:
    """torch's ``t.set_(storage, offset, size, stride)`` and the attributes its rebuilds set, checked as torch
    checks them; _Fallback where torch would fail or make something else than a plain tensor."""
    if type(storage) is not _Storage or dtype not in _DENSE:
        raise _Fallback("a tensor is rebuilt from something else than a storage of a dense dtype")
    if requires_grad is not False and (requires_grad is not True or dtype not in _GRAD_DTYPES):
        raise _Fallback("a tensor is rebuilt with a requires_grad torch refuses")
    if (hooks is not None and (type(hooks) not in (dict, OrderedDict) or hooks)) or \
            (metadata is not None and (type(metadata) not in (dict, OrderedDict) or metadata)):
        raise _Fallback("a tensor is rebuilt with hooks or metadata (conj/neg bits)")
    if type(offset) is not int or not 0 <= offset < MAX_INDEX:
        raise _Fallback("a tensor has an implausible storage offset")
    shape, strides = _dims(size), _dims(stride)
    if len(shape) != len(strides):
        raise _Fallback("a tensor's shape and stride differ in length")
    if 0 not in shape:
        last = offset
        for n, st in zip(shape, strides, strict=True):
            last += (n - 1) * st
        if (last + 1) * ITEMSIZE[dtype] > storage.nbytes:
            raise _Fallback(f"a tensor of shape {shape} reaches past its storage data/{storage.key}")
    return TensorView(dtype, shape, strides, offset, storage.key, storage.nbytes)


def _dims(value: Any) -> tuple[int, ...]:
    if type(value) is not tuple:
        if type(value) is not list:
            raise _Fallback("a tensor has an implausible shape or stride")
        value = tuple(value)
    if len(value) > MAX_NDIM:
        raise _Fallback("a tensor has an implausible shape or stride")
    for v in value:
        if type(v) is not int or not 0 <= v < MAX_INDEX:
            raise _Fallback("a tensor has an implausible shape or stride")
    return value


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> TensorView:
    return _view(storage, storage_offset, size, stride, False, None, None, getattr(storage, "dtype", ""))


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                       backward_hooks: Any, metadata: Any = None) -> TensorView:
    return _view(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata,
                 getattr(storage, "dtype", ""))


def _rebuild_tensor_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                       backward_hooks: Any, dtype: Any, metadata: Any = None) -> TensorView:
    torch = sys.modules.get("torch")  # a torch.<dtype> global imported it
    if torch is None or not isinstance(dtype, torch.dtype):
        raise _Fallback("a tensor is rebuilt with a dtype that is not a torch dtype")
    return _view(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata,
                 str(dtype).removeprefix("torch."))


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> TensorView:
    """``nn.Parameter(data, requires_grad)``: the same view."""
    if type(data) is not TensorView or type(requires_grad) is not bool or \
            (requires_grad and data.dtype not in _GRAD_DTYPES) or \
            not (backward_hooks is None or (type(backward_hooks) in (dict, OrderedDict) and not backward_hooks)):
        raise _Fallback("a parameter is rebuilt with arguments torch refuses")
    return data


_REBUILDS = {f"torch._utils.{f.__name__}": _call(f)
             for f in (_rebuild_tensor, _rebuild_tensor_v2, _rebuild_tensor_v3, _rebuild_parameter)}
_STORAGE_KINDS = {**{f"torch.{k}": _Marker(v) for k, v in STORAGE_DTYPES.items() if v in _DENSE},
                  "torch.storage.UntypedStorage": _Marker("uint8")}  # torch.load makes a uint8 storage of it
# torch.Size, torch.device and torch's dtypes: torch's own objects, so torch is imported when a file names one
_TORCH_VALUES = frozenset({"torch.Size", "torch.device"} | {f"torch.{d}" for d in _DENSE})
_COPYING = {"collections.OrderedDict": OrderedDict, "collections.Counter": Counter, "builtins.set": set,
            "builtins.bytearray": bytearray, "_codecs.encode": encode}
_CONTAINERS: dict[str, Any] = {**_COPYING, "builtins.complex": complex}
# Python's pickle protocol 2 (torch.save's) names builtins by their Python 2 module; torch's unpickler renames it
_CONTAINERS.update({f"__builtin__.{k.removeprefix('builtins.')}": v for k, v in _CONTAINERS.items()
                    if k.startswith("builtins.")})
_COPYING.update({k: v for k, v in _CONTAINERS.items() if k.startswith("__builtin__.") and v is not complex})


class _Budget:
    """Elements (bytes, for numpy arrays) a pickle may still build through copying constructors: its size plus an
    allowance. numpy arrays get their values after they are made (BUILD: ``ndarray.__setstate__``, which copies
    the bytes it is given, and a memo reference can give the same bytes to any number of arrays): each array is
    charged its bytes when the next one is made and when the load ends (:meth:`settle`), so the most the charge
    can lag is one array, whose bytes come from the file."""

    __slots__ = ("arrays", "left", "source")

    def __init__(self, left: int, source: str) -> None:
        self.left, self.source = left, source
        self.arrays: list[Any] = []  # numpy arrays made and not charged yet

    def charge(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise RefusedPickleError(f"{self.source}: the pickle builds far more data than the file holds (an "
                                     "allocation bomb); refused.", path=self.source)

    def settle(self) -> None:
        """Charge the numpy arrays made so far for the bytes they now hold."""
        arrays, self.arrays = self.arrays, []
        self.charge(sum(int(getattr(a, "nbytes", 0)) for a in arrays))


def _charged(full: str, ctor: Any, budget: _Budget) -> _Frozen:
    """Constructor ``ctor`` (global ``full``) charged against ``budget`` for what it builds."""
    reconstruct = full.endswith("._reconstruct")  # numpy allocates the shape it is given, then fills it

    def build(*args: Any) -> Any:
        if not args:  # OrderedDict(): every tensor's backward hooks
            return ctor()
        if reconstruct:  # _reconstruct(ndarray, shape, dtype): allocates prod(shape) items of dtype
            budget.settle()
            shape = args[1] if len(args) > 1 else ()
            dims = (shape,) if type(shape) is int else shape
            if type(dims) not in (tuple, list) or not all(type(d) is int and d >= 0 for d in dims):
                raise RefusedPickleError(f"{budget.source}: the pickle makes a numpy array of shape "
                                         f"{str(shape)[:80]}; refused.", path=budget.source)
            n = 1
            for d in dims:
                n *= d
            budget.charge(n * 64)  # 64: numpy's largest item (the dtype argument is a code, read by numpy)
            out = ctor(*args)
            budget.arrays.append(out)
            return out
        if ctor is bytearray and type(args[0]) is int:
            budget.charge(args[0])  # before it allocates
            return ctor(*args)
        out = ctor(*args)
        budget.charge(len(out))
        return out

    return _call(build)


class _FileUnpickler(pickle.Unpickler):
    """Python's C unpickler with only the globals :func:`_walk` resolved (names as written: no Python 2 renames);
    constructors that copy what they are given are charged for what they build, so that a small pickle cannot
    make a big object many times over (a memo reference costs 2 bytes).
    NOTE: nothing it hands out refers back to it, so it and its memo (every object the pickle made) go as soon
    as the load returns, not at the next garbage collection (an import runs with the collector paused)."""

    def __init__(self, data: bytes, source: str, found: dict[str, Any]) -> None:
        super().__init__(io.BytesIO(data), fix_imports=False, encoding="utf-8")
        self._budget = budget = _Budget(len(data) + ELEMENT_ALLOWANCE, source)
        self._found = {k: _charged(k, v, budget) if k in _COPYING or k == "torch.Size" or "_reconstruct" in k else v
                       for k, v in found.items()}
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full not in self._found:  # _walk saw every GLOBAL opcode; nothing else asks
            raise _Fallback(f"data.pkl asks for {full[:200]} in a way the opcode walk did not see")
        return self._found[full]

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not tuple or len(pid) != 5:
            raise _Fallback("data.pkl names a storage in a form torch.save does not write")
        tag, kind, key, location, numel = pid
        if type(tag) is not str or tag != "storage" or type(kind) is not _Marker or type(key) is not str or \
                not (key.isascii() and key.isdigit() and len(key) <= 18) or type(location) is not str or \
                type(numel) is not int or not 0 <= numel < MAX_INDEX:
            raise _Fallback("data.pkl names a storage in a form torch.save does not write")
        nbytes = numel * ITEMSIZE[kind.dtype]
        known = self.storages.get(key)
        if known is None:
            known = self.storages[key] = _Storage(key, kind.dtype, nbytes)
        elif (known.dtype, known.nbytes) != (kind.dtype, nbytes):
            raise _Fallback(f"storage data/{key} is named with two sizes or dtypes")  # torch keeps the first
        return known


NATIVE_GLOBALS = frozenset({*_REBUILDS, *_STORAGE_KINDS, *_TORCH_VALUES, *_CONTAINERS})
"""The globals this reader builds itself besides :func:`.chunks.safe_globals`: each one torch's weights-only
unpickler accepts too (tests/test_torch_file_open.py checks it against torch's own list)."""

__all__ = ["NATIVE_GLOBALS", "TensorView", "TorchFileLoad"]
