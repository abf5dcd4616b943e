"""The one reader of metric logs: Shardscope's ``metrics/rank_N.jsonl`` (one line per ``report()``),
TensorBoard event files (``torch.utils.tensorboard``, Lightning's default logger), Lightning CSVLogger
``metrics.csv`` and an HF Trainer's ``trainer_state.json`` log history. The Training panel's follower reads
them live as they grow (:func:`read_rank_metrics`, :func:`open_metric_log`); the Library's metric at a
checkpoint's step (:mod:`..library.step_metrics`) reads them whole, through the same functions.

Event files are read with TensorBoard's own reader (``pip install shardscope[tensorboard]``), never a
home-made protobuf parser. For the panel, tags are mapped to our metric fields by name (``train/loss``,
``train_loss``, ``loss_step`` -> loss; ``lr-AdamW``, ``learning_rate`` -> lr; ...).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ShardscopeError

# field -> tag patterns, most specific first (matched against the lower-cased tag)
TAG_FIELDS: dict[str, tuple[str, ...]] = {
    "loss": (r"^(train[/_])?loss(_step)?$", r"^loss/train$", r"^train[/_]loss(_step|_epoch)?$", r"loss"),
    "lr": (r"^(lr|learning[_-]?rate)$", r"^lr[-/_]", r"(^|/)lr$", r"learning[_-]?rate"),
    "tokens_per_s": (r"tokens?[_/]?per[_/]?s(ec(ond)?)?$", r"tok(en)?s/s$", r"throughput"),
    "steps_per_s": (r"(steps|it|iter)[_/]?per[_/]?s(ec(ond)?)?$", r"it/s$"),
    "cuda_allocated": (r"(cuda|gpu).*(alloc|memory|mem)",),
    "rss": (r"(rss|cpu[_/]?mem|memory)",),
}
EXCLUDE = re.compile(r"(^|[/_])(val|valid|validation|test|eval)([/_]|$)")
EVENT_MARK = "tfevents"
MAX_STATE_BYTES = 64 << 20  # a trainer_state.json (or a whole metrics.csv) read at most


def number(v: object) -> float | None:
    """A finite float from a logged value (a number, or a CSV cell's text); None for anything else
    (blank, NaN, infinity, a bool)."""
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


# ---------------------------------------------------------------------------------------------- rank_N.jsonl
def read_new_records(path: str | os.PathLike, offset: int, size: int | None = None) -> tuple[list[dict], int]:
    """The JSON objects on the complete lines of a JSONL file from byte ``offset`` (to ``size``, else to its
    end), and the bytes they took: a line still being written waits for the next read. Raises OSError."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read() if size is None else f.read(max(0, size - offset))
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records, end


def rank_metric_files(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(rank, path) of each ``metrics/rank_N.jsonl`` of a run folder, by name."""
    out = []
    for p in sorted((Path(run_dir) / "metrics").glob("rank_*.jsonl")):
        try:
            out.append((int(p.stem.split("_")[1]), p))
        except ValueError:
            continue
    return out


def read_rank_metrics(run_dir: str | os.PathLike, offsets: dict[int, int] | None = None
                      ) -> dict[int, list[dict[str, Any]]]:
    """New metric records per rank since ``offsets`` (byte positions, updated in place)."""
    offsets = offsets if offsets is not None else {}
    out: dict[int, list[dict]] = {}
    for rank, p in rank_metric_files(run_dir):
        try:
            recs, used = read_new_records(p, offsets.get(rank, 0))
        except OSError:
            continue
        offsets[rank] = offsets.get(rank, 0) + used
        out[rank] = recs
    return out


# ---------------------------------------------------------------------------------------------- TensorBoard
def event_loader(path: str | os.PathLike) -> Any:
    """TensorBoard's incremental reader of one event file (each ``Load()`` yields the events added since)."""
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    except ImportError:
        raise ShardscopeError(f"{path}: reading TensorBoard event files needs "
                              "`pip install shardscope[tensorboard]`") from None
    return EventFileLoader(str(path))


def summary_values(loader: Any) -> Iterator[tuple[Any, Any]]:
    """(event, summary value) of each value of the summary events a loader has new."""
    for event in loader.Load():
        if event.HasField("summary"):
            for value in event.summary.value:
                yield event, value


def scalar_of(value: Any) -> float | None:
    """A summary value as one number (a simple value, or a one-element numeric tensor), else None."""
    kind = value.WhichOneof("value")
    if kind == "simple_value":
        return float(value.simple_value)
    if kind == "tensor":
        from tensorboard.util import tensor_util  # an optional dependency: event_loader has checked it

        arr = tensor_util.make_ndarray(value.tensor)
        if arr.size == 1 and arr.dtype.kind in "fiu":
            return float(arr.reshape(()))
    return None


# ---------------------------------------------------------------------------------------------- HF Trainer
def trainer_log_history(path: str | os.PathLike) -> list[Any]:
    """An HF Trainer's ``trainer_state.json`` ``log_history`` (one dict per logging step); [] when unreadable."""
    try:
        if os.path.getsize(path) > MAX_STATE_BYTES:
            return []
        with open(path, "rb") as f:
            return json.load(f).get("log_history") or []
    except (OSError, ValueError, AttributeError):
        return []


def field_for(tag: str) -> str | None:
    """Our metric field for a logged tag name, or None (validation and test scalars are left out)."""
    t = tag.lower()
    if EXCLUDE.search(t) or t.startswith("epoch") or t == "step":
        return None
    for name, patterns in TAG_FIELDS.items():
        if any(re.search(p, t) for p in patterns):
            return name
    return None


@dataclass
class ScalarBatch:
    """New records from one log file; ``replace`` when the file was rewritten (drop what was read)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    replace: bool = False


def _choose(tags: dict[str, str], tag: str, name: str) -> bool:
    """Keep the first tag seen for each field (a run logging train/loss and loss_epoch plots one)."""
    return tags.setdefault(name, tag) == tag


class EventFileSource:
    """One TensorBoard event file, read incrementally with TensorBoard's EventFileLoader."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._loader = event_loader(path)
        self.tags: dict[str, str] = {}

    def read(self) -> ScalarBatch:
        """New scalar records from the event file, one per step, in time order."""
        by_step: dict[int, dict[str, Any]] = {}
        for event, value in summary_values(self._loader):
            name = field_for(value.tag)
            if name is None or not _choose(self.tags, value.tag, name):
                continue
            num = scalar_of(value)
            if num is None:
                continue
            rec = by_step.setdefault(event.step, {"step": event.step, "time": event.wall_time})
            rec[name] = num
        return ScalarBatch(sorted(by_step.values(), key=lambda r: r["time"]))


class CsvLogSource:
    """A Lightning CSVLogger metrics.csv. Lightning rewrites the whole file when a new column appears,
    so a changed header (or a shorter file) means: read it again from the top."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.header: list[str] | None = None
        self.tags: dict[str, str] = {}

    def read(self) -> ScalarBatch:
        """New complete rows of the CSV as records; everything again (``replace``) when the file was rewritten."""
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                head = f.readline()
                header = next(csv.reader([head.decode("utf-8", "replace")]), [])
                replace = header != self.header or size < self.offset
                if replace:
                    self.header, self.offset, self.tags = header, len(head), {}
                f.seek(self.offset)
                data = f.read(max(0, size - self.offset))
        except OSError:
            return ScalarBatch()
        end = data.rfind(b"\n") + 1  # a row still being written waits for the next read
        self.offset += end
        rows = csv.DictReader(io.StringIO(data[:end].decode("utf-8", "replace")), fieldnames=self.header)
        return ScalarBatch([r for r in (self._record(*row) for row in csv_scalars(rows)) if r], replace=replace)

    def _record(self, step: float, values: dict[str, float]) -> dict[str, Any] | None:
        rec: dict[str, Any] = {"step": step}
        for tag, value in values.items():
            name = field_for(tag)
            if name is not None and _choose(self.tags, tag, name):
                rec[name] = value
        return rec if len(rec) > 1 else None


def csv_scalars(rows: Iterable[dict[str, str]]) -> Iterator[tuple[float, dict[str, float]]]:
    """Each row of a Lightning CSVLogger metrics.csv that has a step: (step, its numeric columns by name,
    without step and epoch; a metric not logged in the row is blank there and left out)."""
    for row in rows:
        step = number(row.get("step"))
        if step is None:
            continue
        values = {}
        for tag, text in row.items():
            value = number(text)
            if tag and value is not None and tag not in ("step", "epoch"):
                values[tag] = value
        yield step, values


def open_metric_log(path: Path) -> EventFileSource | CsvLogSource:
    """The live reader for a scalar log file found by :func:`.rundir.scalar_logs`."""
    return EventFileSource(path) if EVENT_MARK in path.name else CsvLogSource(path)
