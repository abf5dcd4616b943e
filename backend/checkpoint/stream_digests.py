"""Tensor digests taken in the pass that hashes the files (:func:`.digests.hash_file`): a tensor stored as runs of
its row-major bytes (:meth:`.chunks.ChunkReader.flat_runs`: DCP's dim-0 shards, one chunk per tensor in a
safetensors or ``.pt`` file) is fed to its SHA-256 run after run as each run's bytes pass, with the stored CRC32
of each record checked on the same bytes; so ``seal`` reads every byte once. Files are hashed in parallel, so a
run can pass before the runs ahead of it (rank 1's shard before rank 0's): it is held in memory until its turn,
within :data:`HELD_BUDGET` for all tensors together; a tensor that would exceed it, whose file ends early or whose
CRC32 fails is left to the second pass (:func:`.digests.tensor_digests`), which names what is wrong."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

from ..crc import crc32
from ..errors import CheckpointError
from .digests import FileHash, RangeSink, TensorKey
from .model import TensorEntry, itemsize
from .sources import CheckpointSource

HELD_BUDGET = 256 << 20  # bytes of runs held until their turn, all tensors together


class _Budget:
    def __init__(self, limit: int) -> None:
        self.left = limit
        self.lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self.lock:
            if n > self.left:
                return False
            self.left -= n
            return True

    def give(self, n: int) -> None:
        with self.lock:
            self.left += n


class OrderedDigest:
    """A tensor's logical SHA-256 fed from its runs in order, whatever order their bytes pass in."""

    def __init__(self, runs: int, budget: _Budget) -> None:
        self.h = hashlib.sha256()
        self.runs = runs
        self.next = 0  # the run whose bytes are fed now
        self.ended: set[int] = set()
        self.held: dict[int, list[bytes]] = {}
        self.budget = budget
        self.failed = False
        self.lock = threading.Lock()

    def feed(self, j: int, data: memoryview) -> None:
        with self.lock:
            if self.failed:
                return
            if j == self.next:
                self.h.update(data)
            elif self.budget.take(len(data)):
                self.held.setdefault(j, []).append(bytes(data))
            else:  # too far ahead: the second pass takes this tensor
                self.failed = True
                self.budget.give(sum(len(p) for pieces in self.held.values() for p in pieces))
                self.held.clear()

    def end(self, j: int) -> None:
        with self.lock:
            if self.failed:
                return
            self.ended.add(j)
            while self.next in self.ended:
                self.next += 1
                for piece in self.held.pop(self.next, []):
                    self.h.update(piece)
                    self.budget.give(len(piece))

    def hexdigest(self) -> str | None:
        """The digest when every run was fed in order; None otherwise."""
        return self.h.hexdigest() if not self.failed and self.next == self.runs else None


class _RunSink(RangeSink):
    def __init__(self, digest: OrderedDigest, j: int) -> None:
        self.digest, self.j = digest, j

    def update(self, data: memoryview) -> None:
        self.digest.feed(self.j, data)

    def close(self) -> None:
        self.digest.end(self.j)


class _CrcSink(RangeSink):
    """A stored record's CRC32, computed over its bytes as they pass (on the file hash's lane: ISA-L's CRC32 is
    about 5x as fast as SHA-256)."""

    lane = 0

    def __init__(self, expected: int) -> None:
        self.expected, self.crc, self.ok = expected, 0, False

    def update(self, data: memoryview) -> None:
        self.crc = crc32(data, self.crc)

    def close(self) -> None:
        self.ok = self.crc == self.expected


class StreamedDigests:
    """The ranges to feed into the file pass for every tensor whose layout allows it (``ranges``: per file name,
    (sink, offset, length)), and after the pass the digests they gave (:meth:`digests`)."""

    def __init__(self, source: CheckpointSource, entries: list[TensorEntry]) -> None:
        budget = _Budget(HELD_BUDGET)
        self.ranges: dict[str, list[tuple[Any, int, int]]] = {}
        self.tensors: dict[str, tuple[OrderedDigest, list[_CrcSink]]] = {}
        self.single: dict[str, tuple[str, TensorKey, int, list[_CrcSink]]] = {}  # one run: a range's SHA-256
        for e in entries:
            try:
                runs = source.reader.flat_runs(e)
            except CheckpointError:
                runs = None  # the second pass reads it and says what is wrong
            if not runs:
                continue
            elem = itemsize(e.dtype)
            if len(runs) == 1:
                self._single(e.fqn, runs[0], elem)
                continue
            digest, crcs = OrderedDigest(len(runs), budget), []
            for j, (_, chunk, st) in enumerate(runs):  # the values: numel elements from storage_offset
                self.ranges.setdefault(chunk.file, []).append(
                    (_RunSink(digest, j), st.data_offset + st.storage_offset * elem, st.numel * elem))
                if st.crc32 is not None:
                    crcs.append(_CrcSink(st.crc32))
                    self.ranges[chunk.file].append((crcs[-1], st.data_offset, st.nbytes))
            self.tensors[e.fqn] = (digest, crcs)

    def _single(self, fqn: str, run: tuple[Any, Any, Any], elem: int) -> None:
        """A tensor stored as one run: the SHA-256 of that byte range (shared with its chunk's when the chunk is the
        same bytes, as in a safetensors file), its record's CRC32 checked on the way."""
        _, chunk, st = run
        off, length = st.data_offset + st.storage_offset * elem, st.numel * elem
        key, crcs = TensorKey(fqn), []
        self.ranges.setdefault(chunk.file, []).append((key, off, length))
        if st.crc32 is not None:
            crcs.append(_CrcSink(st.crc32))
            self.ranges[chunk.file].append((crcs[-1], st.data_offset, st.nbytes))
        self.single[fqn] = (chunk.file, key, off + length, crcs)

    def digests(self, files: dict[str, FileHash]) -> dict[str, str]:
        """fqn -> logical SHA-256 of every tensor fed whole, in order, its records' CRC32s as stored; ``files``:
        what the files' pass gave (a one-run tensor's digest is a range's there, if its file was long enough)."""
        out = {}
        for fqn, (name, key, end, crcs) in self.single.items():
            got = files.get(name)
            if got is not None and got.bytes >= end and key in got.ranges and all(c.ok for c in crcs):
                out[fqn] = got.ranges[key]
        for fqn, (digest, crcs) in self.tensors.items():
            h = digest.hexdigest()
            if h is not None and all(c.ok for c in crcs):
                out[fqn] = h
        return out


__all__ = ["HELD_BUDGET", "OrderedDigest", "StreamedDigests"]
