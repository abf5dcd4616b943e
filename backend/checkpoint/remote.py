"""fsspec URLs (``s3://``, ``gs://``, ``hf://``, ``memory://``, ...): which strings are URLs, the filesystem for
one (a missing backend package named), and the one translation of a backend's or the network's errors into a
one-line :class:`CheckpointError` (exit 2). The planned reads are in :mod:`.remote_reads`, the copy of a whole
object to a local file in :mod:`.download`, and uploads in :mod:`..export.remote_target`."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import CheckpointError
from ..filenames import TMP_PREFIX, URL_RE, is_url

log = logging.getLogger(__name__)

BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "hf": "huggingface_hub",
            "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs", "http": "aiohttp", "https": "aiohttp",
            "hdfs": "pyarrow", "sftp": "paramiko", "ssh": "paramiko"}
# Errors raised by the network stacks under fsspec backends that mean "cannot reach / read it".
REMOTE_ERROR_MODULES = {"botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "google", "azure",
                        "huggingface_hub", "s3fs", "gcsfs", "adlfs", "fsspec", "paramiko"}


def default_options(protocol: str) -> dict[str, Any]:
    """Options that make an unreachable endpoint fail in about a second instead of retrying for minutes."""
    if protocol in ("s3", "s3a"):
        return {"config_kwargs": {"connect_timeout": 5, "read_timeout": 120,
                                  "retries": {"max_attempts": 2, "mode": "standard"}}}
    return {}


def merge_options(base: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    """``extra`` over ``base``, nested dicts merged key by key (the user's options win)."""
    out = dict(base)
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_options(out[key], value)
        else:
            out[key] = value
    return out


def is_remote_error(exc: BaseException) -> bool:
    """An error of the storage backend or the network (not a bug of ours)."""
    if isinstance(exc, (OSError, TimeoutError)):
        return True
    if any(c.__module__.split(".")[0] in REMOTE_ERROR_MODULES for c in type(exc).__mro__[:-2]):
        return True
    return isinstance(exc, ValueError | TypeError) and _raised_by_backend(exc)


def _raised_by_backend(exc: BaseException) -> bool:
    """True when the innermost frame of ``exc`` is in a storage backend's code: botocore refuses bad options
    (``endpoint_url=notaurl``) with a plain ValueError when it first makes its client, at the first request."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = str(tb.tb_frame.f_globals.get("__name__", "")) if tb is not None else ""
    return module.split(".")[0] in REMOTE_ERROR_MODULES


def remote_error(where: str, exc: BaseException, doing: str = "cannot read it") -> CheckpointError:
    """One line naming the URL and what the backend said."""
    if isinstance(exc, FileNotFoundError):
        return CheckpointError(f"{where}: no such file or folder.", path=where)
    if isinstance(exc, PermissionError):
        return CheckpointError(f"{where}: access denied ({_first_line(exc)}).", path=where,
                               hint="Check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
                                    "--storage-option key=... secret=...).")
    text = _first_line(exc)
    if isinstance(exc, ValueError | TypeError):
        return CheckpointError(f"{where}: bad storage options ({text}).", path=where,
                               hint="Check --storage-option values, e.g. client_kwargs.endpoint_url=http://host:9000")
    if "connect" in text.lower() or "endpoint" in text.lower() or isinstance(exc, TimeoutError):
        return CheckpointError(f"{where}: cannot reach the storage endpoint ({text}).", path=where,
                               hint="Check AWS_ENDPOINT_URL or --storage-option client_kwargs.endpoint_url=...")
    return CheckpointError(f"{where}: {doing} ({text}).", path=where)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def url_protocol(url: str) -> str:
    """The scheme of a URL (``s3`` of ``s3://bucket/key``); CheckpointError for a path that is not a URL."""
    m = URL_RE.match(url)
    if m is None:
        raise CheckpointError(f"{url}: not a URL (scheme://...).", path=url)
    return m.group(1)


def fs_for(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem and path for ``url``; a missing backend package is named."""
    try:
        import fsspec
    except ImportError:
        raise CheckpointError(f"{url}: opening URLs needs the fsspec package (pip install fsspec).",
                              path=url) from None
    protocol = url_protocol(url)
    options = merge_options(default_options(protocol), storage_options)
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        pkg = BACKENDS.get(protocol, f"the fsspec backend for {protocol}://")
        raise CheckpointError(f"{url}: no fsspec backend for {protocol}:// is installed ({exc}).", path=url,
                              hint=f"Install it, e.g. `pip install {pkg}`.") from None
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{url}: bad storage options or URL ({_first_line(exc)}).", path=url) from None


def call(where: str, fn: Any, *args: Any, doing: str = "cannot read it", **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with backend errors turned into one-line :class:`CheckpointError`."""
    try:
        return fn(*args, **kwargs)
    except CheckpointError:
        raise
    except Exception as exc:
        if not is_remote_error(exc):
            raise
        log.info("%s: %r", where, exc)
        raise remote_error(where, exc, doing) from None


__all__ = ["TMP_PREFIX", "URL_RE", "call", "fs_for", "is_remote_error", "is_url", "remote_error", "url_protocol"]
