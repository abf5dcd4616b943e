"""Icons, stylesheets, screenshots, and the README shown by Help › README (no network needed)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

HERE = Path(__file__).parent


def readme_text() -> str:
    """The README: the source tree's file when running from a checkout (editable install), else the
    copy every installed wheel carries as its package description."""
    source = HERE.parent / "README.md"
    if source.is_file() and (HERE.parent / "pyproject.toml").is_file():
        return source.read_text(encoding="utf-8")
    try:
        return metadata.metadata("shardscope").get_payload() or metadata.metadata("shardscope")["Description"] or ""
    except metadata.PackageNotFoundError:
        return ""


def base_dir() -> Path:
    """The folder the README's relative image links (``resources/screenshots/...``) resolve against."""
    return HERE.parent
