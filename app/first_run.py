"""The demo in the window: the run starts at once in the Training tab and is followed live; when it
ends, its last checkpoint opens with a first tensor selected and a hint of what to try."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QObject
from shardscope.backend.checkpoint.model import TensorEntry
from shardscope.backend.runs.launcher import RunConfig
from shardscope.backend.runs.rundir import checkpoints, new_run_dir
from shardscope.widgets.checkpoint_view import CheckpointView
from shardscope.widgets.workers import run_in_background

DEMO_STEPS = 30
HINT = ("Demo finished: this is its last checkpoint. Try: click a module to see its shards stacked · the Ranks "
        "tab · Ctrl+E export · Ctrl+Shift+V verify contents · Help › What a shard map shows")
ENDED = ("finished", "failed", "stopped")


def demo_config() -> RunConfig:
    """The demo's run: a tiny transformer, FSDP2 on 2 CPU ranks, a checkpoint every 10 steps."""
    return RunConfig(strategy="fsdp", nproc=2, steps=DEMO_STEPS, checkpoint_every=10)


def first_tensor(view: CheckpointView, prefer: str = "model.") -> str | None:
    """The first model tensor in the tree's order (else the first tensor), for a first selection."""
    if view.data is None:
        return None
    names = [t.fqn for t in view.data.ckpt.tensors if isinstance(t, TensorEntry)]
    preferred = [n for n in names if n.startswith(prefer)]
    return (preferred or names or [None])[0]


class DemoGuide(QObject):
    """Follows one run in the window's Training tab and opens its last checkpoint when it ends."""

    def __init__(self, window, run_dir: str) -> None:
        super().__init__(window)
        self.window, self.run_dir = window, str(run_dir)
        self.view: CheckpointView | None = None
        self.state = "starting"

    def on_state(self, run_dir: str, state: str) -> None:
        if str(Path(run_dir)) != str(Path(self.run_dir)) or self.state in ENDED:
            return
        self.state = state
        if state == "finished":
            run_in_background(lambda progress=None: [str(p) for p in checkpoints(self.run_dir)], owner=self,
                              on_result=self._open_last)
        elif state in ENDED:
            self.window.statusBar().showMessage(f"The demo run {state}: its logs are in the Training tab.")

    def _open_last(self, found: list[str]) -> None:
        if not found:
            self.window.statusBar().showMessage("The demo run wrote no checkpoint; see its logs in the Training tab.")
            return
        self.view = self.window.open_path(found[-1])
        self.view.loaded.connect(self._select_first)

    def _select_first(self, _data: object) -> None:
        assert self.view is not None
        fqn = first_tensor(self.view)
        if fqn:
            self.view.select_path(fqn)
        self.window.show_note(HINT, self.view)  # until another checkpoint or run is shown


def start_demo(window, config: RunConfig | None = None, run_dir: str | None = None) -> DemoGuide | None:
    """Start the demo run in ``window``'s Training tab (shown at once) and follow it."""
    panel = window.training_panel()
    run_dir = str(run_dir or new_run_dir())
    guide = DemoGuide(window, run_dir)
    panel.runStateChanged.connect(guide.on_state)
    if not panel.start_run(run_dir, config or demo_config()):
        return None
    window.show_note("The demo is training a tiny model with FSDP on 2 CPU ranks; its last checkpoint opens here "
                     "when it ends.", panel)
    return guide
