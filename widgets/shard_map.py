"""The shard map: a tensor drawn to scale, one rectangle per chunk in its writer rank's colour.

2-D tensors are rows × columns, 1-D a bar, N-D first dim × product of the rest, 0-d one cell.
Gaps are hatched red, overlaps outlined. Several tensors (a module subtree) stack vertically.
Hovering shows what is under the pointer (chunk, gap, overlap, tensor) from one lookup on the view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from PySide6.QtCore import QEvent, QPointF, QRectF, Qt
from PySide6.QtGui import QBrush, QColor, QFont, QHelpEvent, QPainter, QPen, QWheelEvent
from PySide6.QtWidgets import QGraphicsRectItem, QGraphicsScene, QGraphicsSimpleTextItem, QGraphicsView, QToolTip
from shardscope.backend.checkpoint.layout import Coverage, Region, coverage
from shardscope.backend.checkpoint.model import Checkpoint, Chunk, TensorEntry
from shardscope.backend.text import count, plain_tooltip

from .palette import rank_color

MAP_WIDTH = 800.0
MAX_ASPECT = 6.0  # a 50000 × 8 tensor would be a hairline: draw rows/cols at most this lopsided
BAR_HEIGHT = 36.0
MAX_STACKED = 200
# NOTE: a module of a 512-rank checkpoint (200 tensors x 176 chunks) took 3.4 s of the GUI thread to
# stack; past this many chunks the stack stops (the caption says how many tensors were left out).
MAX_STACKED_CHUNKS = 8000
MIN_OUTLINED = 3.0  # scene units (about pixels when fitted): thinner chunks are drawn without an outline
MIN_LABEL_PIXELS = 9.0  # a stacked tensor's name is shown only this tall or taller on screen (hover names it)
LABEL_ROOM = 16.0  # scene units above each stacked tensor for its name


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


# What a hover can land on, from the lowest to the highest priority where several overlap.
FRAME, CHUNK, GAP, OVERLAP = range(4)


@dataclass
class HoverIndex:
    """Scene rectangles of everything drawn, for one lookup per hover.

    NOTE: the map sets no per-item tooltips. PySide6 6.12.0 loses a reference to None on every
    ``QGraphicsItem.setToolTip`` (and on other void calls), which aborted the process after ~60k
    chunks drawn; a tooltip string per chunk also cost memory on million-chunk maps. Tensors are
    stacked top to bottom, so a point finds its tensor by binary search on the bands, then its
    chunk by a vectorised test over that tensor's rectangles only.
    """

    boxes: list[tuple[float, float, float, float]] = field(default_factory=list)  # x0, y0, x1, y1
    what: list[tuple[int, TensorEntry, object]] = field(default_factory=list)  # (kind, tensor, chunk or region)
    bands: list[tuple[float, float, int]] = field(default_factory=list)  # (y0, y1, first box) per tensor
    _arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    def add(self, rect: QRectF, kind: int, entry: TensorEntry, detail: object = None) -> None:
        self.boxes.append((rect.left(), rect.top(), rect.right(), rect.bottom()))
        self.what.append((kind, entry, detail))
        self._arrays = None

    def start_band(self, y0: float, y1: float) -> None:
        self.bands.append((y0, y1, len(self.boxes)))
        self._arrays = None

    def lookup(self, x: float, y: float) -> tuple[int, tuple[int, TensorEntry, object]] | None:
        """(box index, (kind, tensor, chunk or region)) at scene point (x, y), or None."""
        if not self.bands:
            return None
        if self._arrays is None:
            self._arrays = (np.asarray(self.boxes, dtype=np.float64).reshape(-1, 4),
                            np.fromiter((w[0] for w in self.what), dtype=np.int8, count=len(self.what)),
                            np.asarray([b[0] for b in self.bands], dtype=np.float64))
        boxes, kinds, band_top = self._arrays
        i = int(np.searchsorted(band_top, y, side="right")) - 1
        if i < 0 or y > self.bands[i][1]:
            return None
        start = self.bands[i][2]
        stop = self.bands[i + 1][2] if i + 1 < len(self.bands) else len(self.boxes)
        b = boxes[start:stop]
        hit = np.flatnonzero((b[:, 0] <= x) & (x <= b[:, 2]) & (b[:, 1] <= y) & (y <= b[:, 3]))
        if not hit.size:
            return None
        best = start + int(hit[np.argmax(kinds[start:stop][hit])])  # the first of the highest kind
        return best, self.what[best]


class ShardMapView(QGraphicsView):
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
        self.label_items: list[QGraphicsSimpleTextItem] = []  # the stacked tensors' names
        self.highlight_rank: int | None = None
        self.hover = HoverIndex()
        self._entries: list[TensorEntry] = []
        self._single = True  # one tensor drawn alone (no label, its own aspect), not a stack
        self._follow_size = True  # refit on resize (False once the user zoomed with the wheel)
        self._ckpt: Checkpoint | None = None

    # ------------------------------------------------------------------ drawing
    def clear_map(self, message: str = "") -> None:
        self.scene().clear()
        self.chunk_items, self.gap_items, self.overlap_items, self.label_items = [], [], [], []
        self.hover = HoverIndex()
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
            # NOTE: drop the previous map's zoom and extent, or the message is drawn at its scale (tiny)
            self.resetTransform()
            self.scene().setSceneRect(box.sceneBoundingRect())

    def show_tensors(self, ckpt: Checkpoint, entries: list[TensorEntry]) -> None:
        self.clear_map()
        self._ckpt = ckpt
        self._entries = stacked_entries(entries)
        self._single = len(entries) == 1
        if not entries:
            self.clear_map("Select a tensor or a module to see how it is sharded.")
            return
        y = 0.0
        single = self._single
        for e in self._entries:
            y = self._draw_tensor(ckpt, e, y, with_label=not single) + (18.0 if not single else 0.0)
        if len(entries) > len(self._entries):
            t = self.scene().addSimpleText(f"… {count(len(entries) - len(self._entries), 'more tensor')} not drawn "
                                           "(select a smaller module to see them)")
            t.setPos(0, y)
            t.setBrush(self.palette().text())
        self.scene().setSceneRect(self.scene().itemsBoundingRect().adjusted(-10, -10, 10, 10))
        self.fit()

    def _geometry(self, shape: tuple[int, ...]) -> tuple[float, float]:
        rows, cols = grid_shape(shape)
        if not shape:  # a scalar is one cell, a square (it was drawn as a bar as wide as a tensor's)
            return BAR_HEIGHT, BAR_HEIGHT
        if len(shape) == 1:
            return MAP_WIDTH, BAR_HEIGHT
        aspect = rows / cols if cols else 1.0
        aspect = min(max(aspect, 1 / MAX_ASPECT), MAX_ASPECT)
        return MAP_WIDTH, MAP_WIDTH * aspect if self._single else max(24.0, min(MAP_WIDTH * aspect, 160.0))

    def _draw_tensor(self, ckpt: Checkpoint, e: TensorEntry, y0: float, with_label: bool) -> float:
        scene = self.scene()
        top = y0
        if with_label:
            label = scene.addSimpleText(f"{e.fqn}  {e.dtype} {list(e.shape)}")
            label.setBrush(self.palette().text())
            label.setPos(0, y0)
            self.label_items.append(label)
            y0 += LABEL_ROOM  # scales with the map, so stacked labels never overlap; hidden while too small to read
        width, height = self._geometry(e.shape)
        rows, cols = grid_shape(e.shape)
        sx = width / cols if cols else width
        sy = height / rows if rows else height
        frame_rect = QRectF(0, y0, width, height)
        frame = scene.addRect(frame_rect, QPen(self.palette().mid().color(), 0))
        frame.setZValue(-1)
        self.hover.start_band(top, y0 + height)
        self.hover.add(frame_rect, FRAME, e)
        if with_label:  # its name's room: hovering it names the tensor (the name is hidden while too small)
            self.hover.add(QRectF(0, top, max(width, label.boundingRect().width()), LABEL_ROOM), FRAME, e)
        chunks = e.chunks
        labelled = len(chunks) <= 64 and not with_label  # rank labels only on a single tensor
        rects = []
        for c in chunks:
            r0, c0, nr, nc = chunk_box(c.offsets, c.sizes, e.shape)  # type: ignore[misc]
            rects.append(QRectF(c0 * sx, y0 + r0 * sy, nc * sx, nr * sy))
        # NOTE: hundreds of thin outlined rects make the paint engine blend every pixel several
        # times (100+ ms for 512 chunks); past 128 chunks, or when a chunk is only a few units
        # thin (outlines would paint it dark), the rank colours alone separate them.
        thinnest = min((min(r.width(), r.height()) for r in rects), default=0.0)
        outlined = len(chunks) <= 128 and thinnest >= MIN_OUTLINED
        outline = QPen(QColor(40, 40, 40), 0) if outlined else QPen(Qt.PenStyle.NoPen)
        for c, rect in zip(chunks, rects, strict=True):
            color = rank_color(c.rank)
            if self.highlight_rank is not None and c.rank != self.highlight_rank:
                color = QColor(color)
                color.setAlpha(50)
            item = scene.addRect(rect, outline, QBrush(color))
            self.hover.add(rect, CHUNK, e, c)
            self.chunk_items.append(ChunkItem(e.fqn, c, item))
            if labelled:
                # a chunk with no writer rank (a consolidated file) is labelled with its file
                text = QGraphicsSimpleTextItem(f"r{c.rank}" if c.rank is not None else c.file, item)
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
            rect = _region_rect(region, e, y0, sx, sy)
            red = QColor("#d62728")
            item = scene.addRect(rect, QPen(red, 0), QBrush(red, Qt.BrushStyle.BDiagPattern))
            item.setZValue(2)
            self.hover.add(rect, GAP, e, region)
            self.gap_items.append(item)
        for region in cov.overlaps:
            rect = _region_rect(region, e, y0, sx, sy)
            pen = QPen(QColor("#d62728"), 2.5, Qt.PenStyle.DashLine)
            pen.setCosmetic(True)
            item = scene.addRect(rect, pen)
            item.setZValue(3)
            self.hover.add(rect, OVERLAP, e, region)
            self.overlap_items.append(item)

    def set_highlight_rank(self, rank: int | None) -> None:
        self.highlight_rank = rank
        for ci in self.chunk_items:
            color = rank_color(ci.chunk.rank)
            if rank is not None and ci.chunk.rank != rank:
                color.setAlpha(50)
            ci.item.setBrush(QBrush(color))

    # ------------------------------------------------------------------ hover
    def describe_at(self, scene_pos: QPointF) -> tuple[str, QRectF] | None:
        """The hover text for a scene point and the scene rectangle it describes, or None."""
        found = self.hover.lookup(scene_pos.x(), scene_pos.y())
        if found is None:
            return None
        i, (kind, e, detail) = found
        x0, y0, x1, y1 = self.hover.boxes[i]
        return _hover_text(kind, e, detail), QRectF(x0, y0, x1 - x0, y1 - y0)

    def viewportEvent(self, event: QEvent) -> bool:
        if event.type() == QEvent.Type.ToolTip and isinstance(event, QHelpEvent):
            found = self.describe_at(self.mapToScene(event.pos()))
            if found is None:
                QToolTip.hideText()
                event.ignore()
            else:
                text, rect = found
                # the tip stays up while the pointer is over the same chunk, and moves on with it
                QToolTip.showText(event.globalPos(), plain_tooltip(text), self.viewport(),
                                  self.mapFromScene(rect).boundingRect())
            return True
        return super().viewportEvent(event)

    # ------------------------------------------------------------------ zoom and pan
    def fit(self) -> None:
        """Show the whole tensor, or a stack across the whole width (it scrolls down); the map then follows the
        view's size again until the user zooms."""
        self._follow_size = True
        rect = self.scene().sceneRect()
        if not rect.isValid():
            return
        if self._single or not self.label_items:
            self.fitInView(rect, Qt.AspectRatioMode.KeepAspectRatio)
        else:
            # NOTE: a stack fitted whole was a 25-35 px strip for a 72-tensor module, its names 3-4 px tall; across
            # the width it reads like a list. The scroll bar it brings up is counted, or fitting would loop.
            width = self.viewport().width()
            scale = width / rect.width()
            if rect.height() * scale > self.viewport().height() and not self.verticalScrollBar().isVisible():
                width -= self.style().pixelMetric(self.style().PixelMetric.PM_ScrollBarExtent)
            scale = max(width - 2, 1) / rect.width()
            self.resetTransform()
            self.scale(scale, scale)
            self.centerOn(rect.center().x(), rect.top() + self.viewport().height() / scale / 2)
        self._show_legible_labels()

    def _show_legible_labels(self) -> None:
        """A stacked tensor's name only where it can be read (MIN_LABEL_PIXELS); hovering its band names it."""
        scale = self.transform().m22()
        for label in self.label_items:
            label.setVisible(label.boundingRect().height() * scale >= MIN_LABEL_PIXELS)

    def wheelEvent(self, event: QWheelEvent) -> None:
        factor = 1.25 if event.angleDelta().y() > 0 else 0.8
        # NOTE: zooming in brings up the scroll bars, which resize the viewport; refitting on that resize
        # undid every wheel zoom at once in the real window
        self._follow_size = False
        self.scale(factor, factor)
        self._show_legible_labels()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        if self.chunk_items and self._follow_size:
            self.fit()

    def mouseDoubleClickEvent(self, event) -> None:
        self.fit()


def stacked_entries(entries: list[TensorEntry]) -> list[TensorEntry]:
    """The first tensors of a module that are stacked: at most MAX_STACKED, and no more once
    MAX_STACKED_CHUNKS chunks are drawn (always at least one)."""
    out: list[TensorEntry] = []
    total = 0
    for e in entries[:MAX_STACKED]:
        if out and total + e.chunk_count > MAX_STACKED_CHUNKS:
            break
        out.append(e)
        total += e.chunk_count
    return out


def _how(ndim: int) -> str:
    return {0: "a scalar: one cell", 1: "a bar"}.get(ndim, "first dim × product of the rest")


def legend_html(ranks: list[int]) -> str:
    """Rank colour legend for a label above the map."""
    shown = ranks[:24]
    parts = [f"<span style='color:{rank_color(r).name()}'>■</span>&nbsp;r{r}" for r in shown]
    if not ranks:
        parts = [f"<span style='color:{rank_color(None).name()}'>■</span>&nbsp;no writer rank recorded"]
    more = f" … ({count(len(ranks), 'rank')})" if len(ranks) > len(shown) else ""
    # NOTE: "&nbsp; " between entries lets the label wrap; an unbreakable legend set the window's minimum width
    return "&nbsp; ".join(parts) + more + "&nbsp; <span style='color:#d62728'>▨</span>&nbsp;gap"


def _region_rect(region: Region, e: TensorEntry, y0: float, sx: float, sy: float) -> QRectF:
    sizes = tuple(b - a for a, b in zip(region.start, region.stop, strict=True))
    r0, c0, nr, nc = chunk_box(region.start, sizes, e.shape)  # type: ignore[misc]
    return QRectF(c0 * sx, y0 + r0 * sy, nc * sx, nr * sy)


def _hover_text(kind: int, e: TensorEntry, detail: object) -> str:
    if kind == CHUNK:
        c: Chunk = detail  # type: ignore[assignment]
        writer = "no writer rank recorded" if c.rank is None else f"rank {c.rank} (writer)"
        return (f"{e.fqn}\n{writer}\noffsets {list(c.offsets)}  sizes {list(c.sizes)}\n"
                f"file {c.file}\nbytes {c.offset:,} – {c.offset + c.length:,} ({c.length:,} B)")
    if kind == GAP:
        return f"{e.fqn}\ngap: elements {detail} are in no chunk"
    if kind == OVERLAP:
        return f"{e.fqn}\noverlap: elements {detail} are in more than one chunk"
    rows, cols = grid_shape(e.shape)
    return (f"{e.fqn}\n{e.dtype} {list(e.shape)}, drawn as {rows} × {cols} "
            f"({'rows × columns' if e.ndim == 2 else _how(e.ndim)})")
