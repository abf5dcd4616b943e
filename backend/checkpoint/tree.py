"""The entries of a checkpoint grouped by their dotted path (``model`` › ``blocks`` › ``0`` › ...)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
        for c in self.children:
            if c.name == name:
                return c
        return None

    def iter_tensors(self):
        if isinstance(self.entry, TensorEntry):
            yield self.entry
        for c in self.children:
            yield from c.iter_tensors()


def build_tree(ckpt: Checkpoint) -> TreeNode:
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

    for entry in [*ckpt.tensors, *ckpt.objects]:
        node = node_for(entry.fqn)
        node.entry = entry
    _aggregate(root, ckpt)
    return root


def _aggregate(node: TreeNode, ckpt: Checkpoint) -> None:
    stack = [(node, False)]
    while stack:
        n, done = stack.pop()
        if not done:
            stack.append((n, True))
            stack.extend((c, False) for c in n.children)
            continue
        ranks: set[int] = set()
        if isinstance(n.entry, TensorEntry):
            n.nbytes, n.chunks, n.tensors = n.entry.nbytes, n.entry.chunk_count, 1
            ranks.update(n.entry.ranks)
        elif isinstance(n.entry, ObjectEntry) and n.entry.rank is not None:
            ranks.add(n.entry.rank)
        for c in n.children:
            n.nbytes += c.nbytes
            n.chunks += c.chunks
            n.tensors += c.tensors
            ranks.update(c.ranks)
        n.ranks = frozenset(ranks)
