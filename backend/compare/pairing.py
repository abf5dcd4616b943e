"""Which entry of A goes with which entry of B.

Names are paired as stored, unless removing a side's container prefix pairs more of them: a DCP
checkpoint (``model.blocks.0.fc1.weight``) and its safetensors export (``blocks.0.fc1.weight``), or a
Lightning ``state_dict.`` folder and an HF export. The container is the one export removes
(:func:`..export.layouts.layout_of_names`: torch DCP ``model.``, Lightning ``state_dict.``, accelerate,
...), and so are the wrapper key parts export removes (torch.compile's ``_orig_mod.``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from ..checkpoint.sources import Source
from ..export.layouts import Layout, layout_of_names, model_key, recognise_layout


def source_layout(source: Source) -> Layout:
    """The layout a source's entries were saved in (which container prefix, if any, holds the model): an opened
    checkpoint's as export recognises it (keys, folder name, Lightning's meta.pt), else read from tensor names."""
    ckpt = getattr(source, "ckpt", None)
    if ckpt is not None:
        return recognise_layout(ckpt)
    return layout_of_names(n for n, e in source.entries().items() if e.kind == "tensor")


@dataclass(frozen=True)
class Pairing:
    """The entries of A and B paired: ``pairs`` maps the name shown for a pair to (A's name, B's name)."""

    pairs: dict[str, tuple[str, str]]
    only_a: list[str]
    only_b: list[str]
    prefix_a: str = ""  # the container removed from A's names to pair them ("" none)
    prefix_b: str = ""
    layouts: tuple[str, str] = ("", "")
    hint: str = ""  # when nothing pairs: what relates the names, if anything

    @property
    def renamed(self) -> bool:
        """True when names were paired without a container prefix rather than as stored."""
        return bool(self.prefix_a or self.prefix_b)

    def describe(self) -> str:
        """One line for the user: how the names were paired."""
        if not self.renamed:
            return "names as stored"
        parts = [f"{side}'s names without the container prefix '{prefix}' (layout: {layout})"
                 for side, prefix, layout in (("A", self.prefix_a, self.layouts[0]), ("B", self.prefix_b,
                                                                                    self.layouts[1])) if prefix]
        return " and ".join(parts) + f"; {len(self.pairs)} pairs"

    def to_json(self) -> dict[str, object]:
        """The pairing rule as a JSON-ready dict."""
        return {"rule": "container" if self.renamed else "exact", "prefix_a": self.prefix_a,
                "prefix_b": self.prefix_b, "text": self.describe()}


def _keys(names: list[str], container: str) -> dict[str, str] | None:
    """Pairing key -> name: names under ``container`` lose it (and wrapper key parts, as export does);
    None when two names would get the same key (then this side is only paired as stored)."""
    out: dict[str, str] = {}
    for n in names:
        key = model_key(n, container)[0] if container and n.startswith(container) else n
        if key in out:
            return None
        out[key] = n
    return out


def pair_names(names_a: list[str], names_b: list[str], layout_a: Layout, layout_b: Layout,
               exact: bool = False) -> Pairing:
    """Pair the entries of A and B: as stored, or (unless ``exact``) without a side's container prefix when
    that pairs more entries. Ties keep the names as stored."""
    choices_a = [""] + ([layout_a.container] if layout_a.container and not exact else [])
    choices_b = [""] + ([layout_b.container] if layout_b.container and not exact else [])
    best: tuple[int, str, str, dict[str, str], dict[str, str]] | None = None
    for pa, pb in product(choices_a, choices_b):
        ka, kb = _keys(names_a, pa), _keys(names_b, pb)
        if ka is None or kb is None:
            continue
        n = len(ka.keys() & kb.keys())
        if best is None or n > best[0]:
            best = (n, pa, pb, ka, kb)
    assert best is not None  # names as stored never collide
    _, pa, pb, ka, kb = best
    pairs = {k: (ka[k], kb[k]) for k in sorted(ka.keys() & kb.keys())}
    only_a = sorted(ka[k] for k in ka.keys() - kb.keys())
    only_b = sorted(kb[k] for k in kb.keys() - ka.keys())
    hint = "" if pairs else prefix_hint(only_a, only_b)
    return Pairing(pairs, only_a, only_b, pa, pb, (layout_a.name, layout_b.name), hint)


def prefix_hint(only_a: list[str], only_b: list[str]) -> str:
    """When no entry pairs because one side's names are the other's under a prefix the layouts do not
    explain (or ``--exact-names`` was asked for), say which prefix; else ""."""
    for longer, shorter, side, other in ((only_a, only_b, "B", "A"), (only_b, only_a, "A", "B")):
        if not shorter:
            continue
        names, first = set(longer), shorter[0]
        prefixes = {n[: -len(first)] for n in longer if n.endswith("." + first)}
        for prefix in sorted(prefixes, key=len):
            if all(prefix + k in names for k in shorter):
                return (f"{side}'s entries are {other}'s without the prefix '{prefix}', so none could be paired "
                        "by name and no values were compared.")
    return ""


__all__ = ["Pairing", "pair_names", "prefix_hint"]
