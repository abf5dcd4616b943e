"""``shardscope average`` as the CLI and the window ask for it: the request checked, the inputs put in step order
for an EMA (:mod:`.series`, the Library's walk), then combined and written by :mod:`..export.average`. It lives here,
above both, because ordering a series is the Library's and writing is the exporters'."""

from __future__ import annotations

from ..export.average import DCP_OUTPUT, HF_SHARD_SIZE, Recipe, average, average_dcp, make_recipe
from ..export.plan import ExportError
from ..export.result import ExportResult
from ..progress import Progress
from .series import checkpoint_series


def average_checkpoints(inputs: list[str], dst: str, fmt: str | None = None, weights: list[float] | None = None,
                        ema: float | None = None, dtype: str | None = None, hf: bool = False, ranks: int = 1,
                        prefix: str | None = None, force: bool = False, verify: bool = True,
                        progress: Progress | None = None, storage_options: dict | None = None
                        ) -> tuple[Recipe, ExportResult]:
    """``shardscope average`` as the CLI and the window ask for it: the request checked before anything is read
    (``fmt`` None: from ``dst``'s name; ``dcp``: :func:`average_dcp` with ``ranks`` and ``prefix``; ``hf``: a
    sharded safetensors folder), the inputs put in step order for an EMA, then combined and written."""
    from ..export.registry import check_request, output_dtype, parse_shard_size

    recipe = make_recipe(len(inputs), weights, ema)
    if fmt == DCP_OUTPUT:
        if hf:
            raise ExportError("a Hugging Face model is written as safetensors, not as DCP.")
        output_dtype(dtype)
    elif ranks != 1 or prefix:
        raise ExportError("a number of ranks and a key prefix apply to DCP output only.")
    options = {"dtype": dtype, "max_shard_size": parse_shard_size(HF_SHARD_SIZE if hf else None)}
    if fmt != DCP_OUTPUT:
        fmt = check_request(dst, "safetensors" if hf else fmt, **options).name
    if ema is not None:  # in step order, as the Library's walk finds them
        inputs = [p.path for p in checkpoint_series(inputs)]
        if len(inputs) < 2:
            raise ExportError("EMA needs at least two complete checkpoints.")
        recipe = make_recipe(len(inputs), None, ema)
    if fmt == DCP_OUTPUT:
        return recipe, average_dcp(inputs, dst, recipe, ranks, prefix, dtype, force, verify, progress,
                                   storage_options)
    return recipe, average(inputs, dst, fmt, recipe, options, force, verify, progress, storage_options)


__all__ = ["average_checkpoints"]
