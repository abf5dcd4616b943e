"""The output formats: each one registered once in :data:`WRITERS` (its name, its label, what it writes, the
options it takes, its writer), and the one check of a requested export against them (:func:`check_request`).
The CLI's ``--format`` choices and the Export dialog's Format list come from here, and its messages name
options in words, never a command-line flag, so every front end shows them as they are."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..filenames import SAFETENSORS_SUFFIX, TORCH_SUFFIXES
from ..progress import Progress
from ..text import parse_size
from . import hf_writer, safetensors_writer, torch_writer
from .plan import ExportError, ExportPlan
from .source import TensorSource
from .verify import Expectation

# write(plan, out_path, dst, source, progress, left_out) -> (names, expectations): the plan written into
# ``out_path`` (the atomic output's temporary; ``dst`` is the name it will get), each output file's name
# relative to the output ("" for a single file) and what the verifier re-reads; what a writer could not
# write it appends to ``left_out``
WriteFn = Callable[[ExportPlan, str, str, TensorSource, Progress | None, list[str]],
                   tuple[list[str], list[Expectation]]]

# Every option an output can take (plan_export's keyword arguments, and DCP's ranks), in words
OPTION_WORDS = {"only": "choosing entries by prefix", "exclude": "leaving out entries by prefix",
                "rename": "renaming keys", "strip_prefix": "stripping a key prefix",
                "dtype": "casting to another floating-point dtype", "max_shard_size": "a maximum shard size",
                "config": "a config.json to copy", "record_source": "recording the source path",
                "ranks": "a number of ranks"}
SELECTION = frozenset({"only", "exclude", "rename", "strip_prefix", "dtype"})  # what every plan writer takes
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                 "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32"}


@dataclass(frozen=True, slots=True)
class Writer:
    """One output format. ``write`` is None where the format is written apart from an export plan (DCP: see
    ``dcp_writer``), so it is listed but :func:`check_request` and ``export()`` refuse it."""

    name: str  # the CLI's --format value, and ExportPlan.format
    label: str  # the Export dialog's words for it
    output: str  # "file" or "dir": what it writes unsharded (a maximum shard size always makes a folder)
    suffixes: tuple[str, ...]  # destination names that choose it; the first is the one to propose
    options: frozenset[str]  # of OPTION_WORDS
    write: WriteFn | None
    weights_only: bool = False  # tensors only, for a module: by default the model weights, keys as the module
    #                             names them; non-tensor entries go into its metadata where they are scalars
    nested: bool = False  # the nested state dict torch.save would write (planner_data rebuilds it)
    model: bool = False  # a Hugging Face model folder: the weights named and transformed by hf_model (hf_writer)

    def output_kind(self, max_shard_size: int | None) -> str:
        """"file" or "dir": what an export with this maximum shard size writes."""
        return "dir" if max_shard_size else self.output


WRITERS: dict[str, Writer] = {w.name: w for w in (
    Writer("safetensors", "safetensors", "file", (SAFETENSORS_SUFFIX,),
           SELECTION | {"max_shard_size", "config", "record_source"}, safetensors_writer.write, weights_only=True),
    Writer("torch", "torch (.pt)", "file", TORCH_SUFFIXES, SELECTION, torch_writer.write,
           nested=True),
    Writer("hf", "Hugging Face model", "dir", (), SELECTION | {"max_shard_size", "config", "record_source"},
           hf_writer.write, weights_only=True, model=True),
    # NOTE: DCP is written from tensors one at a time, for a number of ranks (dcp_writer.import_file, reshard),
    # not from an export plan through the chunk reader: another signature, so listed here without a writer
    Writer("dcp", "DCP (reshard)", "dir", (), frozenset({"ranks"}), None),
)}


def export_formats() -> tuple[str, ...]:
    """The names ``export()`` writes (the CLI's --format choices)."""
    return tuple(w.name for w in WRITERS.values() if w.write is not None)


def writer(name: str) -> Writer:
    """The registered writer of an export plan called ``name``; :class:`ExportError` for any other name."""
    w = WRITERS.get(name)
    if w is None or w.write is None:
        why = f"{w.label} output is written by import and reshard, not by export" if w else f"unknown format {name!r}"
        raise ExportError(f"{why}; use one of {', '.join(export_formats())}.")
    return w


def parse_shard_size(text: str | None) -> int | None:
    """A maximum shard size as typed (``5GB``, ``500MiB``) in bytes; None when empty."""
    if not text or not text.strip():
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ExportError(f"maximum shard size: {exc}.") from None


def output_dtype(dtype: str | None) -> str | None:
    """The dtype floating-point tensors are cast to (``bf16`` -> ``bfloat16``); None keeps them."""
    if not dtype:
        return None
    out = DTYPE_ALIASES.get(dtype.lower())
    if out is None:
        raise ExportError(f"floating-point dtype {dtype}: use bf16, fp16 or fp32.")
    return out


def parse_rename(rules: list[str] | None) -> list[tuple[re.Pattern, str]]:
    """``REGEX=REPLACEMENT`` rules, compiled (the first ``=`` separates them)."""
    out = []
    for rule in rules or []:
        pattern, sep, repl = rule.partition("=")
        if not sep or not pattern:
            raise ExportError(f"rename rule {rule!r}: write it as REGEX=REPLACEMENT, e.g. "
                              "'^tok_embeddings\\.=embed.'")
        try:
            out.append((re.compile(pattern), repl))
        except re.error as exc:
            raise ExportError(f"rename rule {rule!r}: bad regular expression ({exc}).") from None
    return out


def _given(value: Any) -> bool:
    return value is not None and value is not False and value != []


def _choose(dst: str | None, fmt: str | None, max_shard_size: int | None) -> Writer:
    """The writer named, or the one the destination's name (or a maximum shard size) calls for."""
    if fmt:
        return writer(fmt)
    plan_writers = [WRITERS[n] for n in export_formats()]
    if max_shard_size:  # a sharded folder, whatever its name
        return next(w for w in plan_writers if "max_shard_size" in w.options)
    ext = os.path.splitext(dst or "")[1].lower()
    for w in plan_writers:
        if ext in w.suffixes:
            return w
    sharded = next(w.label for w in plan_writers if "max_shard_size" in w.options)
    raise ExportError(f"{dst}: cannot tell the output format from the name; end it in "
                      f"{' or '.join(w.suffixes[0] for w in plan_writers if w.output == 'file')}, choose a format, "
                      f"or give a maximum shard size for a sharded {sharded} folder.")


def check_request(dst: str | None, fmt: str | None = None, **options: Any) -> Writer:
    """Check a requested export before anything is read: the format (given, or from ``dst``'s name), each given
    option (``plan_export``'s keyword arguments) against what that format takes, and the options' own syntax.
    Returns the writer; raises :class:`ExportError` (exit 2) naming the option in words."""
    unknown = sorted(set(options) - set(OPTION_WORDS))
    if unknown:
        raise TypeError(f"check_request: no option {', '.join(unknown)}")
    w = _choose(dst, fmt, options.get("max_shard_size"))
    for name, value in options.items():
        if _given(value) and name not in w.options:
            takers = [x.label for x in WRITERS.values() if name in x.options]
            raise ExportError(f"{OPTION_WORDS[name]} applies only to {' and '.join(takers)} output, not to "
                              f"{w.label}.")
    if options.get("config") and w.output_kind(options.get("max_shard_size")) != "dir":
        raise ExportError("a config.json is copied next to a sharded export; give a maximum shard size too.")
    output_dtype(options.get("dtype"))
    parse_rename(options.get("rename"))
    return w


__all__ = ["DTYPE_ALIASES", "OPTION_WORDS", "WRITERS", "WriteFn", "Writer", "check_request", "export_formats",
           "output_dtype", "parse_rename", "parse_shard_size", "writer"]
