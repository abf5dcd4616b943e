"""Torch files with a hand-written ``data.pkl``: what torch.save cannot write but a pickle can say (for the tests
of the torch-file reader and of the commands that read torch files)."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import torch


def with_pickle(tmp_path: Path, pkl: bytes, name: str = "hostile.pt", good: Path | None = None) -> Path:
    """A real torch.save archive (``good``, else one of a tensor) whose data.pkl is replaced (CRC32 recomputed;
    the other records kept)."""
    if good is None:
        good = tmp_path / "good.pt"
        torch.save({"t": torch.ones(4)}, good)
    path = tmp_path / name
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            data = pkl if info.filename.endswith("/data.pkl") else zin.read(info)
            zout.writestr(zipfile.ZipInfo(info.filename), data)
    return path


def uni(s: str) -> bytes:
    """BINUNICODE of ``s``."""
    return b"X" + struct.pack("<I", len(s)) + s.encode()
