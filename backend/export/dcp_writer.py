"""Write a DCP checkpoint as if saved by M ranks with even row-wise chunks (FSDP2's ``torch.chunk``
along dim 0), one tensor in memory at a time. The items are ``torch.save`` archives and the
``.metadata`` pickle uses torch's own classes, so ``dcp.load`` reads the result at any world size.
Written into a temporary folder and renamed at the end; ``.metadata`` last, as DCP does."""

from __future__ import annotations

import io
import math
import os
import pickle
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ShardscopeError
from ..format import human_bytes
from ..progress import Progress
from .plan import ExportError
from .writers import TMP_TAG, _check_destination, _same_bits, clean_stale_tmp

DCP_VERSION = "1.0.0"


@dataclass
class TensorIn:
    fqn: str
    dtype: str
    shape: tuple[int, ...]
    load: Callable[[], Any]  # the whole tensor (memory: this one tensor)


@dataclass
class ObjectIn:
    fqn: str
    data: bytes  # a torch.save archive, as DCP stores non-tensor entries


@dataclass
class DcpResult:
    dst: str
    ranks: int
    tensors: int
    bytes: int
    seconds: float
    verified: bool | None = None
    mismatches: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.verified is False:
            return (f"VERIFICATION FAILED: {len(self.mismatches)} tensors differ ({', '.join(self.mismatches[:5])}); "
                    f"nothing was written to {self.dst}.")
        text = (f"wrote {self.dst}: {self.tensors} tensors, {human_bytes(self.bytes)} as {self.ranks} ranks "
                f"in {self.seconds:.1f} s")
        if self.verified:
            text += "\nverified: every tensor reads back equal to the source bit for bit"
        return text


def row_chunks(rows: int, ranks: int) -> list[tuple[int, int]]:
    """(start, stop) per rank, as torch.chunk splits dim 0 (later ranks may get nothing)."""
    per = math.ceil(rows / ranks) if rows else 0
    return [(min(rows, r * per), min(rows, (r + 1) * per)) for r in range(ranks)]


def write_dcp(tensors: Iterable[TensorIn], objects: Iterable[ObjectIn], dst: str, ranks: int,
              planner_data: dict[str, tuple] | None = None, force: bool = False, verify: bool = True,
              progress: Progress | None = None, total_bytes: int = 0) -> DcpResult:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    if ranks < 1:
        raise ExportError("--ranks must be at least 1.")
    t0 = time.monotonic()
    clean_stale_tmp(dst)
    _check_destination(dst, force, total_bytes + (1 << 20))
    base = os.path.basename(dst.rstrip("/"))
    tmp = os.path.join(os.path.dirname(os.path.abspath(dst)), f".{base}{TMP_TAG}{os.getpid()}")
    os.makedirs(tmp)
    names = [f"__{r}_0.distcp" for r in range(ranks)]
    files = [open(os.path.join(tmp, n), "wb") for n in names]
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    written: list[TensorIn] = []
    nbytes = 0
    if progress:
        progress.start(total_bytes or 1, "writing")
    try:
        for obj in objects:
            f = files[0]
            off = f.tell()
            f.write(obj.data)
            sdm[obj.fqn] = BytesStorageMetadata()
            storage[MetadataIndex(obj.fqn)] = _StorageInfo(names[0], off, len(obj.data))
        for t in tensors:
            value = t.load()
            if tuple(value.shape) != tuple(t.shape):
                raise ExportError(f"{t.fqn}: read a tensor of shape {list(value.shape)}, expected {list(t.shape)}.")
            chunks = []
            if value.dim() == 0 or value.shape[0] == 0:
                pieces = [(0, (0,) * value.dim(), value)]
            else:
                pieces = [(r, (a, *([0] * (value.dim() - 1))), value[a:b])
                          for r, (a, b) in enumerate(row_chunks(value.shape[0], ranks)) if b > a]
            for r, offsets, piece in pieces:
                f = files[r]
                off = f.tell()
                torch.save(piece.clone(), f)
                meta = ChunkStorageMetadata(torch.Size(offsets), torch.Size(piece.shape))
                chunks.append(meta)
                storage[MetadataIndex(t.fqn, meta.offsets)] = _StorageInfo(names[r], off, f.tell() - off)
            sdm[t.fqn] = TensorStorageMetadata(TensorProperties(dtype=value.dtype), torch.Size(value.shape), chunks)
            written.append(t)
            nbytes += value.numel() * value.element_size()
            if progress:
                progress.advance(value.numel() * value.element_size(), t.fqn)
            del value, pieces
        for f in files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        md = Metadata(sdm, planner_data=planner_data or {k: (k,) for k in sdm},
                      storage_data=storage, storage_meta=StorageMeta(checkpoint_id=dst, save_id=str(uuid.uuid4())),
                      version=DCP_VERSION)
        buf = io.BytesIO()
        pickle.dump(md, buf)  # writing with torch's classes; Shardscope itself never unpickles this way
        with open(os.path.join(tmp, ".metadata"), "wb") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        mismatches = _verify(tmp, written) if verify else []
        if mismatches:
            shutil.rmtree(tmp, ignore_errors=True)
            return DcpResult(dst, ranks, len(written), nbytes, time.monotonic() - t0, False, mismatches)
        if os.path.exists(dst):
            shutil.rmtree(dst) if os.path.isdir(dst) else os.unlink(dst)
        os.replace(tmp, dst)
    except BaseException as exc:
        for f in files:
            f.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and not isinstance(exc, ShardscopeError):
            raise ExportError(f"{dst}: cannot write ({exc.strerror or exc}).") from None
        raise
    return DcpResult(dst, ranks, len(written), nbytes, time.monotonic() - t0, True if verify else None)


def _verify(folder: str, tensors: list[TensorIn]) -> list[str]:
    from ..checkpoint import open_checkpoint
    from ..checkpoint.values import ChunkReader

    ckpt = open_checkpoint(folder, use_cache=False)
    bad = []
    with ChunkReader(ckpt) as reader:
        for t in tensors:
            if not ckpt.has_tensor(t.fqn) or not _same_bits(reader.read_tensor(ckpt.tensor(t.fqn)), t.load()):
                bad.append(t.fqn)
    return bad


# ------------------------------------------------------------------ sources
def import_file(src: str, dst: str, ranks: int = 1, prefix: str | None = None, force: bool = False,
                verify: bool = True, progress: Progress | None = None) -> DcpResult:
    """A ``.pt`` (loaded with ``weights_only=True``, memory-mapped) or ``.safetensors`` (single, or a
    folder with an index) becomes a DCP checkpoint. ``prefix`` nests every key (``model``), so
    ``dcp.load({"model": model.state_dict()})`` finds them."""
    import torch

    from ..compare.sources import SafetensorsSource, TorchFileSource, open_source

    source = open_source(src)
    if not isinstance(source, TorchFileSource | SafetensorsSource):
        raise ExportError(f"{src}: import takes a .pt/.pth/.bin or .safetensors file; use reshard for a DCP folder.")
    pre = prefix.strip(".") if prefix else ""

    def key(fqn: str) -> str:
        return f"{pre}.{fqn}" if pre else fqn

    entries = source.entries()
    tensors = [TensorIn(key(k), e.dtype or "", tuple(e.shape or ()), lambda k=k: source.tensor(k))
               for k, e in entries.items() if e.kind == "tensor"]
    objects = [ObjectIn(key(k), _saved(source.object(k))) for k, e in entries.items() if e.kind == "object"]
    planner = {}
    for k in entries:
        path = source.nested_path(k) or (k,)
        planner[key(k)] = ((pre, *map(_key_part, path)) if pre else tuple(map(_key_part, path)))
    total = sum(math.prod(t.shape) * torch.empty((), dtype=getattr(torch, t.dtype)).element_size() for t in tensors)
    return write_dcp(tensors, objects, dst, ranks, planner, force, verify, progress, total)


def _key_part(p: Any) -> Any:
    return p if isinstance(p, int) else str(p)


def _saved(value: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def reshard(src: str, dst: str, ranks: int, force: bool = False, verify: bool = True,
            progress: Progress | None = None) -> DcpResult:
    """Rewrite a DCP checkpoint as if saved by ``ranks`` ranks; non-tensor entries are copied byte for
    byte (never decoded), tensors one at a time."""
    from ..checkpoint import open_checkpoint
    from ..checkpoint.values import ChunkReader

    ckpt = open_checkpoint(src)
    missing = [f.name for f in ckpt.files if f.kind == "data" and f.bytes is None]
    if missing:
        raise ExportError(f"{ckpt.path}: missing {', '.join(missing)}; cannot reshard an incomplete checkpoint.")
    reader = ChunkReader(ckpt)
    try:
        tensors = [TensorIn(t.fqn, t.dtype, t.shape, lambda t=t: reader.read_tensor(t)) for t in ckpt.tensors]
        objects = [ObjectIn(o.fqn, reader.handles.read(o.file, o.offset, o.length)) for o in ckpt.objects if o.file]
        return write_dcp(tensors, objects, dst, ranks, dict(ckpt.planner_data), force, verify, progress,
                         ckpt.total_bytes)
    finally:
        reader.close()
