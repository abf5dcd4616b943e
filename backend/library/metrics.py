"""A metric at a checkpoint's step, from whatever the run logged: Shardscope's ``metrics/rank_N.jsonl``
(mean over ranks), Lightning's CSVLogger ``metrics.csv``, TensorBoard event files (Lightning's default
logger), or an HF Trainer checkpoint's ``trainer_state.json``. Files are read incrementally or cached by
size and time, so polling a live run stays cheap."""

from __future__ import annotations

import bisect
import csv
import glob
import io
import json
import logging
import math
import os
import threading
from dataclasses import dataclass, field

from .scan import RunRecord

MAX_STATE_BYTES = 64 << 20
log = logging.getLogger(__name__)


@dataclass
class _FileState:
    ident: tuple[int, int]  # (device, inode): a replaced file is read afresh
    offset: int = 0
    values: dict[str, dict[int, float]] = field(default_factory=dict)  # metric -> step -> last value


_cache: dict[str, _FileState] = {}
_lock = threading.Lock()


def _number(v: object) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int | float):
        return float(v) if math.isfinite(v) else None
    if isinstance(v, str) and v.strip():
        try:
            f = float(v)
        except ValueError:
            return None
        return f if math.isfinite(f) else None
    return None


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
            with open(path, "rb") as f:
                f.seek(state.offset)
                data = f.read(st.st_size - state.offset)
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
            state.offset += end
            for line in data[:end].splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                step = rec.get("step") if isinstance(rec, dict) else None
                if not isinstance(step, int):
                    continue
                for key, v in rec.items():
                    num = _number(v)
                    if num is not None and key != "step":
                        state.values.setdefault(key, {})[step] = num
        return state.values


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
            rows = csv.DictReader(io.StringIO(f.read(MAX_STATE_BYTES)))
            out: dict[str, dict[int, float]] = {}
            for row in rows:
                step = _number(row.get("step"))
                if step is None:
                    continue
                for key, v in row.items():
                    num = _number(v)
                    if num is not None and key not in ("step", "epoch"):
                        out.setdefault(str(key), {})[int(step)] = num
            return out
    except (OSError, csv.Error, UnicodeDecodeError):
        return {}


@_whole_file_cached
def _event_values(path: str) -> dict[str, dict[int, float]]:
    """Scalars of a TensorBoard event file by tag (Lightning's default logger), with TensorBoard's own reader."""
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.util import tensor_util
    except ImportError:
        log.warning("%s: reading TensorBoard event files needs `pip install shardscope[tensorboard]`", path)
        return {}
    out: dict[str, dict[int, float]] = {}
    try:
        for event in EventFileLoader(path).Load():
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                kind = value.WhichOneof("value")
                num: float | None = None
                if kind == "simple_value":
                    num = _number(float(value.simple_value))
                elif kind == "tensor":
                    arr = tensor_util.make_ndarray(value.tensor)
                    num = _number(float(arr.reshape(()))) if arr.size == 1 and arr.dtype.kind in "fiu" else None
                if num is not None:
                    out.setdefault(value.tag, {})[int(event.step)] = num
    except Exception:  # a damaged event file: what was read so far counts; the rest is logged
        log.warning("%s: stopped reading the event file", path, exc_info=True)
    return out


@_whole_file_cached
def _trainer_state_values(path: str) -> dict[str, dict[int, float]]:
    try:
        if os.path.getsize(path) > MAX_STATE_BYTES:
            return {}
        with open(path, "rb") as f:
            history = json.load(f).get("log_history") or []
    except (OSError, ValueError, AttributeError):
        return {}
    out: dict[str, dict[int, float]] = {}
    for rec in history:
        step = rec.get("step") if isinstance(rec, dict) else None
        if isinstance(step, int):
            for key, v in rec.items():
                num = _number(v)
                if num is not None and key != "step":
                    out.setdefault(key, {})[step] = num
    return out


def run_metric(run: RunRecord, metric: str) -> dict[int, float]:
    """``step -> value`` of ``metric`` for a run (Shardscope: the mean over ranks at each step)."""
    per_rank = [_jsonl_values(p).get(metric, {}) for p in sorted(glob.glob(os.path.join(run.path, "metrics",
                                                                                       "rank_*.jsonl")))]
    per_rank = [v for v in per_rank if v]
    if per_rank:
        steps = set().union(*per_rank)
        return {s: sum(v[s] for v in per_rank if s in v) / sum(1 for v in per_rank if s in v) for s in steps}
    for csv_path in (os.path.join(run.path, "metrics.csv"), *sorted(glob.glob(os.path.join(run.path, "*",
                                                                                           "metrics.csv")))):
        values = _csv_values(csv_path).get(metric)
        if values:
            return values
    events = sorted(glob.glob(os.path.join(run.path, "*tfevents*")) +
                    glob.glob(os.path.join(run.path, "*", "*tfevents*")))
    merged: dict[int, float] = {}
    for path in events:  # oldest first: a resumed run's later file wins
        merged.update(_event_values(path).get(metric, {}))
    if merged:
        return merged
    out: dict[int, float] = {}
    for c in run.checkpoints:  # HF Trainer: each checkpoint carries the history up to it
        if c.format == "hf-trainer":
            out.update(_trainer_state_values(os.path.join(c.path, "trainer_state.json")).get(metric, {}))
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

