"""DeepSpeed ZeRO checkpoints (stages 1-3, fp32/fp16/bf16), read without DeepSpeed and without running its pickles:
a tag folder (``global_step2/``: ``*_model_states.pt`` and ``*_optim_states.pt`` per rank), or the save folder
around it (its ``latest`` file chooses the tag, and the checkpoint says so).

:mod:`..checkpoint.deepspeed_state` reads the rank files through an allow-list into flat element ranges of zip
records. Here each range becomes chunks of the one model: a flat range of a row-major tensor is a few N-D boxes,
each one contiguous run of the record, so the shard map draws ZeRO-1/2's flat partitions (a parameter may straddle
two ranks) and ZeRO-3's per-parameter partitions like DCP chunks, and the one chunk reader reads them with the
record's stored CRC32 checked. The tree: every parameter under its module name (the fp32 master weights, as
``zero_to_fp32`` gives them), frozen parameters, buffers and tied names; the optimizer state per parameter under
``optimizer.state.<name>.<exp_avg|...>``; ``deepspeed.config``, the step and versions as values."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from ..filenames import (
    DS_LATEST,
    ds_model_file,
    ds_optim_file,
    is_deepspeed_save_dir,
    is_deepspeed_step_folder,
    parse_ds_latest,
)
from .base import RESUMABLE, Facts, FileNames, Format, StorageOptions, Target, head

if TYPE_CHECKING:
    from ..checkpoint.deepspeed_state import DeepSpeedState
    from ..checkpoint.model import Checkpoint, Problem
    from ..progress import Progress

OPTIMIZER_ROOT = "optimizer.state."  # where the optimizer's per-parameter state sits in the tree
VALUES_ROOT = "deepspeed."  # the save's config, step and versions (training state: not exported by default)


class DeepSpeedFormat(Format):
    name = "deepspeed"
    label = "DeepSpeed ZeRO checkpoint"
    kind = RESUMABLE

    def detect_folder(self, name: str, files: FileNames, dirs: list[str]) -> bool:
        return is_deepspeed_step_folder(files)

    def opens_folder(self, name: str, files: FileNames, dirs: list[str]) -> bool:
        """The save folder: a listing walks into it (it is the run), but opening it opens its ``latest`` tag."""
        return is_deepspeed_save_dir(files, dirs)

    def probe_folder(self, path: str, names: set[str], dirs: list[str], local: bool = True) -> Facts:
        optim = sorted({o[1] for n in names if (o := ds_optim_file(n)) is not None})
        models = {m[0] for n in names if (m := ds_model_file(n)) is not None}
        ranks = optim or sorted(r for r in models if r is not None)
        pinned = _named_by_latest(path) if local else ""
        if not optim:
            return Facts(self.name, "incomplete", "no optimizer-states files: the save did not finish (or is not "
                         "a ZeRO save)", ranks, RESUMABLE, pinned=pinned)
        gaps = sorted(set(range(optim[-1] + 1)) - set(optim))
        if gaps:
            return Facts(self.name, "incomplete", f"no optimizer-states file of rank(s) {gaps}", ranks, RESUMABLE,
                         pinned=pinned)
        zero3 = {r for r in models if r is not None}
        if zero3 and sorted(zero3) != optim:
            return Facts(self.name, "incomplete", f"model-states files of ranks {sorted(zero3)} but optimizer-states "
                         f"files of ranks {optim}", ranks, RESUMABLE, pinned=pinned)
        return Facts(self.name, "complete", "", ranks, RESUMABLE, pinned=pinned)

    def open(self, path: Target, storage_options: StorageOptions | None = None, use_cache: bool = True,
             progress: Progress | None = None) -> Checkpoint:
        from ..checkpoint.deepspeed_state import read_deepspeed_state
        from ..errors import CheckpointError
        from ..filenames import is_url

        if is_url(str(path)) or not isinstance(path, str | os.PathLike):
            raise CheckpointError(f"{path}: DeepSpeed checkpoints are read from a local folder; copy it here first.",
                                  path=str(path))
        state = read_deepspeed_state(str(path))
        return to_checkpoint(state, str(path))

    def deep_checks(self, ckpt: Checkpoint, progress: Progress | None = None) -> list[Problem]:
        """Every zip record no chunk reads (the pickles, the bf16 module weights, the padding's records) read once
        and its CRC32 checked; the records chunks read are checked as they are read."""
        from ..checkpoint.deepspeed_read import check_record
        from ..checkpoint.storage import LocalHandles

        state, covered = ckpt.format_data["state"], ckpt.format_data["covered"]
        problems = []
        with LocalHandles(state.folder) as handles:
            for file, records in sorted(state.records.items()):
                for key in sorted(records):
                    if (file, key) in covered:
                        continue
                    if progress is not None:
                        progress.check()
                    problem = check_record(handles, state, file, key)
                    if problem is not None:
                        problems.append(problem)
        return problems


def _named_by_latest(path: str) -> str:
    """Why a tag folder is kept whatever the rules: the save folder's ``latest`` names it (what a resume loads)."""
    parent = os.path.dirname(os.path.abspath(path))
    text = head(os.path.join(parent, DS_LATEST), 4096)
    tag = parse_ds_latest(text) if text else None
    return f"the save folder's {DS_LATEST} file names it" if tag == os.path.basename(os.path.abspath(path)) else ""


def flat_boxes(shape: tuple[int, ...], start: int, count: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the boxes that cover flat elements ``start .. start+count`` of a row-major tensor of
    ``shape``, in order; each box is one contiguous run of the flat storage (at most 2 per dimension)."""
    if count <= 0:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (count,))]
    inner = math.prod(shape[1:])
    end = start + count
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    row, off = divmod(start, inner)
    if off:  # the rest of a first, partial slice
        take = min(end, (row + 1) * inner) - start
        out += [((row, *o), (1, *s)) for o, s in flat_boxes(shape[1:], off, take)]
        start += take
        if start >= end:
            return out
    first, last = start // inner, end // inner
    if last > first:  # whole slices
        out.append(((first, *(0,) * (len(shape) - 1)), (last - first, *shape[1:])))
    tail = end - last * inner
    if tail:  # the start of a last, partial slice
        out += [((last, *o), (1, *s)) for o, s in flat_boxes(shape[1:], 0, tail)]
    return out


def to_checkpoint(state: DeepSpeedState, opened: str) -> Checkpoint:
    """The one checkpoint model of a read DeepSpeed state: chunks at the pieces' boxes, located in their records."""
    import numpy as np

    from ..checkpoint.dtypes import ITEMSIZE, contiguous_strides
    from ..checkpoint.items import StoredTensor
    from ..checkpoint.model import Checkpoint, ChunkTable, FileInfo, ObjectEntry, TensorEntry

    names = sorted({n for r in state.ranks for n in (r.model_file, r.optim_file) if n})
    rank_of: dict[str, int | None] = {}
    for r in state.ranks:
        if r.optim_file:
            rank_of[r.optim_file] = r.rank
        if r.model_file:
            rank_of.setdefault(r.model_file, r.rank if state.stage == 3 else None)
    files = [FileInfo(n, rank_of.get(n), _size(state.folder, n)) for n in names]
    file_index = {f.name: i for i, f in enumerate(files)}
    ckpt = Checkpoint(state.folder, DEEPSPEED.name, state.ds_version, files, [], [], ChunkTable.empty())
    cols: dict[str, list[int]] = {k: [] for k in ("tensor", "file", "offset", "length", "dim_start", "dims")}
    located: dict[tuple[str, str, int], StoredTensor] = {}
    covered: set[tuple[str, str]] = set()

    def add(fqn: str, shape: tuple[int, ...], dtype: str, pieces: tuple) -> None:
        first = len(cols["tensor"])
        size = ITEMSIZE.get(dtype, 1)
        for p in sorted(pieces, key=lambda p: p.start):
            rec = state.records[p.file][p.key]
            at = p.start
            for offsets, sizes in flat_boxes(shape, p.start, p.numel):
                n = math.prod(sizes)
                byte = p.byte_offset + (at - p.start) * size
                cols["tensor"].append(len(ckpt.tensors))
                cols["file"].append(file_index[p.file])
                cols["offset"].append(byte)
                cols["length"].append(n * size)
                cols["dim_start"].append(len(cols["dims"]))
                cols["dims"].extend((*offsets, *sizes))
                located[(fqn, p.file, byte)] = StoredTensor(dtype, sizes, contiguous_strides(sizes),
                                                            (byte - rec.offset) // size, rec.offset, rec.nbytes,
                                                            rec.crc32)
                at += n
            covered.add((p.file, p.key))
        ckpt.tensors.append(TensorEntry(fqn, dtype, shape, first, len(cols["tensor"]) - first, ckpt))

    for name in state.names():
        t = state.tensor(name)
        add(name, t.shape, t.dtype, t.pieces)
    for name, t in state.tensors.items():
        for which, pieces in t.optimizer.items():
            add(f"{OPTIMIZER_ROOT}{name}.{which}", t.shape, pieces[0].dtype if pieces else t.dtype, pieces)
    n = len(cols["tensor"])
    ckpt.chunk_table = ChunkTable(np.asarray(cols["tensor"], np.int32).reshape(n),
                                  np.asarray(cols["file"], np.int32).reshape(n),
                                  np.asarray(cols["offset"], np.int64).reshape(n),
                                  np.asarray(cols["length"], np.int64).reshape(n),
                                  np.asarray(cols["dim_start"], np.int64).reshape(n),
                                  np.asarray(cols["dims"], np.int64))
    ckpt.located = located
    ckpt.format_data = {"state": state, "covered": covered}  # for deep_checks
    values = {"config": state.ds_config, "version": state.ds_version, "zero_stage": state.stage,
              "dp_world_size": state.dp_world_size, "mp_world_size": state.mp_world_size,
              "global_steps": state.global_steps, "global_samples": state.global_samples,
              "skipped_steps": state.skipped_steps, "tag": state.tag}
    ckpt.objects = [ObjectEntry(f"{VALUES_ROOT}{k}", None, 0, 0, None, v, True) for k, v in values.items()
                    if v is not None]
    ckpt.problems = list(state.problems)
    if os.path.abspath(opened) != os.path.abspath(state.folder):
        ckpt.notes.append(f"tag {state.tag}, as the save folder's {DS_LATEST} file names it")
    ckpt.reindex()
    return ckpt


def _size(folder: str, name: str) -> int | None:
    try:
        return os.stat(os.path.join(folder, name)).st_size
    except OSError:
        return None


DEEPSPEED = DeepSpeedFormat()
FORMAT = DEEPSPEED
