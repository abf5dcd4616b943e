"""The Training panel: run form, run list, the followed run's header, plots, logs and checkpoints.

Nothing here reads or writes a file or waits on a process: starting, stopping, polling (which reaps
finished torchruns and writes their final status) and listing runs go through backend functions on
the thread pool, and their results come back as queued signals.
"""

from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSplitter,
    QTabWidget,
    QToolButton,
    QVBoxLayout,
    QWidget,
)
from shardscope.backend.atomic_file import write_atomic
from shardscope.backend.errors import ShardscopeError
from shardscope.backend.runs import slurm
from shardscope.backend.runs.follow import RunFollower, RunSnapshot, is_rank
from shardscope.backend.runs.launcher import RunConfig, RunLauncher, stop_run
from shardscope.backend.runs.rundir import ACTIVE_STATES, FINAL_STATES, default_runs_root, new_run_dir, read_config
from shardscope.backend.runs.store import RunInfo, list_runs

from .run_form import RunForm
from .run_plots import RunPlots
from .workers import run_in_background

REDRAW_MS = 100  # 10 Hz: redraw on a timer, never per line read
POLL_MS = 500
LIST_EVERY = 4  # the Runs list is refreshed every 4th poll (2 s)
LOG_LINES = 20000
LEFT_MIN_WIDTH = 250  # the New run form: below this its fields are cut (it scrolls vertically, not sideways)
STATE_COLORS = {"failed": "#d62728", "stopped": "#7f7f7f", "finished": "#2ca02c", "queued": "#e6a000"}


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def without_banners(log: str) -> str:
    """A log tail without torchrun's start-up notices framed by rules of "*" (the OMP_NUM_THREADS one).
    NOTE: a run whose torchrun was killed (kill -9, a scheduler) leaves only that notice in the launcher's log;
    the panel used to say "torchrun failed: Setting OMP_NUM_THREADS environment variable ..." as if it were
    the cause, with the notice as the traceback."""
    out: list[str] = []
    notice: list[str] | None = None  # the lines of a notice being read (kept if it never closes)
    for line in log.splitlines():
        if line.strip() and not line.strip("*"):  # a rule of stars opens or closes a notice
            notice = [line] if notice is None else None
        elif notice is not None:
            notice.append(line)
        else:
            out.append(line)
    return "\n".join(out + (notice or [])).strip()


def _slurm_partitions(progress=None) -> list | str:
    """Partitions from sinfo, or why SLURM cannot be used here (runs on the pool)."""
    if not slurm.available():
        return "sbatch/sinfo are not on PATH on this machine"
    try:
        return slurm.partitions()
    except ShardscopeError as exc:
        return str(exc)


class TrainingPanel(QWidget):
    """Start, watch and stop runs; every run lives in its own run directory."""

    openCheckpoint = Signal(str)
    compareRequested = Signal(str, str)
    runStateChanged = Signal(str, str)  # (run dir, state) of the followed run, when its state changes
    runFolderOpened = Signal(str)  # a folder the user opened by hand: its checkpoints join the Library

    def __init__(self, runs_root: str | os.PathLike | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.runs_root = Path(runs_root) if runs_root else default_runs_root()
        self.follower: RunFollower | None = None
        self.launchers: dict[str, RunLauncher] = {}
        self.runs: list[RunInfo] = []
        self._reading = False
        self._polls = 0
        self._status: dict = {}
        self._launching = False  # a Start or Resume is on its way: no second one until it has started
        self._stopping: set[str] = set()  # runs whose Stop is on its way
        self._gone = False  # the followed run's folder no longer exists (renamed, moved or deleted)
        split = QSplitter(Qt.Orientation.Horizontal)
        # NOTE: the form scrolls, so the panel (and the window) still fits 1280x720 with every row shown
        left = QScrollArea()
        left.setWidgetResizable(True)
        left.setFrameShape(QFrame.Shape.NoFrame)
        left.setWidget(self._build_left())
        split.addWidget(left)
        split.addWidget(self._build_right())
        split.setSizes([330, 1000])
        # NOTE: the form keeps its width and the plots give way (down to their minimum): in a narrow pane
        # (split view at 1280x720) the splitter used to share the room 1:3, leaving the form 100 px
        left.setMinimumWidth(LEFT_MIN_WIDTH)
        split.setStretchFactor(0, 0)
        split.setStretchFactor(1, 1)
        split.setChildrenCollapsible(False)
        QVBoxLayout(self).addWidget(split)
        self.redraw_timer = QTimer(self)
        self.redraw_timer.setInterval(REDRAW_MS)
        self.redraw_timer.timeout.connect(self.plots.redraw)
        self.redraw_timer.start()
        self.poll_timer = QTimer(self)
        self.poll_timer.setInterval(POLL_MS)
        self.poll_timer.timeout.connect(self.poll)
        self.poll_timer.start()
        run_in_background(_slurm_partitions, owner=self, on_result=self._slurm_found)
        self.refresh_runs()

    # ------------------------------------------------------------------ layout
    def _build_left(self) -> QWidget:
        left = QWidget()
        lv = QVBoxLayout(left)
        self.form = RunForm()
        self.form.start_button.clicked.connect(lambda: self.start_run())
        self.form.stop_button.clicked.connect(self.stop_run)
        self.form.stall.valueChanged.connect(
            lambda v: self.follower and setattr(self.follower, "stall_seconds", float(v)))
        self.start_button, self.stop_button = self.form.start_button, self.form.stop_button
        lv.addWidget(self.form)
        lv.addWidget(QLabel("Runs"))
        self.run_list = QListWidget()
        self.run_list.currentItemChanged.connect(
            lambda cur, _prev: cur and self.follow(cur.data(Qt.ItemDataRole.UserRole)))
        lv.addWidget(self.run_list, 1)
        open_button = QPushButton("Open run folder…")
        open_button.setToolTip("Any folder with Shardscope metrics, TensorBoard event files or a Lightning "
                               "metrics.csv, and its checkpoints (e.g. a run launched on a cluster by hand)")
        open_button.clicked.connect(self._open_run_dialog)
        lv.addWidget(open_button)
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
        self.details_button = QToolButton()
        self.details_button.setCheckable(True)
        self.details_button.setText("Show the traceback")
        self.details_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.details_button.setArrowType(Qt.ArrowType.RightArrow)
        self.details_button.toggled.connect(self._toggle_details)
        self.details_button.hide()
        rv.addWidget(self.details_button)
        # NOTE: a fixed, small height: a long traceback scrolls here instead of squashing the plots
        self.details = QPlainTextEdit()
        self.details.setReadOnly(True)
        self.details.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.details.setMaximumHeight(160)
        self.details.hide()
        rv.addWidget(self.details)
        split = QSplitter(Qt.Orientation.Vertical)
        self.plots = RunPlots()
        self.plots.png_button.clicked.connect(self._save_png)
        self.plots.csv_button.clicked.connect(self._save_csv)
        split.addWidget(self.plots)
        self.bottom = QTabWidget()
        self.logs = QTabWidget()
        self.log_views: dict[int, QPlainTextEdit] = {}
        self.bottom.addTab(self.logs, "Logs")
        self.bottom.addTab(self._build_checkpoints(), "Checkpoints")
        split.addWidget(self.bottom)
        split.setSizes([560, 240])
        split.setChildrenCollapsible(False)
        rv.addWidget(split, 1)
        return right

    def _build_checkpoints(self) -> QWidget:
        ck = QWidget()
        cl = QVBoxLayout(ck)
        self.ckpt_list = QListWidget()
        # NOTE: itemActivated (double-click or Enter), not itemDoubleClicked: the keyboard opens a checkpoint too
        self.ckpt_list.itemActivated.connect(lambda it: self.openCheckpoint.emit(it.data(Qt.ItemDataRole.UserRole)))
        cl.addWidget(QLabel("Double-click a checkpoint (or press Enter) to open it in the browser."))
        cl.addWidget(self.ckpt_list, 1)
        self.ckpt_list.setSelectionMode(QListWidget.SelectionMode.ExtendedSelection)
        self.ckpt_list.itemSelectionChanged.connect(self._update_buttons)
        row = QHBoxLayout()
        self.resume_button = QPushButton("Resume from selected")
        self.resume_button.setToolTip("Resume this run from the selected checkpoint (once the run has ended)")
        self.resume_button.setEnabled(False)
        self.resume_button.clicked.connect(self.resume_run)
        self.compare_button = QPushButton("Compare two selected")
        self.compare_button.setToolTip("Compare the two selected checkpoints (Ctrl+click to select two)")
        self.compare_button.setEnabled(False)
        self.compare_button.clicked.connect(self._compare_selected)
        row.addWidget(self.resume_button)
        row.addWidget(self.compare_button)
        cl.addLayout(row)
        return ck

    def _slurm_found(self, result: list | str) -> None:
        self.form.set_slurm(None, result) if isinstance(result, str) else self.form.set_slurm(result)

    # ------------------------------------------------------------------ runs
    def refresh_runs(self, select: str | None = None) -> None:
        """List the runs under the runs folder again (in the background) and select ``select``."""
        root = self.runs_root
        run_in_background(lambda progress=None: list_runs(root), owner=self,
                          on_result=lambda runs: self._show_runs(runs, select))

    def _show_runs(self, runs: list[RunInfo], select: str | None = None) -> None:
        if self.follower is None and not select:
            # NOTE: a panel opened again (its tab closed while a run went on, or a new window) shows the run
            # that is still going; it used to say "No run selected" with Stop out of reach
            live = next((r for r in runs if r.state in ACTIVE_STATES), None)
            if live is not None:
                self.follow(str(live.path))
        current = select or (self.follower and str(self.follower.run_dir))
        # NOTE: a run folder opened from elsewhere is listed too, but not one renamed or deleted under us
        # (it used to stay at the top of the list, blank, next to its new name)
        gone = self._gone and self.follower is not None and current == str(self.follower.run_dir)
        if current and not gone and current not in [str(r.path) for r in runs]:
            state = self._status.get("state", "") if self.follower and str(self.follower.run_dir) == current else ""
            runs.insert(0, RunInfo(Path(current), state, 0.0))  # a run folder opened from elsewhere
        self.runs = runs
        items = {self.run_list.item(i).data(Qt.ItemDataRole.UserRole): self.run_list.item(i)
                 for i in range(self.run_list.count())}
        if list(items) != [str(r.path) for r in runs]:
            self.run_list.blockSignals(True)
            self.run_list.clear()
            for r in runs:
                item = QListWidgetItem()
                item.setData(Qt.ItemDataRole.UserRole, str(r.path))
                self.run_list.addItem(item)
            self.run_list.blockSignals(False)
            self._fill_compare(runs)
        for i, r in enumerate(runs):
            item = self.run_list.item(i)
            item.setText(f"{r.path.name}  {r.state}")
            item.setToolTip(f"{r.path}\n{r.explanation}".strip())
            if str(r.path) == current and self.run_list.currentItem() is not item:
                self.run_list.blockSignals(True)
                self.run_list.setCurrentItem(item)
                self.run_list.blockSignals(False)

    def _fill_compare(self, runs: list[RunInfo]) -> None:
        """Offer every run but the one shown; the run being compared stays chosen (the list is refilled
        when a run appears or goes and when another run is shown, and used to fall back to "(none)"
        while its dashed curve stayed in the plot)."""
        chosen = self.compare.currentData() or ""
        shown = str(self.follower.run_dir) if self.follower is not None else None
        self.compare.blockSignals(True)
        self.compare.clear()
        self.compare.addItem("(none)", "")
        for r in runs:
            if str(r.path) != shown:  # a run compared with itself shows nothing
                self.compare.addItem(r.path.name, str(r.path))
        self.compare.setCurrentIndex(max(self.compare.findData(chosen), 0))
        self.compare.blockSignals(False)
        if chosen and self.compare.currentData() != chosen:  # the compared run is gone
            self.plots.set_overlay(None)

    def run_state(self, run_dir: str) -> str:
        """The state the Runs list shows for a run."""
        for i in range(self.run_list.count()):
            item = self.run_list.item(i)
            if item.data(Qt.ItemDataRole.UserRole) == str(run_dir):
                return item.text().rsplit("  ", 1)[-1]
        return ""

    def _open_run_dialog(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Open a run folder", str(self.runs_root))
        if path:
            self.follow(path)
            self.refresh_runs(select=path)
            self.runFolderOpened.emit(path)

    def follow(self, run_dir: str) -> None:
        """Show a run (ours, one written by `report()` elsewhere, or any folder with TensorBoard or CSV
        logs) and follow it live."""
        if self.follower is not None and str(self.follower.run_dir) == str(run_dir):
            return
        self.follower = RunFollower(run_dir, stall_seconds=float(self.form.stall.value()))
        self.plots.set_follower(self.follower)
        for i in reversed(range(self.logs.count())):
            self.logs.removeTab(i)
        self.log_views.clear()
        self.ckpt_list.clear()
        self._set_details({})
        self._status = {}
        self._gone = False
        self._update_buttons()  # nothing is known of this run yet: no Stop or Resume for the last one's state
        self._fill_compare(self.runs)
        self.status.setText(f"Following {run_dir} …")
        self.poll()

    def config(self) -> RunConfig:
        return self.form.config()

    def start_run(self, run_dir: str | None = None, config: RunConfig | None = None) -> bool:
        """Check the form (or ``config``) and start the run in the background; False (and the problems
        shown next to their fields) when it cannot start."""
        config = (config or self.form.config()).resolved()
        problems = config.problems()
        self.form.show_problems(problems)
        if problems:
            self.status.setText("<span style='color:#d62728'>Cannot start: fix the fields marked in red.</span>")
            return False
        root = self.runs_root

        def launch(progress=None) -> RunLauncher:
            return RunLauncher(run_dir or new_run_dir(root), config).start()

        self.status.setText("Starting …")
        self._launch(launch)
        return True

    def _launch(self, launch) -> None:
        """Start or resume on the pool; Start and Resume stay disabled until it has started or failed
        (two resumes of one run directory would both find it ended and start two torchruns)."""
        self._launching = True
        self._update_buttons()
        run_in_background(launch, owner=self, on_result=self._started, on_error=self._start_failed,
                          on_finished=self._launch_done)

    def _launch_done(self) -> None:
        self._launching = False
        self._update_buttons()

    def _started(self, launcher: RunLauncher) -> None:
        self.launchers[str(launcher.run_dir)] = launcher
        self.follower = None  # NOTE: followed again from scratch: a resumed run's header, plots and logs
        self.follow(str(launcher.run_dir))
        self.refresh_runs(select=str(launcher.run_dir))

    def _start_failed(self, message: str) -> None:
        self.status.setText(f"<span style='color:#d62728'>Cannot start: {_escape(message)}</span>")

    def resume_run(self) -> None:
        """Launch the followed run again from the selected checkpoint, into the same run directory."""
        items = self.ckpt_list.selectedItems()
        if self.follower is None or len(items) != 1:
            self.status.setText("Select one checkpoint of this run to resume from.")
            return
        if self._launching:
            return
        if self._status.get("state") not in FINAL_STATES:
            self.status.setText("Resume once the run has ended (stop it first).")
            return
        item = items[0]
        run_dir, ckpt = self.follower.run_dir, item.data(Qt.ItemDataRole.UserRole)

        def launch(progress=None) -> RunLauncher:
            config = RunConfig.from_record(read_config(run_dir))
            config.resume = ckpt
            return RunLauncher(run_dir, config).start()

        self.status.setText("Resuming …")
        self._launch(launch)

    def stop_run(self) -> None:
        if self.follower is None:
            return
        run_dir = str(self.follower.run_dir)
        launcher = self.launchers.get(run_dir)
        self._stopping.add(run_dir)
        self._update_buttons()
        self.status.setText(f"Stopping: {self._stop_how()} …")

        def stop(progress=None):
            return launcher.stop() if launcher is not None else stop_run(run_dir)

        def done() -> None:
            self._stopping.discard(run_dir)
            self._update_buttons()

        run_in_background(stop, owner=self, on_result=lambda _s: self.poll(),
                          on_error=lambda m: self.status.setText(_escape(m)), on_finished=done)

    def _stop_how(self) -> str:
        return "scancel" if self._status.get("scheduler") == "slurm" else \
            "SIGTERM to every process of the run, SIGKILL after 10 s"

    def _update_buttons(self) -> None:
        """Start, Stop, Resume and Compare enabled for what the followed run's state allows now."""
        st, state = self._status, self._status.get("state")
        run_dir = str(self.follower.run_dir) if self.follower is not None else ""
        stopping = run_dir in self._stopping or bool(st.get("stop_requested"))
        ours = run_dir in self.launchers or bool(st.get("pid") or st.get("job_id"))
        selected = len(self.ckpt_list.selectedItems())
        self.start_button.setEnabled(not self._launching)
        self.stop_button.setEnabled(bool(run_dir) and state in ACTIVE_STATES and ours and not stopping)
        self.resume_button.setEnabled(state in FINAL_STATES and selected == 1 and not self._launching)
        self.compare_button.setEnabled(selected == 2)

    # ------------------------------------------------------------------ live updates
    def poll(self) -> None:
        """One background read: reap our torchruns (their final status is written), what is new in the
        followed run, and every few polls the Runs list with each run's state."""
        if self._reading:
            return
        self._reading = True
        self._polls += 1
        follower = self.follower
        launchers = list(self.launchers.values())
        root = self.runs_root if self._polls % LIST_EVERY == 0 else None

        def work(progress=None):
            for launcher in launchers:
                launcher.status()
            snap = follower.read() if follower is not None else None
            gone = follower is not None and not follower.run_dir.is_dir()
            return snap, (list_runs(root) if root else None), gone

        run_in_background(work, owner=self, on_result=lambda r: self._apply(follower, *r),
                          on_error=lambda m: self.status.setText(_escape(m)),
                          on_finished=lambda: setattr(self, "_reading", False))

    def _apply(self, follower: RunFollower | None, snap: RunSnapshot | None, runs: list[RunInfo] | None,
               gone: bool = False) -> None:
        if follower is not None and follower is self.follower:
            self._gone = gone
        if runs is not None:
            self._show_runs(runs)
        if follower is None or follower is not self.follower or snap is None:
            return
        if gone:
            self._show_gone(follower)
            return
        follower.apply(snap)
        if snap.new_points or snap.replaced:
            self.plots.mark_dirty()
        for rank in follower.series:
            if is_rank(rank):
                self._log_view(rank)  # a tab for every rank that reports, even one that printed nothing yet
        for rank, text in sorted(snap.new_log.items()):
            self._log_view(rank).appendPlainText(text.rstrip("\n"))
        names = [self.ckpt_list.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.ckpt_list.count())]
        for p in snap.checkpoints:
            if str(p) not in names:
                item = QListWidgetItem(str(p.relative_to(follower.run_dir)) if p.is_relative_to(follower.run_dir)
                                       else p.name)
                item.setData(Qt.ItemDataRole.UserRole, str(p))
                self.ckpt_list.addItem(item)
        self._show_status(follower, snap)

    def _show_gone(self, follower: RunFollower) -> None:
        """The followed run's folder went away: say so (not "a run started outside Shardscope"), keep what was
        read, and offer nothing that would act on the old path."""
        self._status = {}
        self.ckpt_list.clear()  # their paths are gone with the folder
        self._update_buttons()
        self._show_runs([r for r in self.runs if r.path != follower.run_dir])  # its blank entry leaves the list
        self.status.setText(f"<b>{_escape(follower.run_dir.name)}</b>: <span style='color:#d62728'>this run folder "
                            f"no longer exists</span> (renamed, moved or deleted): {_escape(str(follower.run_dir))}. "
                            "Pick the run again in the Runs list.")

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
        previous, self._status = self._status.get("state"), st
        state = st.get("state")
        if state and state != previous:
            self.runStateChanged.emit(str(follower.run_dir), state)
        known = next((r for r in self.runs if r.path == follower.run_dir), None)
        if known is None or known.state != (state or ""):  # the Runs list says what the header says
            self._show_runs([RunInfo(r.path, state or "", r.mtime, st.get("explanation", "")) if r is known else r
                             for r in self.runs])
        if state in FINAL_STATES:
            self._stopping.discard(str(follower.run_dir))
        self._update_buttons()
        shown = state or "no status.json: a run started outside Shardscope; following its files"
        color = STATE_COLORS.get(state or "")
        head = f"<span style='color:{color}'>{shown}</span>" if color else shown
        nodes = f", {st['nodes']}" if st.get("nodes") else ""
        where = f" (SLURM job {st['job_id']}{nodes})" if st.get("job_id") else ""
        parts = [f"<b>{_escape(follower.run_dir.name)}</b>: {head}{where}"]
        line = follower.progress()
        if line:
            parts.append(line.replace("  ", " · "))
        if state == "queued":
            parts.append(f"waiting: {_escape(st.get('explanation', ''))}")
        if state in ACTIVE_STATES and (st.get("stop_requested") or str(follower.run_dir) in self._stopping):
            parts.append(f"stopping: {self._stop_how()} …")
        if snap.stalled:
            parts.append(f"<span style='color:#d62728'><b>stalled</b>: no new step from rank(s) "
                         f"{', '.join(map(str, snap.stalled))} for {follower.stall_seconds:.0f} s</span>")
        if state in ("finished", "failed", "stopped") and st.get("explanation"):
            parts.append(_escape(st["explanation"]))
        for problem in snap.problems:
            parts.append(f"<span style='color:#d62728'>{_escape(problem)}</span>")
        failures = {r: tb for r, tb in ((r, without_banners(tb)) for r, tb in snap.failures.items())
                    if tb or r != -1}  # the launcher's log with nothing but notices says nothing more
        self._set_details(failures, st.get("root_cause_rank"))
        for r, tb in sorted(failures.items()):
            # the last line that says something (torchrun's summary ends in a rule of "=", its banner of "*")
            last = next((ln for ln in reversed(tb.splitlines()) if ln.strip(" =-*")), "no traceback recorded")
            who = "torchrun" if r == -1 else f"rank {r}"
            parts.append(f"<span style='color:#d62728'>{who} failed: {_escape(last)}</span>")
        self.status.setText("<br>".join(p for p in parts if p))

    def _set_details(self, failures: dict[int, str], root_cause: int | None = None) -> None:
        text = "\n\n".join(f"--- {'launcher' if r == -1 else f'rank {r}'}\n{tb}" for r, tb in sorted(failures.items()))
        if text != self.details.toPlainText():
            self.details.setPlainText(text)
            # the rank that failed first (torchrun_root_cause) when it left a traceback (a rank killed by
            # a signal often printed nothing), else the first failed rank: its log in front
            first = root_cause if root_cause in failures else min(failures, default=None)
            if first is not None and first in self.log_views:  # the failed rank's log in front
                self.logs.setCurrentWidget(self.log_views[first])
        self.details_button.setVisible(bool(text))
        self.details.setVisible(bool(text) and self.details_button.isChecked())

    def _toggle_details(self, on: bool) -> None:
        self.details_button.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow)
        self.details_button.setText("Hide the traceback" if on else "Show the traceback")
        self.details.setVisible(on and bool(self.details.toPlainText()))

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

        def show(snap: RunSnapshot) -> None:
            if self.compare.currentData() == path:  # not a choice the user has changed since
                other.apply(snap)
                self.plots.set_overlay(other)

        run_in_background(lambda progress=None: other.read(), owner=self, on_result=show)

    def _save_png(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save plots", "loss.png", "PNG (*.png)")
        if path:
            self.plots.grab().save(path)

    def _save_csv(self) -> None:
        if self.follower is None:
            return
        path, _ = QFileDialog.getSaveFileName(self, "Save metrics", "metrics.csv", "CSV (*.csv)")
        if path:
            text = self.follower.csv()
            run_in_background(lambda progress=None: write_atomic(path, text), owner=self,
                              on_error=lambda m: self.status.setText(_escape(m)))

    def shutdown(self) -> None:
        self.poll_timer.stop()
        self.redraw_timer.stop()

