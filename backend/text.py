"""Small text helpers shared by the CLI and the GUI."""

from __future__ import annotations

import html
import re
from collections.abc import Iterable

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def human_bytes(n: int | float | None) -> str:
    """Bytes as a short human string: 1.5 GiB, 12 KiB (binary units); "—" for None."""
    if n is None:
        return "—"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_size(text: str) -> int:
    """``5GB`` -> 5e9, ``500MiB`` -> 500·2**20 (HF's convention: GB is 10**9)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 5GB, 500MB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human_duration(seconds: float) -> str:
    """Seconds as a clock string: M:SS, or H:MM:SS from an hour on (negatives count as 0)."""
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


# NOTE: lone surrogates (a JSON header may hold "\\ud800") cannot be encoded at all: printing one raises.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff\ud800-\udfff]")


def step_rate(steps_per_second: float) -> str:
    """A training speed as it reads best: ``2.5 steps/s``, or below 0.1 steps/s the time of one step
    (``45 s/step``, ``12 min/step``) rather than ``0.0 steps/s``."""
    if steps_per_second >= 0.1:
        return f"{steps_per_second:.1f} steps/s"
    if steps_per_second <= 0:
        return "0 steps/s"
    seconds = 1 / steps_per_second
    return f"{seconds:.0f} s/step" if seconds < 120 else f"{seconds / 60:.0f} min/step"


def count(n: int, one: str, many: str | None = None) -> str:
    """``1 tensor``, ``2 tensors``, ``1,024 non-tensor entries``: a count with its noun in the right number."""
    return f"{n:,} {one if n == 1 else (many or one + 's')}"


def rich_name(name: object) -> str:
    """A name from a file for a Qt rich-text label: escaped as for a terminal, then as HTML (a tensor named
    ``<img src=/some/file>`` would otherwise make Qt open that file, and a U+202E reverse the label)."""
    return html.escape(escape_name(name))


def plain_tooltip(text: str) -> str:
    """A tooltip that Qt shows as the plain text it is: Qt takes a text whose first line holds a tag for rich
    text (and loads what an ``<img>`` names), so such a text is escaped line by line."""
    if "<" not in text:
        return text
    return "<p style='white-space:pre'>" + "<br>".join(rich_name(line) for line in text.split("\n")) + "</p>"


def escape_name(name: object) -> str:
    """A name from a file made safe for a terminal line: control and bidi characters as ``\\uXXXX``."""
    text = str(name)
    return _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}" if ord(m.group()) > 0xFF else f"\\x{ord(m.group()):02x}",
                       text)


_DIGITS = re.compile(r"(\d+)")


def natural_key(text: str) -> tuple:
    """Sort key that orders numbers by value: ``__2`` before ``__10`` before ``__100``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p.lower()) for p in _DIGITS.split(text) if p)


def byte_unit(largest: float) -> tuple[float, str]:
    """(divisor, name) of the binary unit in which ``largest`` bytes reads as 1 to 1023, so a plot axis
    never needs an SI multiplier ("MiB written (x0.001)")."""
    for power, name in enumerate(("B", "KiB", "MiB", "GiB", "TiB")):
        if abs(largest) < 1024 ** (power + 1) or name == "TiB":
            return float(1024**power), name
    return float(1024**4), "TiB"


def ranks_text(ranks: Iterable[int], empty: str = "-") -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``: ranks as runs."""
    ranks = sorted(ranks)
    if not ranks:
        return empty
    parts, start, prev = [], ranks[0], ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(parts)
