"""The Training panel: run form, run list, live per-rank plots, logs and checkpoints of a run."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QColor, QGuiApplication
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPlainTextEdit,
    QPushButton,
    QSlider,
    QSpinBox,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)
from shardscope.backend.runs.follow import RunFollower, RunSnapshot
from shardscope.backend.runs.launcher import (
    RunConfig,
    RunLauncher,
    default_runs_root,
    describe_exit,
    log_tail,
    stop_run,
)
from shardscope.backend.runs.metrics import PeakBlocks, Series, debiased_ema, peak_view, smooth_segments
from shardscope.backend.runs.store import RunInfo, list_runs, write_text

from .palette import rank_color
from .workers import Worker, run_in_background

REDRAW_MS = 100  # 10 Hz: redraw on a timer, never per line read
POLL_MS = 500
LOG_LINES = 20000


def _plot(title: str, left: str, bottom: str) -> pg.PlotWidget:
    w = pg.PlotWidget(title=title)
    pal = QGuiApplication.palette()
    w.setBackground(pal.base().color())
    w.setLabel("left", left)
    w.setLabel("bottom", bottom)
    # w.showGrid(x=True, y=True, alpha=0.15)
    w.addLegend(offset=(-10, 10))
    return w


def _curve(plot: pg.PlotWidget, color: QColor, width: float = 1.5, name: str | None = None,
           style: Qt.PenStyle = Qt.PenStyle.SolidLine) -> pg.PlotDataItem:
    item = plot.plot(pen=pg.mkPen(color, width=width, style=style), name=name)
    # NOTE: the data given here is already peak-downsampled to the visible range (peak_view): a few
    # thousand points whatever the run's length, so every min and max stays visible and frames stay cheap
    item.setSkipFiniteCheck(True)
    return item


class RunPlots(QWidget):
    """Loss per rank and mean (raw faint, smoothed on top), memory per rank, throughput."""

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
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
        self.png_button = QPushButton("Save plots as PNG…")
        self.csv_button = QPushButton("Save data as CSV…")
        bar.addWidget(self.png_button)
        bar.addWidget(self.csv_button)
        layout.addLayout(bar)
        split = QSplitter(Qt.Orientation.Vertical)
        self.loss = _plot("loss", "loss", "step")
        split.addWidget(self.loss)
        lower = QSplitter(Qt.Orientation.Horizontal)
        self.memory = _plot("memory", "MiB", "seconds since start")
        self.speed = _plot("throughput", "tokens/s", "step")
        lower.addWidget(self.memory)
        lower.addWidget(self.speed)
        split.addWidget(lower)
        split.setSizes([400, 220])
        layout.addWidget(split, 1)
        self.follower: RunFollower | None = None
        self.overlay: RunFollower | None = None
        self._curves: dict[tuple, pg.PlotDataItem] = {}
        self._smooth: dict[int, tuple[np.ndarray, tuple[float, int], int]] = {}
        self._restart_lines: list[pg.InfiniteLine] = []
        self._blocks: dict[tuple, PeakBlocks] = {}
        self._dirty = False
        for plot in (self.loss, self.memory, self.speed):
            plot.getViewBox().sigXRangeChanged.connect(lambda *_a: self.mark_dirty())
        self._smooth_worker: Worker | None = None
        self.slider.valueChanged.connect(self._weight_changed)

    @property
    def weight(self) -> float:
        return self.slider.value() / 100

    def set_follower(self, follower: RunFollower | None) -> None:
        self.follower = follower
        for plot in (self.loss, self.memory, self.speed):
            plot.clear()
            plot.addLegend(offset=(-10, 10))
        self._curves.clear()
        self._smooth.clear()
        self._blocks.clear()
        self._restart_lines.clear()
        self._dirty = True

    def _set(self, key: tuple, plot: pg.PlotWidget, x: np.ndarray, y: np.ndarray, restarts: list[int],
             x_shift: float = 0.0, y_scale: float = 1.0) -> None:
        """Hand one curve its visible data, peak-downsampled, split at restarts. The shift and scale
        apply to the few thousand points drawn, not to the million behind them."""
        vb = plot.getViewBox()
        x_range = None if vb.autoRangeEnabled()[0] else tuple(v + x_shift for v in vb.viewRange()[0])
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
        if x_shift:
            px = px - x_shift
        if y_scale != 1.0:
            py = py * y_scale
        self._curves[key].setData(px, py, connect="finite")

    def set_overlay(self, follower: RunFollower | None) -> None:
        self.overlay = follower
        key = ("overlay",)
        if key in self._curves:
            self.loss.removeItem(self._curves.pop(key))
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
        if sum(len(v) for v in series.values()) < 200_000:
            self._dirty = True
            return
        w = self.weight

        def smooth_all(progress=None):
            table = {r: (*smooth_segments(v, w, (0.0, 0), 0, restarts.get(r, [])), len(v))
                     for r, v in series.items()}
            if len(series) >= 2:  # the mean of ranks is key -1
                n = min(len(v) for v in series.values())
                mean = np.mean([v[:n] for v in series.values()], axis=0)
                table[-1] = (*smooth_segments(mean, w, (0.0, 0), 0, restarts.get(min(series), [])), n)
            return w, table

        self._smooth_worker = run_in_background(smooth_all, on_result=self._smoothed)

    def _smoothed(self, result) -> None:
        self._smooth_worker = None
        w, table = result
        if w == self.weight:
            self._smooth = dict(table.items())
            self._dirty = True

    def _smoothed_loss(self, rank: int, s: Series) -> np.ndarray:
        loss = s.column("loss")
        have = self._smooth.get(rank)
        backlog = len(loss) - (have[2] if have is not None else 0)
        if backlog > 200_000:  # a long run just opened: smooth it off the GUI thread, raw until then
            if self._smooth_worker is None:
                self._weight_changed(self.slider.value())
            return have[0] if have is not None else np.full(len(loss), np.nan)
        if have is None:
            out, state = smooth_segments(loss, self.weight, (0.0, 0), 0, s.restarts)
            self._smooth[rank] = (out, state, len(loss))
            return out
        arr, state, n = have
        if n < len(loss):
            more, state = smooth_segments(loss[n:], self.weight, state, n, s.restarts)
            arr = np.concatenate([arr, more])
            self._smooth[rank] = (arr, state, len(loss))
        return arr

    def redraw(self) -> bool:
        """Update every curve from the follower's buffers; returns False when nothing changed."""
        if not self._dirty or self.follower is None:
            return False
        self._dirty = False
        series = self.follower.series
        ranks = sorted(series)
        faint = []
        for r in ranks:
            s = series[r]
            if not len(s):
                continue
            step = s.column("step")
            color = rank_color(r)
            raw = QColor(color)
            raw.setAlpha(60)
            key = ("raw", r)
            if key not in self._curves:
                self._curves[key] = _curve(self.loss, raw, 1)
                self._curves[("smooth", r)] = _curve(self.loss, color, 1, f"rank {r}")
                self._curves[("rss", r)] = _curve(self.memory, color, 1, f"rank {r} RSS")
                self._curves[("cuda", r)] = _curve(self.memory, color, 1, None, Qt.PenStyle.DashLine)
                self._curves[("tok", r)] = _curve(self.speed, color, 1, f"rank {r}")
            self._set(key, self.loss, step, s.column("loss"), s.restarts)
            self._set(("smooth", r), self.loss, step, self._smoothed_loss(r, s), s.restarts)
            t = s.column("time")
            t0 = t[0] if len(t) and np.isfinite(t[0]) else 0.0
            # memory is plotted against time, which keeps rising across restarts
            self._set(("rss", r), self.memory, t, s.column("rss"), s.restarts, x_shift=t0, y_scale=2**-20)
            cuda = s.column("cuda_allocated")
            if np.isfinite(cuda[-1:]).any():
                self._set(("cuda", r), self.memory, t, cuda, s.restarts, x_shift=t0, y_scale=2**-20)
            self._set(("tok", r), self.speed, step, s.column("tokens_per_s"), s.restarts)
            faint.append(s)
        self._draw_mean(faint)
        self._draw_restarts(series)
        self._draw_overlay()
        return True

    def _draw_mean(self, series: list[Series]) -> None:
        if len(series) < 2:
            return
        n = min(len(s) for s in series)
        if not n:
            return
        steps = series[0].column("step")[:n]
        pen = QGuiApplication.palette().text().color()
        if ("mean",) not in self._curves:
            self._curves[("mean",)] = _curve(self.loss, pen, 2, "mean of ranks")
        # incremental, like the per-rank curves: only points new since the last frame are averaged
        # and smoothed (key -1 in the smoothing cache is the mean)
        have = self._smooth.get(-1)
        done = have[2] if have is not None and have[2] <= n else 0
        if n - done > 200_000:  # being smoothed in the background (see _smoothed_loss)
            return
        mean_new = np.mean([s.column("loss")[done:n] for s in series], axis=0)
        restarts = series[0].restarts
        if have is None or done == 0:
            smooth, state = smooth_segments(mean_new, self.weight, (0.0, 0), 0, restarts)
        else:
            more, state = smooth_segments(mean_new, self.weight, have[1], done, restarts)
            smooth = np.concatenate([have[0], more])
        self._smooth[-1] = (smooth, state, n)
        self._set(("mean",), self.loss, steps, smooth, [r for r in series[0].restarts if r < n])

    def _draw_restarts(self, series: dict[int, Series]) -> None:
        s0 = series.get(0) or next(iter(series.values()), None)
        if s0 is None:
            return
        steps = s0.column("step")
        for i in s0.restarts[len(self._restart_lines):]:
            line = pg.InfiniteLine(pos=float(steps[i]), angle=90, pen=pg.mkPen("#d62728", style=Qt.PenStyle.DashLine),
                                   label="resumed", labelOpts={"position": 0.9, "color": "#d62728"})
            self.loss.addItem(line)
            self._restart_lines.append(line)

    def _draw_overlay(self) -> None:
        if self.overlay is None or not self.overlay.series:
            return
        series = [s for s in self.overlay.series.values() if len(s)]
        if not series:
            return
        n = min(len(s) for s in series)
        mean = np.mean([s.column("loss")[:n] for s in series], axis=0)
        smooth, _ = debiased_ema(mean, self.weight)
        if ("overlay",) not in self._curves:
            self._curves[("overlay",)] = _curve(self.loss, QColor("#7f7f7f"), 2.0,
                                                f"compare: {self.overlay.run_dir.name}", Qt.PenStyle.DashLine)
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
        return int(np.isfinite(s.column("loss")).sum())


class TrainingPanel(QWidget):
    """Start, watch and stop runs; every run lives in its own run directory."""

    openCheckpoint = Signal(str)
    compareRequested = Signal(str, str)
    runChanged = Signal(str)

    def __init__(self, runs_root: str | os.PathLike | None = None, parent=None) -> None:
        super().__init__(parent)
        self.runs_root = Path(runs_root) if runs_root else default_runs_root()
        self.follower: RunFollower | None = None
        self.launchers: dict[str, RunLauncher] = {}
        self._reading = False
        self._status: dict = {}
        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(self._build_left())
        split.addWidget(self._build_right())
        split.setSizes([330, 1000])
        QVBoxLayout(self).addWidget(split)
        self.redraw_timer = QTimer(self)
        self.redraw_timer.setInterval(REDRAW_MS)
        self.redraw_timer.timeout.connect(self.plots.redraw)
        self.redraw_timer.start()
        self.poll_timer = QTimer(self)
        self.poll_timer.setInterval(POLL_MS)
        self.poll_timer.timeout.connect(self.poll)
        self.poll_timer.start()
        self.refresh_runs()

    # ------------------------------------------------------------------ layout
    def _build_left(self) -> QWidget:
        left = QWidget()
        lv = QVBoxLayout(left)
        box = QGroupBox("New run")
        form = QFormLayout(box)
        self.strategy = QComboBox()
        self.strategy.addItems(["fsdp", "ddp"])
        self.nproc = QSpinBox()
        self.nproc.setRange(1, 64)
        self.nproc.setValue(2)
        self.device = QComboBox()
        self.device.addItems(["auto", "cpu", "cuda"])
        self.steps = QSpinBox()
        self.steps.setRange(1, 10_000_000)
        self.steps.setValue(200)
        self.ckpt_every = QSpinBox()
        self.ckpt_every.setRange(0, 1_000_000)
        self.ckpt_every.setValue(50)
        self.width_ = QSpinBox()
        self.width_.setRange(8, 8192)
        self.width_.setValue(64)
        self.depth = QSpinBox()
        self.depth.setRange(1, 256)
        self.depth.setValue(2)
        self.heads = QSpinBox()
        self.heads.setRange(1, 128)
        self.heads.setValue(4)
        self.batch = QSpinBox()
        self.batch.setRange(1, 4096)
        self.batch.setValue(8)
        self.lr = QDoubleSpinBox()
        self.lr.setDecimals(5)
        self.lr.setRange(1e-6, 1.0)
        self.lr.setValue(3e-3)
        self.stall = QSpinBox()
        self.stall.setRange(5, 86400)
        self.stall.setValue(60)
        self.stall.setSuffix(" s")
        self.stall.setToolTip("Flag a rank as stalled when it reports no new step for this long")
        self.stall.valueChanged.connect(lambda v: self.follower and setattr(self.follower, "stall_seconds", float(v)))
        self.script = QLineEdit()
        self.script.setPlaceholderText("optional: your own script (uses the same launcher)")
        self.script_args = QLineEdit()
        self.script_args.setPlaceholderText("arguments for the script")
        for label, w in (("Strategy", self.strategy), ("Processes", self.nproc), ("Device", self.device),
                         ("Steps", self.steps), ("Checkpoint every", self.ckpt_every), ("Width", self.width_),
                         ("Depth", self.depth), ("Heads", self.heads), ("Batch / rank", self.batch),
                         ("Learning rate", self.lr), ("Script", self.script), ("Script args", self.script_args),
                         ("Stalled after", self.stall)):
            form.addRow(label, w)
        buttons = QHBoxLayout()
        self.start_button = QPushButton("Start")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.start_button.clicked.connect(self.start_run)
        self.stop_button.clicked.connect(self.stop_run)
        buttons.addWidget(self.start_button)
        buttons.addWidget(self.stop_button)
        form.addRow(buttons)
        lv.addWidget(box)
        lv.addWidget(QLabel("Runs"))
        self.run_list = QListWidget()
        self.run_list.currentItemChanged.connect(
            lambda cur, _prev: cur and self.follow(cur.data(Qt.ItemDataRole.UserRole)))
        lv.addWidget(self.run_list, 1)
        row = QHBoxLayout()
        open_button = QPushButton("Open run folder…")
        open_button.clicked.connect(self._open_run_dialog)
        row.addWidget(open_button)
        lv.addLayout(row)
        lv.addWidget(QLabel("Compare loss with"))
        self.compare = QComboBox()
        self.compare.currentIndexChanged.connect(self._compare_changed)
        lv.addWidget(self.compare)
        return left

    def _build_right(self) -> QWidget:
        right = QWidget()
        rv = QVBoxLayout(right)
        self.status = QLabel("No run selected.")
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        rv.addWidget(self.status)
        split = QSplitter(Qt.Orientation.Vertical)
        self.plots = RunPlots()
        self.plots.png_button.clicked.connect(self._save_png)
        self.plots.csv_button.clicked.connect(self._save_csv)
        split.addWidget(self.plots)
        bottom = QTabWidget()
        self.logs = QTabWidget()
        self.log_views: dict[int, QPlainTextEdit] = {}
        bottom.addTab(self.logs, "Logs")
        ck = QWidget()
        cl = QVBoxLayout(ck)
        self.ckpt_list = QListWidget()
        self.ckpt_list.itemDoubleClicked.connect(lambda it: self.openCheckpoint.emit(it.data(Qt.ItemDataRole.UserRole)))
        cl.addWidget(QLabel("Double-click a checkpoint to open it in the browser."))
        cl.addWidget(self.ckpt_list, 1)
        self.ckpt_list.setSelectionMode(QListWidget.SelectionMode.ExtendedSelection)
        row = QHBoxLayout()
        self.resume_button = QPushButton("Resume this run from the selected checkpoint")
        self.resume_button.clicked.connect(self.resume_run)
        self.compare_button = QPushButton("Compare the two selected")
        self.compare_button.clicked.connect(self._compare_selected)
        row.addWidget(self.resume_button)
        row.addWidget(self.compare_button)
        cl.addLayout(row)
        bottom.addTab(ck, "Checkpoints")
        split.addWidget(bottom)
        split.setSizes([560, 240])
        rv.addWidget(split, 1)
        return right

    # ------------------------------------------------------------------ runs
    def refresh_runs(self, select: str | None = None) -> None:
        current = select or (self.follower and str(self.follower.run_dir))
        self.run_list.blockSignals(True)
        self.run_list.clear()
        runs = list_runs(self.runs_root)
        if current and current not in [str(r.path) for r in runs] and Path(current).exists():
            runs.insert(0, RunInfo(Path(current), "", 0.0))  # a run folder opened from elsewhere
        for r in runs:
            item = QListWidgetItem(f"{r.path.name}  {r.state}")
            item.setData(Qt.ItemDataRole.UserRole, str(r.path))
            item.setToolTip(str(r.path))
            self.run_list.addItem(item)
            if str(r.path) == current:
                self.run_list.setCurrentItem(item)
        self.run_list.blockSignals(False)
        self.compare.blockSignals(True)
        self.compare.clear()
        self.compare.addItem("(none)", "")
        for r in runs:
            self.compare.addItem(r.path.name, str(r.path))
        self.compare.blockSignals(False)

    def _open_run_dialog(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Open a run directory", str(self.runs_root))
        if path:
            self.follow(path)
            self.refresh_runs(select=path)

    def follow(self, run_dir: str) -> None:
        """Show a run (ours, or one written by `report()` on another machine) and follow it live."""
        if self.follower is not None and str(self.follower.run_dir) == str(run_dir):
            return
        self.follower = RunFollower(run_dir, stall_seconds=float(self.stall.value()))
        self.plots.set_follower(self.follower)
        for i in reversed(range(self.logs.count())):
            self.logs.removeTab(i)
        self.log_views.clear()
        self.ckpt_list.clear()
        self.status.setText(f"Following {run_dir} …")
        self.runChanged.emit(str(run_dir))
        self.poll()

    def config(self) -> RunConfig:
        model = {"width": self.width_.value(), "depth": self.depth.value(), "heads": self.heads.value(),
                 "batch_size": self.batch.value(), "lr": self.lr.value()}
        script = self.script.text().strip() or None
        return RunConfig(strategy=self.strategy.currentText(), nproc=self.nproc.value(), steps=self.steps.value(),
                         checkpoint_every=self.ckpt_every.value(),
                         device=None if self.device.currentText() == "auto" else self.device.currentText(),
                         script=script, script_args=self.script_args.text().split() if script else [],
                         model={} if script else model)

    def start_run(self, run_dir: str | None = None, config: RunConfig | None = None) -> str | None:
        run_dir = run_dir or str(self.runs_root / time.strftime("run-%Y%m%d-%H%M%S"))
        try:
            launcher = RunLauncher(run_dir, config or self.config()).start()
        except Exception as exc:
            self.status.setText(f"<span style='color:#d62728'>Cannot start: {exc}</span>")
            return None
        self.launchers[str(launcher.run_dir)] = launcher
        self.follower = None
        self.follow(str(launcher.run_dir))
        self.refresh_runs(select=str(launcher.run_dir))
        return str(launcher.run_dir)

    def resume_run(self) -> None:
        item = self.ckpt_list.currentItem()
        if self.follower is None or item is None:
            self.status.setText("Select a checkpoint of this run to resume from.")
            return
        import json

        try:
            cfg = json.loads((self.follower.run_dir / "config.json").read_text())
        except (OSError, ValueError):
            cfg = {}
        known = {k: v for k, v in cfg.items() if k in RunConfig.__dataclass_fields__}
        config = RunConfig(**{**known, "resume": item.data(Qt.ItemDataRole.UserRole)})
        self.start_run(str(self.follower.run_dir), config)

    def stop_run(self) -> None:
        if self.follower is None:
            return
        run_dir = str(self.follower.run_dir)
        launcher = self.launchers.get(run_dir)
        self.stop_button.setEnabled(False)
        self.status.setText("Stopping: SIGTERM to every process of the run, SIGKILL after 10 s …")

        def stop(progress=None):
            return launcher.stop() if launcher is not None else stop_run(run_dir)

        run_in_background(stop, on_result=lambda _c: self.poll(), on_error=lambda m: self.status.setText(m))

    # ------------------------------------------------------------------ live updates
    def poll(self) -> None:
        for launcher in self.launchers.values():
            launcher.poll()  # reaps finished torchrun processes and writes their final status
        if self.follower is None or self._reading:
            return
        self._reading = True
        follower = self.follower
        run_in_background(lambda progress=None: follower.read(), on_result=lambda snap: self._apply(follower, snap),
                          on_finished=lambda: setattr(self, "_reading", False))

    def _apply(self, follower: RunFollower, snap: RunSnapshot) -> None:
        if follower is not self.follower:
            return
        follower.apply(snap)
        if snap.new_points:
            self.plots.mark_dirty()
        for rank in follower.series:
            self._log_view(rank)  # a tab for every rank that reports, even one that printed nothing yet
        for rank, text in sorted(snap.new_log.items()):
            self._log_view(rank).appendPlainText(text.rstrip("\n"))
        names = [self.ckpt_list.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.ckpt_list.count())]
        for p in snap.checkpoints:
            if str(p) not in names:
                item = QListWidgetItem(p.name)
                item.setData(Qt.ItemDataRole.UserRole, str(p))
                self.ckpt_list.addItem(item)
        self._show_status(follower, snap)

    def _log_view(self, rank: int) -> QPlainTextEdit:
        view = self.log_views.get(rank)
        if view is None:
            view = QPlainTextEdit()
            view.setReadOnly(True)
            view.setMaximumBlockCount(LOG_LINES)
            view.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
            self.log_views[rank] = view
            title = "launcher" if rank == -1 else f"rank {rank}" if rank >= 0 else "other"
            order = sorted(self.log_views)
            self.logs.insertTab(order.index(rank), view, title)
        return view

    def _show_status(self, follower: RunFollower, snap: RunSnapshot) -> None:
        st = snap.status
        self._status = st
        state = st.get("state", "unknown (no status.json: a run started by hand?)")
        ours = str(follower.run_dir) in self.launchers
        running = state in ("starting", "running")
        self.stop_button.setEnabled(running and (ours or bool(st.get("pid"))))
        s0 = follower.series.get(0)
        parts = [f"<b>{follower.run_dir.name}</b>: {state}"]
        if s0 is not None and len(s0):
            step = s0.column("step")[-1]
            loss = s0.column("loss")[-1]
            sps = s0.column("steps_per_s")[-1]
            parts.append(f"step {step:.0f}, loss {loss:.4f}, {sps:.1f} steps/s" if np.isfinite(sps) else
                         f"step {step:.0f}, loss {loss:.4f}")
        if snap.stalled:
            parts.append(f"<span style='color:#d62728'><b>stalled</b>: no new step from rank(s) "
                         f"{', '.join(map(str, snap.stalled))} for {follower.stall_seconds:.0f} s</span>")
        if state in ("finished", "failed", "stopped"):
            parts.append(describe_exit(st.get("exit_code")) if "exit_code" in st else st.get("explanation", ""))
        if state == "failed":
            for r in st.get("failed_ranks") or []:
                parts.append(f"<span style='color:#d62728'>rank {r} failed; end of its log:</span>"
                             f"<pre>{_escape(log_tail(follower.run_dir, r, 12))}</pre>")
        self.status.setText("<br>".join(p for p in parts if p))

    def _compare_selected(self) -> None:
        items = self.ckpt_list.selectedItems()
        if len(items) != 2:
            self.status.setText("Select two checkpoints (Ctrl+click) to compare them.")
            return
        a, b = sorted(i.data(Qt.ItemDataRole.UserRole) for i in items)
        self.compareRequested.emit(a, b)

    def _compare_changed(self, _i: int) -> None:
        path = self.compare.currentData()
        if not path:
            self.plots.set_overlay(None)
            return
        other = RunFollower(path)

        def read(progress=None):
            return other.read()

        run_in_background(read, on_result=lambda snap: (other.apply(snap), self.plots.set_overlay(other)))

    def _save_png(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save plots", "loss.png", "PNG (*.png)")
        if path:
            self.plots.grab().save(path)

    def _save_csv(self) -> None:
        if self.follower is None:
            return
        path, _ = QFileDialog.getSaveFileName(self, "Save metrics", "metrics.csv", "CSV (*.csv)")
        if path:
            write_text(path, self.follower.csv())

    def shutdown(self) -> None:
        self.poll_timer.stop()
        self.redraw_timer.stop()


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
