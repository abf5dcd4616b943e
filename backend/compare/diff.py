"""``diff A B``: which entries exist on one side only, which changed dtype, shape, layout or values,
and by how much. Tensor pairs are streamed by one reader thread per side (:mod:`.streams`), a few windows in memory;
other pairs are compared one pair in memory at a time."""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint.chunks import torch_dtype
from ..checkpoint.seal import unchanged_manifest
from ..checkpoint.sources import CheckpointSource, EntryInfo, Source, tensor_windows
from ..checkpoint.values import finite_histogram
from ..errors import CheckpointError
from ..progress import Progress
from .pairing import Pairing, pair_names, source_layout
from .streams import Streams

BLOCK = 1 << 22


@dataclass
class Change:
    """One entry that differs between A and B, and how. ``fqn`` is the name shown for the pair; ``fqn_a`` and
    ``fqn_b`` are the names in each side ('' for a side that does not hold it)."""
    fqn: str
    kind: str  # values, dtype, shape, layout, unreadable
    max_abs_diff: float | None = None
    rel_l2: float | None = None
    frac_changed: float | None = None
    detail: str = ""  # dtype/shape: both sides; unreadable: why, naming the file and entry
    fqn_a: str | None = None
    fqn_b: str | None = None
    side: str = ""  # unreadable: "A", "B" or "A and B"

    def __post_init__(self) -> None:
        self.fqn_a = self.fqn if self.fqn_a is None else self.fqn_a
        self.fqn_b = self.fqn if self.fqn_b is None else self.fqn_b

    def to_json(self) -> dict[str, Any]:
        """The change as a JSON-ready dict: names, kind and how much the values differ."""
        out = {"fqn": self.fqn, "fqn_a": self.fqn_a, "fqn_b": self.fqn_b, "kind": self.kind,
               "max_abs_diff": self.max_abs_diff, "rel_l2": self.rel_l2, "frac_changed": self.frac_changed,
               "detail": self.detail}
        if self.kind == "unreadable":
            out["side"] = self.side
        return out


@dataclass
class DiffResult:
    """Everything ``diff`` found: entries on one side only, changed entries, entries that could not be read
    (the rest is still compared), the unchanged count and how names were paired."""
    a: str
    b: str
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    changed: list[Change] = field(default_factory=list)
    unchanged: int = 0
    unreadable: list[Change] = field(default_factory=list)
    pairing: Pairing | None = None
    left_out: tuple[int, int] | None = None  # entries of A and B that are not model weights, when only those are
    by_digest: int = 0  # of the unchanged: tensor pairs whose sealed digests are equal, no byte of them read

    @property
    def differs(self) -> bool:
        """True when anything but the layout differs among what could be read (as cmp has it)."""
        return bool(self.only_a or self.only_b or any(c.kind != "layout" for c in self.changed))

    def to_json(self) -> dict[str, Any]:
        """The whole comparison as a JSON-ready dict: entries only in A, only in B, changed, unreadable,
        unchanged, and the pairing rule."""
        return {"only_a": self.only_a, "only_b": self.only_b, "changed": [c.to_json() for c in self.changed],
                "unreadable": [c.to_json() for c in self.unreadable], "unchanged": self.unchanged,
                "unchanged_by_digest": self.by_digest, "pairing": self.pairing.to_json() if self.pairing else None,
                "not_weights": list(self.left_out) if self.left_out else None}


class BlockStats:
    """The statistics of :func:`value_change`, one block of elements at a time: each block's part is kept and
    folded in block order, so blocks read out of order (a prefix read again) give the same floats."""

    def __init__(self) -> None:
        self.blocks: list[tuple[int, float | None, bool, float, float]] = []

    def measure(self, x: Any, y: Any) -> tuple[int, float | None, bool, float, float]:
        """One block's part: elements changed, max |a-b| of the finite differences (None: none finite), whether
        some difference is not finite, sum of the squared finite differences, sum of a's finite squares."""
        import torch

        # NOTE: the same floats as the plain formulas (:meth:`_plain`, kept for complex values): masks are taken
        # only when something is not finite (a reduction over the same values in the same order gives the same
        # sum), NaN and equality tests are exact in a float dtype, so they run there, and temporaries are reused
        if x.is_complex():  # widened as before (to float64: the real part)
            return self._plain(x.to(torch.float64), y.to(torch.float64))
        floating = x.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        if not floating and x.is_floating_point():  # float8 and the like: compared widened, as before
            return self._plain(x.to(torch.float64), y.to(torch.float64))
        xd = x.to(torch.float64)
        owned = xd.data_ptr() != x.data_ptr()  # a new tensor: may be changed in place
        x_fin = not floating or _finite(x)
        all_fin = x_fin and (not floating or _finite(y))
        both_nan = None
        if not all_fin and bool(torch.isnan(x).any()) and bool(torch.isnan(y).any()):
            both_nan = torch.isnan(x) & torch.isnan(y)
            if not bool(both_nan.any()):
                both_nan = None
        if floating:
            ne = x != y
            d = y.to(torch.float64, copy=True)
        else:  # an int64 beyond 2**53 compares as its float64, as before
            d = y.to(torch.float64)
            ne = xd != d
        if both_nan is not None:
            ne &= ~both_nan
        changed = int(torch.count_nonzero(ne))
        del ne
        torch.sub(xd, d, out=d)  # x - y in float64, into y's widened copy
        if both_nan is not None:
            d.masked_fill_(both_nan, 0.0)
        del both_nan
        lo, hi = (float(v) for v in torch.aminmax(d))  # NaN if any is NaN
        top: float | None
        if math.isfinite(lo) and math.isfinite(hi):
            top, inf, d2 = max(abs(lo), abs(hi)), False, float(d.square_().sum())
        else:
            df = d[torch.isfinite(d)]
            top = float(df.abs().max()) if df.numel() else None
            inf, d2 = True, float((df ** 2).sum())
        del d
        if x_fin:
            a2 = float((xd.square_() if owned else xd ** 2).sum())
        else:
            a2 = float((xd[torch.isfinite(x)] ** 2).sum())
        return changed, top, inf, d2, a2

    @staticmethod
    def _plain(x: Any, y: Any) -> tuple[int, float | None, bool, float, float]:
        import torch

        both_nan = torch.isnan(x) & torch.isnan(y)
        ne = (x != y) & ~both_nan
        changed = int(ne.sum())
        d = torch.where(both_nan, torch.zeros_like(x), x - y)
        finite = torch.isfinite(d)
        top = float(d[finite].abs().max()) if bool(finite.any()) else None
        inf = not bool(finite.all())
        d2 = float((d[finite] ** 2).sum())
        xf = x[torch.isfinite(x)]
        return changed, top, inf, d2, float((xf ** 2).sum())

    def add(self, x: Any, y: Any) -> None:
        """Measure the next block (flat tensors of one dtype and length)."""
        self.blocks.append(self.measure(x, y))

    def result(self, numel: int) -> tuple[float, float, float]:
        """(max |a-b|, ||a-b|| / ||a||, fraction changed) over the blocks in order."""
        max_abs = 0.0
        d2 = a2 = 0.0
        changed = 0
        for n, top, inf, bd2, ba2 in self.blocks:
            changed += n
            if top is not None:
                max_abs = max(max_abs, top)
            if inf:
                max_abs = math.inf
            d2 += bd2
            a2 += ba2
        if changed == 0:  # differs only in the bit patterns of NaNs or signed zeros
            return 0.0, 0.0, 0.0
        rel = math.sqrt(d2) / math.sqrt(a2) if a2 > 0 else (0.0 if d2 == 0 else math.inf)
        return max_abs, rel, changed / numel


def _finite(t: Any) -> bool:
    """Every element of a float tensor finite (its min and max are: they are NaN when one is NaN); one pass, no
    mask."""
    import torch

    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def value_change(a: Any, b: Any) -> tuple[float, float, float] | None:
    """(max |a-b|, ||a-b|| / ||a||, fraction of elements that differ), or None when bit-identical.
    NaN equals NaN here; computed in float64 blocks of ``BLOCK`` elements."""
    import torch

    fa, fb = a.reshape(-1), b.reshape(-1)
    if fa.numel() == 0 or torch.equal(fa.contiguous().view(torch.uint8), fb.contiguous().view(torch.uint8)):
        return None
    stats = BlockStats()
    for s in range(0, fa.numel(), BLOCK):
        stats.add(fa[s:s + BLOCK], fb[s:s + BLOCK])
    return stats.result(fa.numel())


def _same_object(x: Any, y: Any) -> bool:
    import numpy as np
    import torch

    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype and \
            x.shape == y.shape and value_change(x, y) is None
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same_object(x[k], y[k]) for k in x)
    if isinstance(x, list | tuple) and isinstance(y, list | tuple):
        return len(x) == len(y) and all(_same_object(p, q) for p, q in zip(x, y, strict=True))
    if isinstance(x, io.BytesIO) and isinstance(y, io.BytesIO):  # compares by identity otherwise
        return x.getvalue() == y.getvalue()
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):  # a numpy RNG state: == is elementwise
        return isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.dtype == y.dtype and \
            x.shape == y.shape and bool(np.array_equal(x, y))
    return bool(x == y)


def unreadable_reason(exc: BaseException, fqn: str) -> str:
    """One line saying why entry ``fqn`` could not be read, naming the file and the entry."""
    if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
        text = f"{exc.filename}: {exc.strerror or exc}" if exc.filename else f"{exc.strerror or exc}"
    else:
        text = str(exc)
    text = " ".join(text.split())
    return text if fqn in text else f"{text} (entry {fqn})"


def _read_both(read_a: Callable[[str], Any], read_b: Callable[[str], Any], key: str, na: str, nb: str
               ) -> tuple[Any, Any, Change | None]:
    """Both sides' values of one pair, or a Change of kind ``unreadable`` saying which side failed and why.
    NOTE: only bad input is caught (CheckpointError, OSError); Cancelled and bugs go up as they are."""
    values, reasons, sides = [], [], []
    for side, read, name in (("A", read_a, na), ("B", read_b, nb)):
        try:
            values.append(read(name))
        except (CheckpointError, OSError) as exc:
            values.append(None)
            reasons.append(unreadable_reason(exc, name))
            sides.append(side)
    if not sides:
        return values[0], values[1], None
    detail = reasons[0] if len(reasons) == 1 else f"A: {reasons[0]}; B: {reasons[1]}"
    return None, None, Change(key, "unreadable", detail=detail, fqn_a=na, fqn_b=nb, side=" and ".join(sides))


def _compare_pair(a: Source, b: Source, key: str, na: str, nb: str, x: EntryInfo, y: EntryInfo) -> Change | None:
    """How one paired entry differs (None: it does not)."""
    def change(kind: str, max_abs: float | None = None, rel: float | None = None, frac: float | None = None,
               detail: str = "") -> Change:
        return Change(key, kind, max_abs, rel, frac, detail=detail, fqn_a=na, fqn_b=nb)

    if x.kind != y.kind:
        return change("shape", detail=f"{x.kind} vs {y.kind}")
    if x.kind == "object":
        va, vb, bad = _read_both(a.object, b.object, key, na, nb)
        return bad or (None if _same_object(va, vb) else change("values", detail="non-tensor value"))
    if x.dtype != y.dtype:
        return change("dtype", detail=f"{x.dtype} vs {y.dtype}")
    if x.shape != y.shape:
        return change("shape", detail=f"{list(x.shape or ())} vs {list(y.shape or ())}")
    ta, tb, bad = _read_both(a.tensor, b.tensor, key, na, nb)
    if bad:
        return bad
    ch = value_change(ta, tb)
    del ta, tb  # one tensor pair in memory at a time
    if ch is not None:
        return change("values", *ch)
    if x.layout is not None and y.layout is not None and x.layout != y.layout:
        return change("layout", detail=f"{len(x.layout)} vs {len(y.layout)} chunks")
    return None


def _streamable(a: Source, b: Source, x: EntryInfo, y: EntryInfo) -> bool:
    """A tensor pair the reader threads compare: same dtype and shape, values to read, both sides read through
    a chunk reader."""
    return isinstance(a, CheckpointSource) and isinstance(b, CheckpointSource) and x.kind == y.kind == "tensor" \
        and x.dtype == y.dtype and x.shape == y.shape and x.shape is not None and math.prod(x.shape) > 0


def same_bytes(x: memoryview, y: memoryview) -> bool:
    """True when two equally long buffers hold the same bytes (numpy, 8 bytes at a time, the GIL released)."""
    import numpy as np

    n = len(x) // 8 * 8
    return bool(np.array_equal(np.frombuffer(x, np.uint64, n // 8), np.frombuffer(y, np.uint64, n // 8))) and \
        x[n:] == y[n:]


def _compare_streamed(streams: Streams, a: Source, b: Source, key: str, na: str, nb: str, x: EntryInfo,
                      y: EntryInfo) -> Change | None:
    """How one tensor pair differs, from the windows the reader threads hand over: byte comparison until the
    first window that differs, then :class:`BlockStats` over it and every later window (the windows are
    ``value_change``'s blocks, so the numbers are the same). A window of A before the first difference is read
    again for its share of ||a|| (only then, and without the CRC32s already checked). A pair a side could not
    read is compared the one-pair-in-memory way, which says what failed exactly as before."""
    import torch

    assert isinstance(a, CheckpointSource)
    try:
        dtype = torch_dtype(x.dtype or "")
    except CheckpointError:  # the readers fail on it too
        for _ in streams.windows():
            pass
        return _compare_pair(a, b, key, na, nb, x, y)
    stats: BlockStats | None = None
    first = 0
    for wa, wb in streams.windows():
        if stats is None and same_bytes(wa, wb):
            first += 1
            continue
        if stats is None:
            stats = BlockStats()
        stats.add(torch.frombuffer(wa, dtype=dtype), torch.frombuffer(wb, dtype=dtype))
    if any(streams.errors):
        return _compare_pair(a, b, key, na, nb, x, y)
    if stats is not None and first:
        prefix = BlockStats()
        buf: list[bytearray] = []

        def take(n: int) -> memoryview:
            if not buf or len(buf[0]) < n:
                buf[:] = [bytearray(n)]
            return memoryview(buf[0])[:n]

        try:
            for i, w in enumerate(tensor_windows(a, na, BLOCK, take, check=False)):
                if i == first:
                    break
                t = torch.frombuffer(w, dtype=dtype)
                prefix.add(t, t)  # bytes equal in B: the same floats value_change takes from both
        except (CheckpointError, OSError):
            return _compare_pair(a, b, key, na, nb, x, y)
        stats.blocks[:0] = prefix.blocks
    if stats is not None:
        return Change(key, "values", *stats.result(math.prod(x.shape or ())), fqn_a=na, fqn_b=nb)
    if x.layout is not None and y.layout is not None and x.layout != y.layout:
        return Change(key, "layout", detail=f"{len(x.layout)} vs {len(y.layout)} chunks", fqn_a=na, fqn_b=nb)
    return None


def diff(a: Source, b: Source, progress: Progress | None = None, exact_names: bool = False,
         only_weights: bool = False) -> DiffResult:
    """Compare two sources entry by entry. Names are paired as stored, or without a side's container prefix
    when that pairs more (see :mod:`.pairing`; ``exact_names`` turns that off). ``only_weights``: only the entries
    export takes as the model's weights on each side (its layout's :meth:`Layout.is_model`), so a checkpoint and
    its export compare equal. An entry that cannot be read is listed in ``unreadable`` and the rest is still
    compared.
    Tensor pairs of the same dtype and shape are read by one thread per side in windows of ``BLOCK`` elements
    (see :mod:`.streams`): both reads overlap, each byte is read once with its stored CRC32 checked in the same
    pass, and memory holds a few windows, not a tensor pair. Other pairs are compared one in memory at a time."""
    ea, eb = a.entries(), b.entries()
    layout_a, layout_b = source_layout(a), source_layout(b)
    left_out = None
    if only_weights:
        wa = {n: e for n, e in ea.items() if layout_a.is_model(n)}
        wb = {n: e for n, e in eb.items() if layout_b.is_model(n)}
        left_out, ea, eb = (len(ea) - len(wa), len(eb) - len(wb)), wa, wb
    pairing = pair_names(list(ea), list(eb), layout_a, layout_b, exact=exact_names)
    res = DiffResult(a.name, b.name, pairing.only_a, pairing.only_b, pairing=pairing, left_out=left_out)
    same = set(_same_digests(a, b, pairing))
    for key in same:  # sealed on both sides with equal digests: equal values, no byte read
        na, nb = pairing.pairs[key]
        x, y = ea[na], eb[nb]
        if x.layout is not None and y.layout is not None and x.layout != y.layout:
            res.changed.append(Change(key, "layout", detail=f"{len(x.layout)} vs {len(y.layout)} chunks",
                                      fqn_a=na, fqn_b=nb))
        else:
            res.unchanged += 1
    res.by_digest = len(same)
    todo = {k: p for k, p in pairing.pairs.items() if k not in same}
    streamed = [(na, nb) for na, nb in todo.values() if _streamable(a, b, ea[na], eb[nb])]
    keys = {k for k, (na, nb) in todo.items() if _streamable(a, b, ea[na], eb[nb])}
    if progress:
        progress.start(len(todo), "comparing")
    with contextlib.ExitStack() as stack:
        streams = stack.enter_context(Streams(a, b, streamed, BLOCK)) if streamed else None
        for key, (na, nb) in todo.items():
            if progress:
                progress.advance(1, key)
            if key in keys:
                assert streams is not None
                c = _compare_streamed(streams, a, b, key, na, nb, ea[na], eb[nb])
            else:
                c = _compare_pair(a, b, key, na, nb, ea[na], eb[nb])
            if c is None:
                res.unchanged += 1
            elif c.kind == "unreadable":
                res.unreadable.append(c)
            else:
                res.changed.append(c)
    order = {"shape": 0, "dtype": 1, "values": 2, "layout": 3}
    res.changed.sort(key=lambda c: (order[c.kind], -(c.rel_l2 if c.rel_l2 is not None and c.rel_l2 == c.rel_l2
                                                      else 0.0), c.fqn))
    return res


def _same_digests(a: Source, b: Source, pairing: Pairing) -> list[str]:
    """The paired tensors whose digests in both sides' manifests are equal (same dtype, shape and SHA-256 of
    their logical bytes), when both are sealed and unchanged since (:func:`.seal.unchanged_manifest`)."""
    if not isinstance(a, CheckpointSource) or not isinstance(b, CheckpointSource):
        return []
    ma = unchanged_manifest(a.ckpt)
    mb = unchanged_manifest(b.ckpt) if ma is not None else None
    if ma is None or mb is None:
        return []
    out = []
    for key, (na, nb) in pairing.pairs.items():
        ta, tb = ma.tensors.get(na), mb.tensors.get(nb)
        if ta is not None and tb is not None and (ta.dtype, ta.shape, ta.sha256) == (tb.dtype, tb.shape, tb.sha256):
            out.append(key)
    return out


@dataclass
class DifferenceDetail:
    """For one entry in both sources: the histogram of a - b (float64), for the Compare view."""

    fqn: str
    counts: list[int]
    edges: list[float]
    nonzero: int
    numel: int


def difference_histogram(a: Source, b: Source, fqn: str, bins: int = 64, progress: Progress | None = None,
                         fqn_b: str | None = None) -> DifferenceDetail:
    """The histogram of a - b of one entry in float64 blocks (the Compare view's detail); ``fqn_b`` is the
    entry's name in B when the names were paired without a container prefix."""
    import numpy as np
    import torch

    x = a.tensor(fqn).reshape(-1)
    y = b.tensor(fqn if fqn_b is None else fqn_b).reshape(-1)
    if x.shape != y.shape:
        return DifferenceDetail(fqn, [], [], 0, x.numel())

    def blocks() -> Any:
        for s in range(0, x.numel(), BLOCK):
            yield x[s:s + BLOCK].to(torch.float64) - y[s:s + BLOCK].to(torch.float64)

    lo, hi = math.inf, -math.inf
    for d in blocks():
        d = d[torch.isfinite(d)]
        if d.numel():
            lo, hi = min(lo, float(d.min())), max(hi, float(d.max()))
        if progress:
            progress.check()
    if lo > hi:
        return DifferenceDetail(fqn, [], [], 0, x.numel())
    nonzero = [0]

    def count_nonzero(d: Any) -> None:
        nonzero[0] += int((d != 0).sum())

    edges = np.linspace(lo, hi if hi > lo else lo + 1e-12, bins + 1)
    counts = finite_histogram(blocks, edges, progress, count_nonzero)
    return DifferenceDetail(fqn, counts.tolist(), edges.tolist(), nonzero[0], x.numel())
