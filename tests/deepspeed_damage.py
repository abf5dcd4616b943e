"""Damaged and hostile DeepSpeed files for the parser's tests and fuzzers, made from the real fixtures: a
``torch.save`` archive with one record replaced (the zip rewritten, CRC32s right), a data.pkl that would run a
command, a model-states file edited through torch itself (a trusted fixture: the tests may unpickle it)."""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path


def archive_records(data: bytes) -> list[tuple[str, bytes]]:
    """(full name, bytes) of every record of a zip archive, in order."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return [(info.filename, z.read(info)) for info in z.infolist()]


def rezip(data: bytes, replace: dict[str, bytes]) -> bytes:
    """The archive ``data`` written again (stored, as torch.save writes it) with the records whose name ends in a
    key of ``replace`` (``data.pkl``, ``data/0``) holding the new bytes."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name, body in archive_records(data):
            key = name.split("/", 1)[1]
            z.writestr(zipfile.ZipInfo(name), replace.get(key, body))
    return out.getvalue()


def pickle_of(path: Path) -> bytes:
    """The data.pkl of a torch.save archive."""
    return next(body for name, body in archive_records(path.read_bytes()) if name.endswith("/data.pkl"))


def evil_pickle(module: str, name: str, marker: Path) -> bytes:
    """A protocol-2 pickle that calls ``module.name`` with a command creating ``marker`` (or, for eval/exec, the
    Python that does), nested inside a dict as a DeepSpeed file would hold it."""
    if name in ("eval", "exec"):
        arg = f"open({str(marker)!r}, 'w').close()"
    elif module == "subprocess":
        arg = ["touch", str(marker)]  # type: ignore[assignment]
    else:
        arg = f"touch {marker}"
    call = b"c" + module.encode() + b"\n" + name.encode() + b"\n" + pickle.dumps((arg,), protocol=2)[2:-1] + b"R"
    return b"\x80\x02}X\x14\x00\x00\x00optimizer_state_dict" + call + b"s."


def with_evil_pickle(path: Path, module: str, name: str, marker: Path) -> None:
    """Replace the data.pkl of the archive at ``path`` by :func:`evil_pickle`."""
    path.write_bytes(rezip(path.read_bytes(), {"data.pkl": evil_pickle(module, name, marker)}))


def edit_model_states(path: Path, edit: Callable[[dict], None]) -> None:
    """Load a (trusted) model-states file with torch, ``edit`` its dict, save it back with torch.save."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    edit(state)
    torch.save(state, path)


def flip_tensor_byte(path: Path, key: str = "data/0", at: int = 0) -> None:
    """Flip one bit of storage record ``key`` in place (its stored CRC32 left as it was)."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/" + key))
    start = info.header_offset + 30 + len(info.filename.encode()) + \
        int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
    data[start + at] ^= 0x10
    path.write_bytes(bytes(data))
