"""DeepSpeed ZeRO checkpoints (stage 1, 2 and 3) described without importing deepspeed and without unpickling
arbitrary objects: where every parameter's fp32 master weights and optimizer states lie, as flat element ranges
(:class:`Piece`) of zip records in the rank files, by the rules of DeepSpeed's own ``zero_to_fp32.py``. Nothing
here reads a tensor byte (:mod:`.deepspeed_read` does); every size and count from the files is checked against
the others and against what the files hold, and what does not add up is a :class:`~.model.Problem`."""

from __future__ import annotations

import math
import os
from typing import Any

from ..errors import CheckpointError
from ..filenames import DS_LATEST as LATEST
from ..filenames import ds_model_file as model_file
from ..filenames import ds_optim_file as optim_file
from ..filenames import is_deepspeed_save_dir, is_deepspeed_step_folder
from ..filenames import parse_ds_latest as parse_latest
from .deepspeed_layout import Part, ZeroLayout, flat_layout, zero3_layout
from .deepspeed_model import DeepSpeedState, DeepSpeedTensor, Piece, RankFiles
from .model import MAX_INDEX, MAX_NDIM, Problem
from .storage import LocalHandles
from .unpickler import DEEPSPEED_CLASSES, StandIn, describe
from .whole_archive import StoredArray, TorchArchive, load_torch_archive, plain

MAX_LATEST = 4096  # bytes of a ``latest`` file read
MAX_WORLD = 1 << 16  # data-parallel ranks a checkpoint may claim
MAX_LISTED = 8  # missing ranks named one by one; more are one problem


# ---------------------------------------------------------------- where a checkpoint is
def latest_tag(save_dir: str) -> str:
    """The tag the ``latest`` file of a save folder names: one plain folder name inside it."""
    path = os.path.join(save_dir, LATEST)
    handles = LocalHandles(save_dir)
    try:
        text = handles.read(LATEST, 0, min(handles.size(LATEST), MAX_LATEST))
    finally:
        handles.close()
    tag = parse_latest(text)
    if tag is None:
        raise CheckpointError(f"{path}: does not name a tag folder (one plain folder name); refused.", path=path)
    return tag


def step_folder(path: str, tag: str | None = None) -> tuple[str, str]:
    """(tag folder, tag) of a save folder (its ``latest`` tag, or ``tag``) or of a tag folder itself."""
    try:
        entries = list(os.scandir(path))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot list ({exc.strerror}).", path=path) from None
    files = [e.name for e in entries if e.is_file(follow_symlinks=False)]
    dirs = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    if tag is None and is_deepspeed_step_folder(files):
        return path, os.path.basename(os.path.normpath(path))
    if tag is None and not is_deepspeed_save_dir(files, dirs):
        raise CheckpointError(f"{path}: not a DeepSpeed checkpoint (no model-states file, no 'latest' file).",
                              path=path)
    tag = latest_tag(path) if tag is None else tag
    if parse_latest(tag.encode("utf-8", "replace")) != tag or tag not in dirs:
        raise CheckpointError(f"{path}: the tag {tag[:100]!r} is not a folder of this save folder.", path=path)
    return os.path.join(path, tag), tag


# ---------------------------------------------------------------- checked access to the unpickled trees
class _Reader:
    """The parsed files and the problems found; checked getters that name the file and key on failure."""

    def __init__(self, folder: str, handles: Any) -> None:
        self.folder, self.handles = folder, handles
        self.archives: dict[str, TorchArchive] = {}
        self.problems: list[Problem] = []

    def archive(self, name: str) -> TorchArchive:
        if name not in self.archives:
            self.archives[name] = load_torch_archive(self.handles, name, self.handles.size(name), DEEPSPEED_CLASSES)
        return self.archives[name]

    def fail(self, file: str, message: str) -> CheckpointError:
        where = os.path.join(self.folder, file)
        return CheckpointError(f"{where}: {message}", path=where)

    def get(self, file: str, tree: Any, key: str, types: type | tuple[type, ...], optional: bool = False) -> Any:
        if not isinstance(tree, dict):
            raise self.fail(file, f"expected a dict holding {describe(key)}, found {type(tree).__name__}.")
        value = tree.get(key)
        if value is None and optional:
            return None
        if not isinstance(value, types) or (isinstance(value, bool) and types in (int, (int,))):
            raise self.fail(file, f"{describe(key)} is {type(value).__name__}, not what DeepSpeed writes there.")
        return value

    def count(self, file: str, value: Any, what: str) -> int:
        if isinstance(value, StandIn):  # ZeroStageEnum
            value = value.value
        if type(value) is not int or not 0 <= value < MAX_INDEX:
            raise self.fail(file, f"{what} is {describe(value)}, not a count.")
        return value

    def shapes(self, file: str, value: Any, what: str) -> dict[str, tuple[int, ...]]:
        """A name -> shape dict (``param_shapes`` groups, ``frozen_param_shapes``), every shape checked."""
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise self.fail(file, f"{what} is not a dict of parameter names.")
        out = {}
        for name, shape in value.items():
            if not isinstance(shape, tuple | list) or len(shape) > MAX_NDIM or \
                    not all(type(v) is int and 0 <= v < MAX_INDEX for v in shape) or math.prod(shape) >= MAX_INDEX:
                raise self.fail(file, f"{what}: the shape of {describe(name)} is not a plausible shape.")
            out[name] = tuple(shape)
        return out

    def flat(self, file: str, value: Any, what: str) -> StoredArray:
        if not isinstance(value, StoredArray) or not value.contiguous:
            raise self.fail(file, f"{what} is not a contiguous tensor.")
        return value

    def problem(self, kind: str, message: str, fqn: str | None = None, file: str | None = None) -> None:
        self.problems.append(Problem(kind, message, fqn, file))


def _classify(names: list[str], mp_rank: int, reader: _Reader) -> tuple[dict[int | None, str], dict[int, str]]:
    models: dict[int | None, str] = {}
    optims: dict[int, str] = {}
    prefixes: dict[str, int] = {}
    for n in names:
        if (m := model_file(n)) is not None and m[1] == mp_rank:
            models[m[0]] = n
        elif (o := optim_file(n)) is not None and o[2] == mp_rank:
            prefixes[o[0]] = prefixes.get(o[0], 0) + 1
            optims.setdefault(o[1], n)
    if len(prefixes) > 1:
        reader.problem("mixed", f"optimizer files of several kinds ({sorted(prefixes)}): two saves in one folder")
    if None in models and len(models) > 1:
        reader.problem("mixed", "model files of ZeRO-3 and of ZeRO-1/2 in one folder: two saves in one folder")
    return models, optims


def read_deepspeed_state(path: str, tag: str | None = None, mp_rank: int = 0) -> DeepSpeedState:
    """Describe the DeepSpeed ZeRO checkpoint at ``path`` (a save folder: its ``latest`` tag or ``tag``; or a tag
    folder) for model-parallel rank ``mp_rank``. CheckpointError when a file cannot be read as DeepSpeed writes
    it (a refused pickle global, a damaged archive, a key of the wrong type); what only does not add up across
    files (a missing rank, sizes that disagree) is in ``problems``, and the tensors it touches are incomplete."""
    folder, tag = step_folder(path, tag)
    try:
        names = sorted(e.name for e in os.scandir(folder) if e.is_file(follow_symlinks=False))
    except OSError as exc:
        raise CheckpointError(f"{folder}: cannot list ({exc.strerror}).", path=folder) from None
    handles = LocalHandles(folder)
    try:
        return _read(_Reader(folder, handles), folder, tag, names, mp_rank)
    finally:
        handles.close()


def _read(reader: _Reader, folder: str, tag: str, names: list[str], mp_rank: int) -> DeepSpeedState:
    models, optims = _classify(names, mp_rank, reader)
    if not models:
        raise CheckpointError(f"{folder}: no model-states file of model-parallel rank {mp_rank}.", path=folder)
    if not optims:
        raise CheckpointError(f"{folder}: no optimizer-states files: a DeepSpeed save without ZeRO (or without its "
                              "optimizer); only ZeRO checkpoints are read.", path=folder)
    first = optims[min(optims)]
    osd0 = reader.get(first, reader.archive(first).root, "optimizer_state_dict", dict)
    if "zero_stage" not in osd0:
        raise reader.fail(first, "no zero_stage: not a ZeRO optimizer (DeepSpeed's zero_to_fp32 refuses it too).")
    stage = reader.count(first, osd0["zero_stage"], "zero_stage")
    if stage not in (1, 2, 3):
        raise reader.fail(first, f"ZeRO stage {stage} is not one of 1, 2, 3.")
    counts = osd0.get("partition_count")
    world = max((reader.count(first, c, "partition_count") for c in counts), default=0) \
        if isinstance(counts, list) else reader.count(first, counts, "partition_count")
    if not 1 <= world <= MAX_WORLD:
        raise reader.fail(first, f"partition_count {world} is not a plausible data-parallel world size.")
    if (stage == 3) != (None not in models):
        reader.problem("mixed", f"ZeRO stage {stage} with model files named for stage {'3' if stage < 3 else '1/2'}")
    model0 = models.get(0 if stage == 3 else None) or models[min(models, key=lambda r: -1 if r is None else r)]
    if model0 != models.get(0 if stage == 3 else None):
        reader.problem("missing_file", f"the model file of rank 0 is missing; {model0} stands in for it", file=model0)
    for rank in sorted(set(optims) | {r for r in models if r is not None}):
        if rank >= world:
            reader.problem("extra_file", f"rank {rank}'s files lie beyond the {world} partitions the optimizer names",
                           file=optims.get(rank) or models.get(rank))
    _missing(reader, world, optims, "optimizer")
    if stage == 3:
        _missing(reader, world, models, "model")
    root = reader.archive(model0).root
    if not isinstance(root, dict):
        raise reader.fail(model0, "not a dict: not a DeepSpeed model-states file.")
    parts = _partitions(reader, {r: n for r, n in optims.items() if r < world}, stage)
    model = _model(reader, model0, root, stage)
    if stage == 3:
        frags = {r: _fragments(reader, n) for r, n in sorted(models.items(), key=lambda m: m[0] or 0)
                 if r is not None and r < world}
        layout = zero3_layout(world, model["param_shapes"], parts, model["frozen_shapes"], frags, reader.problem)
    else:
        layout = flat_layout(world, model["param_shapes"], parts, reader.problem)
    return _state(reader, folder, tag, stage, world, mp_rank, models, optims, model, layout, model0)


def _missing(reader: _Reader, world: int, present: dict, what: str) -> None:
    """One problem per missing rank file, or one for them all when many are missing."""
    missing = world - sum(1 for r in present if r is not None and r < world)
    if not missing:
        return
    named = []
    for r in range(world):
        if r not in present:
            named.append(r)
            if len(named) > MAX_LISTED:
                break
    if missing <= MAX_LISTED:
        for r in named:
            reader.problem("missing_file", f"the {what} file of rank {r} (of {world}) is missing")
    else:
        reader.problem("missing_file", f"the {what} files of {missing} of the {world} ranks are missing (ranks "
                       f"{', '.join(map(str, named[:MAX_LISTED]))}, ...)")


def _partitions(reader: _Reader, optims: dict[int, str], stage: int) -> dict[int, Part]:
    """Per rank: its flat fp32 groups, the optimizer states of each group, the group and parameter paddings."""
    out = {}
    for rank, name in sorted(optims.items()):
        osd = reader.get(name, reader.archive(name).root, "optimizer_state_dict", dict)
        got = osd.get("zero_stage")
        if got is None or reader.count(name, got, "zero_stage") != stage:
            reader.problem("mixed", f"rank {rank}'s optimizer is not of ZeRO stage {stage}", file=name)
            continue
        key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
        groups = [reader.flat(name, g, f"{key}[{i}]") for i, g in enumerate(reader.get(name, osd, key, list))]
        if any(len(g.shape) != 1 for g in groups):
            raise reader.fail(name, f"{key} holds a tensor that is not flat (1-D).")
        base = reader.get(name, osd, "optimizer_state_dict" if stage == 3 else "base_optimizer_state", (dict, list))
        paddings, aligns = osd.get("group_paddings"), osd.get("param_alignment_paddings")
        out[rank] = Part(rank, reader.archives[name], groups, _optimizer_states(reader, name, base, len(groups)),
                         [reader.count(name, p, "group_paddings") for p in paddings]
                         if isinstance(paddings, list) else None,
                         [[reader.count(name, p, "param_alignment_paddings") for p in g] for g in aligns]
                         if isinstance(aligns, list) and all(isinstance(g, list) for g in aligns) else None)
    return out


def _optimizer_states(reader: _Reader, name: str, base: Any, groups: int) -> list[dict[str, StoredArray]]:
    """Each flat group's optimizer states (1-D tensors: ``exp_avg``, ...): torch's state_dict of the flat
    partitions (one torch parameter per group, numbered in param_groups order), or DeepSpeed's elastic list."""
    if isinstance(base, list):
        per_group = base
    else:
        order = [i for g in reader.get(name, base, "param_groups", list) for i in reader.get(name, g, "params", list)]
        state = reader.get(name, base, "state", dict)
        per_group = [state.get(i) if isinstance(i, int | str) else None for i in order]
    if len(per_group) != groups:
        reader.problem("size", f"the optimizer state has {len(per_group)} groups; the partitions {groups}", file=name)
    out = []
    for i, states in enumerate(per_group[:groups]):
        out.append({k: reader.flat(name, v, f"optimizer state {describe(k)} of group {i}")
                    for k, v in states.items()
                    if isinstance(k, str) and isinstance(v, StoredArray) and v.shape and len(v.shape) == 1}
                   if isinstance(states, dict) else {})
    return out


def _fragments(reader: _Reader, name: str) -> dict[str, tuple[TorchArchive, StoredArray]]:
    """A ZeRO-3 model file's partitions of the frozen parameters."""
    archive = reader.archive(name)
    frags = reader.get(name, archive.root, "frozen_param_fragments", dict, optional=True) or {}
    return {k: (archive, reader.flat(name, v, "a frozen fragment")) for k, v in frags.items() if isinstance(k, str)}


def _model(reader: _Reader, name: str, root: dict, stage: int) -> dict[str, Any]:
    """What the (rank 0) model file says: parameter shapes by group, frozen shapes, buffers, ties, counters."""
    param_shapes = [reader.shapes(name, g, "param_shapes") for g in reader.get(name, root, "param_shapes", list)]
    frozen = reader.get(name, root, "frozen_param_shapes", dict, optional=True)
    module = reader.get(name, root, "module", dict, optional=True) or {}
    buffers = reader.get(name, root, "buffer_names", list)
    shared = reader.get(name, root, "shared_params", dict, optional=True) or {}
    return {
        "param_shapes": param_shapes,
        "frozen_shapes": None if frozen is None else reader.shapes(name, frozen, "frozen_param_shapes"),
        "frozen_fragments": _fragments(reader, name) if stage < 3 else {},
        "module": {k: v for k, v in module.items() if isinstance(k, str) and isinstance(v, StoredArray)},
        "buffers": [b for b in buffers if isinstance(b, str)],
        "shared": {k: v for k, v in shared.items() if isinstance(k, str) and isinstance(v, str)},
        "counters": {k: root.get(k) if type(root.get(k)) is int else None
                     for k in ("global_steps", "global_samples", "skipped_steps", "mp_world_size")},
        "ds_version": root.get("ds_version") if isinstance(root.get("ds_version"), str) else None,
        "ds_config": plain(root.get("ds_config")),
    }


def _whole(reader: _Reader, file: str, archive: TorchArchive, array: StoredArray, name: str) -> tuple[Piece, ...]:
    if not array.contiguous:
        reader.problem("unsupported", f"{describe(name)} is stored strided (not contiguous); its values are not "
                       "mapped", name, file)
        return ()
    rec = archive.record_of(array)
    return (Piece(0, file, f"data/{array.key}", archive.byte_offset(array, 0), 0, array.numel, array.dtype,
                  rec.crc32),) if array.numel else ()


def _state(reader: _Reader, folder: str, tag: str, stage: int, world: int, mp_rank: int, models: dict,
           optims: dict, model: dict, layout: ZeroLayout, file0: str) -> DeepSpeedState:
    tensors: dict[str, DeepSpeedTensor] = {}
    module, archive0 = model["module"], reader.archives[file0]
    for b in model["buffers"]:  # DeepSpeed's order: buffers, frozen, trainable, then the tied names
        if b in module:
            tensors[b] = DeepSpeedTensor(b, "buffer", module[b].shape, module[b].dtype,
                                         _whole(reader, file0, archive0, module[b], b))
        else:
            reader.problem("missing", f"buffer {describe(b)} is named but not in the model file's module", b, file0)
    frozen = model["frozen_shapes"]
    if stage < 3 and frozen is not None:
        for k, shape in frozen.items():
            frag = model["frozen_fragments"].get(k)
            if frag is None or frag[1].numel != math.prod(shape):
                reader.problem("size", f"frozen parameter {describe(k)} has no fragment of its shape {shape}", k,
                               file0)
                tensors[k] = DeepSpeedTensor(k, "frozen", shape, frag[1].dtype if frag else "float32", ())
            else:
                tensors[k] = DeepSpeedTensor(k, "frozen", shape, frag[1].dtype,
                                             _whole(reader, file0, frag[0], frag[1], k))
    elif stage < 3:  # ZeRO-1 saves no frozen fragments: its frozen parameters are only in the module
        trained = {n for g in model["param_shapes"] for n in g}
        for k, array in module.items():
            if k not in trained and k not in model["buffers"] and k not in model["shared"] and array.numel:
                tensors[k] = DeepSpeedTensor(k, "frozen", array.shape, array.dtype,
                                             _whole(reader, file0, archive0, array, k))
    tensors.update(layout.tensors)
    shared = {}
    for alias, source in model["shared"].items():
        if source in tensors:
            shared[alias] = source
        else:
            reader.problem("missing", f"tied parameter {describe(alias)} names {describe(source)}, which the "
                           "checkpoint lacks", alias)
    params = [n for g in model["param_shapes"] for n in g]
    model_dtype = next((module[n].dtype for n in params if n in module), None)
    ranks = tuple(RankFiles(r, models.get(r if stage == 3 else None), optims.get(r)) for r in range(world))
    counters = model["counters"]
    return DeepSpeedState(folder, tag, stage, world, counters["mp_world_size"] or 1, mp_rank, model_dtype,
                          layout.master_dtype, model["ds_version"], model["ds_config"], counters["global_steps"],
                          counters["global_samples"], counters["skipped_steps"], ranks, tensors, shared,
                          layout.optimizer_states, {n: a.records for n, a in reader.archives.items()}, reader.problems)


__all__ = ["DEEPSPEED_CLASSES", "latest_tag", "plain", "read_deepspeed_state", "step_folder"]
