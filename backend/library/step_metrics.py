"""A metric at a checkpoint's step, from whatever the run logged: Shardscope's ``metrics/rank_N.jsonl``
(mean over ranks), Lightning's CSVLogger ``metrics.csv``, TensorBoard event files (Lightning's default
logger), or an HF Trainer checkpoint's ``trainer_state.json``, each read by :mod:`..runs.metric_logs`.
Files are read incrementally or cached by size and time, so polling a live run stays cheap."""

from __future__ import annotations

import bisect
import csv
import io
import logging
import os
import threading
from dataclasses import dataclass, field

from ..errors import ShardscopeError
from ..filenames import HF_TRAINER_STATE
from ..runs.metric_logs import (
    EVENT_MARK,
    MAX_STATE_BYTES,
    csv_scalars,
    event_loader,
    number,
    rank_metric_files,
    read_new_records,
    scalar_of,
    summary_values,
    trainer_log_history,
)
from ..runs.rundir import SCALAR_LOG_NAMES, scalar_logs
from .records import RunRecord

log = logging.getLogger(__name__)


@dataclass
class _FileState:
    ident: tuple[int, int]  # (device, inode): a replaced file is read afresh
    offset: int = 0
    values: dict[str, dict[int, float]] = field(default_factory=dict)  # metric -> step -> last value


_cache: dict[str, _FileState] = {}
_lock = threading.Lock()


def _jsonl_values(path: str) -> dict[str, dict[int, float]]:
    """Every numeric field of a metrics JSONL file by step (the last record of a step wins: a resumed run)."""
    try:
        st = os.stat(path)
    except OSError:
        return {}
    with _lock:
        state = _cache.get(path)
        if state is None or state.ident != (st.st_dev, st.st_ino) or st.st_size < state.offset:
            state = _cache[path] = _FileState((st.st_dev, st.st_ino))
        if st.st_size > state.offset:
            records, used = read_new_records(path, state.offset, st.st_size)
            state.offset += used
            _add_by_step(records, state.values)
        return state.values


def _add_by_step(records: list, out: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """Every numeric field of records that have an integer ``step`` into ``out`` (a later record of a step wins)."""
    for rec in records:
        step = rec.get("step") if isinstance(rec, dict) else None
        if isinstance(step, int):
            for key, v in rec.items():
                num = number(v)
                if num is not None and key != "step":
                    out.setdefault(key, {})[step] = num
    return out


def _whole_file_cached(read):
    """Cache a whole-file reader by (path, size, mtime): the Library polls every few seconds."""
    cache: dict[str, tuple[tuple[int, int], dict[str, dict[int, float]]]] = {}

    def cached(path: str) -> dict[str, dict[int, float]]:
        try:
            st = os.stat(path)
        except OSError:
            return {}
        stamp = (st.st_size, st.st_mtime_ns)
        with _lock:
            hit = cache.get(path)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        values = read(path)
        with _lock:
            cache[path] = (stamp, values)
        return values

    return cached


@_whole_file_cached
def _csv_values(path: str) -> dict[str, dict[int, float]]:
    """Lightning's CSVLogger file: a ``step`` column and one column per logged metric (blank where not logged)."""
    try:
        with open(path, newline="") as f:
            out: dict[str, dict[int, float]] = {}
            for step, values in csv_scalars(csv.DictReader(io.StringIO(f.read(MAX_STATE_BYTES)))):
                for key, num in values.items():
                    out.setdefault(key, {})[int(step)] = num
            return out
    except (OSError, csv.Error, UnicodeDecodeError):
        return {}


@_whole_file_cached
def _event_values(path: str) -> dict[str, dict[int, float]]:
    """Scalars of a TensorBoard event file by tag (Lightning's default logger), with TensorBoard's own reader."""
    try:
        loader = event_loader(path)
    except ShardscopeError as exc:
        log.warning("%s", exc)
        return {}
    out: dict[str, dict[int, float]] = {}
    try:
        for event, value in summary_values(loader):
            num = number(scalar_of(value))
            if num is not None:
                out.setdefault(value.tag, {})[int(event.step)] = num
    except Exception:  # a damaged event file: what was read so far counts; the rest is logged
        log.warning("%s: stopped reading the event file", path, exc_info=True)
    return out


@_whole_file_cached
def _trainer_state_values(path: str) -> dict[str, dict[int, float]]:
    return _add_by_step(trainer_log_history(path), {})


def run_metric(run: RunRecord, metric: str) -> dict[int, float]:
    """``step -> value`` of ``metric`` for a run (Shardscope: the mean over ranks at each step)."""
    per_rank = [_jsonl_values(str(p)).get(metric, {}) for _rank, p in rank_metric_files(run.path)]
    per_rank = [v for v in per_rank if v]
    if per_rank:
        steps = set().union(*per_rank)
        return {s: sum(v[s] for v in per_rank if s in v) / sum(1 for v in per_rank if s in v) for s in steps}
    # NOTE: the logs the Training panel plots, found as it finds them (Lightning's CSVLogger writes
    # RUN/lightning_logs/version_N/metrics.csv, two levels down: a glob one level down missed it)
    logs = scalar_logs(run.path)
    for csv_path in (p for p in logs if p.name in SCALAR_LOG_NAMES):
        values = _csv_values(str(csv_path)).get(metric)
        if values:
            return values
    merged: dict[int, float] = {}
    for path in (p for p in logs if EVENT_MARK in p.name):
        merged.update(_event_values(str(path)).get(metric, {}))  # oldest first: a resumed run's later file wins
    if merged:
        return merged
    out: dict[int, float] = {}
    for c in run.checkpoints:  # HF Trainer: each checkpoint carries the history up to it
        state = os.path.join(c.path, HF_TRAINER_STATE)
        if not c.is_file and os.path.isfile(state):
            out.update(_trainer_state_values(state).get(metric, {}))
    return out


def value_at(values: dict[int, float], step: int | None) -> float | None:
    """The value logged at ``step``, else the last one logged before it (what the checkpoint had seen)."""
    if step is None or not values:
        return None
    if step in values:
        return values[step]
    steps = sorted(values)
    i = bisect.bisect_right(steps, step)
    return values[steps[i - 1]] if i else None


def checkpoint_metrics(run: RunRecord, metric: str) -> dict[str, float]:
    """``checkpoint path -> metric value at its step`` for the run's checkpoints that have one."""
    values = run_metric(run, metric)
    out = {}
    for c in run.checkpoints:
        v = value_at(values, c.step)
        if v is not None:
            out[c.path] = v
    return out

