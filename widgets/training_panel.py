"""The Training panel: run form, run list, the followed run's header, plots, logs and checkpoints.

Nothing here reads or writes a file or waits on a process: starting, stopping, polling and listing runs go
through backend functions on the thread pool, and their results come back as queued signals. A run's state is
written by its supervisor alone (see backend/runs/supervisor.py): the panel only reads it, so closing the
window (or this tab) leaves every run going, and each still settles to finished, failed or stopped. Stop is
``shardscope stop``'s own path (launcher.stop_run).
"""

from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFrame,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QScrollArea,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from ..backend.atomic_file import write_atomic
from ..backend.runs.follow import RunFollower, RunSnapshot, is_rank
from ..backend.runs.launcher import RunConfig, RunLauncher, resume_config, stop_run
from ..backend.runs.rundir import ACTIVE_STATES, OVER_STATES, default_runs_root, new_run_dir
from ..backend.runs.store import RunInfo, list_runs
from .form_wheel import wheel_only_when_focused
from .run_checkpoints import RunCheckpoints
from .run_form import RunForm, slurm_partitions
from .run_header import escape, failures_of, header_html, stop_how
from .run_logs import LogTabs, Traceback
from .run_plots import RunPlots
from .workers import run_in_background

REDRAW_MS = 100  # 10 Hz: redraw on a timer, never per line read
POLL_MS = 500
LIST_EVERY = 4  # the Runs list is refreshed every 4th poll (2 s)
LEFT_MIN_WIDTH = 250  # the New run form: below this its fields are cut (it scrolls vertically, not sideways)


class TrainingPanel(QWidget):
    """Start, watch and stop runs; every run lives in its own run directory."""

    openCheckpoint = Signal(str)
    compareRequested = Signal(str, str)
    runStateChanged = Signal(str, str)  # (run dir, state) of the followed run, when its state changes
    runFolderOpened = Signal(str)  # a folder the user opened by hand (the window offers to add it to the Library)

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
        run_in_background(slurm_partitions, owner=self, on_result=self._slurm_found)
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
        wheel_only_when_focused(left)  # NOTE: the form scrolls: the wheel over a field must not change it
        return left

    def _build_right(self) -> QWidget:
        right = QWidget()
        rv = QVBoxLayout(right)
        self.status = QLabel("No run selected.")
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        rv.addWidget(self.status)
        self.logs = LogTabs()
        self.log_views = self.logs.views
        self.traceback = Traceback(self.logs, self)
        self.details_button, self.details = self.traceback.button, self.traceback.text
        rv.addWidget(self.details_button)
        rv.addWidget(self.details)
        split = QSplitter(Qt.Orientation.Vertical)
        self.plots = RunPlots()
        self.plots.png_button.clicked.connect(self._save_png)
        self.plots.csv_button.clicked.connect(self._save_csv)
        split.addWidget(self.plots)
        self.bottom = QTabWidget()
        self.bottom.addTab(self.logs, "Logs")
        self.bottom.addTab(self._build_checkpoints(), "Checkpoints")
        split.addWidget(self.bottom)
        split.setSizes([560, 240])
        split.setChildrenCollapsible(False)
        rv.addWidget(split, 1)
        return right

    def _build_checkpoints(self) -> QWidget:
        ck = RunCheckpoints()
        ck.opened.connect(self.openCheckpoint)
        self.ckpt_list, self.resume_button, self.compare_button = ck.list, ck.resume_button, ck.compare_button
        self.ckpt_list.itemSelectionChanged.connect(self._update_buttons)
        self.resume_button.clicked.connect(self.resume_run)
        self.compare_button.clicked.connect(self._compare_selected)
        self.checkpoints = ck
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
        # starts beside the run shown (a sibling run is one click away), else in the runs folder
        start = os.path.dirname(str(self.follower.run_dir)) if self.follower is not None else str(self.runs_root)
        path = QFileDialog.getExistingDirectory(self, "Open a run folder", start)
        if path:
            self.follow(path)
            self.refresh_runs(select=path)
            self.runFolderOpened.emit(path)

    def follow(self, run_dir: str) -> None:
        """Show a run (ours, one written by `report()` elsewhere, or any folder with TensorBoard or CSV
        logs) and follow it live."""
        if self.follower is not None and str(self.follower.run_dir) == str(run_dir):
            return
        self.follower = RunFollower(run_dir)  # the run's own stall limit (config.json), else the default
        self.plots.set_follower(self.follower)
        self.logs.reset()
        self.ckpt_list.clear()
        self.traceback.set_failures({})
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
        if config is not None:  # the form shows what runs (the demo's steps, not the form's last ones)
            self.form.show_config(config)
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
        self.status.setText(f"<span style='color:#d62728'>Cannot start: {escape(message)}</span>")

    def resume_run(self) -> None:
        """Launch the followed run again from the selected checkpoint, into the same run directory, on the form's
        Processes (a checkpoint resumes at another world size; the header says "resuming step N of a 2-rank run
        on 3 ranks")."""
        items = self.ckpt_list.selectedItems()
        if self.follower is None or len(items) != 1:
            self.status.setText("Select one checkpoint of this run to resume from.")
            return
        if self._launching:
            return
        if self._status.get("state") not in OVER_STATES:
            self.status.setText("Resume once the run has ended (stop it first).")
            return
        item = items[0]
        run_dir, ckpt = self.follower.run_dir, item.data(Qt.ItemDataRole.UserRole)
        nproc = self.form.nproc.value()

        def launch(progress=None) -> RunLauncher:
            return RunLauncher(run_dir, resume_config(run_dir, ckpt, nproc)).start()

        self.status.setText(f"Resuming from {escape(Path(ckpt).name)} on {nproc} process(es) …")
        self._launch(launch)

    def stop_run(self) -> None:
        if self.follower is None:
            return
        run_dir = str(self.follower.run_dir)
        self._stopping.add(run_dir)
        self._update_buttons()
        self.status.setText(f"Stopping: {stop_how(self._status)} …")

        def stop(progress=None):
            return stop_run(run_dir)  # what `shardscope stop` does, whoever started the run

        def done() -> None:
            self._stopping.discard(run_dir)
            self._update_buttons()

        run_in_background(stop, owner=self, on_result=lambda _s: self.poll(),
                          on_error=lambda m: self.status.setText(escape(m)), on_finished=done)

    def _update_buttons(self) -> None:
        """Start, Stop, Resume and Compare enabled for what the followed run's state allows now."""
        st, state = self._status, self._status.get("state")
        run_dir = str(self.follower.run_dir) if self.follower is not None else ""
        stopping = run_dir in self._stopping or bool(st.get("stop_requested"))
        ours = run_dir in self.launchers or bool(st.get("supervisor_pid") or st.get("pid") or st.get("job_id"))
        selected = len(self.ckpt_list.selectedItems())
        self.start_button.setEnabled(not self._launching)
        self.stop_button.setEnabled(bool(run_dir) and state in ACTIVE_STATES and ours and not stopping)
        self.resume_button.setEnabled(state in OVER_STATES and selected == 1 and not self._launching)
        self.compare_button.setEnabled(selected == 2)

    # ------------------------------------------------------------------ live updates
    def poll(self) -> None:
        """One background read: what is new in the followed run, and every few polls the Runs list with each
        run's state (the supervisors of runs started here are reaped once they have ended)."""
        if self._reading:
            return
        self._reading = True
        self._polls += 1
        follower = self.follower
        launchers = list(self.launchers.values())
        root = self.runs_root if self._polls % LIST_EVERY == 0 else None

        def work(progress=None):
            for launcher in launchers:
                if launcher.proc is not None:
                    launcher.proc.poll()  # reaps a supervisor that has ended (it settled its run first)
            snap = follower.read() if follower is not None else None
            gone = follower is not None and not follower.run_dir.is_dir()
            return snap, (list_runs(root) if root else None), gone

        run_in_background(work, owner=self, on_result=lambda r: self._apply(follower, *r),
                          on_error=lambda m: self.status.setText(escape(m)),
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
                self.logs.view(rank)  # a tab for every rank that reports, even one that printed nothing yet
        for rank, text in sorted(snap.new_log.items()):
            self.logs.view(rank).appendPlainText(text.rstrip("\n"))
        self.checkpoints.add(snap.checkpoints, follower.run_dir)
        self._show_status(follower, snap)

    def _show_gone(self, follower: RunFollower) -> None:
        """The followed run's folder went away: say so (not "a run started outside Shardscope"), keep what was
        read, and offer nothing that would act on the old path."""
        self._status = {}
        self.ckpt_list.clear()  # their paths are gone with the folder
        self._update_buttons()
        self._show_runs([r for r in self.runs if r.path != follower.run_dir])  # its blank entry leaves the list
        self.status.setText(f"<b>{escape(follower.run_dir.name)}</b>: <span style='color:#d62728'>this run folder "
                            f"no longer exists</span> (renamed, moved or deleted): {escape(str(follower.run_dir))}. "
                            "Pick the run again in the Runs list.")

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
        if state in OVER_STATES:
            self._stopping.discard(str(follower.run_dir))
        self._update_buttons()
        failures = failures_of(snap)
        self.traceback.set_failures(failures, st.get("root_cause_rank"))
        stopping = st.get("stop_requested") or str(follower.run_dir) in self._stopping
        self.status.setText(header_html(follower, snap, bool(stopping), failures))

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
                              on_error=lambda m: self.status.setText(escape(m)))

    def shutdown(self) -> None:
        self.poll_timer.stop()
        self.redraw_timer.stop()

