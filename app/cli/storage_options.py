"""``--storage-option KEY=VALUE`` for every subcommand that takes a path or URL: fsspec options
(endpoint, credentials, ...) handed to the storage layer through ``open_folder(..., storage_options=)``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardscope.backend.errors import ShardscopeError

HELP = ("fsspec option for URL paths, e.g. client_kwargs.endpoint_url=http://127.0.0.1:9000, key=..., "
        "secret=..., anon=true (repeatable; VALUE is JSON when it parses, else a string; dotted KEY nests)")


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    """Add the repeatable ``--storage-option`` to a subcommand's parser."""
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE", help=HELP)


def parse_storage_options(items: list[str]) -> dict[str, Any] | None:
    """``["client_kwargs.endpoint_url=http://h:9000", "anon=true"]`` -> nested dict (None when empty)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ShardscopeError(f"--storage-option {item!r}: expected KEY=VALUE (KEY may be dotted: a.b=c).")
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ShardscopeError(f"--storage-option {item!r}: {part} was already given a value.")
            node = child
        node[parts[-1]] = value
    return out or None


def storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """The parsed ``--storage-option`` values of a command line."""
    return parse_storage_options(getattr(args, "storage_option", None) or [])


def folder(args: argparse.Namespace, path: str) -> Any:
    """``path`` opened as a storage Folder with the command line's storage options (what
    ``open_checkpoint`` and the compare sources accept in place of a path)."""
    from shardscope.backend.checkpoint.storage import is_url, open_folder

    return open_folder(path, storage_options(args)) if is_url(path) else path


def apply_to_fsspec(args: argparse.Namespace, paths: list[str]) -> None:
    """For commands that open many paths over their life (``gui``; ``ls`` and ``prune``, whose URL roots
    are listed and pruned deep in the library code), the options become fsspec's own per-protocol defaults
    for this process (``fsspec.config.conf``): for the protocols of ``paths``, or ``s3`` when none is a URL."""
    options = storage_options(args)
    if not options:
        return
    import fsspec.config
    from shardscope.backend.checkpoint.remote import URL_RE

    protocols = {m.group(1) for m in (URL_RE.match(p) for p in paths) if m} or {"s3"}
    for protocol in protocols:
        fsspec.config.conf.setdefault(protocol, {}).update(options)
