"""Both sides of a diff read at once: one reader thread per side streams the paired tensors' bytes, in order, as
windows of ``BLOCK`` elements, at most :data:`AHEAD` bytes of them ahead of the caller (the bounded queue),
while the caller compares the windows of A and B as they arrive. The reads (``preadv``), CRC32 checks
(``zlib``) and the comparison (numpy) all release the GIL, so the two reads and the comparison overlap.

A tensor whose chunks are runs of its row-major bytes (dim-0 shards, what FSDP writes; one chunk per tensor in a
``.pt`` or safetensors file) is read straight into the windows by :meth:`ChunkReader.read_runs`; any other
tensor is assembled with :meth:`ChunkReader.read_tensor` in the thread and handed over window by window."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from ..checkpoint.sources import CheckpointSource, Source, tensor_windows
from ..errors import CheckpointError

AHEAD = 64 << 20  # bytes of windows in flight per side: being read, queued and being compared
REUSE = 1 << 20  # windows this large are read into recycled buffers (no new pages to fault in)


class _Stopped(Exception):
    pass


class SideReader(threading.Thread):
    """Reads the tensors ``names`` of one source in order; puts ``("win", view, token)`` for each window, then
    ``("end", error)`` per tensor (error: the CheckpointError or OSError that stopped it, else None), or
    ``("crash", exc)`` for anything else. At most :data:`AHEAD` bytes of windows are out at a time (always at
    least one window), however small the tensors: the consumer gives each window's token back with
    :meth:`release`, and buffers of large windows are read into again."""

    def __init__(self, source: CheckpointSource, names: list[str], window_elems: int) -> None:
        super().__init__(daemon=True, name=f"diff-reader-{source.name}")
        self.source = source
        self.names = names
        self.window_elems = window_elems
        self.out: queue.Queue = queue.Queue()
        self.buffers: list[bytearray] = []  # large buffers given back, to be read into again
        self.used = 0
        self.halted = False
        self.cond = threading.Condition()
        self._token: tuple[int, bytearray | None] | None = None

    def _reserve(self, n: int) -> None:
        with self.cond:
            while self.used and self.used + n > AHEAD and not self.halted:
                self.cond.wait()
            if self.halted:
                raise _Stopped
            self.used += n

    def _take(self, n: int) -> memoryview:
        self._reserve(n)
        buf = None
        if n >= REUSE:
            with self.cond:
                buf = next((b for b in self.buffers if len(b) >= n), None)
                if buf is not None:
                    self.buffers.remove(buf)
            buf = buf if buf is not None else bytearray(n)
        self._token = (n, buf)
        return memoryview(buf)[:n] if buf is not None else memoryview(bytearray(n))

    def run(self) -> None:
        try:
            for name in self.names:
                error: BaseException | None = None
                try:
                    it = tensor_windows(self.source, name, self.window_elems, self._take)
                    while True:
                        self._token = None
                        try:
                            view = next(it)
                        except StopIteration:
                            break
                        if self._token is None:  # a view of an assembled tensor
                            self._reserve(len(view))
                            self._token = (len(view), None)
                        self.out.put(("win", view, self._token))
                        self._token = None
                except (CheckpointError, OSError) as exc:
                    error = exc
                    if self._token is not None:  # taken for a window that was not filled
                        self.release(self._token)
                        self._token = None
                self.out.put(("end", error))
        except _Stopped:
            return
        except BaseException as exc:  # a bug or MemoryError: the consumer raises it
            self.out.put(("crash", exc))

    def release(self, token: tuple[int, bytearray | None]) -> None:
        """A window's token back: its bytes count no more, its buffer (if large) can be read into again."""
        n, buf = token
        with self.cond:
            self.used -= n
            if buf is not None and len(self.buffers) < 4:
                self.buffers.append(buf)
            self.cond.notify_all()

    def stop(self) -> None:
        """End the thread at its next window (whatever it holds is dropped) and wait for it."""
        with self.cond:
            self.halted = True
            self.cond.notify_all()
        self.join()


class Streams:
    """Reader threads for both sides of the paired tensors ``pairs`` ((name in A, name in B), in the order they
    are compared); each call of :meth:`windows` yields the next pair's windows side by side."""

    def __init__(self, a: Source, b: Source, pairs: list[tuple[str, str]], window_elems: int) -> None:
        assert isinstance(a, CheckpointSource) and isinstance(b, CheckpointSource)
        self.sides = (SideReader(a, [p[0] for p in pairs], window_elems),
                      SideReader(b, [p[1] for p in pairs], window_elems))

    def __enter__(self) -> Streams:
        for s in self.sides:
            s.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self.sides:
            s.stop()

    @staticmethod
    def _get(side: SideReader) -> tuple:
        item = side.out.get()
        if item[0] == "crash":
            raise item[1]
        return item

    def windows(self) -> Iterator[tuple[memoryview, memoryview]]:
        """The next pair's windows side by side, each pair's buffers given back when the next is asked for.
        Ends after the pair's last window; then :attr:`errors` holds each side's error (or None). After a side
        fails, its partner's remaining windows are read and dropped (so both sides stay at the same pair)."""
        sa, sb = self.sides
        self.errors: list[BaseException | None] = [None, None]
        ended = [False, False]
        while not all(ended):
            items = [None if ended[i] else self._get(s) for i, s in enumerate(self.sides)]
            for i, item in enumerate(items):
                if item is not None and item[0] == "end":
                    ended[i] = True
                    self.errors[i] = item[1]
            ia, ib = items
            if ia is not None and ia[0] == "win" and ib is not None and ib[0] == "win":
                try:
                    yield ia[1], ib[1]
                finally:
                    sa.release(ia[2])
                    sb.release(ib[2])
                continue
            for side, item in ((sa, ia), (sb, ib)):  # one side ended (or failed) before the other
                if item is not None and item[0] == "win":
                    side.release(item[2])
