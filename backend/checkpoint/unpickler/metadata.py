"""DCP ``.metadata``: Python's C unpickler over inert records, every callable frozen; the reply unpickler of
the metadata helper process."""


from __future__ import annotations

import functools
import io
import pickle
from collections.abc import Callable
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

from ...errors import RefusedPickleError
from ..dtypes import DTYPE_NAMES
from ..safe_pickle import (
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
from .objects import ELEMENT_ALLOWANCE

# ---------------------------------------------------------------- DCP .metadata: the C unpickler over inert records
# A ``.metadata`` is torch's own plain pickle (protocol 4/5, a million chunks): read with Python's C unpickler (speed)
# over the records of :mod:`.safe_pickle`. Every global resolves to a record class (BUILD fills its ``__dict__``, as
# plain pickle fills torch's dataclasses), a builtin container, or a frozen callable (no ``__dict__``: BUILD on it
# fails); nothing else is reachable.


class FrozenCall:
    """A function a pickle may call, with nothing to set on it (BUILD on a plain function sets its attributes)."""

    __slots__ = ("_fn",)
    _fn: Callable[..., Any]

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


_CHECKPOINT_CLASSES: dict[str, Callable[..., Any]] = {
    "Metadata": MetadataRecord,
    "TensorStorageMetadata": TensorStorageRecord,
    "ChunkStorageMetadata": ChunkRecord,
    "BytesStorageMetadata": BytesStorageRecord,
    "MetadataIndex": MetadataIndexRecord,
    "TensorProperties": TensorPropertiesRecord,
    "StorageMeta": StorageMetaRecord,
    "_MEM_FORMAT_ENCODING": _mem_format_encoding,
}

METADATA_GLOBALS: dict[tuple[str, str], Any] = {}
_cls: Callable[..., Any]  # the classes and functions a metadata pickle may call
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
    from .. import safe_pickle

    helper = __name__.rsplit(".", 2)[0] + ".reader_process"  # named, not imported: it imports this module
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
