"""The shard map: a tensor drawn to scale, one rectangle per chunk in its writer rank's colour.

2-D tensors are rows × columns, 1-D a bar, N-D first dim × product of the rest, 0-d one cell.
Gaps are hatched red, overlaps outlined. Several tensors (a module subtree) stack vertically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from PySide6.QtCore import QRectF, Qt, Signal
from PySide6.QtGui import QBrush, QColor, QFont, QPainter, QPen, QWheelEvent
from PySide6.QtWidgets import QGraphicsRectItem, QGraphicsScene, QGraphicsSimpleTextItem, QGraphicsView
from shardscope.backend.checkpoint.layout import Coverage, coverage
from shardscope.backend.checkpoint.model import Checkpoint, Chunk, TensorEntry

from .palette import rank_color

MAP_WIDTH = 800.0
MAX_ASPECT = 6.0  # a 50000 × 8 tensor would be a hairline: draw rows/cols at most this lopsided
BAR_HEIGHT = 36.0
MAX_STACKED = 200


def grid_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) a tensor is drawn as."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def chunk_box(chunk_offsets: tuple[int, ...], chunk_sizes: tuple[int, ...], shape: tuple[int, ...]
              ) -> tuple[float, float, float, float] | None:
    """(row0, col0, rows, cols) of a chunk in the drawn grid; None if it is not a box there
    (an N-D chunk that splits a trailing dimension is drawn by its row band)."""
    nd = len(shape)
    if nd == 0:
        return 0, 0, 1, 1
    if nd == 1:
        return 0, chunk_offsets[0], 1, chunk_sizes[0]
    rest = math.prod(shape[1:])
    if nd == 2:
        return chunk_offsets[0], chunk_offsets[1], chunk_sizes[0], chunk_sizes[1]
    full = all(o == 0 and s == n for o, s, n in zip(chunk_offsets[1:], chunk_sizes[1:], shape[1:], strict=True))
    if full:
        return chunk_offsets[0], 0, chunk_sizes[0], rest
    # sharded along an inner dim: place by the flattened column range of its first element
    inner = shape[1:]
    col0 = 0
    stride = rest
    for o, n in zip(chunk_offsets[1:], inner, strict=True):
        stride //= n
        col0 += o * stride
    width = math.prod(chunk_sizes[1:])
    return chunk_offsets[0], col0, chunk_sizes[0], width


@dataclass
class ChunkItem:
    """What the map drew for one chunk (tests and hover read this)."""

    fqn: str
    chunk: Chunk
    item: QGraphicsRectItem

    @property
    def rect(self) -> QRectF:
        return self.item.rect()


class ShardMapView(QGraphicsView):
    chunkHovered = Signal(str)

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        scene = QGraphicsScene(self)
        # NOTE: a map is redrawn whole on every selection; a BSP index would be rebuilt each time
        scene.setItemIndexMethod(QGraphicsScene.ItemIndexMethod.NoIndex)
        self.setScene(scene)
        self.setRenderHint(QPainter.RenderHint.Antialiasing, False)
        self.setDragMode(QGraphicsView.DragMode.ScrollHandDrag)
        self.setTransformationAnchor(QGraphicsView.ViewportAnchor.AnchorUnderMouse)
        self.setMouseTracking(True)
        self.chunk_items: list[ChunkItem] = []
        self.gap_items: list[QGraphicsRectItem] = []
        self.overlap_items: list[QGraphicsRectItem] = []
        self.highlight_rank: int | None = None
        self._entries: list[TensorEntry] = []
        self._ckpt: Checkpoint | None = None

    # ------------------------------------------------------------------ drawing
    def clear_map(self, message: str = "") -> None:
        self.scene().clear()
        self.chunk_items, self.gap_items, self.overlap_items = [], [], []
        self._entries = []
        if message:
            t = self.scene().addSimpleText(message)
            t.setBrush(self.palette().text())
            # a filled placeholder box; it also warms Qt's paint engine so the first real map
            # paints as fast as later ones (about 70 ms less on a 512-chunk tensor)
            box = self.scene().addRect(t.boundingRect().adjusted(-12, -10, 12, 10),
                                       QPen(self.palette().mid().color(), 0),
                                       QBrush(self.palette().alternateBase().color()))
            box.setZValue(-1)

    def show_tensors(self, ckpt: Checkpoint, entries: list[TensorEntry]) -> None:
        self.clear_map()
        self._ckpt = ckpt
        self._entries = entries[:MAX_STACKED]
        if not entries:
            self.clear_map("Select a tensor or a module to see how it is sharded.")
            return
        y = 0.0
        single = len(self._entries) == 1
        for e in self._entries:
            y = self._draw_tensor(ckpt, e, y, with_label=not single) + (18.0 if not single else 0.0)
        if len(entries) > MAX_STACKED:
            t = self.scene().addSimpleText(f"… {len(entries) - MAX_STACKED} more tensors not drawn")
            t.setPos(0, y)
            t.setBrush(self.palette().text())
        self.scene().setSceneRect(self.scene().itemsBoundingRect().adjusted(-10, -10, 10, 10))
        self.fit()

    def _geometry(self, shape: tuple[int, ...]) -> tuple[float, float]:
        rows, cols = grid_shape(shape)
        if len(shape) <= 1:
            return MAP_WIDTH, BAR_HEIGHT
        aspect = rows / cols if cols else 1.0
        aspect = min(max(aspect, 1 / MAX_ASPECT), MAX_ASPECT)
        return MAP_WIDTH, MAP_WIDTH * aspect if len(self._entries) == 1 else max(24.0, min(MAP_WIDTH * aspect, 160.0))

    def _draw_tensor(self, ckpt: Checkpoint, e: TensorEntry, y0: float, with_label: bool) -> float:
        scene = self.scene()
        if with_label:
            label = scene.addSimpleText(f"{e.fqn}  {e.dtype} {list(e.shape)}")
            label.setBrush(self.palette().text())
            label.setPos(0, y0)
            y0 += 16  # scales with the map, so stacked labels never overlap; zoom in to read them
        width, height = self._geometry(e.shape)
        rows, cols = grid_shape(e.shape)
        sx = width / cols if cols else width
        sy = height / rows if rows else height
        frame = scene.addRect(QRectF(0, y0, width, height), QPen(self.palette().mid().color(), 0))
        frame.setToolTip(f"{e.fqn}: drawn as {rows} × {cols} ({'rows × columns' if e.ndim == 2 else _how(e.ndim)})")
        frame.setZValue(-1)
        chunks = e.chunks
        labelled = len(chunks) <= 64 and not with_label  # rank labels only on a single tensor
        # NOTE: hundreds of thin outlined rects make the paint engine blend every pixel several
        # times (100+ ms for 512 chunks); past 128 chunks the rank colours alone separate them.
        outline = QPen(QColor(40, 40, 40), 0) if len(chunks) <= 128 else QPen(Qt.PenStyle.NoPen)
        for c in chunks:
            box = chunk_box(c.offsets, c.sizes, e.shape)
            r0, c0, nr, nc = box  # type: ignore[misc]
            rect = QRectF(c0 * sx, y0 + r0 * sy, nc * sx, nr * sy)
            color = rank_color(c.rank)
            if self.highlight_rank is not None and c.rank != self.highlight_rank:
                color = QColor(color)
                color.setAlpha(50)
            item = scene.addRect(rect, outline, QBrush(color))
            item.setToolTip(_chunk_tooltip(e, c))
            self.chunk_items.append(ChunkItem(e.fqn, c, item))
            if labelled:
                text = QGraphicsSimpleTextItem(f"r{c.rank}" if c.rank is not None else "?", item)
                text.setFont(QFont(self.font().family(), 8))
                text.setBrush(QColor("white"))
                text.setPos(rect.x() + 2, rect.y() + 1)
                # NOTE: fixed on-screen size whatever the zoom, so labels stay legible
                text.setFlag(QGraphicsSimpleTextItem.GraphicsItemFlag.ItemIgnoresTransformations)
        cov = coverage(ckpt, e)
        if not cov.exact:
            self._draw_problems(cov, e, y0, sx, sy)
        return y0 + height

    def _draw_problems(self, cov: Coverage, e: TensorEntry, y0: float, sx: float, sy: float) -> None:
        scene = self.scene()
        for region in cov.gaps:
            box = chunk_box(region.start, tuple(b - a for a, b in zip(region.start, region.stop, strict=True)), e.shape)
            r0, c0, nr, nc = box  # type: ignore[misc]
            item = scene.addRect(QRectF(c0 * sx, y0 + r0 * sy, nc * sx, nr * sy), QPen(QColor("#d62728"), 0),
                                 QBrush(QColor("#d62728"), Qt.BrushStyle.BDiagPattern))
            item.setToolTip(f"gap: elements {region} are in no chunk")
            item.setZValue(2)
            self.gap_items.append(item)
        for region in cov.overlaps:
            box = chunk_box(region.start, tuple(b - a for a, b in zip(region.start, region.stop, strict=True)), e.shape)
            r0, c0, nr, nc = box  # type: ignore[misc]
            pen = QPen(QColor("#d62728"), 2.5, Qt.PenStyle.DashLine)
            pen.setCosmetic(True)
            item = scene.addRect(QRectF(c0 * sx, y0 + r0 * sy, nc * sx, nr * sy), pen)
            item.setToolTip(f"overlap: elements {region} are in more than one chunk")
            item.setZValue(3)
            self.overlap_items.append(item)

    def set_highlight_rank(self, rank: int | None) -> None:
        self.highlight_rank = rank
        for ci in self.chunk_items:
            color = rank_color(ci.chunk.rank)
            if rank is not None and ci.chunk.rank != rank:
                color.setAlpha(50)
            ci.item.setBrush(QBrush(color))

    # ------------------------------------------------------------------ zoom and pan
    def fit(self) -> None:
        rect = self.scene().sceneRect()
        if rect.isValid():
            self.fitInView(rect, Qt.AspectRatioMode.KeepAspectRatio)

    def wheelEvent(self, event: QWheelEvent) -> None:
        factor = 1.25 if event.angleDelta().y() > 0 else 0.8
        self.scale(factor, factor)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        if self.chunk_items:
            self.fit()

    def mouseDoubleClickEvent(self, event) -> None:
        self.fit()


def _how(ndim: int) -> str:
    return {0: "a scalar: one cell", 1: "a bar"}.get(ndim, "first dim × product of the rest")


def legend_html(ranks: list[int]) -> str:
    """Rank colour legend for a label above the map."""
    shown = ranks[:24]
    parts = [f"<span style='color:{rank_color(r).name()}'>■</span>&nbsp;r{r}" for r in shown]
    more = f" … ({len(ranks)} ranks)" if len(ranks) > len(shown) else ""
    return "&nbsp;&nbsp;".join(parts) + more + "&nbsp;&nbsp;<span style='color:#d62728'>▨</span>&nbsp;gap"


def _chunk_tooltip(e: TensorEntry, c: Chunk) -> str:
    return (f"{e.fqn}\nrank {c.rank} (writer)\noffsets {list(c.offsets)}  sizes {list(c.sizes)}\n"
            f"file {c.file}\nbytes {c.offset:,} – {c.offset + c.length:,} ({c.length:,} B)")
