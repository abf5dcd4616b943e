"""DCP ``.metadata`` files unpickled safely: the inert records DCP's dataclasses become, and the limits a load runs
under (memory, stack). torch's ``FileSystemReader.read_metadata`` calls plain ``pickle.load``, so a hostile checkpoint
folder runs code on open; here every global is looked up in an exact (module, name) allow-list, which
:mod:`.unpickler` owns (``METADATA_GLOBALS``, with every other pickle allow-list), and mapped to an inert stand-in:
nothing from the file is imported or called, and torch is not needed at all.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import threading
from typing import Any


class Record:
    """Plain stand-in for a DCP dataclass: pickle's BUILD fills ``__dict__``."""

    __slots__ = ("__dict__",)

    def get(self, name: str, default: Any = None) -> Any:
        """The attribute ``name`` as pickled, or ``default`` when the file did not set it."""
        return self.__dict__.get(name, default)


class MetadataRecord(Record):
    """Stand-in for DCP's ``Metadata``: the top-level object of a ``.metadata`` file."""

    kind = "Metadata"


class TensorStorageRecord(Record):
    """Stand-in for ``TensorStorageMetadata``: a tensor's properties, size and chunks."""

    kind = "TensorStorageMetadata"


class _CompactRecord(Record):
    """For the per-chunk records (a million in a big checkpoint): keep the fields in slots and
    empty the state dict pickle hands over, since the unpickler's memo keeps that dict alive
    until the load ends; that roughly halves the memory of a big load."""

    __slots__ = ()
    _fields: tuple[str, ...] = ()

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state = {**(state[0] or {}), **(state[1] or {})}
        for name in self._fields:
            setattr(self, name, state.get(name))
        state.clear()

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default)

    # the fields as a dict, as a plain record's __dict__ is: a property where object declares an attribute
    @property
    def __dict__(self) -> dict:  # type: ignore[override]
        return {n: getattr(self, n, None) for n in self._fields}


class ChunkRecord(_CompactRecord):
    """Stand-in for ``ChunkStorageMetadata``: one chunk's offsets and sizes in the full tensor."""

    __slots__ = ("offsets", "sizes")
    _fields = ("offsets", "sizes")
    kind = "ChunkStorageMetadata"


class BytesStorageRecord(Record):
    """Stand-in for ``BytesStorageMetadata``: a non-tensor (pickled object) entry."""

    kind = "BytesStorageMetadata"


class MetadataIndexRecord(_CompactRecord):
    """Hashes by value like torch's frozen dataclass, so ``storage_data`` is looked up directly
    (no second million-entry index)."""

    __slots__ = ("fqn", "index", "offset")
    _fields = ("fqn", "offset", "index")
    kind = "MetadataIndex"
    # as the file pickled them (checked where they are used): a name, a chunk's offsets, an index or None
    fqn: Any
    offset: Any
    index: Any

    @classmethod
    def probe(cls, fqn: str, offset: Any) -> MetadataIndexRecord:
        """A lookup key for ``storage_data`` made without unpickling (``index`` left None)."""
        key = cls.__new__(cls)
        key.fqn, key.offset, key.index = fqn, offset, None
        return key

    def __hash__(self) -> int:
        return hash((self.fqn, self.offset))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, MetadataIndexRecord) and self.fqn == other.fqn
                and self.offset == other.offset)


class StorageInfoRecord(_CompactRecord):
    """Stand-in for ``_StorageInfo``: which file holds an item, and at which offset and length."""

    __slots__ = ("length", "offset", "relative_path", "transform_descriptors")
    _fields = ("relative_path", "offset", "length", "transform_descriptors")
    kind = "_StorageInfo"


class StorageMetaRecord(Record):
    """Stand-in for ``StorageMeta``: the storage layer's per-save metadata."""

    kind = "StorageMeta"


class StoragePrefixRecord(Record):
    """Stand-in for ``_StoragePrefix``: the file-name prefix a rank writes under."""

    kind = "_StoragePrefix"


class TensorPropertiesRecord(Record):
    """TensorProperties pickles a 5-tuple since torch 2.1 and a plain dict before."""

    kind = "TensorProperties"

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state


class ShardMetadataRecord(Record):
    """Stand-in for ``ShardMetadata``: one shard of an old-style ShardedTensor."""

    kind = "ShardMetadata"


class SavePlanRecord(Record):
    """Stand-in for the planner's ``SavePlan`` (and Megatron-Core's ``MCoreSavePlan``): Megatron's save keeps every
    rank's plan in the Metadata (``all_local_plans``, to reuse it on the next save); nothing here reads it."""

    kind = "SavePlan"


class WriteItemRecord(Record):
    """Stand-in for the planner's ``WriteItem`` and ``TensorWriteData`` (inside a kept ``SavePlan``)."""

    kind = "WriteItem"


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic GC while millions of acyclic objects are made; it would rescan them all
    over and over (5x the unpickling time on a million-chunk file)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def stream_size(stream: Any) -> int:
    """Bytes in the stream (a local file, an fsspec file or a BytesIO), for the allocation budget."""
    try:
        return os.fstat(stream.fileno()).st_size
    except (OSError, AttributeError, io.UnsupportedOperation):
        pass
    size = getattr(stream, "size", None)
    if isinstance(size, int):
        return size
    pos = stream.tell()
    end = stream.seek(0, io.SEEK_END)
    stream.seek(pos)
    return end


MEMO_ALLOWANCE = 256 << 20  # address space an unpickle may add on top of 16x the file's size


def _address_space() -> tuple[int, int, int] | None:
    """(mapped bytes, soft limit, hard limit) of this process; None where that is unknown (not Linux)."""
    try:
        import resource

        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        return (vm, *resource.getrlimit(resource.RLIMIT_AS))
    except (ImportError, OSError, StopIteration, ValueError):
        return None


@contextlib.contextmanager
def address_space_limit(extra: int):
    """Cap the process's new address space at ``extra`` bytes above what it maps now (Linux), so that
    allocations the C unpickler makes from numbers in the file fail with MemoryError instead of filling
    RAM. NOTE: pickle's own memo table is sized by the index a PUT opcode names (``LONG_BINPUT
    0x2a05f200`` zero-fills 11 GB) and nothing outside C sees that opcode. The limit is per process, so it
    is only set where no other thread can allocate (see :func:`must_isolate`); reading, setting and
    restoring it happen under one lock, so two loads never restore each other's limit."""
    import resource

    with _LIMIT_LOCK:
        now = _address_space()
        if now is None or (now[1] != resource.RLIM_INFINITY and now[1] <= now[0] + extra):
            yield  # no limit known here, or already a tighter one
            return
        vm, soft, hard = now
        want = vm + extra if hard == resource.RLIM_INFINITY else min(vm + extra, hard)
        resource.setrlimit(resource.RLIMIT_AS, (want, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


_LIMIT_LOCK = threading.Lock()
_DEALLOC_NOISE = "deallocated bytearray object has exported buffers"


@contextlib.contextmanager
def _quiet_bytearray_noise():
    """NOTE: when malloc fails in CPython 3.11's ``PyByteArray_FromStringAndSize`` (a ``BYTEARRAY8`` opcode
    with a huge length, under the limit above) it frees the half-made bytearray before setting its export
    count, and the dealloc, reading that uninitialised field, may print "SystemError: deallocated bytearray
    object has exported buffers" through ``sys.excepthook`` (found by fuzzing). The load still fails
    cleanly with MemoryError; this keeps that stray line off the user's terminal. Only used where no other
    thread runs (the caller holds ``_LIMIT_LOCK``, see :mod:`.reader_process`)."""
    import sys

    previous = sys.excepthook

    def hook(kind: type, value: BaseException, tb: Any) -> None:
        if not (kind is SystemError and str(value) == _DEALLOC_NOISE):
            previous(kind, value, tb)

    sys.excepthook = hook
    try:
        yield
    finally:
        sys.excepthook = previous
_STACK_LOCK = threading.Lock()
MAX_STACK = 4 << 30


def with_deep_stack(func: Any, size: int) -> Any:
    """Run ``func`` in a thread whose C stack fits the deepest nesting a file of ``size`` bytes can hold.

    NOTE: CPython hashes a nested tuple recursively in C without a depth check, so a dict key nested
    200,000 deep (a few hundred KB of pickle) overflows an 8 MB stack and kills the process; each level
    costs under 128 bytes of stack, and only the pages actually used are ever touched."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = func()
        except BaseException as exc:  # handed to the calling thread, which re-raises it
            box["error"] = exc

    with _STACK_LOCK:
        old = threading.stack_size(min(MAX_STACK, (64 << 20) + 128 * size))
        try:
            worker = threading.Thread(target=run, name="metadata-unpickle", daemon=True)
            worker.start()
        finally:
            threading.stack_size(old)
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class NotStreamable(Exception):
    """The file does not have the layout the streaming reader relies on (:mod:`.streaming`)."""
