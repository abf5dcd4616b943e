"""One index of a stacked source tensor (one expert of torchtitan's ``[E, ...]`` experts, one layer of Megatron's
stacked layers) read from only the chunks that hold it, each chunk read once (its stored CRC32s checked) however many
outputs take an index of it: a stacked tensor saved as one chunk is read once for its E outputs, not E times, and
kept only until its last output has been made; one saved in per-layer or per-rank chunks is read chunk by chunk."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from ..checkpoint.chunks import ChunkReader, torch_dtype
from ..checkpoint.layout import coverage
from ..checkpoint.model import Chunk, TensorEntry
from ..errors import CheckpointError
from .plan import ExportItem


def stacked_index(item: ExportItem) -> int | None:
    """The index of the stacked first dimension the item's transform starts with (None: it takes the whole
    source tensor)."""
    steps = item.transform.steps if item.transform is not None else ()
    return steps[0].args[0] if steps and steps[0].op == "index" else None


def _holds(chunk: Chunk, i: int) -> bool:
    return bool(chunk.sizes) and chunk.offsets[0] <= i < chunk.offsets[0] + chunk.sizes[0]


class StackedReads:
    """Chunks shared by several outputs' indices, read once and dropped after their last use."""

    def __init__(self, reader: ChunkReader, items: list[ExportItem]) -> None:
        self.reader = reader
        self._left: Counter[tuple[str, int]] = Counter()
        for it in items:
            i = stacked_index(it)
            if i is not None:
                self._left.update((it.entry.fqn, n) for n, c in enumerate(it.entry.chunks) if _holds(c, i))
        self._values: dict[tuple[str, int], Any] = {}
        self._locks: dict[tuple[str, int], threading.Lock] = {k: threading.Lock() for k in self._left}
        self._lock = threading.Lock()

    def row(self, entry: TensorEntry, i: int) -> Any:
        """``entry[i]`` assembled from the chunks that hold row ``i``."""
        import torch

        if not coverage(self.reader.ckpt, entry).exact:  # the chunks tile the tensor: those holding row i tile it
            raise CheckpointError(f"{self.reader.ckpt.path}: the chunks of {entry.fqn} do not tile its shape "
                                  f"{list(entry.shape)} (see `shardscope verify`), so its values cannot be "
                                  "assembled.", path=self.reader.ckpt.path, fqn=entry.fqn)
        out = torch.empty(entry.shape[1:], dtype=torch_dtype(entry.dtype))
        for n, c in enumerate(entry.chunks):
            if _holds(c, i):
                part = self._chunk(entry, n, c)[i - c.offsets[0]]
                out[tuple(slice(o, o + s) for o, s in zip(c.offsets[1:], c.sizes[1:], strict=True))].copy_(part)
        return out

    def _chunk(self, entry: TensorEntry, n: int, c: Chunk) -> Any:
        key = (entry.fqn, n)
        lock = self._locks.get(key)
        if lock is None:  # an index no planned item takes: read, not kept
            return self.reader.read_chunk(entry.fqn, c, entry.dtype)
        with lock:
            value = self._values.get(key)
            if value is None:
                value = self.reader.read_chunk(entry.fqn, c, entry.dtype)
            with self._lock:
                self._left[key] -= 1
                if self._left[key] > 0:
                    self._values[key] = value
                else:
                    self._values.pop(key, None)
            return value


__all__ = ["StackedReads", "stacked_index"]
