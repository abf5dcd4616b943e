"""A prune's own record of what it moved out of the way, and the only proof that lets a later ``prune``, ``watch``
or ``ls`` finish an interrupted removal.

Before a checkpoint (and its export's lineage sidecar and manifest) is renamed to
``.shardscope-prune-<mode>-<name>``, a record ``<that name>.prune-record.json`` is written beside it, naming each
move (from, to) with the file's identity (device and inode, which a rename keeps). An entry with a prune's name is
finished only when its record names it and it is still that very file; anything else of such a name (a user's
folder, a copy, a stale record's namesake) is kept and named. NOTE: ``ls`` once deleted any folder named
``.shardscope-prune-delete-<anything>``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..atomic_file import write_atomic
from ..filenames import is_url

PRUNE_PREFIX = ".shardscope-prune-"  # a checkpoint renamed out of the way by an unfinished prune
RECORD_SUFFIX = ".prune-record.json"  # beside it: what the prune moved, and from where
SCHEMA = "shardscope-prune-record/1"
MODES = ("trash", "delete")
MAX_RECORD_BYTES = 64 << 10
ON_A_URL = "a prune's name on a URL, where no prune acts; kept"
NOT_RECORDED = "no record of a Shardscope prune names it; kept (remove it by hand if it is yours to remove)"


@dataclass(frozen=True, slots=True)
class Move:
    """One rename a prune made (or was about to make): names in one folder, and the file's identity."""

    source: str  # the name it had
    hidden: str  # the prune's name for it
    dev: int
    ino: int


@dataclass(frozen=True, slots=True)
class Leftover:
    """A checkpoint an interrupted prune renamed out of the way, as its record proves; finished by the next
    ``prune``, ``watch`` or ``ls``."""

    path: str  # the hidden name
    original: str  # where the checkpoint was
    mode: str  # "trash" or "delete"
    record: str = ""  # the prune's record of it
    moves: tuple[Move, ...] = ()  # the checkpoint first, then its sidecar and manifest


def hidden_name(mode: str, name: str) -> str:
    """The name a prune gives ``name`` while it removes it."""
    return f"{PRUNE_PREFIX}{mode}-{name}"


def has_prune_name(name: str) -> bool:
    """True for an entry with a prune's name (a record's own file excluded)."""
    return name.startswith(PRUNE_PREFIX) and not name.endswith(RECORD_SUFFIX)


def same_file(path: str, move: Move) -> bool:
    """True when ``path`` is the very file ``move`` recorded (no link followed)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (move.dev, move.ino)


def write_record(folder: str, mode: str, names: list[str]) -> tuple[str, tuple[Move, ...]]:
    """Record, durably and before any rename, that ``names`` (entries of ``folder``: the checkpoint, then its
    sidecar and manifest) are about to be moved to their prune names; the record's path and its moves."""
    moves = []
    for name in names:
        st = os.lstat(os.path.join(folder, name))
        moves.append(Move(name, hidden_name(mode, name), st.st_dev, st.st_ino))
    record = os.path.join(folder, moves[0].hidden + RECORD_SUFFIX)
    doc = {"schema": SCHEMA, "mode": mode,
           "moved": [{"from": m.source, "to": m.hidden, "dev": m.dev, "ino": m.ino} for m in moves]}
    write_atomic(record, json.dumps(doc, indent=1))
    return record, tuple(moves)


def _plain(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def read_record(record: str) -> tuple[str, tuple[Move, ...]] | None:
    """(mode, moves) of a prune record when it is one of ours (an untrusted file: every field checked)."""
    try:
        with open(record, "rb") as f:
            doc = json.loads(f.read(MAX_RECORD_BYTES + 1)[:MAX_RECORD_BYTES])
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or doc.get("mode") not in MODES or \
            not isinstance(doc.get("moved"), list) or not doc["moved"]:
        return None
    moves = []
    for m in doc["moved"]:
        if not isinstance(m, dict) or not _plain(m.get("from")) or m.get("to") != hidden_name(doc["mode"], m["from"]) \
                or not all(isinstance(m.get(k), int) and not isinstance(m.get(k), bool) for k in ("dev", "ino")):
            return None
        moves.append(Move(m["from"], m["to"], m["dev"], m["ino"]))
    if os.path.basename(record) != moves[0].hidden + RECORD_SUFFIX:
        return None
    return doc["mode"], tuple(moves)


def leftovers_in(folder: str, names: list[str]) -> tuple[list[Leftover], list[tuple[str, str]]]:
    """Of the entries of a local ``folder`` with a prune's name (``names``, records included), the interrupted
    prunes their records prove, and the others (path, why it is kept). A URL folder: every one is kept (no prune
    acts there, and no record is read)."""
    if is_url(folder):
        return [], [(f"{folder.rstrip('/')}/{n}", ON_A_URL) for n in sorted(names) if has_prune_name(n)]
    proven: list[Leftover] = []
    covered: set[str] = set()
    for name in sorted(n for n in names if n.startswith(PRUNE_PREFIX) and n.endswith(RECORD_SUFFIX)):
        record = os.path.join(folder, name)
        read = read_record(record)
        if read is None:
            continue
        mode, moves = read
        covered.update(m.hidden for m in moves if same_file(os.path.join(folder, m.hidden), m))
        main = moves[0]
        proven.append(Leftover(os.path.join(folder, main.hidden), os.path.join(folder, main.source), mode, record,
                               moves))
    strays = [(os.path.join(folder, n), NOT_RECORDED) for n in sorted(names) if has_prune_name(n)
              and n not in covered]
    return proven, strays


def remove_record(record: str) -> None:
    """Forget a finished (or never begun) prune."""
    try:
        os.unlink(record)
    except FileNotFoundError:
        pass


__all__ = ["MODES", "NOT_RECORDED", "PRUNE_PREFIX", "RECORD_SUFFIX", "Leftover", "Move", "has_prune_name",
           "hidden_name", "leftovers_in", "read_record", "remove_record", "same_file", "write_record"]
