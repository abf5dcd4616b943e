"""The tensor tree: a QAbstractItemModel over backend ``TreeNode``s, and its filter proxies."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import (
    QAbstractItemModel,
    QModelIndex,
    QPersistentModelIndex,
    QRegularExpression,
    QSortFilterProxyModel,
    Qt,
)
from PySide6.QtWidgets import QStyledItemDelegate, QStyleOptionViewItem, QTreeView
from shardscope.backend.checkpoint.model import ObjectEntry, TensorEntry
from shardscope.backend.checkpoint.tree import TreeNode
from shardscope.backend.text import count, escape_name, human_bytes, plain_tooltip, ranks_text

NodeRole = Qt.ItemDataRole.UserRole + 1  # the TreeNode itself
SortRole = Qt.ItemDataRole.UserRole + 2  # numeric sort keys
PathRole = Qt.ItemDataRole.UserRole + 3  # full dotted path, for the text filter
RanksRole = Qt.ItemDataRole.UserRole + 4  # " 0 1 3 " for the rank filter

COLUMNS = ("Name", "dtype", "shape", "size", "chunks", "ranks")


class TensorTreeModel(QAbstractItemModel):
    """Adapter only: the backend tree is the source of truth; no per-row widgets."""

    def __init__(self, root: TreeNode | None = None, values: dict[str, str] | None = None, parent=None) -> None:
        super().__init__(parent)
        self._root = root or TreeNode("", "", None)
        self._values = values or {}  # small non-tensor values, fqn -> text

    def set_root(self, root: TreeNode, values: dict[str, str] | None = None) -> None:
        self.beginResetModel()
        self._root = root
        self._values = values or {}
        self.endResetModel()

    def set_values(self, values: dict[str, str]) -> None:
        """Small non-tensor values arrive after the tree; only the shape column changes."""
        self._values = values
        stack = list(self._root.children)
        while stack:
            n = stack.pop()
            if isinstance(n.entry, ObjectEntry) and n.entry.fqn in values:
                idx = self.createIndex(n.row, 2, n)
                self.dataChanged.emit(idx, idx, [Qt.ItemDataRole.DisplayRole])
            stack.extend(n.children)

    @property
    def root(self) -> TreeNode:
        return self._root

    def node(self, index: QModelIndex) -> TreeNode:
        # NOTE: internalPointer is the TreeNode; the tree keeps every node alive for the model's life.
        return index.internalPointer() if index.isValid() else self._root

    def index(self, row: int, column: int, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> QModelIndex:
        p = self.node(parent)
        if 0 <= row < len(p.children) and 0 <= column < len(COLUMNS):
            return self.createIndex(row, column, p.children[row])
        return QModelIndex()

    def parent(self, index: QModelIndex | QPersistentModelIndex = QModelIndex()) -> QModelIndex:  # type: ignore[override]
        if not index.isValid():
            return QModelIndex()
        n = self.node(index).parent
        if n is None or n is self._root:
            return QModelIndex()
        return self.createIndex(n.row, 0, n)

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:
        if parent.isValid() and parent.column() != 0:
            return 0
        return len(self.node(parent).children)

    def columnCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:
        return len(COLUMNS)

    def hasChildren(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> bool:
        return self.rowCount(parent) > 0

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[section]
        return None

    def flags(self, index: QModelIndex | QPersistentModelIndex) -> Qt.ItemFlag:
        if not index.isValid():
            return Qt.ItemFlag.NoItemFlags
        return Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable

    def data(self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        n: TreeNode = index.internalPointer()
        col = index.column()
        e = n.entry
        if role == Qt.ItemDataRole.DisplayRole:
            if col == 0:  # escaped: a U+202E or newline in a stored name must not reorder or split the row
                return escape_name(n.name)
            if isinstance(e, TensorEntry):
                return (None, e.dtype, "×".join(map(str, e.shape)) or "scalar", human_bytes(e.nbytes),
                        str(e.chunk_count), ranks_text(n.ranks, ""))[col]
            if isinstance(e, ObjectEntry):
                # NOTE: an entry with no stored bytes of its own (a .pt's step, a safetensors header value): no size
                return (None, "object", escape_name(self._values.get(e.fqn, "")),
                        human_bytes(e.length if e.file else None), "", ranks_text(n.ranks, ""))[col]
            return (None, "", count(n.tensors, "tensor"), human_bytes(n.nbytes), str(n.chunks),
                    ranks_text(n.ranks, ""))[col]
        if role == SortRole:
            if col == 0:
                return n.name
            if isinstance(e, TensorEntry):
                return (None, e.dtype, e.numel, e.nbytes, e.chunk_count, len(n.ranks))[col]
            return (None, "", 0, n.nbytes, n.chunks, len(n.ranks))[col]
        if role == Qt.ItemDataRole.ToolTipRole:
            if isinstance(e, TensorEntry):
                where = f"written by {count(len(n.ranks), 'rank')} ({ranks_text(n.ranks)})" if n.ranks else \
                    "no writer rank recorded"
                return plain_tooltip(f"{e.fqn}\n{e.dtype} {list(e.shape)}, {count(e.chunk_count, 'chunk')} {where}")
            return plain_tooltip(n.path)
        if role == NodeRole:
            return n
        if role == PathRole:
            return n.path
        if role == RanksRole:
            return " " + " ".join(map(str, sorted(n.ranks))) + " "
        if role == Qt.ItemDataRole.TextAlignmentRole and col in (3, 4):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None

    def index_for_path(self, path: str) -> QModelIndex:
        node = self._root
        for part in _split(path, node):
            nxt = node.child(part)
            if nxt is None:
                return QModelIndex()
            node = nxt
        return self.createIndex(node.row, 0, node) if node is not self._root else QModelIndex()


def _split(path: str, root: TreeNode) -> list[str]:
    return [p for p in path.split(".") if p] if path else []


class RankFilterProxy(QSortFilterProxyModel):
    """Shows only entries with chunks written by one rank (C++ regex filter on RanksRole)."""

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.setRecursiveFilteringEnabled(True)
        self.setFilterRole(RanksRole)
        self.rank: int | None = None

    def set_rank(self, rank: int | None) -> None:
        self.rank = rank
        self.setFilterRegularExpression(QRegularExpression("" if rank is None else f" {rank} "))


class TextFilterProxy(QSortFilterProxyModel):
    """Substring (default), glob or regular expression over the full dotted path; sorts numerically."""

    MODES = ("substring", "glob", "regex")

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.setRecursiveFilteringEnabled(True)
        self.setFilterRole(PathRole)
        self.setSortRole(SortRole)
        self.setFilterCaseSensitivity(Qt.CaseSensitivity.CaseInsensitive)
        self.mode = "substring"
        self.text = ""
        self.valid = True

    def set_filter(self, text: str, mode: str = "substring") -> bool:
        self.text, self.mode = text, mode
        if mode == "regex":
            rx = QRegularExpression(text, QRegularExpression.PatternOption.CaseInsensitiveOption)
        elif mode == "glob":
            rx = QRegularExpression(QRegularExpression.wildcardToRegularExpression(
                text, QRegularExpression.WildcardConversionOption.UnanchoredWildcardConversion),
                QRegularExpression.PatternOption.CaseInsensitiveOption)
        else:
            rx = QRegularExpression(QRegularExpression.escape(text),
                                    QRegularExpression.PatternOption.CaseInsensitiveOption)
        self.valid = rx.isValid()
        if self.valid:
            self.setFilterRegularExpression(rx)
        return self.valid


# ------------------------------------------------------------------ the tree's columns
NAME_ROOM = "exp_avg_sq…"  # what the deepest names keep visible (exp_avg and exp_avg_sq must differ)


class NameDelegate(QStyledItemDelegate):
    """The name column elides at the start, keeping a name's end (``…avg_sq``): eliding in the middle, a deep
    ``exp_avg`` and ``exp_avg_sq`` both became ``e…g``."""

    def initStyleOption(self, option: QStyleOptionViewItem, index: QModelIndex | QPersistentModelIndex) -> None:
        super().initStyleOption(option, index)
        option.textElideMode = Qt.TextElideMode.ElideLeft


def size_columns(tree: QTreeView) -> None:
    """Widths from the font, so "1023.9 MiB" and "float32" fit at any DPI and font size."""
    fm = tree.fontMetrics()
    pad = 2 * fm.averageCharWidth() + 4
    # NOTE: the shape column holds a module's count too: "2,001 tensors" was cut to "2,001…nsors" at 512 ranks
    samples = ("bfloat16", "20,000 tensors", "1023.9 MiB", "00000", "000–000")
    header = tree.header()
    header.setStretchLastSection(False)
    header.setMinimumSectionSize(fm.horizontalAdvance("0000") + pad)
    for col, text in enumerate(samples, start=1):
        tree.setColumnWidth(col, fm.horizontalAdvance(text) + pad)
    tree.setTextElideMode(Qt.TextElideMode.ElideMiddle)


def name_floor(tree: QTreeView, depth: int) -> int:
    """The name column's least width: the indentation of the deepest level (``depth``) and NAME_ROOM."""
    return tree.indentation() * (depth + 1) + tree.fontMetrics().horizontalAdvance(NAME_ROOM) + 12


def tree_room(tree: QTreeView, depth: int) -> int:
    """The width the tree widget needs to show every column, and names ``depth`` levels deep whole, without
    scrolling sideways: the number columns, the name column's floor, the frame and a vertical scroll bar."""
    from PySide6.QtWidgets import QStyle

    others = sum(tree.columnWidth(c) for c in range(1, tree.header().count()))
    chrome = 2 * tree.frameWidth() + tree.style().pixelMetric(QStyle.PixelMetric.PM_ScrollBarExtent, None, tree)
    return name_floor(tree, depth) + others + chrome + 2


def fit_name_column(tree: QTreeView, depth: int) -> None:
    """The name column takes what the numbers leave, never less than the deepest names need (then the tree
    scrolls sideways), so sizes and counts are never cut and deep names stay apart."""
    if tree.header().count() < 2:
        return
    others = sum(tree.columnWidth(c) for c in range(1, tree.header().count()))
    tree.setColumnWidth(0, max(tree.viewport().width() - others, name_floor(tree, depth)))
