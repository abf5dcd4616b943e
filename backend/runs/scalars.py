"""Scalars a script logged without ``report()``: TensorBoard event files (``torch.utils.tensorboard``,
Lightning's default logger) and Lightning CSVLogger ``metrics.csv``, read live as they grow.

Event files are read with TensorBoard's own reader (``pip install shardscope[tensorboard]``), never a
home-made protobuf parser. Tags are mapped to our metric fields by name (``train/loss``, ``train_loss``,
``loss_step`` -> loss; ``lr-AdamW``, ``learning_rate`` -> lr; ...).
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
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
        try:
            from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
            from tensorboard.util import tensor_util
        except ImportError:
            raise ShardscopeError(f"{path}: reading TensorBoard event files needs "
                                  "`pip install shardscope[tensorboard]`") from None
        self.path = path
        self._loader = EventFileLoader(str(path))
        self._tensor_util = tensor_util
        self.tags: dict[str, str] = {}

    def read(self) -> ScalarBatch:
        """New scalar records from the event file, one per step, in time order."""
        by_step: dict[int, dict[str, Any]] = {}
        for event in self._loader.Load():
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                name = field_for(value.tag)
                if name is None or not _choose(self.tags, value.tag, name):
                    continue
                number = self._number(value)
                if number is None:
                    continue
                rec = by_step.setdefault(event.step, {"step": event.step, "time": event.wall_time})
                rec[name] = number
        return ScalarBatch(sorted(by_step.values(), key=lambda r: r["time"]))

    def _number(self, value: Any) -> float | None:
        kind = value.WhichOneof("value")
        if kind == "simple_value":
            return float(value.simple_value)
        if kind == "tensor":
            arr = self._tensor_util.make_ndarray(value.tensor)
            if arr.size == 1 and arr.dtype.kind in "fiu":
                return float(arr.reshape(()))
        return None


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
        return ScalarBatch([r for r in (self._record(row) for row in rows) if r], replace=replace)

    def _record(self, row: dict[str, str]) -> dict[str, Any] | None:
        step = _float(row.get("step"))
        if step is None:
            return None
        rec: dict[str, Any] = {"step": step}
        for tag, text in row.items():
            name = field_for(tag or "")
            value = _float(text)
            if name is not None and value is not None and _choose(self.tags, tag, name):
                rec[name] = value
        return rec if len(rec) > 1 else None


def _float(text: str | None) -> float | None:
    try:
        v = float(text) if text not in (None, "") else None
    except ValueError:
        return None
    return v if v is not None and math.isfinite(v) else None


def open_source(path: Path) -> EventFileSource | CsvLogSource:
    """The reader for a scalar log file found by :func:`rundir.scalar_logs`."""
    return EventFileSource(path) if EVENT_MARK in path.name else CsvLogSource(path)
