"""Small files written whole or not at all (status.json, config.json, a job script, an export of run data):
a temporary in the same folder, fsync, rename over the name, fsync the folder. The one owner of that job;
exports of checkpoints (folders, remote uploads, signals) go through :mod:`.export.atomic`, which shares
:func:`fsync_path`."""

from __future__ import annotations

import errno
import os
import tempfile

from .filenames import SMALL_TMP_SUFFIX  # the temporary is ``.<name>.<random>.tmp``: hidden


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder (a folder's entry list: makes a rename durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(path: str | os.PathLike) -> None:
    """fsync a folder's entry list after a rename in it. NOTE: some file systems cannot fsync a folder
    (EINVAL, ENOTSUP); the rename is then as durable as they make it, which is not an error."""
    try:
        fsync_path(path)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise


def write_atomic(path: str | os.PathLike, data: str | bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part:
    a uniquely named temporary in the same folder (two threads may write the same status at once), fsync,
    rename, fsync of the folder. ``mode``: the file's permission bits (default: mkstemp's 0o600)."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=SMALL_TMP_SUFFIX, dir=folder or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_folder(folder or ".")


__all__ = ["fsync_folder", "fsync_path", "write_atomic"]
