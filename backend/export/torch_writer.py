"""torch ``.pt`` output: the archive ``torch.save`` would write for the nested state dict that
``dcp_to_torch_save`` builds, written by our own zip writer. Every record's place is known before a
byte is written, so tensors are copied in parallel into their ranges and each local header gets its
CRC32 afterwards; no tensor is held in memory unless it must be assembled or cast."""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import sys
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..checkpoint.chunks import ChunkReader, torch_dtype
from ..checkpoint.flatten import dotted, flatten
from ..checkpoint.items import StorageRef
from ..checkpoint.model import contiguous_strides
from ..checkpoint.unpickler import allow_torch_safe_globals
from ..formats.lightning import trainer_state
from ..progress import Progress
from .plan import ExportError, ExportItem, ExportPlan
from .source import TensorSource, pwrite_all, run_parallel, tensor_bytes, write_buffer
from .verify import Expectation

ALIGN = 64  # torch's storage alignment: data records start on 64-byte boundaries (mmap=True loads)
_Z64 = 0xFFFFFFFF
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01


@dataclass(frozen=True, slots=True)
class _Placeholder:
    """Stands for output tensor ``index`` in the nested dict until the pickler meets it."""

    index: int


def set_element(root: dict, path: tuple, value: Any) -> None:
    """torch's ``_traverse.set_element``: str keys make dicts, int keys make lists."""
    cur: Any = root
    for i in range(1, len(path)):
        prev, key = path[i - 1], path[i]
        default: Any = {} if type(key) is str else []
        if isinstance(cur, dict):
            cur = cur.setdefault(prev, default)
        else:
            while len(cur) <= prev:
                cur.append(None)
            if cur[prev] is None:
                cur[prev] = default
            cur = cur[prev]
    key = path[-1]
    if type(key) is int:
        while len(cur) <= key:
            cur.append(None)
    cur[key] = value


def nested_state(plan: ExportPlan, reader: ChunkReader) -> dict:
    """The nested dict ``dcp_to_torch_save`` would save, with placeholders for the plan's tensors
    (flat keys when the plan renamed them)."""
    root: dict = {}
    planner = plan.ckpt.planner_data

    def place(fqn: str, key: str, value: Any) -> None:
        path = planner.get(fqn)
        if path and not plan.keys_renamed:
            set_element(root, path, value)
        else:
            root[key] = value

    for i, it in enumerate(plan.items):
        place(it.entry.fqn, it.key, _Placeholder(i))
    for key, o in plan.objects:
        place(o.fqn, key, reader.read_object(o))
    if plan.include_meta:  # Lightning's meta.pt merged at the top level, as its own consolidation does
        for k, v in trainer_state(plan.ckpt, reader).items():
            root.setdefault(k, v)
    return root


def pickle_state(root: dict, items: tuple[ExportItem, ...]) -> tuple[bytes, list[tuple[StorageRef, Any]]]:
    """data.pkl, and the storages in key order: (record, ExportItem or an in-memory tensor)."""
    import torch

    storages: list[tuple[StorageRef, Any]] = []
    storage_types = torch.storage._dtype_to_storage_type_map()

    def rebuild(dtype: str, shape: tuple, what: Any) -> Any:
        rec = StorageRef(str(len(storages)), math.prod(shape), dtype)
        storages.append((rec, what))
        args: tuple[Any, ...] = (rec, 0, shape, contiguous_strides(shape), False, OrderedDict())
        if torch_dtype(dtype) in storage_types:
            return (torch._utils._rebuild_tensor_v2, args)
        # float8, uint16/32/64 have no typed storage class: torch.save writes bytes and names the dtype (v3)
        return (torch._utils._rebuild_tensor_v3, (*args, torch_dtype(dtype)))

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, _Placeholder):
                it = items[obj.index]
                return rebuild(it.dtype, tuple(it.shape), it)
            if isinstance(obj, torch.Tensor):  # a tensor inside a non-tensor entry
                t = obj.detach().cpu().contiguous().clone()  # a storage of exactly its bytes
                return rebuild(str(t.dtype).removeprefix("torch."), tuple(t.shape), t)
            return NotImplemented

        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, StorageRef):
                if obj.dtype is None:  # rebuild names every storage's dtype
                    raise ExportError(f"storage {obj.key}: no dtype to write it with.")
                tdtype = torch_dtype(obj.dtype)
                if tdtype not in storage_types:  # an untyped storage counts bytes
                    return ("storage", torch.UntypedStorage, obj.key, "cpu", obj.numel * tdtype.itemsize)
                return ("storage", getattr(torch, storage_types[tdtype]), obj.key, "cpu", obj.numel)
            return None

    data = io.BytesIO()
    Pickler(data, protocol=2).dump(root)
    return data.getvalue(), storages


# ------------------------------------------------------------------ the zip container
@dataclass(slots=True)
class _Record:
    name: bytes
    size: int
    header_at: int = 0
    data_at: int = 0
    crc: int = 0

    @property
    def zip64(self) -> bool:
        return self.size >= _Z64

    def local_header(self) -> bytes:
        z64 = struct.pack("<HHQQ", 1, 16, self.size, self.size) if self.zip64 else b""
        fixed = 30 + len(self.name) + len(z64) + 4
        pad = self.data_at - self.header_at - fixed
        extra = z64 + struct.pack("<2sH", b"FB", pad) + b"Z" * pad
        size32 = _Z64 if self.zip64 else self.size
        return struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 45 if self.zip64 else 20, _flags(self.name), 0, 0,
                           _DOS_DATE, self.crc, size32, size32, len(self.name), len(extra)) + self.name + extra

    def central_header(self) -> bytes:
        big = [v for v in (self.size, self.size) if v >= _Z64] + ([self.header_at] if self.header_at >= _Z64 else [])
        extra = struct.pack(f"<HH{len(big)}Q", 1, 8 * len(big), *big) if big else b""
        size32 = _Z64 if self.zip64 else self.size
        return struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 45, 45 if big else 20, _flags(self.name), 0, 0,
                           _DOS_DATE, self.crc, size32, size32, len(self.name), len(extra), 0, 0, 0, 0,
                           min(self.header_at, _Z64)) + self.name + extra


def _flags(name: bytes) -> int:
    return 0x800 if not name.isascii() else 0  # bit 11: the name is UTF-8


def _layout(records: list[_Record]) -> int:
    """Place every record (data 64-byte aligned); returns where the central directory starts."""
    pos = 0
    for r in records:
        r.header_at = pos
        fixed = 30 + len(r.name) + (20 if r.zip64 else 0) + 4
        r.data_at = pos + fixed + (-(pos + fixed) % ALIGN)
        pos = r.data_at + r.size
    return pos


def _directory(records: list[_Record], cd_at: int) -> bytes:
    cd = b"".join(r.central_header() for r in records)
    n = len(records)
    tail = b""
    if n >= 0xFFFF or cd_at >= _Z64 or len(cd) >= _Z64:
        eocd64_at = cd_at + len(cd)
        tail = struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, len(cd), cd_at)
        tail += struct.pack("<4sIQI", b"PK\x06\x07", 0, eocd64_at, 1)
    eocd = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), min(len(cd), _Z64),
                       min(cd_at, _Z64), 0)
    return cd + tail + eocd


RUN_BYTES = 8 << 20  # records written by one pool job: up to this many bytes or RUN_ITEMS records
RUN_ITEMS = 1024


def archive_name(dst: str) -> str:
    """The folder name inside the archive, as torch.save picks it (the file's stem)."""
    stem = os.path.splitext(os.path.basename(dst))[0]
    return stem or "archive"


def write(plan: ExportPlan, out_path: str, dst: str, source: TensorSource, progress: Progress | None,
          left_out: list[str]) -> tuple[list[str], list[Expectation]]:
    """Write the plan as one torch archive at ``out_path``; returns ([""], expectations)."""
    import torch

    pkl, storages = pickle_state(nested_state(plan, source.reader), plan.items)
    prefix = archive_name(dst).encode() + b"/"
    small = [(b"data.pkl", pkl), (b".format_version", b"1"), (b".storage_alignment", str(ALIGN).encode()),
             (b"byteorder", sys.byteorder.encode())]
    tail = [(b"version", b"3\n"), (b".data/serialization_id", str(zlib.crc32(pkl)).zfill(40).encode())]
    records = [_Record(prefix + n, len(d)) for n, d in small]
    data_records = [_Record(prefix + f"data/{rec.key}".encode(),
                            what.nbytes if isinstance(what, ExportItem) else what.numel() * what.element_size())
                    for rec, what in storages]
    records += data_records + [_Record(prefix + n, len(d)) for n, d in tail]
    cd_at = _layout(records)
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, cd_at)
        for r, (_, data) in zip(records[:len(small)] + records[-len(tail):], small + tail, strict=True):
            r.crc = zlib.crc32(data)
            pwrite_all(fd, data, r.data_at)

        def one(r: _Record, what: Any) -> int:
            if isinstance(what, ExportItem):
                return source.write(what, fd, r.data_at, progress)
            return write_buffer(fd, r.data_at, tensor_bytes(what), None)

        def many(pairs: list[tuple[_Record, Any]]) -> list[int]:
            return [one(r, what) for r, what in pairs]

        # small records go to the pool a run at a time (a job per tensor cost more than its write: 300,000 tensors)
        runs: list[list[tuple[_Record, Any]]] = [[]]
        size = 0
        for r, (_, what) in zip(data_records, storages, strict=True):
            if runs[-1] and (size + r.size > RUN_BYTES or len(runs[-1]) >= RUN_ITEMS):
                runs.append([])
                size = 0
            runs[-1].append((r, what))
            size += r.size
        crcs = [c for run in run_parallel([(many, (run,)) for run in runs if run], progress, source.budget)
                for c in run]
        for r, crc in zip(data_records, crcs, strict=True):
            r.crc = crc
        for r in records:
            pwrite_all(fd, r.local_header(), r.header_at)
        pwrite_all(fd, _directory(records, cd_at), cd_at)
    finally:
        os.close(fd)  # fsynced by the atomic output while the verifier reads
    check_archive(out_path, plan, storages, torch)
    return [""], [Expectation(out_path, r.data_at, r.size, r.crc, what.key if isinstance(what, ExportItem)
                              else f"tensor in a non-tensor entry (data/{rec.key})")
                  for r, (rec, what) in zip(data_records, storages, strict=True)]


def check_archive(path: str, plan: ExportPlan, storages: list, torch: Any) -> None:
    """torch.load finds every tensor with its dtype and shape. It maps the file without touching the
    tensor data (the verifier re-reads those bytes in a streaming pass). What the source's reader allows (numpy
    arrays of numbers: an RNG state) is allowed here too."""
    allow_torch_safe_globals()
    loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    flat = {dotted(k): v for k, v in flatten(loaded).items()}
    for it in plan.items:
        key = dotted(plan.ckpt.planner_data.get(it.entry.fqn) or (it.key,)) if not plan.keys_renamed else it.key
        got = flat.get(key)
        if not isinstance(got, torch.Tensor) or str(got.dtype).removeprefix("torch.") != it.dtype \
                or tuple(got.shape) != tuple(it.shape):
            raise ExportError(f"{path}: the archive read back lacks {it.key} as {it.dtype} {list(it.shape)}.")
    del loaded, flat


__all__ = ["ALIGN", "archive_name", "check_archive", "nested_state", "pickle_state",
           "set_element", "write"]
