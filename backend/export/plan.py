"""What an export will write, computed from the metadata alone (keys, dtypes, shapes, sizes).
A plan is never changed by the writers; what they find at write time goes into the result."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

from ..checkpoint.model import FLOAT_DTYPES, Checkpoint, ObjectEntry, TensorEntry, itemsize
from ..errors import ShardscopeError
from ..filenames import LIGHTNING_META, TORCH_SUFFIXES
from ..format import count
from .layouts import Layout, recognise_layout, unwrap_key

DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                 "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32"}
FORMATS = ("safetensors", "torch")


class ExportError(ShardscopeError):
    """Bad export options or an output that cannot be written (one line, exit 2)."""


@dataclass(frozen=True, slots=True)
class ExportItem:
    """One output tensor: its name in the output, the source entry, the output dtype."""

    key: str
    entry: TensorEntry
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the output tensor (the full shape of its source entry)."""
        return self.entry.shape

    @property
    def nbytes(self) -> int:
        """Size of the output tensor in bytes at the output dtype."""
        return math.prod(self.entry.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class ExportPlan:
    """What goes where. ``keys_renamed``: output keys differ from the stored names, so a torch
    export writes a flat dict instead of the nested one ``dcp_to_torch_save`` would."""

    ckpt: Checkpoint
    format: str
    items: tuple[ExportItem, ...]
    objects: tuple[tuple[str, ObjectEntry], ...]  # (output key, entry)
    layout: Layout
    left_out: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    max_shard_size: int | None = None
    include_meta: bool = False  # Lightning meta.pt merged into a torch export
    keys_renamed: bool = False
    config_file: str | None = None  # copied next to a sharded safetensors export
    record_source: bool = False  # put the source path into the output's metadata

    @property
    def total_bytes(self) -> int:
        """Bytes of all output tensors together, at their output dtypes."""
        return sum(i.nbytes for i in self.items)

    def need_bytes(self) -> int:
        """Free space the output needs: tensors, non-tensor entries, headers and the archive directory."""
        return (self.total_bytes + sum(o.length for _, o in self.objects) + 512 * (len(self.items) + 1)
                + (1 << 20))


def format_for(dst: str, fmt: str | None, max_shard_size: int | None) -> str:
    """The output format: given, or from the destination's extension."""
    if fmt:
        if fmt not in FORMATS:
            raise ExportError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}.")
        return fmt
    ext = os.path.splitext(dst)[1].lower()
    if ext == ".safetensors" or max_shard_size:
        return "safetensors"
    if ext in TORCH_SUFFIXES:
        return "torch"
    raise ExportError(f"{dst}: cannot tell the format from the name; end it in .safetensors or .pt "
                      "(or give --format), or give --max-shard-size for a sharded safetensors folder.")


def _under(fqn: str, prefix: str) -> bool:
    return fqn == prefix or fqn.startswith(prefix + ".")


def parse_rename(rules: list[str] | None) -> list[tuple[re.Pattern, str]]:
    """``REGEX=REPLACEMENT`` rules, compiled (the first ``=`` separates them)."""
    out = []
    for rule in rules or []:
        pattern, sep, repl = rule.partition("=")
        if not sep or not pattern:
            raise ExportError(f"--rename {rule!r}: write it as REGEX=REPLACEMENT, e.g. '^tok_embeddings\\.=embed.'")
        try:
            out.append((re.compile(pattern), repl))
        except re.error as exc:
            raise ExportError(f"--rename {rule!r}: bad regular expression ({exc}).") from None
    return out


def _read_config(path: str | None, max_shard_size: int | None) -> str | None:
    if not path:
        return None
    if not max_shard_size:
        raise ExportError("--config is copied next to a sharded export; give --max-shard-size too.")
    try:
        with open(path, encoding="utf-8") as fh:
            json.load(fh)
    except OSError as exc:
        raise ExportError(f"{path}: cannot read the config ({exc.strerror or exc}).") from None
    except ValueError as exc:
        raise ExportError(f"{path}: not a JSON file ({exc}).") from None
    return os.path.abspath(path)


@dataclass(frozen=True, slots=True)
class _Selection:
    wanted: frozenset[str]
    left_out: tuple[str, ...]
    container: str


def _select(ckpt: Checkpoint, fmt: str, layout: Layout, only: list[str], exclude: list[str]) -> _Selection:
    names = [t.fqn for t in ckpt.tensors] + [o.fqn for o in ckpt.objects]
    for flag, prefixes in (("--only", only), ("--exclude", exclude)):
        for p in prefixes:
            if not any(_under(n, p) for n in names):
                roots = sorted({n.split(".", 1)[0] for n in names})
                raise ExportError(f"{ckpt.path}: {flag} {p} matches no entry; top-level keys: "
                                  f"{', '.join(roots[:12])}{' ...' if len(roots) > 12 else ''}.")
    if only:
        wanted = {n for n in names if any(_under(n, p) for p in only)}
        why = f"outside {', '.join(only)}"
    elif fmt == "safetensors":
        wanted = {t.fqn for t in ckpt.tensors if layout.is_model(t.fqn)} | \
                 {o.fqn for o in ckpt.objects if layout.is_model(o.fqn)}
        why = "not model weights"
    else:
        wanted = set(names)
        why = ""
    excluded = {n for n in wanted if any(_under(n, p) for p in exclude)}
    wanted -= excluded
    notes = [f"--exclude {p} changed nothing: what it names is left out anyway ({why})"
             for p in exclude if not any(_under(n, p) for n in excluded)]
    groups = ((("tensor", "tensors"), [t.fqn for t in ckpt.tensors]),
              (("non-tensor entry", "non-tensor entries"), [o.fqn for o in ckpt.objects]))
    for kind, group in groups:
        skipped = [n for n in group if n not in wanted and n not in excluded]
        if skipped:
            roots = sorted({n.split(".", 1)[0] for n in skipped})
            notes.append(f"{count(len(skipped), *kind)} {why} ({', '.join(roots[:6])}"
                         f"{' ...' if len(roots) > 6 else ''})")
        gone = [n for n in group if n in excluded]
        if gone:
            notes.append(f"{count(len(gone), *kind)} under --exclude {', '.join(exclude)}")
    container = ""
    if fmt == "safetensors" and layout.container and all(n.startswith(layout.container) for n in wanted):
        container = layout.container
    return _Selection(frozenset(wanted), tuple(notes), container)


def require_nesting(ckpt: Checkpoint) -> None:
    """Refuse (one line naming the file and the entry) a checkpoint whose planner_data cannot rebuild the nested
    state dict that a .pt export writes and a reshard copies."""
    problem = ckpt.nesting_problem()
    if problem:
        raise ExportError(os.path.join(ckpt.path, problem.message))  # the message starts with the file's name


def plan_export(ckpt: Checkpoint, fmt: str, only: list[str] | None = None, strip_prefix: str | None = None,
                dtype: str | None = None, max_shard_size: int | None = None, exclude: list[str] | None = None,
                rename: list[str] | None = None, config: str | None = None,
                record_source: bool = False) -> ExportPlan:
    """Pick the entries and their output names. ``strip_prefix=None`` removes the layout's container
    prefix (``model.``) in a safetensors export so keys load into the module; ``''`` keeps every key."""
    out_dtype = None
    if dtype:
        out_dtype = DTYPE_ALIASES.get(dtype.lower())
        if out_dtype is None:
            raise ExportError(f"--dtype {dtype}: use bf16, fp16 or fp32.")
    layout = recognise_layout(ckpt)
    sel = _select(ckpt, fmt, layout, [p.rstrip(".") for p in only or []], [p.rstrip(".") for p in exclude or []])
    strip = sel.container if strip_prefix is None else strip_prefix
    rules = parse_rename(rename)
    used = [False] * len(rules)
    unwrap = fmt == "safetensors" and strip_prefix != ""  # '' keeps every key as stored
    unwrapped: set[str] = set()

    def out_key(fqn: str) -> str:
        key = fqn[len(strip):] if strip and fqn.startswith(strip) else fqn
        if unwrap:
            key, parts = unwrap_key(key)
            unwrapped.update(parts)
        for i, (pattern, repl) in enumerate(rules):
            new = pattern.sub(repl, key)
            used[i] |= new != key
            key = new
        return key

    seen: dict[str, str] = {}
    items = []
    objects = []
    for fqn, entry in [(t.fqn, t) for t in ckpt.tensors] + [(o.fqn, o) for o in ckpt.objects]:
        if fqn not in sel.wanted:
            continue
        key = out_key(fqn)
        if key in seen:
            raise ExportError(f"{fqn} and {seen[key]} both become {key!r} (--strip-prefix/--rename, wrapper "
                              "key parts such as _orig_mod); change the rules so every key stays unique.")
        seen[key] = fqn
        if isinstance(entry, TensorEntry):
            d = out_dtype if (out_dtype and entry.dtype in FLOAT_DTYPES) else entry.dtype
            items.append(ExportItem(key, entry, d))
        else:
            objects.append((key, entry))
    for (pattern, _), hit in zip(rules, used, strict=True):
        if not hit:
            raise ExportError(f"--rename {pattern.pattern}: matches no exported key.")
    if not items and not objects:
        if only:
            raise ExportError(f"{ckpt.path}: nothing to export under {', '.join(only)}.")
        if not ckpt.tensors and not ckpt.objects:
            raise ExportError(f"{ckpt.path}: the checkpoint holds no entries (an empty state dict was saved); "
                              "nothing to export.")
        raise ExportError(f"{ckpt.path}: nothing to export by default (layout: {layout.name}; "
                          f"{'; '.join(sel.left_out) or 'no entries'}); choose entries with --only PREFIX, or "
                          "export everything to a .pt file.")
    renamed = bool(strip) or bool(rules) or bool(unwrapped)
    if fmt == "torch" and not renamed:
        require_nesting(ckpt)
    notes = [f"layout: {layout.name}" + (f"; keys without the '{strip}' prefix" if strip else "")
             + (f"; wrapper key parts removed: {', '.join(sorted(unwrapped))}" if unwrapped else "")]
    return ExportPlan(ckpt, fmt, tuple(items), tuple(objects), layout, sel.left_out, tuple(notes),
                      max_shard_size, fmt == "torch" and bool(ckpt.extra_files.get(LIGHTNING_META)) and not only,
                      renamed, _read_config(config, max_shard_size),
                      record_source)


__all__ = ["DTYPE_ALIASES", "FORMATS", "ExportError", "ExportItem", "ExportPlan", "format_for",
           "parse_rename", "plan_export", "require_nesting"]
