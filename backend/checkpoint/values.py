"""Tensor values: one tensor assembled from its chunks (memory bounded by that tensor),
non-tensor entries and ``meta.pt`` decoded only through ``torch.load(weights_only=True)``,
and value statistics."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..progress import Progress
from .items import StoredTensor, stored_tensor
from .model import FLOAT_DTYPES, Checkpoint, Chunk, ObjectEntry, TensorEntry
from .storage import handles_for


def torch_dtype(name: str) -> Any:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"dtype {name} is not known to this torch ({torch.__version__}).")
    return dt


class ChunkReader:
    """Reads chunk values of one checkpoint; keeps files open and caches safetensors headers."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self.handles = handles_for(ckpt.path)
        self._blobs: dict = {}

    def close(self) -> None:
        self.handles.close()

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _where(self, fqn: str, chunk: Chunk) -> str:
        return f"{self.handles.where(chunk.file)} (tensor {fqn}, chunk at offsets {list(chunk.offsets)})"

    def locate(self, fqn: str, chunk: Chunk) -> StoredTensor | None:
        """Where a chunk's values are; None if the item needs the generic (torch.load) path."""
        if not chunk.file:
            raise CheckpointError(f"{fqn}: chunk at offsets {list(chunk.offsets)} has no storage entry.", fqn=fqn)
        if self.ckpt.format == "hf-safetensors":  # the chunk's byte range is the raw data itself
            return StoredTensor(self.ckpt.tensor(fqn).dtype, tuple(chunk.sizes), _contiguous_stride(chunk.sizes),
                                0, chunk.offset, chunk.length, None)
        try:
            return stored_tensor(self.handles, chunk.file, chunk.offset, chunk.length, fqn, self._blobs)
        except CheckpointError:
            raise
        except (ValueError, KeyError, IndexError, TypeError, EOFError, Exception) as exc:
            if isinstance(exc, (MemoryError, KeyboardInterrupt)):
                raise
            return None

    def read_chunk(self, fqn: str, chunk: Chunk, dtype: str) -> Any:
        """The chunk as a torch tensor of ``chunk.sizes``, validated against the metadata."""
        try:
            return self._read_chunk(fqn, chunk, dtype)
        except CheckpointError as exc:
            if exc.fqn:
                raise
            raise CheckpointError(f"{exc} (tensor {fqn}, chunk at offsets {list(chunk.offsets)})",
                                  path=exc.path, fqn=fqn) from None

    def _read_chunk(self, fqn: str, chunk: Chunk, dtype: str) -> Any:
        import torch

        st = self.locate(fqn, chunk)
        if st is None:
            tensor = self._generic(fqn, chunk)
        else:
            if st.dtype != dtype:
                raise CheckpointError(f"{self._where(fqn, chunk)}: item holds {st.dtype}, metadata says {dtype}.",
                                      fqn=fqn, path=chunk.file)
            elem = torch.empty((), dtype=torch_dtype(dtype)).element_size()
            need = (st.storage_offset + _span(st.shape, st.stride)) * elem
            if need > st.nbytes:
                raise CheckpointError(f"{self._where(fqn, chunk)}: item storage is shorter than its view.",
                                      fqn=fqn, path=chunk.file)
            buf = bytearray(st.nbytes)
            if st.nbytes:
                self.handles.readinto(chunk.file, st.data_offset, memoryview(buf))
                flat = torch.frombuffer(buf, dtype=torch_dtype(dtype))
                tensor = flat.as_strided(st.shape, st.stride, st.storage_offset)
            else:
                tensor = torch.empty(st.shape, dtype=torch_dtype(dtype))
        if tuple(tensor.shape) != tuple(chunk.sizes):
            raise CheckpointError(f"{self._where(fqn, chunk)}: item has shape {list(tensor.shape)}, metadata says "
                                  f"{list(chunk.sizes)}.", fqn=fqn, path=chunk.file)
        return tensor

    def _generic(self, fqn: str, chunk: Chunk) -> Any:
        import torch

        data = self.handles.read(chunk.file, chunk.offset, chunk.length)
        try:
            t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"{self._where(fqn, chunk)}: item cannot be decoded "
                                  f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}).",
                                  fqn=fqn, path=chunk.file) from None
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{self._where(fqn, chunk)}: item is not a tensor.", fqn=fqn, path=chunk.file)
        return t

    def read_tensor(self, entry: TensorEntry, progress: Progress | None = None) -> Any:
        """The whole tensor assembled from its chunks (reads only this tensor's items)."""
        import torch

        out = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
        chunks = entry.chunks
        if progress:
            progress.start(len(chunks), f"reading {entry.fqn}")
        for c in chunks:
            t = self.read_chunk(entry.fqn, c, entry.dtype)
            region = out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))]
            region.copy_(t)
            if progress:
                progress.advance(1)
        return out

    def read_object(self, obj: ObjectEntry) -> Any:
        """A non-tensor entry, decoded with ``weights_only=True`` (refuses arbitrary objects)."""
        import torch

        if obj.file is None:
            raise CheckpointError(f"{obj.fqn}: no storage entry in the metadata.", fqn=obj.fqn)
        try:
            data = self.handles.read(obj.file, obj.offset, obj.length)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} (entry {obj.fqn})", path=exc.path, fqn=obj.fqn) from None
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"{self.handles.where(obj.file)} (entry {obj.fqn}): cannot be decoded safely "
                f"({str(exc).splitlines()[0][:200]}).", fqn=obj.fqn, path=obj.file) from None


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))


def read_tensor(ckpt: Checkpoint, fqn: str, progress: Progress | None = None) -> Any:
    with ChunkReader(ckpt) as reader:
        return reader.read_tensor(ckpt.tensor(fqn), progress)


def read_lightning_meta(ckpt: Checkpoint) -> dict[str, Any]:
    """The ``meta.pt`` of a Lightning/Fabric folder, loaded with ``weights_only=True``."""
    import torch

    name = ckpt.extra_files.get("meta.pt")
    if not name:
        return {}
    with handles_for(ckpt.path) as handles:
        path = handles.where(name)
        info = next((f for f in ckpt.files if f.name == name), None)
        size = info.bytes if info is not None and info.bytes is not None else handles.size(name)
        data = handles.read(name, 0, size)
    try:
        meta = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot be loaded safely ({str(exc).splitlines()[0][:200]}).",
                              path=path) from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: does not hold a dict.", path=path)
    return meta


def small_value_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class TensorStats:
    numel: int
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    nan: int
    inf: int
    zeros: int
    hist_counts: list[int] = field(default_factory=list)
    hist_edges: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("numel", "min", "max", "mean", "std", "nan", "inf", "zeros",
                                              "hist_counts", "hist_edges")}


def tensor_stats(tensor: Any, bins: int = 64, progress: Progress | None = None) -> TensorStats:
    """min/max/mean/std over finite values, NaN/Inf counts and a histogram, in float64 blocks."""
    import torch

    flat = tensor.reshape(-1)
    if flat.dtype.is_complex:
        flat = flat.abs()
    n = flat.numel()
    block = 1 << 22
    nan = inf = zeros = finite = 0
    s = s2 = 0.0
    lo, hi = math.inf, -math.inf
    blocks = range(0, n, block)
    for start in blocks:
        x = flat[start:start + block].to(torch.float64)
        isnan = torch.isnan(x)
        isinf = torch.isinf(x)
        nan += int(isnan.sum())
        inf += int(isinf.sum())
        zeros += int((x == 0).sum())
        x = x[~(isnan | isinf)]
        if x.numel():
            finite += x.numel()
            s += float(x.sum())
            s2 += float((x * x).sum())
            lo = min(lo, float(x.min()))
            hi = max(hi, float(x.max()))
        if progress:
            progress.check()
    if finite == 0:
        return TensorStats(n, None, None, None, None, nan, inf, zeros)
    mean = s / finite
    # second pass for a numerically sound std and the histogram
    ss = 0.0
    edges = np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)
    counts = np.zeros(bins, np.int64)
    for start in blocks:
        x = flat[start:start + block].to(torch.float64)
        x = x[torch.isfinite(x)]
        if x.numel():
            ss += float(((x - mean) ** 2).sum())
            counts += np.histogram(x.numpy(), bins=edges)[0]
        if progress:
            progress.check()
    std = math.sqrt(ss / (finite - 1)) if finite > 1 else 0.0
    return TensorStats(n, lo, hi, mean, std, nan, inf, zeros, counts.tolist(), edges.tolist())


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES
