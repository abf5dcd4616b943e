"""Values of a DeepSpeed ZeRO checkpoint from the pieces :mod:`.deepspeed_state` found: a tensor is assembled by
reading only its pieces' byte ranges (each checked to lie in its file), and a zip record's CRC32 is checked
while it is streamed (:func:`check_record`, what a deep verify runs over every record)."""

from __future__ import annotations

import zlib
from typing import Any

from ..errors import CheckpointError
from ..progress import Progress
from .deepspeed_model import DeepSpeedState, DeepSpeedTensor, Piece, covers
from .model import ITEMSIZE, Problem
from .storage import LocalHandles
from .whole_archive import RecordInfo, describe

CRC_BLOCK = 8 << 20  # bytes read at a time while a record's CRC32 is computed
MASTER = "fp32"  # the name of the master weights among what read_tensor reads


def _pieces(tensor: DeepSpeedTensor, which: str) -> tuple[Piece, ...]:
    if which == MASTER:
        return tensor.pieces
    if which not in tensor.optimizer:
        raise CheckpointError(f"{describe(tensor.name)}: no optimizer state {describe(which)} (a {tensor.kind} tensor "
                              f"has {describe(sorted(tensor.optimizer)) or 'none'}).", fqn=tensor.name)
    return tensor.optimizer[which]


def read_tensor(state: DeepSpeedState, name: str, which: str = MASTER, handles: Any = None,
                check_crc: bool = False) -> Any:
    """The values of tensor ``name`` (a tied alias too) as a torch tensor of its shape and stored dtype:
    ``which`` is ``"fp32"`` (the master weights of a trainable parameter; a frozen parameter's or buffer's
    values) or an optimizer state (``"exp_avg"``, ...). Reads only the pieces' bytes; a record read whole has its
    CRC32 checked, and with ``check_crc`` every record touched is checked whole. CheckpointError when the
    pieces do not cover the tensor (a missing rank, sizes that did not add up) or the bytes are damaged."""
    import torch

    try:
        tensor = state.tensor(name)
    except KeyError:
        raise CheckpointError(f"{state.folder}: no tensor {describe(name)} in this checkpoint.", path=state.folder,
                              fqn=name) from None
    pieces, numel = _pieces(tensor, which), tensor.numel
    if not covers(pieces, numel):
        held = sum(p.numel for p in pieces)
        raise CheckpointError(f"{state.folder}: {describe(name)} ({describe(which)}): the files hold {held} of its "
                              f"{numel} elements (see the checkpoint's problems).", path=state.folder, fqn=name)
    dtypes = {p.dtype for p in pieces}
    dtype = dtypes.pop() if len(dtypes) == 1 else tensor.dtype if not dtypes else None
    if dtype is None or dtype not in ITEMSIZE or not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise CheckpointError(f"{state.folder}: {describe(name)} ({describe(which)}) is stored as {sorted(dtypes)}, "
                              "not one dtype torch reads.", path=state.folder, fqn=name)
    size = ITEMSIZE[dtype]
    own = handles is None
    handles = LocalHandles(state.folder) if own else handles
    try:
        buf = bytearray(numel * size)
        checked: set[tuple[str, str]] = set()
        for p in pieces:
            rec = state.records[p.file][p.key]
            data = handles.read(p.file, p.byte_offset, p.numel * size)
            if p.byte_offset == rec.offset and len(data) == rec.nbytes:
                _crc_ok(state, p.file, p.key, rec, zlib.crc32(data), name)
                checked.add((p.file, p.key))
            elif check_crc and (p.file, p.key) not in checked:
                problem = check_record(handles, state, p.file, p.key)
                if problem is not None:
                    raise CheckpointError(problem.message, path=f"{state.folder}/{p.file}", fqn=name)
                checked.add((p.file, p.key))
            buf[p.start * size:(p.start + p.numel) * size] = data
    finally:
        if own:
            handles.close()
    out = torch.frombuffer(buf, dtype=getattr(torch, dtype)) if buf else torch.empty(0, dtype=getattr(torch, dtype))
    return out.reshape(tensor.shape)


def _crc_ok(state: DeepSpeedState, file: str, key: str, rec: RecordInfo, crc: int, name: str) -> None:
    if crc != rec.crc32:
        raise CheckpointError(f"{state.folder}/{file}: record {key} fails its CRC32 check (stored {rec.crc32:08x}, "
                              f"read {crc:08x}): the file is damaged.", path=f"{state.folder}/{file}", fqn=name)


def check_record(handles: Any, state: DeepSpeedState, file: str, key: str) -> Problem | None:
    """Stream zip record ``key`` of ``file`` and compare its CRC32 with the stored one: None when they agree,
    else a ``corrupt`` Problem (a ``short_file`` one when the file ends first)."""
    rec = state.records[file][key]
    crc, at, end = 0, rec.offset, rec.offset + rec.nbytes
    try:
        while at < end:
            n = min(CRC_BLOCK, end - at)
            crc = zlib.crc32(handles.read(file, at, n), crc)
            at += n
    except CheckpointError as exc:
        return Problem("short_file", str(exc), None, file)
    if crc != rec.crc32:
        return Problem("corrupt", f"{file}: record {key} fails its CRC32 check (stored {rec.crc32:08x}, read "
                       f"{crc:08x}): the file is damaged.", None, file)
    return None


def verify_records(state: DeepSpeedState, handles: Any = None, progress: Progress | None = None) -> list[Problem]:
    """Deep verify: every zip record of every file read, its CRC32 checked (``progress`` counts bytes)."""
    own = handles is None
    handles = LocalHandles(state.folder) if own else handles
    todo = [(f, k) for f, records in state.records.items() for k in records]
    if progress is not None:
        progress.start(sum(state.records[f][k].nbytes for f, k in todo), "checking the files' CRC32")
    problems = []
    try:
        for f, k in todo:
            problem = check_record(handles, state, f, k)
            if problem is not None:
                problems.append(problem)
            if progress is not None:
                progress.advance(state.records[f][k].nbytes)
    finally:
        if own:
            handles.close()
    return problems


__all__ = ["MASTER", "check_record", "read_tensor", "verify_records"]
