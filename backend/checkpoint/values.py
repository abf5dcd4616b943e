"""Tensor values: value statistics of a tensor read through the chunk reader, and small values in words."""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..progress import Progress

BLOCK = 1 << 22  # elements per float64 block: statistics stay in bounded memory


def small_value_repr(value: Any, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters (an ``io.BytesIO`` by its bytes, not its address)."""
    if isinstance(value, io.BytesIO):
        data = value.getvalue()
        text = f"io.BytesIO of {len(data):,} bytes: {data[:limit]!r}"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class TensorStats:
    """Value statistics of one tensor (finite values only; NaN/Inf counted apart)."""
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
        """The statistics and histogram as a JSON-ready dict."""
        return {k: getattr(self, k) for k in ("numel", "min", "max", "mean", "std", "nan", "inf", "zeros",
                                              "hist_counts", "hist_edges")}


def float64_blocks(flat: Any) -> Iterator[Any]:
    """A flat tensor in float64 blocks of :data:`BLOCK` elements (complex: magnitudes)."""
    import torch

    if flat.dtype.is_complex:
        flat = flat.abs()
    for start in range(0, flat.numel(), BLOCK):
        yield flat[start:start + BLOCK].to(torch.float64)


def finite_histogram(blocks: Callable[[], Iterable[Any]], edges: np.ndarray, progress: Progress | None = None,
                     each: Callable[[Any], None] | None = None) -> np.ndarray:
    """Counts of the finite values of ``blocks()`` in the bins ``edges``; ``each`` sees every finite block."""
    import torch

    counts = np.zeros(len(edges) - 1, np.int64)
    for x in blocks():
        x = x[torch.isfinite(x)]
        if x.numel():
            if each is not None:
                each(x)
            counts += np.histogram(x.numpy(), bins=edges)[0]
        if progress:
            progress.check()
    return counts


def tensor_stats(tensor: Any, bins: int = 64, progress: Progress | None = None) -> TensorStats:
    """min/max/mean/std over finite values, NaN/Inf counts and a histogram, in float64 blocks."""
    import torch

    flat = tensor.reshape(-1)
    n = flat.numel()
    nan = inf = zeros = finite = 0
    s = 0.0
    lo, hi = math.inf, -math.inf
    for x in float64_blocks(flat):
        isnan, isinf = torch.isnan(x), torch.isinf(x)
        nan += int(isnan.sum())
        inf += int(isinf.sum())
        zeros += int((x == 0).sum())
        x = x[~(isnan | isinf)]
        if x.numel():
            finite += x.numel()
            s += float(x.sum())
            lo, hi = min(lo, float(x.min())), max(hi, float(x.max()))
        if progress:
            progress.check()
    if finite == 0:
        return TensorStats(n, None, None, None, None, nan, inf, zeros)
    mean = s / finite
    ss = [0.0]  # second pass: a numerically sound std, and the histogram

    def add_squares(x: Any) -> None:
        ss[0] += float(((x - mean) ** 2).sum())

    edges = np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)
    counts = finite_histogram(lambda: float64_blocks(flat), edges, progress, add_squares)
    std = math.sqrt(ss[0] / (finite - 1)) if finite > 1 else 0.0
    return TensorStats(n, lo, hi, mean, std, nan, inf, zeros, counts.tolist(), edges.tolist())
