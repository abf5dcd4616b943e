"""Drive the real main window (offscreen) through thousands of actions and watch it survive.

``python tests/soak_driver.py --seconds 60 CKPT [CKPT ...] --compare A B --run-dir DIR`` opens every
checkpoint in the real :class:`MainWindow`, follows a run directory whose metrics files a thread keeps
growing, opens a compare view, then repeats random user actions (select tensors and modules, switch
tabs, hover and zoom the shard map, filter, pick ranks, reload, resize) until the time is up. It prints
one JSON line (``SOAK {...}``) and exits 0 only if the reference counts of ``None``, ``True`` and
``False`` never fell, no exception escaped into Qt, and the process tears down normally (no
``os._exit``). ``tests/test_soak.py`` runs it for about a minute, ``benchmarks/soak_long.py`` for hours.
It runs as its own process so that an abort (``Fatal Python error: none_dealloc``) is a failed test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import threading
import time
import traceback
import tracemalloc
from collections import Counter
from pathlib import Path

import psutil
import torch

# How far a reference count may dip below its warmed-up value from ordinary caching. PySide6 6.12.0
# loses one reference to None per void call: a 512-chunk map alone costs thousands.
REFCOUNT_SLACK = 2000
WARMUP_ACTIONS = 300
SAMPLE_EVERY = 25
PAINT_EVERY = 0.5  # seconds between letting Qt paint and run its timers
# relative weights of the user actions (Soak.act_<name>)
ACTIONS = {"select": 30, "hover": 30, "zoom": 6, "right_tab": 6, "main_tab": 5, "rank": 4, "filter": 4,
           "compare": 8, "plots": 5, "reload": 0.3, "layout": 0.7}


def make_big_checkpoint(workdir: Path) -> Path:
    """A DCP checkpoint written as by 512 ranks: ``model.big.weight`` in 512 chunks, 12 small tensors."""
    dst = workdir / "big512"
    if (dst / ".metadata").exists():
        return dst
    g = torch.Generator().manual_seed(0)
    state = {"big.weight": torch.randn(1024, 16, generator=g), "big.bias": torch.randn(1024, generator=g)}
    for i in range(6):
        state[f"layers.{i}.w"] = torch.randn(96, 8, generator=g)
        state[f"layers.{i}.b"] = torch.randn(96, generator=g)
    src = workdir / "big.pt"
    torch.save(state, src)
    subprocess.run([sys.executable, "-m", "shardscope.app.cli", "import", str(src), str(dst), "--ranks", "512",
                    "--prefix", "model"], check=True, capture_output=True, timeout=600)
    return dst


def loaded(view) -> bool:
    """A checkpoint view has its tree and its analysis (health, ranks) shown."""
    return view.data is not None and view.data.problems is not None and view.progress.isHidden()


class MetricsWriter(threading.Thread):
    """Appends per-rank metrics lines to a run directory, as a training script's ``report()`` would."""

    def __init__(self, run_dir: Path, ranks: int = 2) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.ranks = run_dir, ranks
        self.stop = threading.Event()
        self.lines = 0

    def run(self) -> None:
        (self.run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        files = [open(self.run_dir / "metrics" / f"rank_{r}.jsonl", "a") for r in range(self.ranks)]
        step = 0
        try:
            while not self.stop.wait(0.02):
                step += 1
                if step % 3000 == 0:
                    step -= 1000  # a resume from an earlier checkpoint: the plots split the curve
                for r, f in enumerate(files):
                    f.write(json.dumps({"time": time.time(), "rank": r, "step": step, "loss": 5.0 / (1 + step) + r,
                                        "rss": (100 + r) * 2**20, "tokens_per_s": 1000.0 + step % 17}) + "\n")
                    f.flush()
                    self.lines += 1
        finally:
            for f in files:
                f.close()


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        from PySide6.QtCore import QThreadPool
        from shardscope.app.bootstrap import make_app
        from shardscope.app.main_window import MainWindow

        self.args = args
        self.rng = random.Random(args.seed)
        self.app = make_app()
        self.pool = QThreadPool.globalInstance()
        self.win = MainWindow()
        self.win.quiet = True  # no modal message boxes
        self.win.resize(1280, 720)
        self.win.show()
        self.counts: Counter[str] = Counter()
        self.spent: Counter[str] = Counter()  # seconds per kind of action
        self.paint_seconds = 0.0  # letting Qt paint and run its timers between actions
        self.samples: list[tuple[int, int, int, int]] = []  # (actions, None, True, False)
        self.rss_mib: list[int] = []  # resident memory at each sample (a long soak shows leaks here)
        self.growth: list[tuple[int, int, float]] = []  # (actions, live objects, RSS MiB) after warm-up and at the end
        self.types: list[Counter[str]] = []  # live objects by type at the same points
        self.errors: list[str] = []
        self.tooltips = 0
        sys.excepthook = self._excepthook  # an exception in a slot is a failure, not a line on stderr

    def _excepthook(self, kind, value, tb) -> None:
        self.errors.append("".join(traceback.format_exception(kind, value, tb))[-2000:])
        sys.__excepthook__(kind, value, tb)

    # ------------------------------------------------------------------ waiting
    def wait_until(self, cond, what: str, timeout: float = 120.0) -> None:
        from PySide6.QtTest import QTest

        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise RuntimeError(f"soak: timed out after {timeout:.0f} s waiting for {what}")
            QTest.qWait(20)

    def open_all(self) -> None:
        self.views = []
        for path in self.args.checkpoints:
            view = self.win.open_path(str(path))
            self.wait_until(lambda v=view: loaded(v), f"{path} to load")
            self.views.append(view)
        self.paths = {id(v): self._paths(v) for v in self.views}
        self.panel = None
        if self.args.run_dir:
            self.writer = MetricsWriter(Path(self.args.run_dir))
            self.writer.start()
            self.panel = self.win.training_panel(str(self.args.run_dir))
            self.wait_until(lambda: self.panel.plots.curve_points(("raw", 1)) > 0, "the run's first points")
        self.compare = None
        if self.args.compare:
            self.compare = self.win.compare(*self.args.compare)
            self.wait_until(lambda: self.compare.progress.isHidden(), "the compare view")
            if self.compare.result is None:
                raise RuntimeError(f"soak: the compare view failed: {self.compare.summary.text()}")
            self.compare_rows = [self.compare.model.rows[i].fqn for i in range(self.compare.model.rowCount())]

    @staticmethod
    def _paths(view) -> list[str]:
        out, stack = [], list(view.data.tree.children)
        while stack:
            node = stack.pop()
            out.append(node.path)
            stack.extend(node.children)
        return sorted(out)

    # ------------------------------------------------------------------ actions
    def current(self):
        return self.win.current_view()

    def act_select(self) -> None:
        view = self.rng.choice(self.views)
        self._show(view)
        paths = self.paths[id(view)]
        # the 512-chunk map (and its 512-chunk bias: one 512-row chunk table after another), modules
        big = [p for p in paths if p.endswith(("big.weight", "big.bias", "layers")) or p == "model"]
        view.select_path(self.rng.choice(big if big and self.rng.random() < 0.4 else paths))

    def _show(self, widget) -> None:
        for pane in (self.win.tabs, self.win.side_tabs):
            i = pane.indexOf(widget)
            if i >= 0:
                pane.setCurrentIndex(i)

    def act_hover(self) -> None:
        """Move the pointer over the shard map, then ask for a tooltip as Qt does after a pause."""
        from PySide6.QtCore import QEvent, QPoint, QPointF, Qt
        from PySide6.QtGui import QHelpEvent, QMouseEvent
        from PySide6.QtWidgets import QApplication, QToolTip

        view = self.current()
        if view is None:
            return self.act_select()
        vp = view.map.viewport()
        boxes = view.map.hover.boxes
        pos = QPoint()
        for _ in range(4):
            pos = QPoint(self.rng.randrange(max(1, vp.width())), self.rng.randrange(max(1, vp.height())))
            if boxes and self.rng.random() < 0.8:  # mostly over something drawn: a chunk, a frame
                x0, y0, x1, y1 = self.rng.choice(boxes)
                centre = view.map.mapFromScene(QPointF((x0 + x1) / 2, (y0 + y1) / 2))
                if vp.rect().contains(centre):
                    pos = centre
            QApplication.sendEvent(vp, QMouseEvent(QEvent.Type.MouseMove, QPointF(pos), QPointF(vp.mapToGlobal(pos)),
                                                   Qt.MouseButton.NoButton, Qt.MouseButton.NoButton,
                                                   Qt.KeyboardModifier.NoModifier))
        QApplication.sendEvent(vp, QHelpEvent(QEvent.Type.ToolTip, pos, vp.mapToGlobal(pos)))
        expected = view.map.describe_at(view.map.mapToScene(pos))
        if expected is not None:
            self.tooltips += 1
            if not QToolTip.isVisible() or QToolTip.text() != expected[0]:
                self.errors.append(f"no tooltip {expected[0]!r} over the map (shown: {QToolTip.text()!r})")

    def act_zoom(self) -> None:
        from PySide6.QtCore import QPoint, QPointF, Qt
        from PySide6.QtGui import QWheelEvent
        from PySide6.QtWidgets import QApplication

        view = self.current()
        if view is None:
            return self.act_select()
        if self.rng.random() < 0.2:
            view.map.fit()
            return
        vp = view.map.viewport()
        pos = QPointF(vp.width() / 2, vp.height() / 2)
        delta = QPoint(0, self.rng.choice((120, -120)))
        QApplication.sendEvent(vp, QWheelEvent(pos, QPointF(vp.mapToGlobal(pos.toPoint())), QPoint(), delta,
                                               Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier,
                                               Qt.ScrollPhase.NoScrollPhase, False))

    def act_right_tab(self) -> None:
        view = self.current()
        if view is not None:
            view.tabs.setCurrentIndex(self.rng.randrange(view.tabs.count()))

    def act_main_tab(self) -> None:
        pane = self.win.tabs if not self.win.side_tabs.count() or self.rng.random() < 0.5 else self.win.side_tabs
        pane.setCurrentIndex(self.rng.randrange(pane.count()))

    def act_rank(self) -> None:
        view = self.current()
        if view is not None and view.data is not None:
            view.ranks.select_rank(self.rng.choice([*view.data.ckpt.ranks[:8], None, None]))

    def act_filter(self) -> None:
        view = self.current()
        if view is not None:
            view.filter_edit.setText(self.rng.choice(["", "", "big", "layers.1", "bias", "weight", "exp_avg"]))

    def act_compare(self) -> None:
        if self.compare is None or not self.compare_rows:
            return self.act_select()
        self._show(self.compare)
        self.compare.select(self.rng.choice(self.compare_rows))

    def act_plots(self) -> None:
        if self.panel is None:
            return self.act_select()
        self._show(self.panel)
        if self.rng.random() < 0.2:
            self.panel.plots.slider.setValue(self.rng.randrange(self.panel.plots.slider.maximum() + 1))
        self.panel.plots.redraw()

    def act_reload(self) -> None:
        view = self.current()
        if view is None:
            return
        self.win.reload_current()
        new = self.win.current_view()
        self.wait_until(lambda: loaded(new), f"{new.path} to reload")
        self.views[self.views.index(view)] = new
        self.paths[id(new)] = self.paths.pop(id(view))

    def act_layout(self) -> None:
        if self.rng.random() < 0.5:
            self.win.resize(*self.rng.choice([(1280, 720), (1920, 1080), (1000, 700)]))
        elif self.current() is not None:
            self.win.move_to_other_side()

    # ------------------------------------------------------------------ the run
    def sample(self, actions: int) -> None:
        self.samples.append((actions, sys.getrefcount(None), sys.getrefcount(True), sys.getrefcount(False)))
        self.rss_mib.append(round(psutil.Process().memory_info().rss / 2**20))

    def settle(self) -> None:
        """The same things on screen whenever live objects are counted (a 512-chunk table and map hold
        thousands of objects that a small tensor does not): each view's first entry, no filters."""
        from PySide6.QtTest import QTest

        self.win.resize(1280, 720)
        for view in self.views:
            self._show(view)
            view.set_rank_filter(None)
            view.filter_edit.clear()
            view.select_path(self.paths[id(view)][0])
            for i in (*range(view.tabs.count()), 0):  # every tab painted once (the Ranks bars cache 512 rects)
                view.tabs.setCurrentIndex(i)
                QTest.qWait(1)
        for other in (self.panel, self.compare):
            if other is not None:
                self._show(other)
                QTest.qWait(1)
        if self.compare is not None and self.compare_rows:
            self.compare.select(self.compare_rows[0])

    def live(self, actions: int) -> None:
        """Live objects (after a full collection, background work done) and resident memory, for growth."""
        from shardscope.widgets.checkpoint_view import CheckpointView
        from shardscope.widgets.workers import Worker

        self.settle()
        snap = self.snapshot()
        self.kept = {"workers": snap["types"][Worker.__qualname__],
                     "checkpoint_views": snap["types"][CheckpointView.__qualname__], "views_open": len(self.views)}
        self.growth.append((actions, snap["objects"], round(snap["rss"] / 2**20, 1)))
        self.types.append(snap["types"])

    def fallen(self) -> str | None:
        """A message if a reference count fell below its warmed-up value by more than the slack."""
        warm = [s for s in self.samples if s[0] >= WARMUP_ACTIONS]
        if len(warm) < 2:
            return None
        base, last = warm[0], warm[-1]
        for i, name in ((1, "None"), (2, "True"), (3, "False")):
            if last[i] < base[i] - REFCOUNT_SLACK:
                import PySide6

                return (f"sys.getrefcount({name}) fell from {base[i]:,} (after {base[0]:,} actions) to {last[i]:,} "
                        f"(after {last[0]:,}) with PySide6 {PySide6.__version__}: a C extension drops references")
        return None

    def run(self) -> int:
        from PySide6.QtTest import QTest

        t_setup = time.monotonic()
        self.open_all()
        setup = time.monotonic() - t_setup
        names, weights = zip(*ACTIONS.items(), strict=True)
        t0 = time.monotonic()
        deadline = t0 + self.args.seconds
        actions = 0
        painted = t0
        problem = None
        hard_deadline = t0 + self.args.max_seconds
        # time-bound on a quiet machine; a busy one keeps going (up to max_seconds) until min_actions are done
        while (not self.errors and actions < self.args.max_actions and time.monotonic() < hard_deadline
               and (time.monotonic() < deadline or actions < self.args.min_actions)):
            name = self.rng.choices(names, weights)[0]
            t_act = time.monotonic()
            getattr(self, f"act_{name}")()
            self.spent[name] += time.monotonic() - t_act
            self.counts[name] += 1
            actions += 1
            if time.monotonic() - painted > PAINT_EVERY:  # let the window paint and timers fire, as a screen would
                t_paint = time.monotonic()
                QTest.qWait(1)
                painted = time.monotonic()
                self.paint_seconds += painted - t_paint
            if actions == WARMUP_ACTIONS:
                self.live(actions)
            if actions % SAMPLE_EVERY == 0:
                self.sample(actions)
                problem = self.fallen()
                if problem:
                    break
        elapsed = time.monotonic() - t0
        if actions > WARMUP_ACTIONS:
            self.live(actions)
        plotted = self.panel.plots.curve_points(("raw", 0)) if self.panel is not None else 0
        self.close()
        gc.collect()
        self.sample(actions)
        problem = problem or self.fallen()
        summary = {"actions": actions, "seconds": round(elapsed, 1), "setup_seconds": round(setup, 1),
                   "by_kind": dict(self.counts), "tooltips_checked": self.tooltips,
                   "ms_per_action": {k: round(1000 * v / max(1, self.counts[k]), 1) for k, v in self.spent.items()},
                   "paint_seconds": round(self.paint_seconds, 1),
                   "metrics_lines": getattr(getattr(self, "writer", None), "lines", 0), "plotted_points": plotted,
                   "refcounts_first_last": [self.samples[0], self.samples[-1]] if self.samples else [],
                   "rss_mib_first_max_last": [self.rss_mib[0], max(self.rss_mib), self.rss_mib[-1]]
                   if self.rss_mib else [],
                   "live_objects_rss_mib": self.growth,
                   "kept_at_end": getattr(self, "kept", {}),
                   # the types with the most more live objects at the end than after the warm-up
                   "types_grown": (self.types[-1] - self.types[0]).most_common(8) if len(self.types) == 2 else [],
                   "errors": self.errors[:5], "problem": problem}
        print("SOAK " + json.dumps(summary), flush=True)
        if problem or self.errors:
            print(f"soak failed: {problem or self.errors[0]}", file=sys.stderr, flush=True)
            return 1
        return 0

    # ------------------------------------------------------------------ what grows (--probe)
    def snapshot(self) -> dict:
        """Live objects and reference counts after a full collection, with every queued slot delivered."""
        from PySide6.QtTest import QTest

        self.wait_until(lambda: self.pool.activeThreadCount() == 0, "background workers to finish")
        QTest.qWait(1)
        self.app.processEvents()
        gc.collect()
        objects = gc.get_objects()
        types = Counter(type(o).__qualname__ for o in objects)
        snap = {"objects": len(objects), "types": types, "None": sys.getrefcount(None),
                "True": sys.getrefcount(True), "False": sys.getrefcount(False),
                "rss": psutil.Process().memory_info().rss}
        if tracemalloc.is_tracing():
            snap["trace"] = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)])
        del objects
        return snap

    def probe(self, per_kind: int) -> int:
        """Do ``per_kind`` actions of one kind at a time and print what each kind leaves behind per action."""
        from PySide6.QtTest import QTest

        self.open_all()
        for name in ACTIONS:  # warm every path once (caches, fonts, first-use allocations)
            for _ in range(20):
                getattr(self, f"act_{name}")()
                QTest.qWait(1)
        for name in ACTIONS:
            before = self.snapshot()
            for i in range(per_kind):
                getattr(self, f"act_{name}")()
                if i % 10 == 0:
                    QTest.qWait(1)
            after = self.snapshot()
            grown = (after["types"] - before["types"]).most_common(6)
            row = {"kind": name, "actions": per_kind,
                   "objects_per_action": round((after["objects"] - before["objects"]) / per_kind, 2),
                   "refs_None_per_action": round((after["None"] - before["None"]) / per_kind, 2),
                   "refs_True_per_action": round((after["True"] - before["True"]) / per_kind, 2),
                   "refs_False_per_action": round((after["False"] - before["False"]) / per_kind, 2),
                   "rss_kib_per_action": round((after["rss"] - before["rss"]) / 1024 / per_kind, 1),
                   "types_grown": grown}
            if "trace" in after:
                row["top_allocations"] = [str(st) for st in after["trace"].compare_to(before["trace"], "lineno")[:8]]
            print("PROBE " + json.dumps(row), flush=True)
        self.close()
        return 0 if not self.errors else 1

    def close(self) -> None:
        self.win.close()
        if getattr(self, "writer", None) is not None:
            self.writer.stop.set()
            self.writer.join(30)
        self.wait_until(lambda: self.pool.activeThreadCount() == 0, "background workers to finish")
        self.win.deleteLater()
        self.app.processEvents()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", help="checkpoint folders to open")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two checkpoints for a compare view")
    parser.add_argument("--run-dir", help="a run directory to follow; a thread keeps its metrics growing")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to keep acting (after setup)")
    parser.add_argument("--min-actions", type=int, default=0, help="keep going past --seconds until this many")
    parser.add_argument("--max-actions", type=int, default=10**9)
    parser.add_argument("--max-seconds", type=float, default=float("inf"), help="a hard stop, whatever was done")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe", type=int, metavar="N", help="instead of a soak: N actions of each kind in "
                        "turn, printing the objects, references and memory each kind leaves behind")
    parser.add_argument("--tracemalloc", action="store_true", help="with --probe: the top growing allocations")
    args = parser.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    if args.tracemalloc:
        tracemalloc.start(8)
    soak = Soak(args)
    return soak.probe(args.probe) if args.probe else soak.run()


if __name__ == "__main__":
    # NOTE: a normal interpreter exit, on purpose: teardown aborts ("deallocating None/True") are
    # part of what the soak must catch, so nothing here may end with os._exit.
    sys.exit(main())
