"""Where a checkpoint's bytes are: a local folder, or any fsspec URL (``s3://``, ``gs://``, ``hf://``,
``memory://``, ``file://``). Everything reads through :func:`open_folder` and its handles, which fetch
only the byte ranges asked for, so a remote checkpoint is never copied whole."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from ..errors import CheckpointError
from ..filenames import is_metadata_name
from .remote import call, fs_for, is_url
from .remote_reads import RemoteHandles


def outside_link(path: str, root: str) -> str | None:
    """Where ``path`` leads when it is a symbolic link out of the folder ``root`` (the checkpoint's own
    folder), else None: such a file is never opened or counted. The one exception is the Hugging Face hub cache's
    layout: a snapshot folder (``<repo>/snapshots/<revision>/``) links its files to ``<repo>/blobs/``."""
    if not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    inside = os.path.realpath(root)
    if os.path.commonpath([target, inside]) == inside:
        return None
    snapshots = os.path.dirname(inside)
    if os.path.basename(snapshots) == "snapshots":
        blobs = os.path.join(os.path.dirname(snapshots), "blobs")
        if os.path.dirname(target) == blobs:
            return None
    return target


def why_absent(folder: str, name: str) -> str:
    """Why file ``name`` of a checkpoint folder is not in its listing: "is missing", or a refused link."""
    target = None if is_url(folder) else outside_link(os.path.join(folder, name), folder)
    return "is missing" if target is None else f"is a symbolic link to {target}, outside the checkpoint folder: refused"


def open_regular(path: str, root: str | None = None) -> int:
    """A read-only descriptor of a regular file; a FIFO, device or folder is refused without blocking,
    and so is a symbolic link that leads outside the folder ``root``."""
    target = outside_link(path, root) if root is not None else None
    if target is not None:
        raise CheckpointError(f"{path}: a symbolic link to {target}, outside the checkpoint folder; refused.",
                              path=path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open ({exc.strerror}).", path=path) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file (a FIFO, device or folder); refused.", path=path)
    return fd


class LocalHandles:
    """Open files of one local folder, shared by threads (reads use ``os.pread``)."""

    local: Literal[True] = True  # a tag: `if handles.local` tells the two kinds of handles apart

    def __init__(self, folder: str, confined: bool = True) -> None:
        self.folder = folder
        self.confined = confined  # refuse symbolic links that lead out of the folder (see Folder.confined)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def where(self, name: str) -> str:
        """The file's local path, used to open it and in error messages."""
        return os.path.join(self.folder, name)

    def fd(self, name: str) -> int:
        """An open read-only descriptor for file ``name``, opened once and shared by threads."""
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                path = self.where(name)
                fd = open_regular(path, self.folder if self.confined else None)
                self._fds[name] = fd
            return fd

    def read(self, name: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes of file ``name`` from ``offset``; CheckpointError when the file is truncated."""
        data = os.pread(self.fd(name), length, offset)
        if len(data) != length:
            raise CheckpointError(f"{self.where(name)}: file ends before byte {offset + length} "
                                  f"(item at {offset}, {length} bytes): the file is truncated.", path=self.where(name))
        return data

    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with the bytes of file ``name`` from ``offset``; CheckpointError when it is truncated."""
        fd = self.fd(name)
        view = buf.cast("B") if buf.format != "B" else buf
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                raise CheckpointError(f"{self.where(name)}: file ends before byte {offset + len(view)}: the file "
                                      "is truncated.", path=self.where(name))
            got += n

    def size(self, name: str) -> int:
        """Size of file ``name`` in bytes, from its open descriptor."""
        return os.fstat(self.fd(name)).st_size

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """The bytes of every ``(name, start, end)``."""
        return [self.read(name, start, end - start) for name, start, end in ranges]

    def prefetch(self, ranges: Sequence[tuple[str, int, int]]) -> None:
        """A hint that these ranges are read soon (the page cache does this locally)."""

    def plan_items(self, name: str, extents: Iterable[tuple[int, int]]) -> None:
        """Item boundaries of a file (used by remote handles only)."""

    def release(self, name: str, start: int, end: int) -> None:
        """A planned range read for the last time (used by remote handles only)."""

    def plan_table(self, names: Sequence[str], file: Any, offset: Any, length: Any) -> None:
        """Item boundaries of a chunk table (used by remote handles only)."""

    def close(self) -> None:
        """Close every open descriptor; later reads open the files again."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> LocalHandles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Folder:
    """A checkpoint folder: its files and sizes, and readers for them. ``storage_options`` are the
    fsspec options it was opened with (the one channel for endpoints and credentials)."""

    def __init__(self, path: str, fs: Any = None, root: str | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.path = path  # what the user sees: a local path or the URL
        self.fs, self.root = fs, root
        # NOTE: a checkpoint folder is confined: a symbolic link in it that leads out is refused. A file the user
        # named (or the shards of an HF index) is not: the Hugging Face cache links every one into ../../blobs.
        self.confined = True
        self.storage_options = storage_options
        self._listing: dict[str, int] | None = None  # remote: the listing made when opened
        self._remote: RemoteHandles | None = None

    @property
    def local(self) -> bool:
        """True for a folder on the local disk, False for one on an fsspec URL."""
        return self.fs is None

    def join(self, name: str) -> str:
        """The path or URL of file ``name`` in this folder."""
        return os.path.join(self.path, name) if self.local else f"{self.path.rstrip('/')}/{name}"

    def _key(self, name: str) -> str:
        return f"{(self.root or '').rstrip('/')}/{name}"  # root: set for a remote folder, the only one keyed

    def _set_listing(self, entries: list[dict[str, Any]]) -> dict[str, int]:
        self._listing = listing = {os.path.basename(d["name"].rstrip("/")): int(d.get("size") or 0)
                                   for d in entries if d.get("type") == "file"}
        return listing

    def listing(self) -> dict[str, int]:
        """Regular files of the folder and their sizes (one listing request when remote)."""
        if self.local:
            try:
                out = {}
                with os.scandir(self.path) as it:
                    for e in it:
                        if e.is_file() and not (self.confined and e.is_symlink() and outside_link(e.path, self.path)):
                            out[e.name] = e.stat().st_size
                return out
            except OSError as exc:
                raise CheckpointError(f"{self.path}: cannot list the folder ({exc.strerror}).",
                                      path=self.path) from None
        listing = self._listing
        if listing is None:
            listing = self._set_listing(call(self.path, self.fs.ls, self.root, detail=True,
                                             doing="cannot list the folder"))
        return dict(listing)

    def open(self, name: str) -> Any:
        """A binary file object (metadata pickles are read as a stream)."""
        if self.local:
            return os.fdopen(open_regular(os.path.join(self.path, name), self.path if self.confined else None), "rb")
        return call(self.join(name), self.fs.open, self._key(name), "rb", block_size=8 << 20)

    def handles(self) -> LocalHandles | RemoteHandles:
        """Byte-range readers for this folder's files; make one per reader and share it between threads.
        Remote: one planner and cache per folder, shared by its readers (closing drops the cache)."""
        if self.local:
            return LocalHandles(self.path, self.confined)
        if self._remote is None:
            self._remote = RemoteHandles(self.fs, self.root or "", self.path, sizes=self._listing)
        return self._remote

    def identity(self, names: list[str]) -> str | None:
        """What changes when these files change (for the metadata cache)."""
        parts = [f"{os.path.abspath(self.path) if self.local else self.path}"]
        for name in names:
            try:
                if self.local:
                    st = os.stat(os.path.join(self.path, name))
                    parts.append(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{st.st_dev}")
                else:
                    info = call(self.join(name), self.fs.info, self._key(name))
                    stamp = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified")
                    if stamp is None:
                        return None  # nothing tells a changed remote file apart: do not cache
                    parts.append(f"{name}\0{info.get('size')}\0{stamp}")
            except (OSError, CheckpointError):
                return None
        return "\0".join(parts)




def open_folder(path: str | os.PathLike | Folder, storage_options: dict[str, Any] | None = None) -> Folder:
    """The checkpoint folder named by ``path`` (a folder, its ``.metadata`` file, a URL, or a Folder,
    returned as is). ``storage_options`` go to fsspec for URLs (endpoint, credentials, ...)."""
    if isinstance(path, Folder):
        return path
    text = str(path)
    if text.startswith("file://"):
        text = text[len("file://"):]
    if is_url(text):
        return _open_remote(text, storage_options)
    p = Path(text).expanduser()
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder.", path=str(p))
    if p.is_file():
        if is_metadata_name(p.name):
            return Folder(str(p.parent))
        raise CheckpointError(f"{p}: is a file, not a checkpoint folder.", path=str(p),
                              hint="Give the folder that holds .metadata and the __R_N.distcp files.")
    return Folder(str(p))


def _open_remote(url: str, storage_options: dict[str, Any] | None) -> Folder:
    fs, root = fs_for(url, storage_options)
    root = root.rstrip("/")
    fs.invalidate_cache(root)  # a folder opened again (the window's reload) is listed afresh
    entries = call(url, fs.ls, root, detail=True)  # one request: a folder's listing, or the file itself
    if len(entries) == 1 and entries[0].get("type") == "file" and entries[0]["name"].rstrip("/") == root:
        parent, _, base = root.rpartition("/")
        if is_metadata_name(base):
            return Folder(url.rstrip("/").rsplit("/", 1)[0], fs, parent, storage_options)
        raise CheckpointError(f"{url}: is a file, not a checkpoint folder.", path=url)
    folder = Folder(url.rstrip("/"), fs, root, storage_options)
    folder._set_listing(entries)
    return folder


def open_remote_file(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Folder, str]:
    """The folder holding the single object at ``url`` (a ``.safetensors`` file), listing only that object
    (one request: its size is what every read is checked against, and the rest of the prefix is never
    listed), and the object's name in it."""
    fs, root = fs_for(url, storage_options)
    root = root.rstrip("/")
    fs.invalidate_cache(root)
    info = call(url, fs.info, root)
    if info.get("type") != "file":
        raise CheckpointError(f"{url}: is a folder, not a file.", path=url)
    parent, _, name = root.rpartition("/")
    folder = Folder(url.rstrip("/").rsplit("/", 1)[0], fs, parent, storage_options)
    folder._set_listing([{**info, "name": name}])
    return folder, name


def handles_for(path: str | Folder, storage_options: dict[str, Any] | None = None) -> LocalHandles | RemoteHandles:
    """Handles for a folder path or URL (prefer ``Checkpoint.folder.handles()``: no second resolve)."""
    if isinstance(path, Folder):
        return path.handles()
    return open_folder(path, storage_options).handles() if is_url(path) else LocalHandles(str(path))


__all__ = ["Folder", "LocalHandles", "RemoteHandles", "handles_for", "is_url", "open_folder", "open_remote_file"]
