"""The live plots of one run: loss per rank and mean (raw faint, smoothed on top), memory per rank,
throughput; plus any scalar log (TensorBoard, CSV) the run's folder holds. Everything is plotted
against the step, so a resumed run's segments keep their width; curves split where the step goes back."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QSlider, QSplitter, QVBoxLayout, QWidget
from shardscope.backend.runs.follow import RunFollower, is_rank
from shardscope.backend.runs.metrics import (
    PeakBlocks,
    Series,
    debiased_ema,
    peak_view,
    smooth_segments,
    superseded,
)

from .palette import rank_color
from .plot_style import themed_plot
from .workers import Worker, run_in_background

MIB = 2**-20
NO_STEPS = "No step reported yet"
BACKGROUND_POINTS = 200_000  # smoothing more points than this at once happens off the GUI thread
# memory curves: field -> (pen style, what the legend calls it)
MEMORY = {"rss": (Qt.PenStyle.SolidLine, "RSS"), "cuda_allocated": (Qt.PenStyle.DashLine, "CUDA allocated"),
          "cuda_reserved": (Qt.PenStyle.DotLine, "CUDA reserved"), "cuda_peak": (Qt.PenStyle.DashDotLine, "CUDA peak")}


def _plot(title: str, left: str) -> pg.PlotWidget:
    w = themed_plot()
    w.setTitle(title)
    w.setLabel("left", left)
    w.setLabel("bottom", "step")
    return w


def _curve(plot: pg.PlotWidget, color: QColor, width: float = 1.5,
           style: Qt.PenStyle = Qt.PenStyle.SolidLine) -> pg.PlotDataItem:
    item = plot.plot(pen=pg.mkPen(color, width=width, style=style))
    # NOTE: the data given here is already peak-downsampled to the visible range (peak_view): a few
    # thousand points whatever the run's length, so every min and max stays visible and frames stay cheap
    item.setSkipFiniteCheck(True)
    return item


def _masker(old: np.ndarray | None):
    """A function hiding (NaN) the points a later segment replaced; the identity for a run never resumed
    from an older checkpoint."""
    if old is None or not old.any():
        return lambda y: y
    return lambda y: np.where(old[: len(y)], np.nan, y)


def _swatch(color: QColor, text: str) -> str:
    return f"<span style='color:{color.name()}'>&#9632;</span>&nbsp;{text}"


class RunPlots(QWidget):
    """Loss, memory and throughput of one run. The legend is a line of text above the plots, never a
    box over the curves."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        bar = QHBoxLayout()
        bar.addWidget(QLabel("Smoothing"))
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setRange(0, 99)
        self.slider.setValue(60)
        self.slider.setMaximumWidth(200)
        self.slider_label = QLabel("0.60")
        bar.addWidget(self.slider)
        bar.addWidget(self.slider_label)
        bar.addStretch(1)
        self.png_button = QPushButton("Save PNG…")
        self.png_button.setToolTip("Save the plots as a PNG image")
        self.csv_button = QPushButton("Save CSV…")
        self.csv_button.setToolTip("Save every rank's metrics as CSV")
        bar.addWidget(self.png_button)
        bar.addWidget(self.csv_button)
        for b in (self.png_button, self.csv_button):
            b.setEnabled(False)
        layout.addLayout(bar)
        self.legend = QLabel()
        self.legend.setWordWrap(True)
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        layout.addWidget(self.legend)
        split = QSplitter(Qt.Orientation.Vertical)
        self.loss = _plot("loss", "loss")
        split.addWidget(self.loss)
        lower = self._lower = QSplitter(Qt.Orientation.Horizontal)
        self.memory = _plot("memory", "MiB")
        self.speed = _plot("throughput", "tokens/s")
        lower.addWidget(self.memory)
        lower.addWidget(self.speed)
        split.addWidget(lower)
        split.setSizes([400, 220])
        split.setChildrenCollapsible(False)
        layout.addWidget(split, 1)
        self.follower: RunFollower | None = None
        self.overlay: RunFollower | None = None
        self._curves: dict[tuple, pg.PlotDataItem] = {}
        self._smooth: dict[int, tuple[np.ndarray, tuple[float, int], int]] = {}
        self._restart_lines: list[pg.InfiniteLine] = []
        self._blocks: dict[tuple, PeakBlocks] = {}
        self._legend_keys: tuple = ()
        self._speed_seen = False
        self.speed.hide()
        self._dirty = False
        # NOTE: before a run's first step the plots showed empty 0-1 axes (0.1 ... 0.9 steps), as if that were data
        self.no_steps = pg.TextItem(NO_STEPS, color=QGuiApplication.palette().mid().color(), anchor=(0.5, 0.5))
        self.loss.addItem(self.no_steps, ignoreBounds=True)
        self.no_steps.setPos(0.5, 0.5)
        self.no_steps.hide()
        for plot in (self.loss, self.memory, self.speed):
            plot.getViewBox().sigXRangeChanged.connect(lambda *_a: self.mark_dirty())
        self._smooth_worker: Worker | None = None
        self.slider.valueChanged.connect(self._weight_changed)

    @property
    def weight(self) -> float:
        return self.slider.value() / 100

    def set_follower(self, follower: RunFollower | None) -> None:
        self.follower = follower
        for b in (self.png_button, self.csv_button):  # nothing to save before a run is shown
            b.setEnabled(follower is not None)
        for plot in (self.loss, self.memory, self.speed):
            plot.clear()
            # NOTE: the axes go back too: a run that logs no memory used to show the last run's ranges
            plot.setRange(xRange=(0, 1), yRange=(0, 1), padding=0)
            plot.enableAutoRange()
        self._curves.clear()
        self._smooth.clear()
        self._blocks.clear()
        self._restart_lines.clear()
        self._legend_keys = ()
        self.legend.clear()
        self._speed_seen = False
        self.speed.hide()  # shown once a series reports tokens/s (a script may never)
        self.loss.addItem(self.no_steps, ignoreBounds=True)  # plot.clear() took it out
        self.no_steps.setPos(0.5, 0.5)
        self.no_steps.setVisible(follower is not None)  # until the first step is drawn
        self._dirty = True

    def _set(self, key: tuple, plot: pg.PlotWidget, x: np.ndarray, y: np.ndarray, restarts: list[int],
             y_scale: float = 1.0) -> None:
        """Hand one curve its visible data, peak-downsampled, split at restarts. The scale applies to
        the few thousand points drawn, not to the million behind them."""
        vb = plot.getViewBox()
        x_range = None if vb.autoRangeEnabled()[0] else tuple(vb.viewRange()[0])
        buckets = max(200, plot.width())
        if not restarts:
            blocks = self._blocks.setdefault(key, PeakBlocks())
            blocks.update(y)
            px, py = peak_view(x, y, blocks, x_range, buckets)
        else:
            bounds = [0, *restarts, len(y)]
            xs, ys = [], []
            for a, b in itertools.pairwise(bounds):
                sx, sy = peak_view(x[a:b], y[a:b], None, x_range, buckets)
                xs += [sx, [np.nan]]
                ys += [sy, [np.nan]]
            px, py = np.concatenate(xs[:-1]), np.concatenate(ys[:-1])
        if y_scale != 1.0:
            py = py * y_scale
        self._curves[key].setData(px, py, connect="finite")

    def set_overlay(self, follower: RunFollower | None) -> None:
        self.overlay = follower
        key = ("overlay",)
        if key in self._curves:
            self.loss.removeItem(self._curves.pop(key))
        self._legend_keys = ()
        self._dirty = True

    def mark_dirty(self) -> None:
        self._dirty = True

    def _weight_changed(self, _v: int) -> None:
        self.slider_label.setText(f"{self.weight:.2f}")
        self._smooth.clear()  # recomputed from scratch, in the background for long runs
        for key in [k for k in self._blocks if k[0] in ("smooth", "mean")]:
            del self._blocks[key]
        if self.follower is None:
            return
        series = {r: s.column("loss").copy() for r, s in self.follower.series.items()}
        restarts = {r: list(s.restarts) for r, s in self.follower.series.items()}
        if sum(len(v) for v in series.values()) < BACKGROUND_POINTS:
            self._dirty = True
            return
        w = self.weight
        ranks = sorted(r for r in series if is_rank(r))
        if len(ranks) >= 2:  # the mean of ranks (key -1), each rank at its place (taken here, on this thread)
            rank_series = [self.follower.series[r] for r in ranks]
            places = _places(rank_series)
            n = _mean_length(rank_series, places)
            mean = _aligned_mean(rank_series, places, 0, n)
        else:
            mean = None

        def smooth_all(progress=None):
            table = {r: (*smooth_segments(v, w, (0.0, 0), 0, restarts.get(r, [])), len(v))
                     for r, v in series.items()}
            if mean is not None:
                table[-1] = (*smooth_segments(mean, w, (0.0, 0), 0, restarts.get(ranks[0], [])), len(mean))
            return w, table

        self._smooth_worker = run_in_background(smooth_all, owner=self, on_result=self._smoothed)

    def _smoothed(self, result) -> None:
        self._smooth_worker = None
        w, table = result
        if w == self.weight:
            self._smooth = dict(table.items())
            self._dirty = True

    def _smoothed_loss(self, key: int, s: Series) -> np.ndarray:
        loss = s.column("loss")
        have = self._smooth.get(key)
        backlog = len(loss) - (have[2] if have is not None else 0)
        if backlog > BACKGROUND_POINTS:  # a long run just opened: smooth it off the GUI thread, raw until then
            if self._smooth_worker is None:
                self._weight_changed(self.slider.value())
            return have[0] if have is not None else np.full(len(loss), np.nan)
        if have is None:
            out, state = smooth_segments(loss, self.weight, (0.0, 0), 0, s.restarts)
            self._smooth[key] = (out, state, len(loss))
            return out
        arr, state, n = have
        if n < len(loss):
            more, state = smooth_segments(loss[n:], self.weight, state, n, s.restarts)
            arr = np.concatenate([arr, more])
            self._smooth[key] = (arr, state, len(loss))
        return arr

    def redraw(self) -> bool:
        """Update every curve from the follower's buffers; returns False when nothing changed."""
        if not self._dirty or self.follower is None:
            return False
        self._dirty = False
        series = self.follower.series
        drawn = []
        for key in sorted(series):
            s = series[key]
            if len(s):
                self._draw_series(key, s)
                drawn.append(key)
        ranks = [series[k] for k in drawn if is_rank(k)]
        self._draw_mean(ranks)
        self._draw_restarts(ranks)
        self._draw_overlay()
        self._update_legend(drawn)
        self.no_steps.setVisible(not drawn)
        return True

    def _draw_series(self, key: int, s: Series) -> None:
        step = s.column("step")
        color = rank_color(key if is_rank(key) else key - 1000 + 8)
        if ("raw", key) not in self._curves:
            raw = QColor(color)
            raw.setAlpha(60)
            self._curves[("raw", key)] = _curve(self.loss, raw, 1)
            self._curves[("smooth", key)] = _curve(self.loss, color, 1)
            self._curves[("tok", key)] = _curve(self.speed, color, 1)
        old = superseded(step, s.restarts) if s.restarts else None
        live = _masker(old)
        loss = s.column("loss")
        self._set(("raw", key), self.loss, step, live(loss), s.restarts)
        self._set(("smooth", key), self.loss, step, live(self._smoothed_loss(key, s)), s.restarts)
        if old is not None and old.any():  # a resume from an older checkpoint: the replaced steps stay, dotted
            if ("old", key) not in self._curves:
                faint = QColor(color)
                faint.setAlpha(90)
                self._curves[("old", key)] = _curve(self.loss, faint, 1, Qt.PenStyle.DotLine)
            self._set(("old", key), self.loss, step, np.where(old, loss, np.nan), s.restarts)
        for name, (style, _label) in MEMORY.items():
            values = s.column(name)
            if (name, key) not in self._curves:
                if not np.isfinite(values[-256:]).any():  # only the tail: a full scan per frame is too slow
                    continue
                self._curves[(name, key)] = _curve(self.memory, color, 1, style)
            self._set((name, key), self.memory, step, live(values), s.restarts, y_scale=MIB)
        tokens = s.column("tokens_per_s")
        if not self._speed_seen and np.isfinite(tokens[-64:]).any():
            self._speed_seen = True
            self.speed.show()
            half = max(1, self._lower.width() // 2)
            self._lower.setSizes([half, half])  # NOTE: a splitter gives a widget shown late no room otherwise
        self._set(("tok", key), self.speed, step, live(tokens), s.restarts)

    def _update_legend(self, keys: list[int]) -> None:
        memory = tuple(n for n in MEMORY if any((n, k) in self._curves for k in keys))
        overlay = self.overlay.run_dir.name if ("overlay",) in self._curves and self.overlay else None
        replaced = any(("old", k) in self._curves for k in keys)
        legend_keys = (tuple(keys), memory, overlay, replaced)
        if legend_keys == self._legend_keys or self.follower is None:
            return
        self._legend_keys = legend_keys
        parts = [_swatch(rank_color(k if is_rank(k) else k - 1000 + 8), self.follower.label(k)) for k in keys]
        if ("mean",) in self._curves:
            parts.append(_swatch(QGuiApplication.palette().text().color(), "mean of ranks"))
        if overlay:
            parts.append(_swatch(QColor("#7f7f7f"), f"compare: {overlay} (dashed)"))
        if replaced:
            parts.append("dotted: steps a resume from an older checkpoint replaced")
        text = " &nbsp; ".join(parts)
        if len(memory) > 1:
            styles = {"rss": "solid", "cuda_allocated": "dashed", "cuda_reserved": "dotted", "cuda_peak": "dash-dot"}
            text += "<br><small>memory: " + ", ".join(f"{styles[m]} {MEMORY[m][1]}" for m in memory) + "</small>"
        self.legend.setText(text)

    def _draw_mean(self, series: list[Series]) -> None:
        if len(series) < 2:
            return
        places = _places(series)
        n = _mean_length(series, places)
        if not n:
            return
        steps = series[0].column("step")[:n]
        pen = QGuiApplication.palette().text().color()
        if ("mean",) not in self._curves:
            self._curves[("mean",)] = _curve(self.loss, pen, 2)
        # incremental, like the per-rank curves: only points new since the last frame are averaged
        # and smoothed (key -1 in the smoothing cache is the mean)
        have = self._smooth.get(-1)
        done = have[2] if have is not None and have[2] <= n else 0
        if n - done > BACKGROUND_POINTS:  # being smoothed in the background (see _smoothed_loss)
            return
        mean_new = _aligned_mean(series, places, done, n)
        restarts = series[0].restarts
        if have is None or done == 0:
            smooth, state = smooth_segments(mean_new, self.weight, (0.0, 0), 0, restarts)
        else:
            more, state = smooth_segments(mean_new, self.weight, have[1], done, restarts)
            smooth = np.concatenate([have[0], more])
        self._smooth[-1] = (smooth, state, n)
        restarts = [r for r in series[0].restarts if r < n]
        live = _masker(superseded(steps, restarts) if restarts else None)
        self._set(("mean",), self.loss, steps, live(smooth), restarts)

    def _draw_restarts(self, series: list[Series]) -> None:
        if not series:
            return
        s0 = series[0]
        steps = s0.column("step")
        for i in s0.restarts[len(self._restart_lines):]:
            pen = pg.mkPen("#d62728", style=Qt.PenStyle.DashLine)
            for plot in (self.loss, self.memory, self.speed):
                line = pg.InfiniteLine(pos=float(steps[i]), angle=90, pen=pen,
                                       label="resumed" if plot is self.loss else None,
                                       labelOpts={"position": 0.9, "color": "#d62728"})
                plot.addItem(line)
                if plot is self.loss:
                    self._restart_lines.append(line)

    def _draw_overlay(self) -> None:
        if self.overlay is None or not self.overlay.series:
            return
        series = [s for k, s in self.overlay.series.items() if len(s) and is_rank(k)] or \
            [s for s in self.overlay.series.values() if len(s)]
        if not series:
            return
        places = _places(series)
        n = _mean_length(series, places)
        mean = _aligned_mean(series, places, 0, n)
        smooth, _ = debiased_ema(mean, self.weight)
        if ("overlay",) not in self._curves:
            self._curves[("overlay",)] = _curve(self.loss, QColor("#7f7f7f"), 2.0, Qt.PenStyle.DashLine)
        self._blocks.pop(("overlay",), None)
        self._set(("overlay",), self.loss, series[0].column("step")[:n], smooth, series[0].restarts)

    def curve_points(self, key: tuple) -> int:
        """Points of the data behind a curve (not the downsampled points drawn)."""
        if self.follower is None:
            return 0
        if key[0] == "mean":
            return self._smooth.get(-1, (None, None, 0))[2] if key in self._curves else 0
        s = self.follower.series.get(key[1]) if len(key) > 1 else None
        if s is None or key not in self._curves:
            return 0
        column = "loss" if key[0] in ("raw", "smooth") else key[0] if key[0] in MEMORY else "tokens_per_s"
        return int(np.isfinite(s.column(column)).sum())


def _places(series: list[Series]) -> list[int | None]:
    """Where each rank's first record lies among rank 0's records (None: nowhere). A rank that joined at a resume
    on more processes starts at that restart, not at rank 0's first step."""
    s0 = series[0]
    steps0 = s0.column("step")
    out: list[int | None] = []
    for s in series:
        if not len(s):
            out.append(None)
            continue
        first = s.column("step")[0]
        starts = [0, *s0.restarts]
        out.append(next((r for r in starts if r < len(steps0) and steps0[r] == first), None))
    return out


def _mean_length(series: list[Series], places: list[int | None]) -> int:
    """How many of rank 0's records every rank of the latest segment has reported too (a rank that lags a step
    holds the mean back; one that only took part before the last resume does not)."""
    s0 = series[0]
    last = s0.restarts[-1] if s0.restarts else 0
    ends = [p + len(s) for s, p in zip(series, places, strict=True) if p is not None and p + len(s) > last]
    return min(ends, default=0)


def _aligned_mean(series: list[Series], places: list[int | None], lo: int, hi: int) -> np.ndarray:
    """The mean of the ranks' losses at rank 0's records ``lo:hi``, each rank at its own place (NOTE: by index
    alone, after a resume on 3 ranks of a 2-rank run, rank 2's steps 41-80 were averaged into steps 1-40)."""
    values = np.full((len(series), hi - lo), np.nan)
    for k, (s, p) in enumerate(zip(series, places, strict=True)):
        if p is None:
            continue
        a, b = max(lo, p), min(hi, p + len(s))
        if a < b:
            values[k, a - lo:b - lo] = s.column("loss")[a - p:b - p]
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a record no rank has: NaN, a gap in the curve
        return np.nanmean(values, axis=0)
