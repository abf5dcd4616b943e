"""What a listing's probes read of each checkpoint's header bytes, kept between listings: a warm ``ls`` opens no
file that has not changed.

One JSON file per root in the cache folder (``$SHARDSCOPE_CACHE_DIR``, off under ``--no-cache``), written
atomically when the listing found anything new. An entry is the format's :class:`~..formats.base.Facts` of one
checkpoint, keyed by the identity of every file the probe could read: name, size, mtime, ctime, inode and device
from the ``stat`` the listing takes anyway (any write, rename or ``touch`` changes the key). A folder with
subfolders is not cached (a probe may look inside them), nor one whose files changed within the last
:data:`SETTLE_SECONDS` (a second write within the same clock tick would keep the key), nor an unreadable one (the
error may pass: an NFS hiccup, a permission fixed), nor a format whose probe reads other files too
(``Format.probe_reads_own_files``). The file is our own but read as untrusted: bounded, every entry checked; a
damaged one is ignored with one line in the log.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any

from ..atomic_file import write_atomic
from ..filenames import cache_enabled, cache_folder
from ..formats.base import Facts

log = logging.getLogger(__name__)

VERSION = 1
MAX_BYTES = 256 << 20  # a listing of a million checkpoints is about 150 MiB of cache
SETTLE_SECONDS = 1.0


class ProbeCache:
    """The probes of one root's earlier listing (:meth:`get`) and this listing's (:meth:`put`, :meth:`save`)."""

    def __init__(self, root: str) -> None:
        digest = hashlib.sha256(os.fsencode(root)).hexdigest()[:32]
        self.path = os.path.join(cache_folder(), f"listing-{digest}.json")
        self.root = root
        self.settled_ns = time.time_ns() - int(SETTLE_SECONDS * 1e9)
        self.old_facts: list[Facts] = []
        self.old_rows: list[list[Any]] = []
        self.old = self._load()
        self.new: dict[str, list[Any]] = {}  # path -> [key, index in rows]
        self.rows: dict[tuple, int] = {}  # the distinct probes (10,000 checkpoints of a run have a few)
        self.hits = 0

    @classmethod
    def for_root(cls, root: str) -> ProbeCache | None:
        """The cache of a local root; None under ``--no-cache``."""
        return cls(root) if cache_enabled() else None

    def key(self, fmt: str, files: dict[str, Any]) -> str | None:
        """The identity of these files (``DirEntry`` or ``stat_result`` by name) for format ``fmt``; None when
        one cannot be stat'ed or changed too recently to be trusted."""
        parts: list[Any] = [VERSION, fmt]
        settled = self.settled_ns
        for name, info in files.items():  # in listing order: another order is only a miss
            try:
                st = info.stat(follow_symlinks=False) if type(info) is not os.stat_result else info
            except OSError:
                return None
            if st.st_ctime_ns > settled or st.st_mtime_ns > settled:
                return None
            parts.append((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev))
        # repr: names quoted and escaped, so no two lists of files spell the same text
        return hashlib.blake2b(repr(parts).encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()

    def get(self, path: str, key: str) -> Facts | None:
        """The probe cached for ``path`` under ``key``; None when none (or another key) is."""
        entry = self.old.get(path)
        if type(entry) is not list or len(entry) != 2 or entry[0] != key:
            return None
        facts = self.old_facts[entry[1]] if type(entry[1]) is int and 0 <= entry[1] < len(self.old_facts) else None
        if facts is None:
            return None
        self.put(path, key, facts)
        self.hits += 1
        return Facts(facts.format, facts.state, facts.reason, list(facts.ranks), facts.kind, facts.step, facts.pinned)

    def put(self, path: str, key: str, f: Facts) -> None:
        row = (f.format, f.state, f.reason, tuple(f.ranks), f.kind, f.step, f.pinned)
        index = self.rows.get(row)
        if index is None:
            index = self.rows[row] = len(self.rows)
        self.new[path] = [key, index]

    def save(self) -> None:
        """Write this listing's probes when they differ from the last (a failure costs only a slower listing)."""
        facts = [[*row[:3], list(row[3]), *row[4:]] for row in self.rows]
        if self.new == self.old and facts == self.old_rows:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            write_atomic(self.path, json.dumps({"version": VERSION, "root": self.root, "facts": facts,
                                                "probes": self.new}, separators=(",", ":")))
        except (OSError, ValueError) as exc:
            log.warning("cannot write the listing cache %s: %s", self.path, exc)

    def _load(self) -> dict[str, list[Any]]:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size > MAX_BYTES:
                    raise ValueError(f"larger than {MAX_BYTES} bytes")
                doc = json.loads(f.read())
            if isinstance(doc, dict) and doc.get("version") != VERSION and type(doc.get("version")) is int:
                return {}  # another version's: rewritten by this listing
            if not isinstance(doc, dict) or doc.get("root") != self.root:
                raise ValueError("not a listing cache of this root")
            probes, rows = doc.get("probes"), doc.get("facts")
            if type(probes) is not dict or type(rows) is not list or not all(_valid(v) for v in rows):
                raise ValueError("not a listing cache")  # each entry of probes is checked where it is used
            self.old_rows = rows
            self.old_facts = [Facts(v[0], v[1], v[2], v[3], v[4], v[5], v[6]) for v in rows]
            return probes
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as exc:  # damaged, planted or unreadable: only a slower listing
            log.warning("ignoring the listing cache %s: %s", self.path, str(exc).splitlines()[0] if str(exc) else
                        type(exc).__name__)
            return {}


def _valid(v: Any) -> bool:
    """A probe as :meth:`ProbeCache.save` writes it: [format, state, reason, ranks, kind, step, pinned]."""
    return (type(v) is list and len(v) == 7 and all(type(s) is str for s in (*v[:3], v[4], v[6]))
            and type(v[3]) is list and all(type(r) is int and 0 <= r < 1 << 31 for r in v[3])
            and (v[5] is None or type(v[5]) is int))
