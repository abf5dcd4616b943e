"""DCP checkpoints written by torch's own ``FileSystemWriter(path, _extensions=[ZStandard()])``, and mutations of
their compressed items that reach the item codec (issue 32, item 1): a torch.save archive mutated *inside* its
zstd frame and compressed again (the archive parser behind the codec), the compressed bytes themselves mutated,
and frames that lie about their size (one declaring 1 TiB, one producing far more than the item can hold).
Each case is a whole folder: the ``.distcp`` rebuilt around the new items and the ``.metadata`` (torch's own
Metadata, trusted here) given their new offsets and lengths, so a case is a file torch itself could read."""

from __future__ import annotations

import functools
import io
import pickle
import random
import warnings
from pathlib import Path

from fuzz.mutators import BYTE_MUTATORS, DISTCP_MUTATORS, mutate


def zstd_state() -> dict:
    """A small state: tensors of three dtypes, a nested dict, and non-tensor entries (one holding a tensor, which
    DCP saves with torch.save as a BYTE_IO item)."""
    import torch

    g = torch.Generator().manual_seed(32)
    return {"model": {"w": torch.randn(6, 5, generator=g), "b": torch.arange(7, dtype=torch.int64),
                      "h": torch.randn(3, 4, generator=g).to(torch.bfloat16)},
            "step": 11, "pair": (torch.arange(3.0), "lr"), "extra": {"t": torch.ones(2)}}


def write_zstd_checkpoint(path: Path, compressed: bool = True) -> Path:
    """``dcp.save`` of :func:`zstd_state` in this process, through torch's ZStandard extension (or none)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.save(zstd_state(), storage_writer=FileSystemWriter(str(path), _extensions=[ZStandard()] if compressed
                                                                else None))
    return path


def read_metadata(folder: Path) -> object:
    """torch's own Metadata of a (trusted) folder."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(folder)).read_metadata()


def items(folder: Path) -> tuple[object, list[tuple[object, bytes]]]:
    """The Metadata and its (storage key, stored bytes) pairs in file order (one ``.distcp``)."""
    md = read_metadata(folder)
    pairs = sorted(md.storage_data.items(), key=lambda kv: kv[1].offset)
    data = (folder / pairs[0][1].relative_path).read_bytes()
    return md, [(k, data[v.offset:v.offset + v.length]) for k, v in pairs]


def rebuild(source: Path, dst: Path, new: dict[int, bytes], descriptors: list[str] | None = None) -> Path:
    """A copy of ``source`` whose item number ``i`` (file order) holds ``new[i]``; ``descriptors`` replaces every
    item's transforms (a transform Shardscope does not know)."""
    import shutil

    md, pairs = items(source)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    out = io.BytesIO()
    for i, (key, raw) in enumerate(pairs):
        info = md.storage_data[key]
        body = new.get(i, raw)
        info.offset, info.length = out.tell(), len(body)
        if descriptors is not None:
            info.transform_descriptors = descriptors
        out.write(body)
    (dst / md.storage_data[pairs[0][0]].relative_path).write_bytes(out.getvalue())
    (dst / ".metadata").write_bytes(pickle.dumps(md))
    return dst


def compress(data: bytes) -> bytes:
    """One zstd frame as torch's ZStandard writes it (streamed: no content size, no checksum)."""
    import zstandard

    out = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(out, closefd=False) as w:
        w.write(data)
    return out.getvalue()


def decompress(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().stream_reader(data).read()


def declaring(size: int, payload: bytes = b"\0" * 64) -> bytes:
    """A zstd frame whose header declares ``size`` decompressed bytes (8-byte field, single segment) and whose
    one raw block holds ``payload``: a number in the file that must not drive memory."""
    header = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + size.to_bytes(8, "little")
    block = (1 | (len(payload) << 3)).to_bytes(3, "little")  # last block, raw
    return header + block + payload


@functools.cache
def bomb(nbytes: int = 64 << 20) -> bytes:
    """A frame of ``nbytes`` zeros (a few KiB stored): far more than any item of :func:`zstd_state` holds."""
    import zstandard

    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=19).stream_writer(out, closefd=False) as w:
        block = b"\0" * (1 << 20)
        for _ in range(nbytes >> 20):
            w.write(block)
    return out.getvalue()


def mutated_items(source: Path, case: int) -> dict[int, bytes]:
    """Case number ``case`` (reproducible): one item's archive mutated inside its frame, its compressed bytes
    mutated, or a frame lying about its size."""
    rng = random.Random(f"zstd/{case}")
    _, pairs = items(source)
    i = rng.randrange(len(pairs))
    raw = pairs[i][1]
    kind = rng.choice(["inner", "inner", "inner", "outer", "outer", "declared", "bomb"])
    if kind == "inner":
        return {i: compress(mutate(decompress(raw), rng, DISTCP_MUTATORS))}
    if kind == "outer":
        return {i: mutate(raw, rng, BYTE_MUTATORS)}
    if kind == "declared":
        return {i: declaring(rng.choice([1 << 40, 1 << 62, (1 << 64) - 3]))}
    return {i: bomb()}
