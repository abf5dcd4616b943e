"""The one place an output comes into existence: a temporary name in the destination folder,
fsync of file and folder, then a rename. On failure, cancel, SIGINT or SIGTERM the temporary is
removed and the destination is untouched; leftovers of a ``kill -9`` are recognised by their
name (``.shardscope-tmp-<pid>-<hex>``) and removed by the next run into that folder. The destination
is checked first by :func:`~.destination.check_destination` (never the source, never inside it).

SIGINT/SIGTERM: the handler only notes the signal and cancels the job's :class:`Progress`; the job stops
at its next check, and ``__exit__`` removes the temporary once the job's threads have stopped. NOTE: the
handler used to remove the temporary and raise at whatever line the main thread was on: inside
``commit()`` between moving the old folder aside and the new one in (the new output deleted, the old one
left as ``<tmp>-old`` for the next export to delete as a leftover), inside ``with _active_lock`` (a
deadlock on that lock), or while a thread pool was still writing into the folder it had just removed.

A URL destination (``s3://bucket/out/model.safetensors``) is staged in a temporary name in the
local temp folder, written and verified there, and uploaded in ``commit()`` by
:class:`~.remote_target.RemoteTarget` (nothing at the final key(s) until the
whole upload succeeded).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any

from ..atomic_file import fsync_path
from ..checkpoint.manifest import ManifestError, read_manifest, write_manifest
from ..checkpoint.storage import is_url
from ..errors import Cancelled, ShardscopeError
from ..filenames import (
    LINEAGE_FILE_SUFFIX,
    MANIFEST_FILE_SUFFIX,
    MANIFEST_NAME,
    MAX_INDEX_BYTES,
    SAFETENSORS_INDEX,
    TMP_PREFIX,
    lineage_sidecar,
    manifest_path,
)
from ..lineage import read_sidecar, sidecar_bytes, with_written_files
from ..procs import orphaned
from ..progress import Progress
from ..text import human_bytes
from .destination import check_destination, index_files, replaceable
from .output_seal import Origin, check_against_source, output_manifest, seal_kept, source_manifest
from .plan import ExportError as OutputError
from .remote_target import RemoteTarget

_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
HOLD_ENV = "SHARDSCOPE_TEST_HOLD"  # tests: "<point>:<file>" holds the job at a point until a signal comes


def remove_path(path: str) -> None:
    """Remove a file or folder if it exists (never follows a symlinked folder)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):  # nothing there (a file where its folder should be)
            pass


def clean_leftovers(folder: str) -> list[str]:
    """Remove temporaries in ``folder`` left by Shardscope processes that are gone (a kill -9)."""
    removed = orphaned(folder, TMP_PREFIX)
    for name in removed:
        remove_path(os.path.join(folder, name))
    return removed


def _sync_file_range() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return fn


_SYNC_FILE_RANGE = _sync_file_range() if sys.platform.startswith("linux") else None
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a just-written range to disk now (Linux ``sync_file_range``), so
    the final fsync has little left to wait for; a no-op elsewhere. Durability still comes from fsync."""
    if _SYNC_FILE_RANGE is not None and length > 0:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def write_error(dst: str, exc: OSError) -> OutputError:
    """One line for an OS error while writing ``dst``."""
    if exc.errno in _FULL:
        return OutputError(f"{dst}: disk full while writing; nothing was written (the destination is untouched).")
    return OutputError(f"{dst}: cannot write ({exc.strerror or exc}).")


def _name_fits(path: str) -> bool:
    """True when the file system takes ``path``'s last part as a name (a sidecar adds to a long export name:
    then the export goes without one)."""
    try:
        limit = os.pathconf(os.path.dirname(path) or ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    return len(os.fsencode(os.path.basename(path))) <= limit


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # the same file system (the temporary is made next to the destination): no copy
    except OSError:
        shutil.copy2(src, dst)


class AtomicOutput:
    """Context manager: write into ``path`` (a file or a folder), then ``commit()``.

    ``need_bytes`` is checked against the free space of the destination's file system first.
    ``sources`` are the paths or URLs the job reads (the destination may not be one, lie inside one or
    hold one). Signal handlers for SIGINT/SIGTERM are installed for the duration when running on the main
    thread and restored on exit; a signal cancels ``progress``. ``lineage``: the document of the output's lineage
    sidecar (see :mod:`..lineage`), committed with the output, with the names a folder output wrote (local
    destinations only: a sidecar names local paths, and what goes to a URL is what people share).

    --force over a folder replaces only what a record of Shardscope's own says an earlier export wrote there
    (:func:`~.destination.replaceable`); every other entry is kept and named in ``kept``, and one the new
    export would write over is refused (nothing written).
    """

    def __init__(self, dst: str, kind: str = "file", force: bool = False, need_bytes: int = 0,
                 storage_options: dict[str, Any] | None = None, sources: Iterable[str] = (),
                 progress: Progress | None = None, lineage: dict[str, Any] | None = None) -> None:
        self.remote = RemoteTarget(dst, storage_options) if is_url(dst) else None
        self.dst = self.remote.url if self.remote else os.path.abspath(dst.rstrip("/") if kind == "dir" else dst)
        self.kind = kind
        self.force = force
        self.need_bytes = need_bytes
        self.storage_options = storage_options or {}
        self.folder = tempfile.gettempdir() if self.remote else os.path.dirname(self.dst)  # remote: local staging
        self.path = os.path.join(self.folder, f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(3)}")
        self.committed = False
        self.kept: list[str] = []  # --force over a folder: its entries no earlier export wrote, kept
        self.uploaded = ""  # URL destinations: how the upload was checked (the summary's "uploaded:" line)
        self.sources = [str(s) for s in sources]
        self.lineage = None if self.remote or not _name_fits(lineage_sidecar(self.dst, kind == "dir")) else lineage
        # a file's sidecar is staged under a temporary name of its own (removed with the output's on failure)
        self.lineage_tmp = self.path + LINEAGE_FILE_SUFFIX
        self.manifest_tmp = self.path + MANIFEST_FILE_SUFFIX  # a file's manifest, staged (see ``seal``)
        self.sealed = False  # the output's manifest is staged and goes with it
        self.progress = progress or Progress()
        self.signalled: int | None = None  # the first SIGINT/SIGTERM received
        self._old_handlers: dict[int, Any] = {}
        self._holding = 0  # inside a step that must finish (creating, the final renames, cleaning up)

    # ------------------------------------------------------------------ checks
    def _check(self) -> None:
        check_destination(self.dst, self.kind, self.force, self.sources, self.storage_options)
        if self.remote:
            self.remote.check(self.force)
        if not os.path.isdir(self.folder):
            raise OutputError(f"{self.folder}: the destination folder does not exist.")
        sidecar = lineage_sidecar(self.dst, self.kind == "dir")
        if not self.remote and _name_fits(sidecar) and os.path.lexists(sidecar) and read_sidecar(sidecar) is None:
            # NOTE: the commit replaces the export's sidecar by name; a file of that name that is not one of ours
            # (a user's own notes) is never removed
            raise OutputError(f"{sidecar}: exists and is not a Shardscope lineage sidecar (the export writes its "
                              "sidecar there); move it away. Nothing was written.")
        self._check_manifest_name()
        if not os.access(self.folder, os.W_OK):
            raise OutputError(f"{self.folder}: cannot write here (permission denied).")
        free = shutil.disk_usage(self.folder).free
        if self.need_bytes > free:
            raise OutputError(f"{self.folder}: needs {human_bytes(self.need_bytes)} but only {human_bytes(free)} "
                              "is free.")

    def _check_manifest_name(self) -> None:
        """A file output's manifest goes beside it, replacing only a manifest (a user's file of that name is
        never removed)."""
        if self.remote or self.kind == "dir":
            return
        path = manifest_path(self.dst, False)
        try:
            if os.path.lexists(path) and (not os.path.isfile(path) or read_manifest(path) is None):
                raise ManifestError(path)
        except ManifestError:
            raise OutputError(f"{path}: exists and is not a Shardscope manifest (the output's manifest is written "
                              "there); move it away. Nothing was written.") from None

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> AtomicOutput:
        self.hold_for_tests("start")  # the source is open, nothing is written yet
        self._install_handlers()  # before anything: a signal from here on is noted, and acted on below
        try:
            self._check()  # a refused destination is refused before anything is touched
            clean_leftovers(self.folder)
            with self._held():
                if self.kind == "dir":
                    os.mkdir(self.path)
                else:
                    os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            self._stop_if_asked()
        except BaseException as exc:
            self._discard()
            self._restore_handlers()
            if isinstance(exc, OSError):
                raise write_error(self.dst, exc) from None
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        with self._held():
            try:
                if not self.committed:
                    self._discard()
            finally:
                self._restore_handlers()
        if self.signalled is not None and not isinstance(exc, KeyboardInterrupt):
            raise self._interrupted(self.signalled) from None
        if isinstance(exc, OSError) and not isinstance(exc, ShardscopeError):
            raise write_error(self.dst, exc) from None

    def hold_for_tests(self, point: str) -> None:
        """Tests: with ``SHARDSCOPE_TEST_HOLD=<point>:<file>``, write the temporary's path into ``file`` and
        wait here (at most a minute) until a signal came, so that it lands at a known moment of the work."""
        name, _, announce = os.environ.get(HOLD_ENV, "").partition(":")
        if name != point or not announce:
            return
        with open(announce, "w") as f:
            f.write(self.path)
        end = time.monotonic() + 60
        while self.signalled is None and time.monotonic() < end:
            time.sleep(0.01)

    def sync(self) -> None:
        """fsync the temporary (for a folder, every file in it too); may run on another thread while
        the output is verified. The local staging copy of a URL destination needs none."""
        if self.remote:
            return
        try:
            if self.kind == "dir":
                for name in os.listdir(self.path):
                    fsync_path(os.path.join(self.path, name))
            fsync_path(self.path)
        except OSError as exc:
            raise write_error(self.dst, exc) from None

    def seal(self, source: str | None, origins: dict[str, Origin]) -> list[str]:
        """Stage the output's content manifest, read back from what was written (inside a folder output; beside
        a file output under a temporary name, renamed with it), checked against the manifest of ``source`` when it
        is sealed (``origins``: output tensor -> where its values come from). Returns the tensors whose digest
        differs from the source's (then nothing is staged and the output must not be committed)."""
        manifest = output_manifest(self.path, self.kind, self.dst)
        bad = check_against_source(manifest, source_manifest(source) if source else None, origins)
        if not bad and (self.kind == "dir" or _name_fits(manifest_path(self.dst, False))):
            try:
                write_manifest(os.path.join(self.path, MANIFEST_NAME) if self.kind == "dir" else self.manifest_tmp,
                               manifest)
            except OSError as exc:
                raise write_error(self.dst, exc) from None
            self.sealed = True
        return bad

    def commit(self) -> None:
        """Make the temporary durable and give it the destination's name (replacing it with --force). Once
        the renames begin they finish: a signal then is acted on after them (see ``__exit__``)."""
        self._stop_if_asked()
        if self.remote:  # the upload is the commit
            self.remote.commit(self.path, self.kind, stop=self._stop_if_asked, replaceable=self._remote_replaceable)
            if self.sealed and self.kind == "file":  # a folder's manifest went up with it
                self.remote.commit_beside(self.manifest_tmp, MANIFEST_FILE_SUFFIX)
            self.uploaded = self.remote.report.describe()
            self.kept = self.remote.kept
            self._discard()
            self.committed = True
            return
        replaced = self._replaced() if self.kind == "dir" and os.path.isdir(self.dst) else set()
        self._stage_lineage()
        self.sync()  # cheap when sync() already ran: nothing is dirty
        with self._held():
            self._stop_if_asked()
            try:
                if _name_fits(lineage_sidecar(self.dst, self.kind == "dir")):
                    # NOTE: an old sidecar goes first and the new one comes after the output: a failure or a kill
                    # between the renames leaves an export without a sidecar, never one credited to another source
                    remove_path(lineage_sidecar(self.dst, self.kind == "dir"))
                if self.kind == "file" and _name_fits(manifest_path(self.dst, False)):
                    # likewise an old manifest: it never vouches for the new bytes
                    remove_path(manifest_path(self.dst, False))
                if os.path.lexists(self.dst):  # --force, and check_destination saw a folder for a folder
                    if self.kind == "dir":
                        self.kept = self._carry_over(replaced)
                        if self.kept and self.sealed:
                            self.sealed = seal_kept(self.path)  # the kept entries are the output's files too
                        # a folder cannot be replaced in one step: move it aside under a temporary name first
                        aside = f"{self.path}-old"
                        os.rename(self.dst, aside)
                        self.hold_for_tests("swap")
                        try:
                            os.rename(self.path, self.dst)
                        except OSError:
                            os.rename(aside, self.dst)  # the old folder back under its name
                            raise
                        remove_path(aside)
                    else:
                        os.replace(self.path, self.dst)
                else:
                    os.rename(self.path, self.dst)
                if self.sealed and self.kind == "file":
                    os.rename(self.manifest_tmp, manifest_path(self.dst, False))
                if self.lineage is not None:
                    os.rename(self.lineage_tmp, lineage_sidecar(self.dst, self.kind == "dir"))
                fsync_path(self.folder)
            except OSError as exc:
                raise write_error(self.dst, exc) from None
            self.committed = True

    def _stage_lineage(self) -> None:
        """Write the lineage sidecar beside the output under its temporary name (renamed into place after the
        output, see ``commit``); a folder's names the files the export wrote into it."""
        if self.lineage is None:
            return
        doc = with_written_files(self.lineage, os.listdir(self.path)) if self.kind == "dir" else self.lineage
        try:
            with open(self.lineage_tmp, "wb") as f:
                f.write(sidecar_bytes(doc))
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise write_error(self.dst, exc) from None

    def _replaced(self) -> set[str]:
        """The old folder's entries this export replaces or removes: what an earlier export recorded writing
        there. Refused (nothing written) when the export would write over an entry no export recorded."""
        replaced = replaceable(self.dst) | self._old_manifest()
        mine = set(os.listdir(self.path))
        for name in sorted(os.listdir(self.dst)):
            if name in mine and name not in replaced:
                raise OutputError(f"{os.path.join(self.dst, name)}: exists and no earlier export recorded writing "
                                  "it, and this export writes a file of that name; move it away. Nothing was "
                                  "written.")
        return replaced

    def _old_manifest(self) -> set[str]:
        """The old folder's manifest, when it is one (``seal`` of an earlier output): replaced by the new one."""
        try:
            return {MANIFEST_NAME} if read_manifest(os.path.join(self.dst, MANIFEST_NAME)) is not None else set()
        except ManifestError:
            return set()

    def _remote_replaceable(self) -> set[str]:
        """What a --force upload over a URL folder may replace of the old one: the files an earlier export's own
        index records (a URL folder has no lineage sidecar)."""
        assert self.remote is not None
        ours = index_files(self.remote.read_small(SAFETENSORS_INDEX, MAX_INDEX_BYTES))
        return ours | {MANIFEST_NAME} if ours else ours

    def _carry_over(self, replaced: set[str]) -> list[str]:
        """Hard links (copies across file systems) in the new folder of the old folder's entries no earlier
        export recorded writing (``replaced``), so the swap keeps them. NOTE: --force replaced the whole folder
        (an HF model folder's config.json and tokenizer files went without a word), and then every entry of an
        export's kind (a user's ``optimizer.bin`` went); only Shardscope's own record proves what it wrote."""
        kept = []
        with os.scandir(self.dst) as entries:
            for e in sorted(entries, key=lambda e: e.name):
                target = os.path.join(self.path, e.name)
                if e.name in replaced or os.path.lexists(target):
                    continue  # written by an earlier export: replaced by this one, or gone with it
                if e.is_symlink():
                    os.symlink(os.readlink(e.path), target)
                elif e.is_dir():
                    shutil.copytree(e.path, target, symlinks=True, copy_function=_link_or_copy)
                else:
                    _link_or_copy(e.path, target)
                kept.append(e.name)
        if kept:
            fsync_path(self.path)
        return kept

    def _discard(self) -> None:
        """Remove the temporary. NOTE: a writer thread that has not yet seen the cancel may still create a file
        in the folder while it is removed (rmtree then fails on the folder, quietly); removal is tried again."""
        with self._held():  # a second signal must not stop it half-way
            if not self.committed:
                remove_path(self.lineage_tmp)
                remove_path(self.manifest_tmp)
            for attempt in range(20):
                remove_path(self.path)
                if not os.path.lexists(self.path):
                    break
                time.sleep(0.01 * (attempt + 1))

    # ------------------------------------------------------------------ signals
    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """A step that must finish once begun: a signal during it is only noted."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal works on the main thread only; the GUI cancels through Progress
        for sig in _SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    def _stop_if_asked(self) -> None:
        """Raise for a signal noted earlier (called before the final renames and by the upload between its
        requests, so what is at the destination is known when it raises)."""
        if self.signalled is not None:
            raise self._interrupted(self.signalled)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signalled is None:
            # NOTE: only noted: the job stops at its next progress check, its threads too, and __exit__ then
            # removes the temporary; raising here would land on any line (see the module's docstring)
            self.signalled = signum
            self.progress.cancel()
            return
        if not self._holding:  # a second one does not wait for the job to notice the first
            raise self._interrupted(signum)

    def _interrupted(self, signum: int) -> BaseException:
        if self.committed:
            return Cancelled(f"interrupted by {signal.Signals(signum).name} after {self.dst} was written "
                             "(it is complete)")
        if signum == signal.SIGINT:
            return KeyboardInterrupt()
        return Cancelled(f"interrupted by {signal.Signals(signum).name}; nothing was written to {self.dst}")


__all__ = ["TMP_PREFIX", "AtomicOutput", "clean_leftovers", "fsync_path", "remove_path", "start_writeback",
           "write_error"]
