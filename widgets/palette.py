"""One stable palette for ranks: rank r always has the same colour, everywhere."""

from __future__ import annotations

from PySide6.QtGui import QColor

_BASE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
         "#9c755f", "#bab0ac", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def rank_color(rank: int | None) -> QColor:
    if rank is None or rank < 0:
        return QColor("#888888")
    if rank < len(_BASE):
        return QColor(_BASE[rank])
    # beyond 16 ranks: golden-angle hues, stable per rank
    return QColor.fromHsvF(((rank * 0.618033988749895) % 1.0), 0.55, 0.85)
