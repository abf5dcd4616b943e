"""``average``: the uniform or weighted mean of the model weights of several checkpoints, or their exponential
moving average in the order given (``e_0 = W_0``, ``e_i = beta * e_{i-1} + (1 - beta) * W_i``), written by an
export writer (safetensors, torch, a sharded safetensors folder) through :func:`.writers.export`: streaming
(one tensor's inputs at a time per writer thread), verified, atomic, with a lineage sidecar listing every source
and its weight.

Each output tensor is accumulated in float64 from the inputs' exact values and rounded once to the output dtype,
so every element is the correctly rounded float64 result (within one ulp of the exact mean for fp32/bf16
outputs). Integer and bool tensors are not averaged: they must be equal in every input. The inputs must hold
the same model: the same tensors (names, dtypes, shapes) in what the export takes from each."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..checkpoint.chunks import ChunkReader, torch_dtype
from ..checkpoint.model import Checkpoint
from ..checkpoint.sources import CheckpointSource
from ..errors import ShardscopeError
from ..lineage import make_sidecar
from ..progress import Progress
from .lineage import describe_source
from .plan import ExportError, ExportItem, ExportPlan
from .result import ExportResult
from .source import TensorSource, run_parallel, tensor_bytes, write_buffer


@dataclass(frozen=True)
class Recipe:
    """How the inputs are combined: ``weights`` (as given; the mean divides by their sum) or ``beta`` (EMA)."""

    weights: tuple[float, ...]
    beta: float | None = None

    @property
    def method(self) -> str:
        """``ema``, ``mean`` (equal weights) or ``weighted``."""
        if self.beta is not None:
            return "ema"
        return "mean" if len(set(self.weights)) == 1 else "weighted"

    def effective(self) -> list[float]:
        """Each input's share of the result (they sum to 1): for EMA ``beta**(K-1)`` for the first input and
        ``(1-beta) * beta**(K-1-i)`` for input i > 0."""
        k = len(self.weights)
        if self.beta is not None:
            b = self.beta
            return [b ** (k - 1)] + [(1 - b) * b ** (k - 1 - i) for i in range(1, k)]
        total = sum(self.weights)
        return [w / total for w in self.weights]


def make_recipe(count: int, weights: list[float] | None = None, ema: float | None = None) -> Recipe:
    """The recipe for ``count`` inputs; :class:`ExportError` (exit 2) for weights that do not fit."""
    if count < 2:
        raise ExportError("averaging needs at least two checkpoints.")
    if weights is not None and ema is not None:
        raise ExportError("give weights or an EMA beta, not both.")
    if ema is not None:
        if not 0.0 <= ema < 1.0:
            raise ExportError(f"EMA beta {ema}: it must be at least 0 and below 1.")
        return Recipe((1.0,) * count, ema)
    if weights is None:
        return Recipe((1.0,) * count)
    if len(weights) != count:
        raise ExportError(f"{len(weights)} weights for {count} checkpoints; give one weight per checkpoint.")
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ExportError(f"weights {weights}: each must be finite and not negative, and their sum positive.")
    return Recipe(tuple(float(w) for w in weights))


BLOCK = 1 << 15  # elements combined at a time: the float64 accumulator stays in the CPU's cache, one thread per op


def combine(values: list[Any], recipe: Recipe, fqn: str, paths: list[str], dtype: Any) -> Any:
    """The combined tensor in ``dtype`` (a torch dtype), C-contiguous: floating-point inputs accumulated in
    float64 (:func:`_accumulate`) and rounded once; integer and bool inputs must be equal, and are the result."""
    import torch

    exact = [t for t in values if not (t.is_floating_point() or t.is_complex())]
    for i, t in enumerate(values):
        if exact and not torch.equal(exact[0], t):
            raise ShardscopeError(f"{paths[i]}: tensor {fqn} ({t.dtype}) differs from {paths[0]}'s; integer "
                                  "and bool tensors are not averaged and must be equal in every input.")
    if exact:
        return exact[0].to(dtype).contiguous()
    if any(t.is_complex() for t in values):  # rare: accumulated whole, as complex128
        return _accumulate([t.to(torch.complex128, copy=True).reshape(-1) for t in values], recipe) \
            .to(dtype).reshape(values[0].shape)
    flat = [t.reshape(-1) for t in values]
    out = torch.empty(flat[0].numel(), dtype=dtype)
    for s in range(0, out.numel(), BLOCK):  # NOTE: block by block: float64 temporaries the size of a cache
        out[s:s + BLOCK].copy_(_accumulate([t[s:s + BLOCK].to(torch.float64, copy=True) for t in flat], recipe))
    return out.reshape(values[0].shape)


def _accumulate(wide: list[Any], recipe: Recipe) -> Any:
    """The recipe's combination of the inputs' values (float64 or complex128 copies, changed in place), in input
    order, each product rounded before it is added (``beta * e + (1 - beta) * w``, ``w0 * x0 + w1 * x1 + ...``):
    the float64 result as written, whatever torch's kernels fuse (``add_(x, alpha=w)`` may round ``acc + w * x``
    once, as an FMA does, and then differ from it in the last bit)."""
    if recipe.beta is not None:
        acc = wide[0]
        for x in wide[1:]:
            acc.mul_(recipe.beta).add_(x.mul_(1.0 - recipe.beta))
        return acc
    acc = wide[0].mul_(recipe.weights[0])
    for x, w in zip(wide[1:], recipe.weights[1:], strict=True):
        acc.add_(x.mul_(w))
    return acc.div_(sum(recipe.weights))


class AveragedValues(TensorSource):
    """The plan's tensors, each the combination of the same tensor in every input (input 0: the plan's own
    checkpoint, read through the export's reader; the others through their sources)."""

    def __init__(self, reader: ChunkReader, items: list[ExportItem], others: list[dict[str, Any]],
                 recipe: Recipe, paths: list[str]) -> None:
        super().__init__(reader, items)
        self.others = others  # per other input: output key -> (its CheckpointSource, its entry's fqn)
        self.recipe = recipe
        self.paths = paths

    def tensor(self, item: ExportItem) -> Any:
        """The combined output tensor, cast (rounded once) to the item's dtype, contiguous; then the item's
        transform (a Hugging Face model's: permutations, splits and slices, which commute with the combination)."""
        values = [self.reader.read_tensor(item.entry)]
        values += [src.tensor(fqn) for src, fqn in (o[item.key] for o in self.others)]
        out = combine(values, self.recipe, item.entry.fqn, self.paths, torch_dtype(item.dtype))
        return out if item.transform is None else item.transform.apply(out).contiguous()

    def _write(self, item: ExportItem, fd: int, base: int, progress: Progress | None) -> int:
        # the inputs in memory: each as read, and the float64 sum
        need = item.nbytes * (len(self.others) + 3)
        self.budget.acquire(need)
        try:
            return write_buffer(fd, base, tensor_bytes(self.tensor(item)), progress)
        finally:
            self.budget.release(need)

    def write_all(self, jobs: list[tuple[ExportItem, int, int]], progress: Progress | None,
                  path: str | None = None) -> list[int]:
        """Each (item, fd, offset) written on the thread pool, handed to the verifier as it is written."""
        verifier = self.verifier if path is not None else None

        def job(item: ExportItem, fd: int, offset: int) -> list[int]:
            crc = self.write(item, fd, offset, progress)
            if verifier is not None:
                verifier.submit(path, offset, item.nbytes, crc, item.key)
            return [crc]

        return [r[0] for r in run_parallel([(job, j) for j in jobs], progress, self.budget)]


def _signature(plan: ExportPlan) -> dict[str, tuple[str, tuple[int, ...], str]]:
    return {it.key: (it.entry.dtype, tuple(it.entry.shape), it.entry.fqn) for it in plan.items}


def check_same_model(plans: list[ExportPlan], paths: list[str]) -> None:
    """The same tensors (output names, dtypes, shapes) in every input's plan, else one line naming both
    checkpoints and the first tensor that differs."""
    first = _signature(plans[0])
    for plan, path in zip(plans[1:], paths[1:], strict=True):
        other = _signature(plan)
        for key in sorted(first.keys() ^ other.keys()):
            where = path if key in first else paths[0]
            raise ShardscopeError(f"{where} lacks tensor {key} that {paths[0] if key in first else path} holds; "
                                  "these are checkpoints of different models.")
        for key, (dtype, shape, _) in first.items():
            if other[key][:2] != (dtype, shape):
                raise ShardscopeError(f"{path}: tensor {key} is {other[key][0]} {list(other[key][1])}, "
                                      f"{dtype} {list(shape)} in {paths[0]}; these are checkpoints of different "
                                      "models.")
    if not first:
        raise ShardscopeError(f"{paths[0]}: no tensor to average.")


def average_lineage(paths: list[str], formats: list[str], recipe: Recipe, export_format: str) -> dict[str, Any]:
    """The sidecar's document: the first input as its ``source`` (what the Library reads), and ``sources``: every
    input with its share of the result, and the method (mean, weighted, ema and its beta)."""
    described = [describe_source(p, f) for p, f in zip(paths, formats, strict=True)]
    for d, w, given in zip(described, recipe.effective(), recipe.weights, strict=True):
        d["weight"], d["given_weight"] = w, given
    doc = make_sidecar(described[0], export_format)
    doc["average"] = {"method": recipe.method, "beta": recipe.beta, "sources": described}
    return doc


def _plans(paths: list[str], fmt: str, options: dict[str, Any],
           storage_options: dict | None) -> tuple[list[Checkpoint], list[ExportPlan]]:
    """Every input opened and planned for the writer ``fmt`` (a ``.pt``: the model's container only), checked
    to hold the same model."""
    from ..formats import open_checkpoint
    from .layouts import recognise_layout
    from .planner import plan_export

    ckpts = [open_checkpoint(p, storage_options) for p in paths]
    if not options.get("only") and fmt == "torch":  # a .pt of the model's weights, not of the optimizer
        container = recognise_layout(ckpts[0]).container.rstrip(".")
        options = {**options, "only": [container] if container else None}
    plans = [plan_export(c, fmt, **options) for c in ckpts]
    check_same_model(plans, paths)
    return ckpts, plans


def average(paths: list[str], dst: str, fmt: str, recipe: Recipe, plan_options: dict[str, Any] | None = None,
            force: bool = False, verify: bool = True, progress: Progress | None = None,
            storage_options: dict | None = None) -> ExportResult:
    """Combine the model weights of the checkpoints ``paths`` (in that order) by ``recipe`` into ``dst``
    written as ``fmt`` (an export writer's name); ``plan_options``: plan_export's keyword arguments."""
    from .writers import export

    ckpts, plans = _plans(paths, fmt, dict(plan_options or {}), storage_options)
    with contextlib.ExitStack() as stack:
        sources = [stack.enter_context(CheckpointSource(c)) for c in ckpts[1:]]
        others = [{it.key: (src, it.entry.fqn) for it in plan.items} for src, plan in zip(sources, plans[1:],
                                                                                         strict=True)]
        lineage = average_lineage(paths, [c.format for c in ckpts], recipe, fmt)
        return export(plans[0], dst, force=force, verify=verify, progress=progress,
                      storage_options=storage_options, sources=list(paths), lineage=lineage,
                      values=lambda reader, items: AveragedValues(reader, items, others, recipe, paths))


def average_dcp(paths: list[str], dst: str, recipe: Recipe, ranks: int = 1, prefix: str | None = None,
                dtype: str | None = None, force: bool = False, verify: bool = True,
                progress: Progress | None = None, storage_options: dict | None = None) -> ExportResult:
    """The combined model weights written as a DCP checkpoint of ``ranks`` ranks (:func:`.dcp_writer.write_dcp`,
    verified, atomic), keys as the model names them (as a safetensors export has them), nested under ``prefix``
    when given, so ``dcp.load({prefix: model.state_dict()})`` reads them; one tensor's inputs in memory."""
    from .dcp_writer import TensorIn, write_dcp

    ckpts, plans = _plans(paths, "safetensors", {"dtype": dtype}, storage_options)
    pre = prefix.strip(".") if prefix else ""
    with contextlib.ExitStack() as stack:
        sources = [stack.enter_context(CheckpointSource(c)) for c in ckpts]
        inputs = [{it.key: it.entry.fqn for it in plan.items} for plan in plans]

        def load(item: ExportItem) -> Any:
            values = [src.tensor(names[item.key]) for src, names in zip(sources, inputs, strict=True)]
            return combine(values, recipe, item.entry.fqn, paths, torch_dtype(item.dtype))

        tensors = [TensorIn(f"{pre}.{it.key}" if pre else it.key, it.dtype, it.shape, partial(load, it))
                   for it in plans[0].items]
        planner = {t.fqn: (pre, it.key) for t, it in zip(tensors, plans[0].items, strict=True)} if pre else None
        lineage = average_lineage(paths, [c.format for c in ckpts], recipe, DCP_OUTPUT)
        return write_dcp(tensors, [], dst, ranks, planner, force, verify, progress, plans[0].total_bytes,
                         storage_options, sources=list(paths), lineage=lineage)


DCP_OUTPUT = "dcp"  # the DCP writer's name (export/registry.WRITERS): an average written for N ranks
HF_SHARD_SIZE = "5GB"  # ``hf``: the folder save_pretrained writes by default


__all__ = ["AveragedValues", "Recipe", "average", "average_dcp", "average_lineage",
           "check_same_model", "combine", "make_recipe"]
