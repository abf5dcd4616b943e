"""Per-rank metric series in growing numpy buffers, and TensorBoard's debiased EMA smoothing."""

from __future__ import annotations

import itertools
import math

import numpy as np

FIELDS = ("step", "time", "loss", "rss", "cuda_allocated", "cuda_reserved", "cuda_peak", "steps_per_s",
          "tokens_per_s", "lr")
COUNTS = frozenset(("step", "rss", "cuda_allocated", "cuda_reserved", "cuda_peak"))  # whole numbers (bytes, steps)


def field_text(name: str, value: float) -> str:
    """A metric as CSV writes it: empty when missing, a count as an integer (``30``, not ``30.0``)."""
    if value != value:
        return ""
    return str(int(value)) if name in COUNTS and float(value).is_integer() else repr(float(value))


class Series:
    """Append-only float64 columns for one rank; capacity doubles, so appends are amortised O(1)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.n = 0
        self.cols = {f: np.full(capacity, np.nan) for f in FIELDS}
        self.restarts: list[int] = []  # indices where the step went backwards (a resumed run)

    def __len__(self) -> int:
        return self.n

    def append(self, records: list[dict]) -> None:
        """Append metric records (dicts of step, time and values) as new rows."""
        self.append_columns(records_to_columns(records))

    def append_columns(self, cols: dict[str, np.ndarray]) -> None:
        """Append columns made by :func:`records_to_columns` (cheap: the per-record work is done)."""
        k = len(cols["step"])
        if not k:
            return
        need = self.n + k
        cap = len(self.cols["step"])
        if need > cap:
            new = max(need, 2 * cap)
            for f, col in self.cols.items():
                grown = np.full(new, np.nan)
                grown[: self.n] = col[: self.n]
                self.cols[f] = grown
        step = cols["step"]
        prev = np.concatenate(([self.cols["step"][self.n - 1] if self.n else np.nan], step[:-1]))
        back = np.nonzero(np.isfinite(prev) & np.isfinite(step) & (step < prev))[0]
        self.restarts.extend(int(self.n + i) for i in back)
        for f in FIELDS:
            self.cols[f][self.n:need] = cols[f]
        self.n = need

    def column(self, name: str) -> np.ndarray:
        """The filled part of column ``name`` (a view, not a copy)."""
        return self.cols[name][: self.n]


def records_to_columns(records: list[dict]) -> dict[str, np.ndarray]:
    """Metric records (dicts) as float columns, NaN where a record lacks a field (worker-side work)."""
    def num(v: object) -> float:
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else math.nan

    return {f: np.fromiter((num(r.get(f)) for r in records), np.float64, len(records)) for f in FIELDS}


def debiased_ema(values: np.ndarray, weight: float, state: tuple[float, int] = (0.0, 0)
                 ) -> tuple[np.ndarray, tuple[float, int]]:
    """TensorBoard's smoothing: ``last = last*w + (1-w)*x``, divided by ``1 - w**count``.

    NaNs are skipped (they keep the previous value). Vectorised in blocks; returns the smoothed values
    and the state to continue with on the next appended block (so live updates cost O(new points))."""
    x = np.asarray(values, np.float64)
    out = np.empty_like(x)
    last, count = state
    if weight <= 0:
        out[:] = x
        return out, (float(x[-1]) if len(x) else last, count + len(x))
    w = min(weight, 0.999999)
    block = int(max(1, min(4096, 12 / -math.log10(w))))
    j = np.arange(block, dtype=np.float64)
    pw = w ** (j + 1)
    inv = w ** (-j)
    for a in range(0, len(x), block):
        xb = x[a:a + block]
        k = len(xb)
        finite = np.isfinite(xb)
        if not finite.all():  # rare: fall back to the loop for blocks with gaps
            for i in range(k):
                if finite[i]:
                    last = last * w + (1 - w) * xb[i]
                    count += 1
                out[a + i] = last / (1 - w ** count) if count else np.nan
            continue
        acc = np.cumsum(xb * inv[:k]) * (w ** j[:k])
        raw = pw[:k] * last + (1 - w) * acc
        counts = count + np.arange(1, k + 1)
        out[a:a + k] = raw / (1 - w ** counts)
        last = float(raw[-1])
        count += k
    return out, (last, count)


def superseded(step: np.ndarray, restarts: list[int]) -> np.ndarray:
    """True for the points a later segment replaced: an earlier segment's steps at or after the step where
    a later segment (a resume from an older checkpoint) began."""
    out = np.zeros(len(step), bool)
    bounds = [0, *restarts, len(step)]
    later = math.inf
    for a, b in reversed(list(itertools.pairwise(bounds))):
        if b <= a:
            continue
        if later < math.inf:
            out[a:b] = step[a:b] >= later
        first = step[a]
        if math.isfinite(first):
            later = min(later, float(first))
    return out


def smooth_segments(values: np.ndarray, weight: float, state: tuple[float, int], start: int,
                    restarts: list[int]) -> tuple[np.ndarray, tuple[float, int]]:
    """:func:`debiased_ema` of ``values`` (which begin at index ``start`` of the series), starting
    afresh at every restart: a resumed run is smoothed on its own, not from the old run's tail."""
    cuts = [r - start for r in restarts if start < r < start + len(values)]
    if start in restarts:
        state = (0.0, 0)
    if not cuts:
        return debiased_ema(values, weight, state)
    parts = []
    bounds = [0, *cuts, len(values)]
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        out, state = debiased_ema(values[a:b], weight, state if i == 0 else (0.0, 0))
        parts.append(out)
    return np.concatenate(parts), state


BLOCK = 256



def row_min_max(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's min and max ignoring NaN; NaN for a row of NaN only (a loss that blew up), without
    numpy's "All-NaN slice" warning."""
    if not np.isnan(rows).any():
        return rows.min(axis=1), rows.max(axis=1)
    some = ~np.isnan(rows).all(axis=1)
    lo, hi = np.full(len(rows), np.nan), np.full(len(rows), np.nan)
    if some.any():
        lo[some], hi[some] = np.nanmin(rows[some], axis=1), np.nanmax(rows[some], axis=1)
    return lo, hi


class PeakBlocks:
    """Min and max of every 256 points of a growing array, updated as points arrive, so a view of a
    million points becomes ~8,000 plotted points without rescanning the data each frame."""

    def __init__(self) -> None:
        self.mins = np.zeros(0)
        self.maxs = np.zeros(0)
        self.n = 0  # points covered by complete blocks

    def update(self, y: np.ndarray) -> None:
        """Add the min and max of each newly completed 256-point block of ``y``; start over if ``y`` shrank."""
        full = (len(y) // BLOCK) * BLOCK
        if full < self.n:  # the data was replaced (smoothing weight changed): start over
            self.mins, self.maxs, self.n = np.zeros(0), np.zeros(0), 0
        if full > self.n:
            chunk = y[self.n:full].reshape(-1, BLOCK)
            lo, hi = row_min_max(chunk)
            self.mins = np.concatenate([self.mins, lo])
            self.maxs = np.concatenate([self.maxs, hi])
            self.n = full


def _peaks(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.repeat(x, 2), np.column_stack([lo, hi]).ravel()


def peak_view(x: np.ndarray, y: np.ndarray, blocks: PeakBlocks | None, x_range: tuple[float, float] | None,
              buckets: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    """At most about ``2 * buckets`` points showing every min and max of ``y`` over the visible
    part of ``x`` (all of it when ``x_range`` is None). ``x`` must be ascending."""
    n = len(y)
    i0, i1 = 0, n
    if x_range is not None and n:
        i0 = max(0, int(np.searchsorted(x, x_range[0], "left")) - 1)
        i1 = min(n, int(np.searchsorted(x, x_range[1], "right")) + 1)
    count = i1 - i0
    if count <= 2 * buckets:
        return x[i0:i1], y[i0:i1]
    if blocks is not None and i0 == 0 and count // BLOCK >= buckets:
        nb = min(len(blocks.mins), i1 // BLOCK)
        g = -(-nb // buckets)
        m = (nb // g) * g
        lo = blocks.mins[:m].reshape(-1, g).min(axis=1)
        hi = blocks.maxs[:m].reshape(-1, g).max(axis=1)
        xs = x[: m * BLOCK: g * BLOCK]
        px, py = _peaks(xs, lo, hi)
        rest = m * BLOCK  # the tail not in a complete group of blocks: from the raw points
        if rest < i1:
            tx, ty = peak_view(x[rest:i1], y[rest:i1], None, None, max(8, buckets // 50))
            px, py = np.concatenate([px, tx]), np.concatenate([py, ty])
        return px, py
    b = -(-count // buckets)
    m = (count // b) * b
    seg = y[i0:i0 + m].reshape(-1, b)
    lo, hi = row_min_max(seg)
    px, py = _peaks(x[i0:i0 + m:b], lo, hi)
    if m < count:
        px, py = np.concatenate([px, x[i0 + m:i1]]), np.concatenate([py, y[i0 + m:i1]])
    return px, py
