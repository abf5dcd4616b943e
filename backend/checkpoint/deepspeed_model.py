"""The model of a DeepSpeed ZeRO checkpoint as plain dataclasses: which tensors it holds and, for each, the flat
element ranges of zip records (:class:`Piece`) its values lie in. Made by :mod:`.deepspeed_state`, read by
:mod:`.deepspeed_read`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .model import Problem
from .whole_archive import RecordInfo


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``start .. start+numel`` of a flattened tensor, stored as one run in zip record ``key`` of ``file``
    (written by data-parallel ``rank``), from ``byte_offset`` in the file; ``record_crc32`` is the whole record's."""

    rank: int
    file: str
    key: str
    byte_offset: int
    start: int
    numel: int
    dtype: str
    record_crc32: int


@dataclass(frozen=True, slots=True)
class DeepSpeedTensor:
    """One tensor of the checkpoint: ``kind`` is ``trainable`` (fp32 master weights in the optimizer partitions),
    ``frozen`` (not optimized) or ``buffer``; ``optimizer`` maps an optimizer state (``exp_avg``, ...) to its
    pieces, laid out like the master weights. Complete when the pieces cover every element once."""

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]
    optimizer: dict[str, tuple[Piece, ...]] = field(default_factory=dict)
    group: int | None = None

    @property
    def numel(self) -> int:
        """Elements of the tensor (1 for a 0-dim one)."""
        return math.prod(self.shape)

    @property
    def complete(self) -> bool:
        """True when the pieces cover the elements exactly (what :func:`.deepspeed_read.read_tensor` needs)."""
        return covers(self.pieces, self.numel)


def covers(pieces: tuple[Piece, ...], numel: int) -> bool:
    """True when ``pieces`` cover elements 0..numel exactly once."""
    at = 0
    for p in sorted(pieces, key=lambda p: p.start):
        if p.start != at:
            return False
        at += p.numel
    return at == numel


@dataclass(frozen=True, slots=True)
class RankFiles:
    """The files one data-parallel rank wrote (None: missing; below ZeRO-3 every rank shares one model file)."""

    rank: int
    model_file: str | None
    optim_file: str | None


@dataclass(slots=True)
class DeepSpeedState:
    """What a DeepSpeed ZeRO tag folder holds, for one model-parallel rank. ``tensors`` are in the order of
    DeepSpeed's consolidated state dict (buffers, frozen parameters, trainable parameters); ``shared`` maps a tied
    parameter's other name to the name that holds it; ``records`` every zip record of every file read."""

    folder: str
    tag: str
    stage: int
    dp_world_size: int
    mp_world_size: int
    mp_rank: int
    model_dtype: str | None
    master_dtype: str | None
    ds_version: str | None
    ds_config: Any
    global_steps: int | None
    global_samples: int | None
    skipped_steps: int | None
    ranks: tuple[RankFiles, ...]
    tensors: dict[str, DeepSpeedTensor]
    shared: dict[str, str]
    optimizer_states: tuple[str, ...]
    records: dict[str, dict[str, RecordInfo]]
    problems: list[Problem]

    def tensor(self, name: str) -> DeepSpeedTensor:
        """The tensor ``name`` (a tied alias resolves to the tensor it shares); KeyError when absent."""
        return self.tensors[self.shared.get(name, name)]

    def names(self) -> list[str]:
        """Every name DeepSpeed's consolidated state dict has, in its order (tied aliases last)."""
        return [*self.tensors, *(a for a in self.shared if a not in self.tensors)]


__all__ = ["DeepSpeedState", "DeepSpeedTensor", "Piece", "RankFiles", "covers"]
