"""What the window remembers between sessions (QSettings): geometry, splitters, recent checkpoints."""

from __future__ import annotations

from PySide6.QtCore import QSettings

MAX_RECENT = 10


def settings() -> QSettings:
    """The one settings store (per user, Qt's native location)."""
    return QSettings("Shardscope", "Shardscope")


def recent_paths() -> list[str]:
    """Checkpoints opened most recently first."""
    value = settings().value("recent", [])
    if isinstance(value, str):
        value = [value]
    return [str(v) for v in (value or [])]


def add_recent(path: str) -> None:
    recent = [p for p in recent_paths() if p != path]
    settings().setValue("recent", [path, *recent][:MAX_RECENT])


def library_roots() -> list[str]:
    """Folders the user added to the Library (the default runs directory is always shown too)."""
    value = settings().value("library/roots", [])
    if isinstance(value, str):
        value = [value]
    return [str(v) for v in (value or [])]


def set_library_roots(roots: list[str]) -> None:
    settings().setValue("library/roots", list(roots))
