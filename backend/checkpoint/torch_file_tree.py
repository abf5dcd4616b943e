"""A torch.save file read safely and flattened to dotted names with their nested key paths; the torch-file format
(:mod:`..formats.torch_file`) turns the leaves into the checkpoint model, and the chunk reader then reads values
from the file's records.

Its ``data.pkl`` is read without torch by :mod:`.unpickler` (torch's weights-only unpickler, opcode for opcode, with
what :func:`.unpickler.torch_safe_globals` adds): a tensor becomes a :class:`TensorView` (dtype, shape, stride,
storage offset, storage record), no torch tensor is made and no tensor byte read. What weights_only refuses is
refused with one line naming the file, before anything from it could run.

NOTE the fallback: a file this reader does not read the way torch.load would (a global weights_only accepts but
it does not build: sparse, quantized or meta tensors, a tensor saved with attributes, BUILD on a tensor; a legacy
(pre-zip) file; records torch's own checks would refuse; a storage whose record has another size; a tensor or
storage used as a key or inside a non-tensor leaf) is loaded with ``torch.load(weights_only=True, mmap=True)`` after
the checks torch's own loader lacks, and ``TorchFileLoad.fallback`` says why. The values are then torch's own."""

from __future__ import annotations

import io
import logging
import os
import pickletools
import sys
import warnings
import zlib
from typing import Any

from ..errors import CheckpointError
from .flatten import FlattenError, dotted, flatten
from .items import ItemFormatError, torch_archive_records, zip_records
from .safe_pickle import gc_paused
from .storage import LocalHandles
from .unpickler import _HIDDEN, TORCH_FILE, NotBuilt, StorageRef, TensorRef, allow_torch_safe_globals, realize, unpickle

log = logging.getLogger(__name__)

TensorView = TensorRef
"""A dense tensor of the file, not read (:class:`.unpickler.TensorRef`): ``storage`` is the storage's record key
(``"0"`` for ``data/0``) when this module's reader read the file, its address when torch.load did (the fallback)."""


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
        twice = _first_repeat(names)
        raise CheckpointError(f"{name}: two entries are both named {twice!r} once flattened "
                              "(a key with a dot next to a nested one).", path=name, fqn=twice)
    return leaves, paths


# ---------------------------------------------------------------- the fallback: torch.load, as before
def _torch_load(path: str, name: str, budget: int) -> tuple[dict[str, Any], dict[str, tuple]]:
    """``torch.load(weights_only=True, mmap=True)``, flattened; dense tensors as views whose ``storage`` is the
    storage's address in the memory-mapped file."""
    import torch

    allow_torch_safe_globals()
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
                                   int(v.storage_offset()), storage.data_ptr(), storage.nbytes())
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
    try:
        root, storages = unpickle(data, name, TORCH_FILE)
    except NotBuilt as why:  # torch's loader reads it (or says what is wrong with it)
        raise _Fallback(str(why)) from None
    with gc_paused():
        leaves, paths = _flattened(realize(root), name, budget, TensorView)
        located = _storage_records(leaves, storages, records)
        if any(type(v) is not TensorView and _opaque(v) for v in leaves.values()):
            raise _Fallback("a non-tensor entry holds a tensor, a storage or an object this reader does not see into")
    return leaves, paths, located


def _storage_records(leaves: dict[str, Any], storages: dict[str, StorageRef],
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


def _first_repeat(names: list[str]) -> str:
    """The first name that comes a second time (the caller knows one does). NOTE: one pass; a scan of the names
    before each one was quadratic."""
    seen: set[str] = set()
    for n in names:
        if n in seen:
            return n
        seen.add(n)
    raise ValueError("no name comes twice")


__all__ = ["TensorView", "TorchFileLoad"]
