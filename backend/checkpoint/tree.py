"""The entries of a checkpoint grouped by their dotted path (``model`` › ``blocks`` › ``0`` › ...)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .model import Checkpoint, ObjectEntry, TensorEntry


@dataclass(slots=True, eq=False)
class TreeNode:
    """A module path or a leaf entry; aggregates are filled for the whole subtree."""

    name: str
    path: str
    parent: TreeNode | None
    row: int = 0
    children: list[TreeNode] = field(default_factory=list)
    entry: TensorEntry | ObjectEntry | None = None
    nbytes: int = 0
    chunks: int = 0
    ranks: frozenset[int] = frozenset()
    tensors: int = 0

    def child(self, name: str) -> TreeNode | None:
        """The direct child called ``name``, or None."""
        for c in self.children:
            if c.name == name:
                return c
        return None

    def iter_tensors(self):
        """Every tensor entry in this subtree, depth first."""
        if isinstance(self.entry, TensorEntry):
            yield self.entry
        for c in self.children:
            yield from c.iter_tensors()


def build_tree(ckpt: Checkpoint) -> TreeNode:
    """The entries grouped by dotted path, with sizes, chunk counts and ranks aggregated per subtree."""
    root = TreeNode("", "", None)
    index: dict[str, TreeNode] = {"": root}

    def node_for(path: str) -> TreeNode:
        node = index.get(path)
        if node is None:
            parent_path, _, name = path.rpartition(".")
            parent = node_for(parent_path)
            node = TreeNode(name, path, parent, len(parent.children))
            parent.children.append(node)
            index[path] = node
        return node

    entries: list[TensorEntry | ObjectEntry] = [*ckpt.tensors, *ckpt.objects]
    for entry in entries:
        node = node_for(entry.fqn)
        node.entry = entry
    _aggregate(root, ckpt, _tensor_ranks(ckpt))
    return root


def _tensor_ranks(ckpt: Checkpoint) -> list[frozenset[int]]:
    """The writer ranks of every tensor, in one numpy pass (not one per tensor)."""
    t = ckpt.chunk_table
    ranks = ckpt.file_ranks[t.file].astype(np.int64)
    keep = ranks >= 0
    width = int(ranks.max()) + 1 if keep.any() else 1
    pairs = np.sort(t.tensor[keep].astype(np.int64) * width + ranks[keep])
    if len(pairs):  # unique by sort + diff: numpy's hash-based unique is 10x slower here
        pairs = pairs[np.concatenate(([True], pairs[1:] != pairs[:-1]))]
    tensor_of, rank_of = np.divmod(pairs, width)
    out: list[frozenset[int]] = [frozenset()] * len(ckpt.tensors)
    bounds = np.searchsorted(tensor_of, np.arange(len(ckpt.tensors) + 1))
    rank_list = rank_of.tolist()
    for i in np.nonzero(np.diff(bounds))[0].tolist():
        out[i] = frozenset(rank_list[bounds[i]:bounds[i + 1]])
    return out


def _aggregate(node: TreeNode, ckpt: Checkpoint, tensor_ranks: list[frozenset[int]]) -> None:
    index_of = {id(t): i for i, t in enumerate(ckpt.tensors)}
    stack = [(node, False)]
    while stack:
        n, done = stack.pop()
        if not done:
            stack.append((n, True))
            stack.extend((c, False) for c in n.children)
            continue
        # Sibling subtrees mostly share one rank set: union the distinct sets only.
        parts: set[frozenset[int]] = {c.ranks for c in n.children}
        if isinstance(n.entry, TensorEntry):
            n.nbytes, n.chunks, n.tensors = n.entry.nbytes, n.entry.chunk_count, 1
            parts.add(tensor_ranks[index_of[id(n.entry)]])
        elif isinstance(n.entry, ObjectEntry) and n.entry.rank is not None:
            parts.add(frozenset((n.entry.rank,)))
        for c in n.children:
            n.nbytes += c.nbytes
            n.chunks += c.chunks
            n.tensors += c.tensors
        n.ranks = next(iter(parts)) if len(parts) == 1 else frozenset().union(*parts)
