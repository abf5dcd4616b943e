"""A flat Qt table over a Python list: the base of the Library's disk-usage table and the Prune preview."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QPersistentModelIndex, Qt


class RowsTableModel(QAbstractTableModel):
    """A flat table over a Python list (``rows_list()``), with ``HEADERS`` as its column titles."""

    HEADERS: tuple[str, ...] = ()

    def rows_list(self) -> list:
        raise NotImplementedError

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.rows_list())

    def columnCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.HEADERS)

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return self.HEADERS[section]
        return None
