"""An export destination on an fsspec URL (``s3://bucket/out``): the staged output uploaded (one PUT, or an S3
multipart upload with a CRC32 on every request), moved into place and checked, and committed only when the whole
upload succeeded; a --force export over a folder sets the old files aside and puts them back on failure. What
killed exports leave next to a destination (temporary uploads, incomplete multipart uploads) is removed by the
next export there."""

from __future__ import annotations

import logging
import os
import re
import socket
import tempfile
import time
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..checkpoint.remote import call, fs_for, is_remote_error, remote_error, url_protocol
from ..crc import crc32_b64, crc32_combine
from ..errors import CheckpointError
from ..filenames import LEFTOVER_RE, TMP_PREFIX
from ..procs import pid_alive
from .upload_check import Sent, UploadCheck

log = logging.getLogger(__name__)

# Object stores where one PUT (or a multipart upload) appears only when complete: a file goes there directly.
ATOMIC_PUT = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"}
OLD_PREFIX = ".shardscope-old-"  # the old files of a --force export over a folder, while it commits


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


STALE_ENV = "SHARDSCOPE_STALE_UPLOAD_SECONDS"


def stale_seconds() -> float:
    """How long another machine's temporary upload (or any incomplete multipart upload) must have been
    left untouched before an export next to it removes it: a day, or ``$SHARDSCOPE_STALE_UPLOAD_SECONDS``."""
    try:
        return float(os.environ.get(STALE_ENV, 86400))
    except ValueError:
        return 86400.0


def _modified(info: dict[str, Any]) -> float | None:
    when = info.get("LastModified") or info.get("mtime") or info.get("last_modified")
    if when is None:
        return None
    return when.timestamp() if hasattr(when, "timestamp") else float(when)


def _uploads_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "shardscope-uploads")


def _remember_upload(upload_id: str) -> str:
    """A local record ``<pid>-<hash>`` of a multipart upload in flight; removed when it ends."""
    folder = _uploads_dir()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(upload_id)
    return path


def _forget_upload(record: str) -> None:
    try:
        os.unlink(record)
    except OSError:
        pass


def _upload_records() -> dict[str, tuple[str, bool]]:
    """Upload id -> (record path, whether its process is alive), for this machine's multipart uploads."""
    out: dict[str, tuple[str, bool]] = {}
    try:
        names = os.listdir(_uploads_dir())
    except OSError:
        return out
    for name in names:
        pid = name.split("-", 1)[0]
        if not pid.isdigit():
            continue
        alive = pid_alive(int(pid))
        path = os.path.join(_uploads_dir(), name)
        try:
            if not alive and time.time() - os.path.getmtime(path) > 2 * stale_seconds():
                _forget_upload(path)  # its upload is gone by now, or the age rule takes it
                continue
            with open(path, encoding="utf-8") as f:
                out[f.read(1024).strip()] = (path, alive)
        except OSError:
            continue
    return out


PART = 16 << 20  # multipart part size for S3 uploads (5 MiB..5 GiB, at most 10,000 parts)
MAX_PARTS = 10_000
PARTS_IN_FLIGHT = 4  # parts read and sent at once: at most this many parts in memory


def _go_on() -> None:
    """The ``stop`` of a commit nobody can interrupt."""


class RemoteTarget:
    """An export destination on an fsspec URL, committed only when the whole upload succeeded."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.fs, root = fs_for(self.url, storage_options)
        self.root = root.rstrip("/")
        self.protocol = url_protocol(self.url)
        # S3: our own PUTs and parts, each with a CRC32 that the server checks (s3fs sends none of its own)
        self.s3 = self.protocol in ("s3", "s3a") and hasattr(self.fs, "call_s3")
        self.report = UploadCheck(checksummed=self.s3)
        self._stop: Callable[[], None] = _go_on
        self._keep_aside = False  # a failed --force export could not put every old file back
        self.kept: list[str] = []  # --force over a folder: what was there and is not the export's, kept

    def exists(self) -> bool:
        """True when something already exists at the destination URL."""
        return bool(call(self.url, self.fs.exists, self.root, doing="cannot check the destination"))

    def check(self, force: bool) -> None:
        """Refuse an existing destination unless ``force``; fails fast on an unreachable endpoint."""
        self.clean_leftovers()
        if self.exists() and not force:
            raise CheckpointError(f"{self.url}: already exists; choose a name that does not exist yet, or allow "
                                  "overwriting it.", path=self.url)
        bucket = self.root.split("/", 1)[0]
        if self.protocol in ATOMIC_PUT - {"memory"} and not call(self.url, self.fs.exists, bucket,
                                                                  doing="cannot check the destination"):
            raise CheckpointError(f"{self.url}: the bucket {bucket} does not exist (or is not visible with these "
                                  "credentials).", path=self.url)

    def commit(self, local_path: str, kind: str, stop: Callable[[], None] | None = None,
               replaceable: Callable[[], set[str]] | None = None) -> None:
        """Upload ``local_path`` (a file, or a folder when ``kind == "dir"``) to the URL. ``stop`` raises when
        the user asked to stop (a deferred Ctrl-C); it is called between requests, never during one, so what
        is at the destination is known when it raises, and removed. Over an existing folder (--force), only the
        names ``replaceable()`` gives (what an earlier export's own record says it wrote) are replaced or
        removed; the other files are kept (listed in ``kept``), and one the upload would overwrite is refused
        before anything is sent."""
        self._stop = stop or _go_on
        if kind == "file":
            if self.protocol in ATOMIC_PUT:  # one PUT or a multipart upload: visible only when complete
                self._stop()
                sent = self._put(local_path, self.root)
                try:
                    self._confirm(sent, self.root)
                    self._stop()  # a stop asked during the last request: the object goes again
                except BaseException:
                    self._quiet_rm(self.root)  # a damaged object must not stay at the destination
                    raise
                return
            tmp = self._temp_name()
            self._upload_then_move([(local_path, tmp, self.root)], tmp)
            return
        tmp = self._temp_name()
        names = sorted(os.listdir(local_path), key=lambda n: (n.endswith(".json"), n))  # the index last
        moves = [(os.path.join(local_path, n), f"{tmp}/{n}", f"{self.root}/{n}") for n in names
                 if os.path.isfile(os.path.join(local_path, n))]
        old = self._old_files()
        finals = {final for _, _, final in moves}
        ours = replaceable() if old and replaceable is not None else set()
        clash = sorted(p for p in old & finals if p[len(self.root) + 1:] not in ours)
        if clash:
            raise CheckpointError(f"{self.url}/{clash[0][len(self.root) + 1:]}: exists and no earlier export "
                                  "recorded writing it, and this export writes a file of that name; move it away. "
                                  "Nothing was written.", path=self.url)
        # --force over a folder: the old files a move would overwrite are first copied aside (server side),
        # and put back if the export then fails, so a failure leaves the old folder as it was
        saved = self._set_aside(sorted(old & finals)) if old & finals else None
        try:
            self._upload_then_move(moves, tmp)
        except BaseException:
            if saved is not None:
                self._put_back(saved)  # raises, keeping the copies, when one could not be put back
            raise
        finally:
            if saved is not None and not self._keep_aside:
                self._quiet_rm(saved[0], recursive=True)
        for path in sorted(old - finals):  # an earlier export's other files, once the new one is in place
            name = path[len(self.root) + 1:]
            if "/" not in name and name in ours:
                self._quiet_rm(path)
            else:
                self.kept.append(name)  # no export recorded writing it (config.json, a user's files): kept

    def commit_beside(self, local_path: str, suffix: str) -> None:
        """One more object beside a file output, ``<url><suffix>`` (its manifest), once the output is in place."""
        final = self.root + suffix
        self._stop()
        if self.protocol in ATOMIC_PUT:
            self._confirm(self._put(local_path, final), final)
        else:
            tmp = self._temp_name()
            self._upload_then_move([(local_path, tmp, final)], tmp)

    def _set_aside(self, paths: list[str]) -> tuple[str, list[tuple[str, str]]]:
        """Copies of ``paths`` in a folder next to the destination, ``.shardscope-old-…``. NOTE: unlike the
        temporary uploads it is never removed by a later run: after a kill -9 during the moves it holds the
        only copy of the old files the moves had replaced."""
        parent, _, base = self.root.rpartition("/")
        aside = f"{parent}/{OLD_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}-{_host()}-{base}"
        copies = [(p, f"{aside}/{p.rpartition('/')[2]}") for p in paths]
        try:
            for path, copy in copies:
                self._stop()
                call(self.url, self.fs.copy, path, copy, doing="cannot set the old files aside")
        except BaseException:
            self._quiet_rm(aside, recursive=True)
            raise
        return aside, copies

    def _put_back(self, saved: tuple[str, list[tuple[str, str]]]) -> None:
        """After a failed --force export: every old file the new one may have replaced or removed, as it was.
        A file that cannot be put back is named in the log, with the copy that still holds it."""
        aside, copies = saved
        lost = []
        for path, copy in copies:
            try:
                self.fs.copy(copy, path)
            except Exception as exc:
                if not is_remote_error(exc):
                    raise
                lost.append(path)
                log.warning("could not put back %s from %s: %r", path, copy, exc)
        if lost:  # keep the copies: they are all that is left of these files
            self._keep_aside = True
            raise CheckpointError(f"{self.url}: the export failed and {len(lost)} of the old files could not be "
                                  f"put back; their copies are under {self.protocol}://{aside} (see the log).",
                                  path=self.url)

    def read_small(self, name: str, limit: int) -> bytes | None:
        """The first ``limit`` + 1 bytes of the file ``name`` in the destination folder; None when there is none."""
        try:
            with self.fs.open(f"{self.root}/{name}", "rb") as f:
                return f.read(limit + 1)
        except FileNotFoundError:
            return None
        except Exception as exc:
            if not is_remote_error(exc):
                raise
            raise remote_error(self.url, exc, "cannot read the destination") from None

    def _old_files(self) -> set[str]:
        if not self.exists():
            return set()
        found = call(self.url, self.fs.find, self.root, doing="cannot list the destination")
        return {p.rstrip("/") for p in found}

    def _temp_name(self) -> str:
        parent, _, base = self.root.rpartition("/")
        return f"{parent}/{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}-{_host()}-{base}"

    def clean_leftovers(self) -> list[str]:
        """Remove what killed Shardscope exports left next to the destination: temporary uploads of this
        machine whose process is gone (host name and pid in the name), and anyone's (another machine's)
        untouched for longer than :func:`stale_seconds`; on S3 also incomplete multipart uploads to
        these keys, by the same two rules (this machine's are known from their local records)."""
        parent = self.root.rpartition("/")[0]
        try:
            entries = call(self.url, self.fs.ls, parent, detail=True, doing="cannot list the destination")
        except CheckpointError:
            return []
        removed = []
        for entry in entries:
            path = entry["name"].rstrip("/")
            m = LEFTOVER_RE.match(path.rpartition("/")[2])
            if not m:
                continue
            mine = m.group(3).startswith(f"{_host()}-")
            if (mine and not pid_alive(int(m.group(1)))) or (not mine and self._stale(path, entry)):
                self._quiet_rm(path, recursive=True)
                removed.append(path)
        if self.s3:
            removed += self._abort_dead_uploads(parent)
        return removed

    def _stale(self, path: str, entry: dict[str, Any]) -> bool:
        """True when nothing under ``path`` was written for :func:`stale_seconds`."""
        try:
            found = self.fs.find(path, detail=True) if entry.get("type") == "directory" else {path: entry}
        except Exception as exc:
            if not is_remote_error(exc):
                raise
            return False
        times = [_modified(info) for info in found.values()]
        known = [t for t in times if t is not None]
        if not known or len(known) < len(times):
            return False  # no time to go by: never remove another machine's upload
        return time.time() - max(known) > stale_seconds()

    def _abort_dead_uploads(self, parent: str) -> list[str]:
        bucket, _, prefix = parent.partition("/")
        try:
            listed = self.fs.call_s3("list_multipart_uploads", Bucket=bucket,
                                     Prefix=f"{prefix}/" if prefix else "").get("Uploads") or []
        except Exception as exc:
            if not is_remote_error(exc):
                raise
            return []
        records = _upload_records()
        aborted = []
        for up in listed:
            key, upload_id = up.get("Key", ""), up.get("UploadId", "")
            path, alive = records.get(upload_id, ("", False))
            if alive:
                continue  # this machine's export still sending it
            started = up.get("Initiated")
            old = started is not None and time.time() - started.timestamp() > stale_seconds()
            if path or old:
                try:
                    self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
                    aborted.append(f"{bucket}/{key} (incomplete upload {upload_id[:12]})")
                except Exception as exc:
                    if not is_remote_error(exc):
                        raise
                    log.warning("could not abort the upload of %s/%s: %r", bucket, key, exc)
                    continue
            if path:
                _forget_upload(path)
        return aborted

    def _put(self, local: str, remote: str) -> Sent:
        if self.s3:
            return self._put_s3(local, remote)
        call(self.url, self.fs.put_file, local, remote, doing="upload failed")
        return Sent(os.path.getsize(local))

    def _s3_call(self, method: str, doing: str = "upload failed", **kwargs: Any) -> Any:
        return call(self.url, self.fs.call_s3, method, doing=doing, **kwargs)

    def _put_s3(self, local: str, remote: str) -> Sent:
        """One PUT (up to a part's size) or a multipart upload, every request with the CRC32 of its body."""
        bucket, _, key = remote.partition("/")
        size = os.path.getsize(local)
        part = max(PART, -(-size // MAX_PARTS))
        if size > part:
            return self._multipart(local, bucket, key, size, part)
        with open(local, "rb") as f:
            data = f.read(part + 1)
        if len(data) != size:
            raise CheckpointError(f"{self.url}: the staged file changed while it was uploaded.", path=self.url)
        crc = crc32_b64(zlib.crc32(data))
        self._s3_call("put_object", Bucket=bucket, Key=key, Body=data, ChecksumAlgorithm="CRC32", ChecksumCRC32=crc)
        return Sent(size, 1, crc)

    def _multipart(self, local: str, bucket: str, key: str, size: int, part: int) -> Sent:
        upload_id = self._s3_call("create_multipart_upload", Bucket=bucket, Key=key,
                                  ChecksumAlgorithm="CRC32")["UploadId"]
        record = _remember_upload(upload_id)  # a kill -9 from here on is cleaned by this machine's next run
        fd = os.open(local, os.O_RDONLY)

        def one(i: int) -> tuple[dict[str, Any], int, int]:
            self._stop()
            data = os.pread(fd, min(part, size - i * part), i * part)
            crc = zlib.crc32(data)
            out = self._s3_call("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=i + 1,
                                Body=data, ChecksumAlgorithm="CRC32", ChecksumCRC32=crc32_b64(crc))
            return {"PartNumber": i + 1, "ETag": out["ETag"], "ChecksumCRC32": crc32_b64(crc)}, crc, len(data)

        pool = ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="shardscope-upload")
        try:
            done = [f.result() for f in [pool.submit(one, i) for i in range(-(-size // part))]]
            self._stop()
            self._s3_call("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                          MultipartUpload={"Parts": [d[0] for d in done]})
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # no part goes out after this
            try:
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            except Exception as exc:  # the failure that brought us here is the one to report
                if not is_remote_error(exc):
                    raise
                log.warning("could not abort the upload of %s/%s: %r", bucket, key, exc)
            raise
        finally:
            pool.shutdown(wait=True)
            os.close(fd)
            _forget_upload(record)
        if sum(d[2] for d in done) != size:
            raise CheckpointError(f"{self.url}: the staged file changed while it was uploaded.", path=self.url)
        whole = done[0][1]
        for _, crc, length in done[1:]:
            whole = crc32_combine(whole, crc, length)
        composite = crc32_b64(zlib.crc32(b"".join(d[1].to_bytes(4, "big") for d in done)))
        return Sent(size, len(done), crc32_b64(whole), f"{composite}-{len(done)}")

    def _stored(self, remote: str) -> tuple[int, str | None] | None:
        """Size and stored CRC32 of an uploaded object; None when these credentials may write it but not
        read it (a write-only policy: the PUT succeeded, the HEAD is refused)."""
        try:
            if not self.s3:
                info = self.fs.info(remote)
                return int(info.get("size") or 0), None
            bucket, _, key = remote.partition("/")
            head = self.fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
            return int(head.get("ContentLength") or 0), head.get("ChecksumCRC32")
        except PermissionError:
            return None
        except Exception as exc:
            if not is_remote_error(exc):
                raise
            raise remote_error(self.url, exc, "cannot check the upload") from None

    def _confirm(self, sent: Sent, remote: str) -> None:
        """The final object has the staged file's size and (S3) reports its CRC32; else CheckpointError."""
        stored_info = self._stored(remote)
        if stored_info is None:
            self.report.add(sent, False, readable=False)
            return
        size, stored = stored_info
        where = f"{self.url}/{remote[len(self.root):].lstrip('/')}".rstrip("/")
        if size != sent.size:
            raise CheckpointError(f"{where}: the uploaded object has {size} bytes, the staged file {sent.size}.",
                                  path=where)
        if stored is not None and not sent.matches(stored):
            raise CheckpointError(f"{where}: the uploaded object's CRC32 is {stored}, the staged file's "
                                  f"{sent.crc32}: the upload is damaged.", path=where)
        self.report.add(sent, stored is not None)

    def _upload_then_move(self, moves: list[tuple[str, str, str]], tmp: str) -> None:
        done: list[str] = []
        try:
            sent = []
            for local, staged, _ in moves:
                self._stop()
                sent.append(self._put(local, staged))
            for one, (_, staged, final) in zip(sent, moves, strict=True):
                self._stop()
                done.append(final)  # before the request: a copy that lands after a failure is removed too
                if self.s3:  # a server-side copy that computes the copy's CRC32 itself (fsspec's mv drops options)
                    call(self.url, self.fs.copy, staged, final, on_error="raise", ChecksumAlgorithm="CRC32",
                         doing="cannot move the upload into place")  # the staged copies go below, in one bulk delete
                else:
                    call(self.url, self.fs.mv, staged, final, doing="cannot move the upload into place")
                self._confirm(one, final)
            self._stop()
        except BaseException:
            for final in done:  # a half-moved folder is worse than none
                self._quiet_rm(final)
            raise
        finally:
            self._quiet_rm(tmp, recursive=True)

    def _quiet_rm(self, path: str, recursive: bool = False) -> None:
        try:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=recursive)
        except Exception as exc:  # cleanup after a failure must not hide that failure
            if not is_remote_error(exc):
                raise
            log.warning("could not remove %s: %r", path, exc)


__all__ = ["RemoteTarget", "stale_seconds"]
