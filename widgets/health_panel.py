"""The Health tab: the problems the quick check or Verify contents found; clicking one selects its tensor."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QListView, QListWidget, QListWidgetItem

from ..backend.checkpoint.model import Problem

# What Verify contents proves about the bytes: each format says (torch.save items store a CRC32, safetensors none)
from ..backend.formats.base import CHECKSUMS_NONE as NO_CHECKSUMS
from ..backend.formats.base import CHECKSUMS_STORED as CHECKSUMS_WHERE_STORED
from ..backend.text import count

MAX_LISTED = 2000


class HealthPanel(QListWidget):
    """The problems from verify; clicking one selects its tensor."""

    problemActivated = Signal(str)

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        # NOTE: messages wrap at the tab's width (the verdict was one line that needed horizontal scrolling);
        # rows then differ in height, and are laid out again when the width changes
        self.setWordWrap(True)
        self.setUniformItemSizes(False)
        self.setResizeMode(QListView.ResizeMode.Adjust)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.itemClicked.connect(self._clicked)
        self.problems: list[Problem] = []

    def set_problems_pending(self, message: str = "Checking files and layout …") -> None:
        self.clear()
        self.problems = []
        self.addItem(QListWidgetItem(message))

    def set_problems(self, problems: list[Problem], deep: bool = False, note: str = "",
                     checksums: str = "", seal: str = "") -> None:
        """``deep``: the list comes from Verify contents (every stored item read, its CRC32 checked where
        the format stores one); ``checksums`` says which ones do (never claim a CRC safetensors lacks); ``seal``:
        what the check against the checkpoint's manifest proved (SealCheck.summary)."""
        self.clear()
        self.problems = list(problems)
        check = " and checks its size" if checksums == NO_CHECKSUMS else " and checks its CRC32"
        if note:
            self.addItem(QListWidgetItem(note))
        if not problems:
            self.addItem(QListWidgetItem(
                f"✔ Contents verified: every stored item read once ({checksums or CHECKSUMS_WHERE_STORED}); "
                "every file present, every tensor tiled exactly." if deep else
                "✔ Healthy: every file present and long enough, every tensor tiled exactly. (Bytes not read: "
                f"Verify contents reads every item{check}.)"))
            self._add_seal(seal)
            return
        if deep:
            self.addItem(QListWidgetItem(f"Verify contents read every stored item: {count(len(problems), 'problem')}"))
        for p in problems[:MAX_LISTED]:
            item = QListWidgetItem(f"[{p.kind}] {p.message}")
            item.setData(Qt.ItemDataRole.UserRole, p.fqn)
            item.setToolTip(p.message)
            self.addItem(item)
        if len(problems) > MAX_LISTED:
            self.addItem(QListWidgetItem(f"… and {len(problems) - MAX_LISTED:,} more (`shardscope verify --json` "
                                         "lists them all)"))
        self._add_seal(seal)

    def _add_seal(self, seal: str) -> None:
        """The line saying what the checkpoint's manifest proved (last: the problems keep their rows)."""
        if seal:
            mark = "✔ " if seal.startswith("sealed") else "✘ " if seal.startswith("damaged") else ""
            self.addItem(QListWidgetItem(f"{mark}Manifest: {seal}"))

    def _clicked(self, item: QListWidgetItem) -> None:
        fqn = item.data(Qt.ItemDataRole.UserRole)
        if fqn:
            self.problemActivated.emit(fqn)
