"""Where a checkpoint's bytes are: a local folder, or any fsspec URL (``s3://``, ``gs://``, ``hf://``,
``memory://``, ``file://``). Everything reads through :func:`open_folder` and its handles, which fetch
only the byte ranges asked for, so a remote checkpoint is never copied whole."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

URL_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")
BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "hf": "huggingface_hub",
            "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs", "http": "aiohttp", "https": "aiohttp",
            "hdfs": "pyarrow", "sftp": "paramiko", "ssh": "paramiko"}


def is_url(path: str | os.PathLike) -> bool:
    m = URL_RE.match(str(path))
    return bool(m) and m.group(1) != "file"


def _fs_for(url: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError:
        raise CheckpointError(f"{url}: opening URLs needs the fsspec package (pip install fsspec).",
                              path=url) from None
    protocol = URL_RE.match(url).group(1)  # type: ignore[union-attr]
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        pkg = BACKENDS.get(protocol, f"the fsspec backend for {protocol}://")
        raise CheckpointError(f"{url}: no fsspec backend for {protocol}:// is installed ({exc}).", path=url,
                              hint=f"Install it, e.g. `pip install {pkg}`.") from None
    except ValueError as exc:
        raise CheckpointError(f"{url}: {exc}", path=url) from None
    return fs, root


class LocalHandles:
    """Open files of one local folder, shared by threads (reads use ``os.pread``)."""

    local = True

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def where(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                path = self.where(name)
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
                except OSError as exc:
                    raise CheckpointError(f"{path}: cannot open ({exc.strerror}).", path=path) from None
                self._fds[name] = fd
            return fd

    def read(self, name: str, offset: int, length: int) -> bytes:
        data = os.pread(self.fd(name), length, offset)
        if len(data) != length:
            raise CheckpointError(f"{self.where(name)}: file ends before byte {offset + length} "
                                  f"(item at {offset}, {length} bytes): the file is truncated.", path=self.where(name))
        return data

    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
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
        return os.fstat(self.fd(name)).st_size

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> LocalHandles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteHandles:
    """Byte-range reads from an fsspec filesystem (one request per range; nothing cached whole)."""

    local = False

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs, self.root, self.url = fs, root.rstrip("/"), url.rstrip("/")

    def where(self, name: str) -> str:
        return f"{self.url}/{name}"

    def read(self, name: str, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        try:
            data = self.fs.cat_file(f"{self.root}/{name}", start=offset, end=offset + length)
        except FileNotFoundError:
            raise CheckpointError(f"{self.where(name)}: no such file.", path=self.where(name)) from None
        except OSError as exc:
            raise CheckpointError(f"{self.where(name)}: cannot read ({exc}).", path=self.where(name)) from None
        if len(data) != length:
            raise CheckpointError(f"{self.where(name)}: file ends before byte {offset + length}: the file is "
                                  "truncated.", path=self.where(name))
        return data

    def readinto(self, name: str, offset: int, buf: memoryview) -> None:
        view = buf.cast("B") if buf.format != "B" else buf
        view[:] = self.read(name, offset, len(view))

    def size(self, name: str) -> int:
        return int(self.fs.size(f"{self.root}/{name}"))

    def fd(self, name: str) -> int:
        raise OSError("remote files have no descriptor")

    def close(self) -> None:
        pass

    def __enter__(self) -> RemoteHandles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


FileHandles = LocalHandles  # the historical name


class Folder:
    """A checkpoint folder: its files and sizes, and readers for them."""

    def __init__(self, path: str, fs: Any = None, root: str | None = None) -> None:
        self.path = path  # what the user sees: a local path or the URL
        self.fs, self.root = fs, root

    @property
    def local(self) -> bool:
        return self.fs is None

    def join(self, name: str) -> str:
        return os.path.join(self.path, name) if self.local else f"{self.path.rstrip('/')}/{name}"

    def listing(self) -> dict[str, int]:
        try:
            if self.local:
                out = {}
                with os.scandir(self.path) as it:
                    for e in it:
                        if e.is_file():
                            out[e.name] = e.stat().st_size
                return out
            return {os.path.basename(d["name"].rstrip("/")): int(d.get("size") or 0)
                    for d in self.fs.ls(self.root, detail=True) if d.get("type") == "file"}
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot list the folder ({getattr(exc, 'strerror', exc)}).",
                                  path=self.path) from None

    def open(self, name: str) -> Any:
        """A binary file object (metadata pickles are read as a stream)."""
        try:
            if self.local:
                return open(os.path.join(self.path, name), "rb")
            return self.fs.open(f"{self.root.rstrip('/')}/{name}", "rb", block_size=8 << 20)
        except OSError as exc:
            raise CheckpointError(f"{self.join(name)}: cannot read ({getattr(exc, 'strerror', exc)}).",
                                  path=self.join(name)) from None

    def read_all(self, name: str) -> bytes:
        with self.open(name) as f:
            return f.read()

    def handles(self) -> LocalHandles | RemoteHandles:
        return LocalHandles(self.path) if self.local else RemoteHandles(self.fs, self.root, self.path)

    def identity(self, names: list[str]) -> str | None:
        """What changes when these files change (for the metadata cache)."""
        parts = [f"{os.path.abspath(self.path) if self.local else self.path}"]
        for name in names:
            try:
                if self.local:
                    st = os.stat(os.path.join(self.path, name))
                    parts.append(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{st.st_dev}")
                else:
                    info = self.fs.info(f"{self.root.rstrip('/')}/{name}")
                    stamp = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified")
                    if stamp is None:
                        return None  # nothing tells a changed remote file apart: do not cache
                    parts.append(f"{name}\0{info.get('size')}\0{stamp}")
            except OSError:
                return None
        return "\0".join(parts)


RANK_METADATA_RE = re.compile(r"^__(\d+)\.metadata$")


def open_folder(path: str | os.PathLike) -> Folder:
    """The checkpoint folder named by ``path`` (a folder, its ``.metadata`` file, or a URL)."""
    text = str(path)
    if text.startswith("file://"):
        text = text[len("file://"):]
    if is_url(text):
        fs, root = _fs_for(text)
        try:
            kind = fs.info(root).get("type")
        except FileNotFoundError:
            raise CheckpointError(f"{text}: no such file or folder.", path=text) from None
        except OSError as exc:
            raise CheckpointError(f"{text}: cannot reach it ({exc}).", path=text) from None
        if kind == "file":
            base = root.rstrip("/").rsplit("/", 1)
            if base[-1] == ".metadata" or RANK_METADATA_RE.match(base[-1]):
                return Folder(text.rstrip("/").rsplit("/", 1)[0], fs, base[0])
            raise CheckpointError(f"{text}: is a file, not a checkpoint folder.", path=text)
        return Folder(text.rstrip("/"), fs, root)
    p = Path(text).expanduser()
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder.", path=str(p))
    if p.is_file():
        if p.name == ".metadata" or RANK_METADATA_RE.match(p.name):
            return Folder(str(p.parent))
        raise CheckpointError(f"{p}: is a file, not a checkpoint folder.", path=str(p),
                              hint="Give the folder that holds .metadata and the __R_N.distcp files.")
    return Folder(str(p))


def handles_for(path: str) -> LocalHandles | RemoteHandles:
    return open_folder(path).handles() if is_url(path) else LocalHandles(path)

