"""Window-wide shortcuts whatever has focus: a text box (the tree's filter, a form's field) keeps only the keys it
edits with. A focused QLineEdit claims Ctrl+E ("end of line") and Ctrl+D ("delete") through Qt's shortcut
override, so File › Export and View › Compare did nothing right after a checkpoint opened (the filter box has
the focus then) or after a dialog closed back onto it."""

from __future__ import annotations

from PySide6.QtCore import QEvent, QObject
from PySide6.QtGui import QAction, QKeyEvent, QKeySequence
from PySide6.QtWidgets import QAbstractSpinBox, QApplication, QLineEdit, QPlainTextEdit, QTextEdit, QWidget

# What a text box keeps even when a menu entry of the window has the same key: copying, pasting, undoing and
# selecting text are what a text box is for.
EDITING_KEYS = (QKeySequence.StandardKey.Copy, QKeySequence.StandardKey.Cut, QKeySequence.StandardKey.Paste,
                QKeySequence.StandardKey.Undo, QKeySequence.StandardKey.Redo, QKeySequence.StandardKey.SelectAll)
TEXT_BOXES = (QLineEdit, QAbstractSpinBox, QPlainTextEdit, QTextEdit)


class WindowKeysFirst(QObject):
    """An application event filter: in ``window``'s text boxes, a key that is one of the window's shortcuts
    (and not one of EDITING_KEYS) goes to the shortcut, not to the box."""

    def __init__(self, window: QWidget) -> None:
        super().__init__(window)
        self.window = window
        QApplication.instance().installEventFilter(self)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if event.type() != QEvent.Type.ShortcutOverride or not isinstance(watched, TEXT_BOXES):
            return False
        assert isinstance(event, QKeyEvent)
        if watched.window() is not self.window or any(event.matches(k) for k in EDITING_KEYS):
            return False
        if self.is_window_shortcut(QKeySequence(event.keyCombination())):
            # NOTE: filtered out and left unaccepted: Qt then looks the key up in the shortcut map
            return True
        return False

    def is_window_shortcut(self, keys: QKeySequence) -> bool:
        """Whether an enabled action of the window (its menus) answers ``keys``."""
        for act in self.window.findChildren(QAction):
            if act.isEnabled() and any(s.matches(keys) == QKeySequence.SequenceMatch.ExactMatch
                                       for s in act.shortcuts()):
                return True
        return False
