"""Forms that scroll without changing their values: a spin box or a combo box takes the mouse wheel only once it
has the focus (a click or Tab); before that the wheel scrolls the form. The Training form needs scrolling at
1280x720, and the wheel over it turned Heads from 4 to 1 with no notice."""

from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, QPointF, Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import QAbstractScrollArea, QAbstractSpinBox, QApplication, QComboBox, QWidget

WHEELED = (QAbstractSpinBox, QComboBox)


class WheelNeedsFocus(QObject):
    """An event filter: a wheel over an unfocused spin or combo box scrolls what holds it instead."""

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if event.type() != QEvent.Type.Wheel or not isinstance(watched, QWidget) or watched.hasFocus():
            return False
        assert isinstance(event, QWheelEvent)
        area = scroll_area_of(watched)
        if area is None:
            event.ignore()  # nothing scrolls: the wheel does nothing here
            return True
        # NOTE: handed to the scroll area itself, not left to propagate: Qt does not pass a wheel event it did not
        # get from the system (a synthesized one) on to the parents
        viewport = area.viewport()
        pos = QPointF(viewport.mapFromGlobal(event.globalPosition().toPoint()))
        QApplication.sendEvent(viewport, QWheelEvent(pos, event.globalPosition(), event.pixelDelta(),
                                                     event.angleDelta(), event.buttons(), event.modifiers(),
                                                     event.phase(), event.inverted(), event.source()))
        return True


def scroll_area_of(widget: QWidget) -> QAbstractScrollArea | None:
    """The nearest scroll area that holds ``widget`` (its viewport's content), or None."""
    parent = widget.parentWidget()
    while parent is not None:
        if isinstance(parent, QAbstractScrollArea) and parent.viewport().isAncestorOf(widget):
            return parent
        parent = parent.parentWidget()
    return None


def wheel_only_when_focused(root: QWidget) -> None:
    """Every spin box and combo box under ``root`` (made so far) takes the wheel only when focused."""
    guard = root.findChild(WheelNeedsFocus) or WheelNeedsFocus(root)
    for w in root.findChildren(QWidget):
        if isinstance(w, WHEELED):
            # NOTE: the default WheelFocus would let the wheel itself give the focus, and then take the wheel
            w.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
            w.installEventFilter(guard)
