"""What the Training panel's header says about the followed run: its state in colour, progress, why it waits,
stops or stalled, and the last line of each failed rank's traceback."""

from __future__ import annotations

from ..backend.runs.follow import RunFollower, RunSnapshot
from ..backend.runs.rundir import ACTIVE_STATES, OVER_STATES
from .run_logs import without_banners

STATE_COLORS = {"failed": "#d62728", "ended": "#d62728", "stopped": "#7f7f7f", "finished": "#2ca02c",
                "queued": "#e6a000"}


def escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def stop_how(status: dict) -> str:
    """How a run with this ``status.json`` is stopped, in the user's words."""
    return "scancel" if status.get("scheduler") == "slurm" else \
        "SIGTERM to every process of the run, SIGKILL after 10 s"


def failures_of(snap: RunSnapshot) -> dict[int, str]:
    """Each failed rank's traceback (-1: torchrun's), without torchrun's start-up notices."""
    return {r: tb for r, tb in ((r, without_banners(tb)) for r, tb in snap.failures.items())
            if tb or r != -1}  # the launcher's log with nothing but notices says nothing more


def resume_words(note: str, over: bool) -> str:
    """The launcher's "resuming step 40 of a 2-rank run on 3 ranks (...)" while the run lives; once it is over
    (perhaps stopped before it loaded anything) what is true of it then: "launched to resume step 40 ..."."""
    if not over or not note.startswith("resuming "):
        return note
    return "launched to resume " + note.removeprefix("resuming ").split(" (", 1)[0].removesuffix(", as it was saved")


def header_html(follower: RunFollower, snap: RunSnapshot, stopping: bool, failures: dict[int, str]) -> str:
    """The header of the followed run (``stopping``: a Stop is on its way or was asked for)."""
    st = snap.status
    state = st.get("state")
    shown = state or "no status.json: a run started outside Shardscope; following its files"
    color = STATE_COLORS.get(state or "")
    head = f"<span style='color:{color}'>{shown}</span>" if color else shown
    nodes = f", {st['nodes']}" if st.get("nodes") else ""
    where = f" (SLURM job {st['job_id']}{nodes})" if st.get("job_id") else ""
    parts = [f"<b>{escape(follower.run_dir.name)}</b>: {head}{where}"]
    line = follower.progress()
    if line:
        parts.append(line.replace("  ", " · "))
    if st.get("resumed"):
        parts.append(escape(resume_words(st["resumed"], state in OVER_STATES)))
    if state == "queued":
        parts.append(f"waiting: {escape(st.get('explanation', ''))}")
    if state in ACTIVE_STATES and stopping:
        parts.append(f"stopping: {stop_how(st)} …")
    if snap.stalled:
        parts.append(f"<span style='color:#d62728'><b>stalled</b>: no new step from rank(s) "
                     f"{', '.join(map(str, snap.stalled))} for {follower.stall_limit:.0f} s</span>")
    if state in OVER_STATES and st.get("explanation"):
        parts.append(escape(st["explanation"]))
    for problem in snap.problems:
        parts.append(f"<span style='color:#d62728'>{escape(problem)}</span>")
    for r, tb in sorted(failures.items()):
        # the last line that says something (torchrun's summary ends in a rule of "=", its banner of "*")
        last = next((ln for ln in reversed(tb.splitlines()) if ln.strip(" =-*")), "no traceback recorded")
        who = "torchrun" if r == -1 else f"rank {r}"
        parts.append(f"<span style='color:#d62728'>{who} failed: {escape(last)}</span>")
    return "<br>".join(p for p in parts if p)
