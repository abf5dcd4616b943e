"""``plan_export``: which entries an export writes and under which names, computed from the metadata alone.
The requested options are checked once (``registry.check_request``); what depends on the checkpoint (a
prefix that matches nothing, two keys that become one) is checked here. Messages name options in words."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..checkpoint.model import FLOAT_DTYPES, Checkpoint, TensorEntry
from ..formats.lightning import has_trainer_state
from ..text import count
from .hf_model import rotary_trap
from .hf_writer import hf_plan
from .layouts import Layout, model_key, recognise_layout
from .plan import ExportError, ExportItem, ExportPlan
from .registry import Writer, check_request, output_dtype, parse_rename


def _under(fqn: str, prefix: str) -> bool:
    return fqn == prefix or fqn.startswith(prefix + ".")


def _read_config(path: str | None) -> str | None:
    if not path:
        return None
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


def _select(ckpt: Checkpoint, w: Writer, layout: Layout, only: list[str], exclude: list[str]) -> _Selection:
    names = [t.fqn for t in ckpt.tensors] + [o.fqn for o in ckpt.objects]
    for what, prefixes in (("a prefix to export", only), ("a prefix to leave out", exclude)):
        for p in prefixes:
            if not any(_under(n, p) for n in names):
                roots = sorted({n.split(".", 1)[0] for n in names})
                raise ExportError(f"{ckpt.path}: {p} ({what}) matches no entry; top-level keys: "
                                  f"{', '.join(roots[:12])}{' ...' if len(roots) > 12 else ''}.")
    if only:
        wanted = {n for n in names if any(_under(n, p) for p in only)}
        why = tensors_why = f"outside {', '.join(only)}"
    elif w.weights_only:
        wanted = {t.fqn for t in ckpt.tensors if layout.keeps_tensor(t.fqn)} | \
                 {o.fqn for o in ckpt.objects if layout.is_model(o.fqn)}
        why = "not model weights"
        tensors_why = "of training state"  # the only tensors a weights export leaves out
    else:
        wanted = set(names)
        why = tensors_why = ""
    excluded = {n for n in wanted if any(_under(n, p) for p in exclude)}
    wanted -= excluded
    notes = [f"leaving out {p} changed nothing: what it names is left out anyway ({why})"
             for p in exclude if not any(_under(n, p) for n in excluded)]
    groups = ((("tensor", "tensors"), [t.fqn for t in ckpt.tensors], tensors_why),
              (("non-tensor entry", "non-tensor entries"), [o.fqn for o in ckpt.objects], why))
    for kind, group, left_why in groups:
        skipped = [n for n in group if n not in wanted and n not in excluded]
        if skipped:
            roots = sorted({layout.root_key(n) for n in skipped})
            notes.append(f"{count(len(skipped), *kind)} {left_why} ({', '.join(roots[:6])}"
                         f"{' ...' if len(roots) > 6 else ''})")
        gone = [n for n in group if n in excluded]
        if gone:
            notes.append(f"{count(len(gone), *kind)} under {', '.join(exclude)}, left out as asked")
    container = ""
    if w.weights_only and layout.container and all(n.startswith(layout.container) for n in wanted):
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
    """Pick the entries and their output names for the writer called ``fmt`` (see ``registry.WRITERS``).
    ``strip_prefix=None`` removes the layout's container prefix (``model.``) in a weights-only export (safetensors)
    so keys load into the module; ``''`` keeps every key."""
    w = check_request(None, fmt, only=only, strip_prefix=strip_prefix, dtype=dtype, max_shard_size=max_shard_size,
                      exclude=exclude, rename=rename, config=config, record_source=record_source)
    out_dtype = output_dtype(dtype)
    layout = recognise_layout(ckpt)
    sel = _select(ckpt, w, layout, [p.rstrip(".") for p in only or []], [p.rstrip(".") for p in exclude or []])
    strip = sel.container if strip_prefix is None else strip_prefix
    rules = parse_rename(rename)
    used = [False] * len(rules)
    unwrap = w.weights_only and strip_prefix != ""  # '' keeps every key as stored
    unwrapped: set[str] = set()

    def out_key(fqn: str) -> str:
        key, parts = model_key(fqn, strip, unwrap)
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
            raise ExportError(f"{fqn} and {seen[key]} both become {key!r} (the prefix stripped, the "
                              "rename rules, wrapper key parts such as _orig_mod); change the rules so every key "
                              "stays unique.")
        seen[key] = fqn
        if isinstance(entry, TensorEntry):
            d = out_dtype if (out_dtype and entry.dtype in FLOAT_DTYPES) else entry.dtype
            items.append(ExportItem(key, entry, d))
        else:
            objects.append((key, entry))
    for (pattern, _), hit in zip(rules, used, strict=True):
        if not hit:
            raise ExportError(f"rename rule {pattern.pattern}: matches no exported key.")
    if not items and not objects:
        if only:
            raise ExportError(f"{ckpt.path}: nothing to export under {', '.join(only)}.")
        if not ckpt.tensors and not ckpt.objects:
            raise ExportError(f"{ckpt.path}: the checkpoint holds no entries (an empty state dict was saved); "
                              "nothing to export.")
        raise ExportError(f"{ckpt.path}: nothing to export by default (layout: {layout.name}; "
                          f"{'; '.join(sel.left_out) or 'no entries'}); choose the entries to export by prefix, "
                          "or export everything to a .pt file.")
    renamed = bool(strip) or bool(rules) or bool(unwrapped)
    if w.nested and not renamed:
        require_nesting(ckpt)
    notes = [f"layout: {layout.name}" + (f"; keys without the '{strip}' prefix" if strip else "")
             + (f"; wrapper key parts removed: {', '.join(sorted(unwrapped))}" if unwrapped else "")]
    trap = None if w.model or not rules else rotary_trap([(it.entry.fqn, it.key) for it in items])
    notes += [trap] if trap else []
    plan = ExportPlan(ckpt, fmt, tuple(items), tuple(objects), layout, sel.left_out, tuple(notes),
                      max_shard_size, w.nested and has_trainer_state(ckpt) and not only,
                      renamed, _read_config(config), record_source=record_source)
    return hf_plan(plan, plan.config_file) if w.model else plan


__all__ = ["plan_export", "require_nesting"]
