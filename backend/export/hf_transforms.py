"""The exact tensor transforms a Hugging Face export applies, each on one tensor: a step knows the shape it makes
(from the source shape alone, before anything is read) and applies itself with plain torch indexing and views, so
the output's values are the source's bytes rearranged, never recomputed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class TransformError(ValueError):
    """A transform that does not fit the tensor's shape (the planner names the tensor)."""


def _need(ok: bool, why: str) -> None:
    if not ok:
        raise TransformError(why)


@dataclass(frozen=True, slots=True)
class Step:
    """One exact transform: ``op`` with its integer arguments.

    - ``index (i,)`` or ``(i, n)``: ``t[i]`` (one layer of Megatron's stacked layers; one expert of ``n`` stacked
      experts, the first dimension checked to be ``n``)
    - ``rows (start, stop)``: ``t[start:stop]`` (vocabulary padding removed; Megatron's ``[G; U]`` halves)
    - ``groups (n_kv, per, d, start, stop)``: ``t.view(n_kv, per, d, ...)[:, start:stop]`` flattened (Megatron's fused
      QKV, ``per = g + 2`` blocks of ``d`` rows per KV group: q ``[0, g)``, k ``[g, g+1)``, v ``[g+1, g+2)``)
    - ``pair (i,)``: ``t.view(F, 2, ...)[:, i]`` (torchtitan's fused ``w13``: gate 0, up 1)
    - ``rotary (n,)``: ``t.view(n, d//2, 2, ...).transpose(1, 2)`` flattened: adjacent rotary pairs (torchtitan's
      complex RoPE) to rotated halves (HF); ``n`` heads of ``d`` rows
    - ``unrotary (n,)``: ``t.view(n, 2, d//2, ...).transpose(1, 2)`` flattened: the inverse of ``rotary`` (HF's halves
      back to adjacent pairs, as an import to torchtitan needs)
    """

    op: str
    args: tuple[int, ...]

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape this step makes of ``shape``; :class:`TransformError` where it does not fit."""
        _need(len(shape) >= 1, f"{self.describe()} needs at least one dimension, not a scalar")
        rest = tuple(shape[1:])
        if self.op == "index":
            _need(len(self.args) < 2 or shape[0] == self.args[1],
                  f"the first dimension ({shape[0]}) is not the {self.args[-1]} stacked experts the config gives")
            _need(self.args[0] < shape[0], f"index {self.args[0]} is past the first dimension ({shape[0]})")
            return rest
        if self.op == "rows":
            start, stop = self.args
            _need(stop <= shape[0], f"rows {start}:{stop} are past the first dimension ({shape[0]})")
            return (stop - start, *rest)
        if self.op == "groups":
            n_kv, per, d, start, stop = self.args
            _need(shape[0] == n_kv * per * d, f"first dimension {shape[0]} is not {n_kv} groups of {per}x{d} rows")
            return (n_kv * (stop - start) * d, *rest)
        if self.op == "pair":
            if len(shape) == 3 and shape[1] == 2:  # stored as [F, 2, D]
                return (shape[0], shape[2])
            _need(shape[0] % 2 == 0, f"first dimension {shape[0]} is not pairs of rows")
            return (shape[0] // 2, *rest)
        if self.op in ("rotary", "unrotary"):
            (n,) = self.args
            _need(shape[0] % n == 0 and (shape[0] // n) % 2 == 0,
                  f"first dimension {shape[0]} is not {n} heads of an even size")
            return tuple(shape)
        raise TransformError(f"unknown transform {self.op}")

    def apply(self, t: Any) -> Any:
        """The transformed tensor (a view where torch can make one)."""
        rest = tuple(t.shape[1:])
        if self.op == "index":
            return t[self.args[0]]
        if self.op == "rows":
            return t[self.args[0]:self.args[1]]
        if self.op == "groups":
            n_kv, per, d, start, stop = self.args
            return t.reshape(n_kv, per, d, *rest)[:, start:stop].reshape(n_kv * (stop - start) * d, *rest)
        if self.op == "pair":
            if t.dim() == 3 and t.shape[1] == 2:
                return t[:, self.args[0]]
            return t.reshape(t.shape[0] // 2, 2, *rest)[:, self.args[0]]
        if self.op == "rotary":
            (n,) = self.args
            d = t.shape[0] // n
            return t.reshape(n, d // 2, 2, *rest).transpose(1, 2).reshape(t.shape)
        if self.op == "unrotary":
            (n,) = self.args
            d = t.shape[0] // n
            return t.reshape(n, 2, d // 2, *rest).transpose(1, 2).reshape(t.shape)
        raise TransformError(f"unknown transform {self.op}")

    def describe(self) -> str:
        """The step in words (the plan's notes and the lineage sidecar)."""
        a = self.args
        return {"index": lambda: (f"expert {a[0]} of {a[1]} stacked experts" if len(a) == 2
                                  else f"index {a[0]} of the stacked first dimension"),
                "rows": lambda: f"rows {a[0]}:{a[1]}",
                "groups": lambda: f"fused QKV split by {a[0]} KV groups of {a[1]}x{a[2]} rows, rows {a[3]}:{a[4]} of "
                                  "each group",
                "pair": lambda: f"{'gate' if a[0] == 0 else 'up'} half of an interleaved [F, 2, D] gate/up",
                "rotary": lambda: f"rotary permutation over {a[0]} heads (adjacent pairs to halves)",
                "unrotary": lambda: f"inverse rotary permutation over {a[0]} heads (halves to adjacent pairs)",
                }.get(self.op, lambda: self.op)()

    def inverse(self) -> Step:
        """The step that undoes this one on its output; :class:`TransformError` for a step that drops values (an
        index, a row range, a split: its inverse needs the other parts, not one tensor)."""
        undo = {"rotary": "unrotary", "unrotary": "rotary"}.get(self.op)
        _need(undo is not None, f"{self.describe()} has no inverse on one tensor")
        return Step(undo, self.args)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Transform:
    """Steps applied in order to one source tensor to make one output tensor."""

    steps: tuple[Step, ...]

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The output shape for a source of ``shape``; :class:`TransformError` where a step does not fit."""
        for s in self.steps:
            shape = s.shape(shape)
        return shape

    def apply(self, t: Any) -> Any:
        """The output tensor, contiguous (its bytes are what is written)."""
        for s in self.steps:
            t = s.apply(t)
        return t.contiguous()

    def describe(self) -> str:
        return "; ".join(s.describe() for s in self.steps)

    def inverse(self) -> Transform:
        """The transform that makes the source tensor back from the output (steps undone in reverse order);
        :class:`TransformError` when a step has no inverse on one tensor."""
        return Transform(tuple(s.inverse() for s in reversed(self.steps)))


__all__ = ["Step", "Transform", "TransformError"]
