"""The one way plots are made here: pyqtgraph widgets in the window's palette, with axes that never
print an SI multiplier, and an integer axis that labels categories (ranks, tensors) only where they fit."""

from __future__ import annotations

import math
from collections.abc import Callable

import pyqtgraph as pg
from PySide6.QtGui import QFontMetrics, QGuiApplication

LABEL_LINES = 1.5  # a value axis's labels are at least this many text lines apart (up the axis)


def themed_plot(**axis_items: pg.AxisItem) -> pg.PlotWidget:
    """A PlotWidget coloured by the palette (dark or light); axes without auto SI prefixes, the left one with
    labels that never run together (:class:`ValueAxis`) unless ``axis_items`` gives another."""
    w = pg.PlotWidget(axisItems={"left": ValueAxis("left"), **axis_items})
    pal = QGuiApplication.palette()
    w.setBackground(pal.base().color())
    for axis in ("left", "bottom"):
        ax = w.getAxis(axis)
        ax.setTextPen(pal.text().color())
        ax.setPen(pal.mid().color())
        ax.enableAutoSIPrefix(False)
    return w


class ValueAxis(pg.AxisItem):
    """A vertical value axis with a label every LABEL_LINES text lines at least. NOTE: pyqtgraph asks for 2.25
    intervals whatever the height, so a 50 px memory plot labelled 330, 332, ... 338 one over the other."""

    def __init__(self, orientation: str, **kwargs) -> None:
        super().__init__(orientation, **kwargs)
        self.setStyle(maxTextLevel=0)  # minor ticks are marks only: the labels are spaced here
        self.enableAutoSIPrefix(False)

    def tickStrings(self, values: list[float], scale: float, spacing: float) -> list[str]:
        """Values of 10,000 and more in thousands or millions ("50k", "1.25M"): a throughput axis labelled 50000
        was wider than its room and touched its title at 1280x720."""
        top = max((abs(v * scale) for v in values), default=0.0)
        if top < 10_000 or spacing <= 0:
            return super().tickStrings(values, scale, spacing)
        unit, suffix = next((u, s) for u, s in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")) if top >= u)
        step = spacing * scale / unit
        digits = next(d for d in range(7) if d == 6 or abs(round(step, d) - step) <= 1e-9 * step)
        return [f"{v * scale / unit:.{digits}f}{suffix}" if v else "0" for v in values]

    def tickSpacing(self, minVal: float, maxVal: float, size: float):
        levels = super().tickSpacing(minVal, maxVal, size)
        span = abs(maxVal - minVal)
        if not levels or size <= 0 or span == 0:
            return levels
        font = self.style.get("tickFont") or QGuiApplication.font()
        room = QFontMetrics(font).height() * LABEL_LINES  # pixels each label needs up the axis
        major = max(levels[0][0], nice_spacing(span * room / size))
        if major == levels[0][0]:
            return levels
        return [(major, 0.0), (major / 5, 0.0)]


def nice_spacing(raw: float) -> float:
    """The smallest of ..., 0.1, 0.2, 0.5, 1, 2, 5, 10, ... at least ``raw`` (> 0)."""
    base = 10.0 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw * (1 - 1e-9))


def nice_step(raw: float) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... at least ``raw``."""
    if raw <= 1:
        return 1
    base = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * base >= raw:
            return int(m * base)
    return int(10 * base)


class CategoryAxis(pg.AxisItem):
    """Ticks at whole numbers only (one per category), spaced so that labels never run together:
    each label gets ``min_pixels`` (its text width across, or a line height along a vertical axis)."""

    def __init__(self, orientation: str, label_of: Callable[[int], str] | None = None, **kwargs) -> None:
        super().__init__(orientation, **kwargs)
        self.label_of = label_of or str
        self.count = 0
        self.min_pixels = 24.0
        self.enableAutoSIPrefix(False)

    def set_categories(self, count: int, label_of: Callable[[int], str], min_pixels: float) -> None:
        self.count, self.label_of, self.min_pixels = count, label_of, min_pixels
        self.picture = None
        self.update()

    def tickSpacing(self, minVal: float, maxVal: float, size: float):
        if size <= 0:
            return [(1.0, 0.0)]
        step = nice_step((maxVal - minVal) * self.min_pixels / size)
        return [(float(step), 0.0)]

    def tickValues(self, minVal: float, maxVal: float, size: float):
        """Pyqtgraph's ticks, without those whose label would stick out past either end of the axis."""
        levels = super().tickValues(minVal, maxVal, size)
        lo, hi = sorted((minVal, maxVal))  # NOTE: an inverted axis (heat map rows) passes them reversed
        if size <= 0 or hi <= lo:
            return levels
        margin = (hi - lo) * (self.min_pixels / 2) / size
        return [(sp, [v for v in vals if lo + margin <= v <= hi - margin]) for sp, vals in levels]

    def tickStrings(self, values, scale, spacing):
        out = []
        for v in values:
            i = round(v)
            out.append(self.label_of(i) if abs(v - i) < 1e-6 and 0 <= i < self.count else "")
        return out
