"""The real window survives thousands of actions (issue 10): run in its own process, so an abort in a C
extension (PySide6 6.12.0's lost references to None) is a failed test that shows the abort message.

2,000 actions (about 2 minutes on a busy 2-core machine); ``benchmarks/soak_long.py`` runs the same
driver for hours.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from soak_driver import REFCOUNT_SLACK, WARMUP_ACTIONS, make_big_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.gui]

HERE = Path(__file__).parent
# A count, not a time: a busy machine (2-11 actions/s measured with the load average at 9-12 on 2 cores)
# takes longer rather than proving less. 2,000 took 54-106 s of actions at a load average of 2-4.
ACTIONS = 2000
# Growth after the warm-up, per action. Measured over 1,700 actions: live objects +277 (of 237,000),
# resident memory grew 10 KiB per action (the run's metrics keep growing; malloc keeps freed
# pages). What a leak of ours costs: a worker kept per started worker (the PySide6 pool bug worked around
# in widgets/workers.py) about 10 objects each, one 512-chunk map or chunk table kept per selection
# thousands of objects and ~300 KiB, one window-sized pixmap per action 3.5 MiB.
OBJECTS_PER_ACTION = 1.0
OBJECTS_SLACK = 3000  # caches that fill once (pyqtgraph's, the tooltip's, a new tab's)
# No single type may gain more than this (the same things on screen at both counts): the total hides a
# leak behind caches that empty (with the PySide6 pool bug put back, 2,000 actions ended with 2,200 fewer
# objects in all, but 45 workers and 516 QRectF kept). Measured: at most 150 (pyqtgraph Points: the
# run's "resumed" markers and axes, which grow with the run). A type kept once per 5 actions fails.
TYPE_SLACK = 300
TYPE_PER_ACTION = 0.02
RSS_KIB_PER_ACTION = 40  # four times what was measured
RSS_SLACK_MIB = 32


@pytest.fixture(scope="module")
def big512(fixtures) -> Path:
    """``model.big.weight`` in 512 chunks from 512 writer ranks (kept next to the session fixtures)."""
    return make_big_checkpoint(fixtures["fsdp2_r4"].parent)


def test_window_survives_thousands_of_actions(fixtures, big512, tmp_path):
    steps = fixtures["steps_r2"]
    cmd = [sys.executable, str(HERE / "soak_driver.py"), str(big512), str(fixtures["fsdp2_r4"]),
           "--compare", str(steps / "step2"), str(steps / "step3"), "--run-dir", str(tmp_path / "run"),
           "--seconds", "0", "--min-actions", str(ACTIONS), "--max-actions", str(ACTIONS), "--max-seconds", "900",
           "--seed", "10"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    # an abort (SIGABRT: -6) or a failed check: show what the process said, the abort's stack first
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-6000:]}\n{proc.stdout[-2000:]}"
    assert "Fatal Python error" not in proc.stderr
    summary = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("SOAK "))[5:])
    print(json.dumps(summary, indent=1))  # shown with `pytest -rP`: how much was done, how fast, memory
    assert summary["problem"] is None and summary["errors"] == []
    kinds = summary["by_kind"]
    # every kind of action, enough of each that the run means something
    assert summary["actions"] == ACTIONS, summary
    assert kinds["select"] >= 400 and kinds["hover"] >= 400 and kinds["compare"] >= 80 and kinds["plots"] >= 40, kinds
    assert all(kinds.get(k, 0) >= 3 for k in ("zoom", "right_tab", "main_tab", "rank", "filter", "reload", "layout"))
    assert summary["tooltips_checked"] >= 200, summary
    assert summary["plotted_points"] >= 100 and summary["metrics_lines"] >= 200, summary
    (first_actions, *first), (_last_actions, *last) = summary["refcounts_first_last"]
    assert first_actions < summary["actions"]
    assert all(b >= a - REFCOUNT_SLACK for a, b in zip(first, last, strict=True)), summary["refcounts_first_last"]
    (warm, objects0, rss0), (end, objects1, rss1) = summary["live_objects_rss_mib"]
    assert warm == WARMUP_ACTIONS and end == ACTIONS
    assert objects1 - objects0 <= OBJECTS_SLACK + OBJECTS_PER_ACTION * (end - warm), \
        f"live Python objects grew from {objects0:,} to {objects1:,} over {end - warm:,} actions: a leak"
    worst = summary["types_grown"][0] if summary["types_grown"] else ("-", 0)
    assert worst[1] <= TYPE_SLACK + TYPE_PER_ACTION * (end - warm), \
        f"{worst[1]:,} more live {worst[0]} objects after {end - warm:,} actions: a leak ({summary['types_grown']})"
    kept = summary["kept_at_end"]  # at most one worker per widget slot (a view's last load, a poll) outlives its work
    assert kept["workers"] <= 12 and kept["checkpoint_views"] == kept["views_open"], kept
    assert rss1 - rss0 <= RSS_SLACK_MIB + RSS_KIB_PER_ACTION * (end - warm) / 1024, \
        f"resident memory grew from {rss0} to {rss1} MiB over {end - warm:,} actions"
