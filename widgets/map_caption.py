"""The line above the shard map: what is drawn and how (a tensor, a module's tensors stacked, or nothing for a
non-tensor entry), and the legend of the rank colours when something is drawn."""

from __future__ import annotations

from ..backend.checkpoint.model import Checkpoint, TensorEntry
from ..backend.checkpoint.tree import TreeNode
from ..backend.text import count, rich_name
from .shard_map import grid_shape, legend_html, stacked_entries

NOTHING_SHARDED = "Nothing is sharded here: no shard map to draw."
ONE_VALUE = "a non-tensor entry, stored whole (its value is in the Inspector)"
VALUES_ONLY = "no tensors under it, only non-tensor entries"


def map_caption(ck: Checkpoint, node: TreeNode, tensors: list[TensorEntry]) -> str:
    """The caption for ``node`` whose map draws ``tensors`` (its own, or its subtree's)."""
    legend = legend_html(sorted(node.ranks) or ck.ranks)  # the ranks this entry's chunks come from
    if isinstance(node.entry, TensorEntry):
        e = node.entry
        rows, cols = grid_shape(e.shape)
        return (f"<b>{rich_name(e.fqn)}</b> drawn as {rows} × {cols}, {count(e.chunk_count, 'chunk')}"
                f"{unsharded_note(ck)} (wheel: zoom, drag: pan, double-click: fit)<br>{legend}")
    name = f"<b>{rich_name(node.path or 'all')}</b>"
    if not tensors:  # no "0 tensors stacked" and no legend of colours nothing is drawn in
        return f"{name}: {ONE_VALUE if node.entry is not None else VALUES_ONLY}"
    shown = len(stacked_entries(tensors))
    stacked = f"{count(len(tensors), 'tensor')} stacked" if shown == len(tensors) else \
        f"the first {shown:,} of {count(len(tensors), 'tensor')} stacked"
    return f"{name}: {stacked}, each scaled to the same width{unsharded_note(ck)}<br>{legend}"


def unsharded_note(ck: Checkpoint) -> str:
    """", all in one file (NAME), not sharded" for a checkpoint of one file and no writer ranks, else ""."""
    files = ck.data_files
    if ck.ranks or len(files) != 1:
        return ""
    return f", all in one file ({rich_name(files[0].name)}), not sharded"
