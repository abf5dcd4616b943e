"""Metadata loads in a helper process, for callers that share their process with other threads.

NOTE: the unpickler's address-space limit (:func:`.safe_pickle.address_space_limit`) is per process: set
while a GUI worker unpickles, it makes any other thread's allocation fail (a tensor load, the GUI itself),
and two loads side by side (the Compare view) would race to restore it. So the limit is only set on the
main thread of a process with no other Python thread (the CLI, the fuzzers). Anywhere else the load runs
in a helper process that sets the limit for itself and sends back what the load returned, as a pickle of
Shardscope's own record classes made by CPython's pickler (memo indices in order: nothing for a file to
inflate), read here with an allow-list of those classes. A helper serves one load at a time and stays
for the next one (starting Python and numpy costs far more than a small load), unless a load left it
big; it ends when this process closes its socket.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import pickle
import shutil
import socket
import struct
import sys
import tempfile
import threading
from typing import Any

from .. import errors, progress
from .safe_pickle import NotStreamable, Record, gc_paused
from .unpickler import ShippedUnpickler, shippable_globals, unpickle_metadata

ISOLATE: bool | None = None  # None: decide per call (see must_isolate); True/False: always/never isolate
_IN_HELPER = False
_FUNCS = ("shardscope.backend.checkpoint.unpickler.metadata:unpickle_metadata",
          "shardscope.backend.checkpoint.streaming:stream_metadata",
          "shardscope.backend.checkpoint.streaming:stream_metadata_compact")
_HELPER_MAIN = "from shardscope.backend.checkpoint.reader_process import helper_main; helper_main()"
RETIRE_RSS = 512 << 20  # a helper that holds more than this after a load ends instead of waiting for the next
MAX_IDLE = 2  # helpers kept waiting (the Compare view opens two checkpoints at once)


def must_isolate() -> bool:
    """True when a metadata load here must run in a helper process: on any thread but the main one, or
    while another Python thread runs (``ISOLATE`` overrides; a helper never isolates again)."""
    if _IN_HELPER:
        return False
    if ISOLATE is not None:
        return ISOLATE
    if not sys.platform.startswith("linux"):
        return False  # the address-space limit is only set on Linux: there is nothing to keep from other threads
    return threading.current_thread() is not threading.main_thread() or threading.active_count() > 1


class _Helper:
    """One helper process and the socket to it (the file descriptor of each load goes with its request)."""

    def __init__(self) -> None:
        import subprocess

        mine, theirs = socket.socketpair()
        self.log = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _HELPER_MAIN, str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=self.log)
        finally:
            theirs.close()
        self.sock = mine
        self.replies = mine.makefile("rb")
        self.fresh = True

    def call(self, name: str, source: str, fd: int, pos: int) -> tuple[bytes | None, bool]:
        """Send one load; its reply (None when the helper ended without one) and whether the helper stays."""
        request = json.dumps([name, source, pos]).encode()
        try:
            socket.send_fds(self.sock, [struct.pack("<Q", len(request)) + request], [fd])
            head = self.replies.read(9)
            if len(head) < 9:
                return None, False
            size, stays = struct.unpack("<QB", head)
            blob = self.replies.read(size)
            return (blob if len(blob) == size else None), bool(stays)
        except OSError:
            return None, False

    def kill(self) -> None:
        """End the helper at once, from any thread (a cancelled load); the waiting call then gets no reply."""
        with contextlib.suppress(OSError):
            self.proc.kill()

    def close(self, kill: bool = False) -> tuple[int, str]:
        """End the helper (it leaves when its socket closes); its exit code and the end of what it printed."""
        self.replies.close()
        self.sock.close()
        if kill:
            self.proc.kill()
        try:
            code = self.proc.wait(30)
        except Exception:  # it must not outlive this call, whatever went wrong
            self.proc.kill()
            code = self.proc.wait()
        with self.log:
            self.log.seek(0)
            return code, self.log.read()[-3000:].decode("utf-8", "replace")


_IDLE: list[_Helper] = []
_IDLE_LOCK = threading.Lock()
_BUSY: set[_Helper] = set()  # helpers serving a load now
_BUSY_LOCK = threading.Lock()


def busy_helpers() -> list[int]:
    """The process ids of the helpers serving a load now."""
    with _BUSY_LOCK:
        return [h.proc.pid for h in _BUSY]


def _forget_helpers() -> None:
    """NOTE: a forked child must not talk to its parent's helpers (two processes on one socket), and the
    lock may have been held by a thread that does not exist in the child: it starts afresh."""
    global _IDLE_LOCK, _BUSY_LOCK
    _IDLE.clear()
    _IDLE_LOCK = threading.Lock()
    _BUSY.clear()
    _BUSY_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_helpers)


@atexit.register
def _close_idle() -> None:
    with _IDLE_LOCK:
        helpers, _IDLE[:] = list(_IDLE), []
    for helper in helpers:
        helper.close()


def run_isolated(func: Any, data: Any, source: str) -> Any:
    """``func(stream, source)`` (a metadata load, one of ``_FUNCS``) in a helper process; its result is
    returned and its errors raised here as if it had run in this process."""
    name = f"{func.__module__}:{func.__qualname__}"
    if name not in _FUNCS:
        raise ValueError(f"{name} cannot run in the metadata helper process")
    operation = progress.current()
    if operation is not None:
        operation.check()
    with _as_file(data) as (fd, pos):
        for _attempt in range(2):
            with _IDLE_LOCK:
                idle = _IDLE.pop() if _IDLE else None
            helper = idle or _Helper()
            # NOTE: the load cannot check for a cancel while it waits on the helper: a cancel kills the helper
            # (a 50 MB .metadata kept loading, and its helper kept its memory, after the tab was closed)
            stop = operation.on_cancel(helper.kill) if operation is not None else None
            with _BUSY_LOCK:
                _BUSY.add(helper)
            try:
                blob, stays = helper.call(name, source, fd, pos)
            except BaseException:
                helper.close(kill=True)
                raise
            finally:
                with _BUSY_LOCK:
                    _BUSY.discard(helper)
                if stop is not None:
                    stop()
            if operation is not None and operation.cancelled:
                helper.close(kill=True)
                raise errors.Cancelled()
            if blob is not None or helper.fresh:
                break
            helper.close()  # a waiting helper that had ended meanwhile: once more with a new one
        helper.fresh = False
    kept = False
    if stays and blob is not None:
        with _IDLE_LOCK:
            if len(_IDLE) < MAX_IDLE:
                _IDLE.append(helper)
                kept = True
    code, tail = (0, "") if kept else helper.close()
    if blob is None:
        return _no_reply(code, source, tail)
    with gc_paused():
        reply = ShippedUnpickler(io.BytesIO(blob)).load()
    return _reply_value(reply, source)


@contextlib.contextmanager
def _as_file(data: Any):
    """(descriptor, position) the helper reads the metadata from: the file's own when it has one, else a
    temporary copy (a remote file, bytes)."""
    stream = io.BytesIO(data) if isinstance(data, bytes | bytearray | memoryview) else data
    try:
        fd, pos = stream.fileno(), stream.tell()
    except (OSError, AttributeError, io.UnsupportedOperation):
        with tempfile.TemporaryFile() as copy:
            shutil.copyfileobj(stream, copy, 8 << 20)
            copy.flush()
            yield copy.fileno(), 0
        return
    yield fd, pos


def _no_reply(code: int, source: str, log_tail: str) -> Any:
    if code < 0:  # ended by a signal while reading this file (the out-of-memory killer, a crash)
        raise errors.RefusedPickleError(f"{source}: the metadata reader process was ended by signal {-code} "
                                        "while reading this file; refused.", path=source)
    raise RuntimeError(f"{source}: the metadata reader process ended (exit {code}) without an answer: {log_tail}")


def _reply_value(reply: Any, source: str) -> Any:
    """The helper's result, or its error raised again (an unexpected one is an internal error)."""
    if isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "ok":
        return reply[1]
    if isinstance(reply, tuple) and len(reply) == 5 and reply[0] == "error":
        _, kind, message, path, fqn = reply
        if kind == "NotStreamable":
            raise NotStreamable(message)
        cls = getattr(errors, kind, None)
        if isinstance(cls, type) and issubclass(cls, errors.CheckpointError):
            raise cls(message, path=path, fqn=fqn)
        raise RuntimeError(f"{source}: the metadata reader process failed: {message}")
    raise RuntimeError(f"{source}: the metadata reader process sent an answer of an unknown form")


# ---------------------------------------------------------------- what crosses the socket
def _rebuild_record(cls: type[Record], state: dict) -> Record:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def _gone() -> None:
    return None


class _ShipPickler(pickle.Pickler):
    """Pickles a load's result for the parent. The streaming reader's stand-ins are classes made in a
    function: a record among them goes as its module-level record class, a shared event sink as None
    (what it received is in the events). A class or function the parent would not accept is refused
    here (a file naming ``torch.Size`` without calling it), so the parent only ever sees a clean error."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type) or callable(obj):
            if (getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)) not in shippable_globals():
                raise pickle.PicklingError(f"{getattr(obj, '__qualname__', type(obj).__name__)} as a value")
            return NotImplemented
        cls = type(obj)
        if "<locals>" not in cls.__qualname__:
            return NotImplemented
        base = next((b for b in cls.__mro__ if issubclass(b, Record) and "<locals>" not in b.__qualname__), None)
        if base is None:
            return _gone, ()
        return _rebuild_record, (base, dict(obj.__dict__))


# ---------------------------------------------------------------- the helper process
def helper_main() -> None:
    """The helper: run metadata loads sent over the socket (fd in ``argv[1]``) until it closes."""
    import signal

    global _IN_HELPER
    _IN_HELPER = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent; the helper ends with its socket
    sock = socket.socket(fileno=int(sys.argv[1]))
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 8, 1)
        if len(msg) < 8 or not fds:
            break  # the parent closed the socket
        want = struct.unpack("<Q", msg)[0]
        request = b""
        while len(request) < want:
            part = sock.recv(want - len(request))
            if not part:
                return
            request += part
        name, source, pos = json.loads(request)  # from the parent process: plain data, no pickle
        with os.fdopen(fds[0], "rb") as stream:
            stream.seek(pos)
            blob = _answer(name, source, stream)
        stays = _rss() < RETIRE_RSS
        sock.sendall(struct.pack("<QB", len(blob), stays))
        sock.sendall(blob)
        if not stays:
            break


def _answer(name: str, source: str, stream: Any) -> bytes:
    """The pickled reply to one load: ("ok", result) or ("error", kind, message, path, fqn)."""
    import importlib
    import traceback

    if name not in _FUNCS:
        return _pickled(("error", "internal", f"not a metadata load: {name}", source, None))
    module, _, attr = name.partition(":")
    try:
        reply: tuple = ("ok", getattr(importlib.import_module(module), attr)(stream, source))
    except errors.CheckpointError as exc:
        reply = ("error", type(exc).__name__, str(exc), exc.path, exc.fqn)
    except Exception as exc:  # sent to the parent, which raises it there
        kind = "NotStreamable" if type(exc).__name__ == "NotStreamable" else "internal"
        reply = ("error", kind, str(exc) if kind != "internal" else traceback.format_exc()[-3000:], source, None)
    try:
        return _pickled(reply)
    except (RecursionError, pickle.PicklingError, TypeError, ValueError) as exc:  # what the file built
        what = "nests deeper than any DCP metadata does" if isinstance(exc, RecursionError) else \
            f"holds a value no DCP metadata holds ({str(exc)[:100]})"
        return _pickled(("error", "RefusedPickleError", f"{source}: the metadata {what}; refused.", source, None))


def _pickled(obj: Any) -> bytes:
    buf = io.BytesIO()
    _ShipPickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


def _rss() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return 0


def load_metadata_pickle(data: Any, source: str) -> Any:
    """Unpickle DCP metadata safely (:func:`.unpickler.unpickle_metadata`), in a helper process where an
    address-space limit could hurt another thread of this one (see :func:`must_isolate`)."""
    if must_isolate():
        return run_isolated(unpickle_metadata, data, source)
    return unpickle_metadata(data, source)
