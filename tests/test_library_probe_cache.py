"""The listing's probe cache (backend/library/probe_cache.py): a warm ``ls`` reuses the header probes of files that
did not change, sees every change, and survives a damaged cache file."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
from conftest import run_cli
from shardscope.backend.library import scan
from shardscope.backend.library.probe_cache import SETTLE_SECONDS, ProbeCache
from shardscope.backend.library.scan import LocalTree
from shardscope.backend.library.walk import Walker


@pytest.fixture
def root(tmp_path, fixtures, monkeypatch) -> Path:
    """Two finished DCP saves and a torch file, settled (changed long enough ago to be cached); its own cache."""
    monkeypatch.setenv("SHARDSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SHARDSCOPE_LOG", str(tmp_path / "shardscope.log"))
    runs = tmp_path / "runs" / "exp"
    for step in (100, 200):
        shutil.copytree(fixtures["fsdp2_r2"], runs / "checkpoints" / f"step_{step}")
    (runs / "step_300.pt").write_bytes(b"\x80\x02" + bytes(62))  # a legacy torch file: its first byte decides
    old = time.time() - 3600
    for p in runs.rglob("*"):
        os.utime(p, (old, old))
    time.sleep(SETTLE_SECONDS + 0.1)  # their ctime is now: a probe is cached only once it settled
    return tmp_path / "runs"


def _walk(root: Path) -> tuple[ProbeCache, dict[str, tuple]]:
    """One listing through the cache, as scan() does it; the cache and each checkpoint's probed facts."""
    probes = ProbeCache(str(root))
    walker = Walker(LocalTree(probes), time.time())
    walker.walk(str(root))
    probes.save()
    return probes, {os.path.basename(c.path): (c.state, c.reason, c.format, c.kind, c.ranks) for c in walker.found}


def test_a_warm_listing_reuses_probes_and_sees_every_change(root, monkeypatch):
    cold, first = _walk(root)
    assert cold.hits == 0 and os.path.isfile(cold.path)
    warm, again = _walk(root)
    assert warm.hits == 3 and again == first
    assert first["step_100"][0] == "complete" and first["step_300.pt"][0] == "complete"
    # the same listing as with no cache at all
    with monkeypatch.context() as m:
        m.setenv("SHARDSCOPE_NO_CACHE", "1")
        uncached = scan([root]).to_json()
    assert scan([root]).to_json() == uncached

    # .metadata rewritten in place: same size, a new mtime; then its old mtime put back (only ctime tells)
    meta = root / "exp" / "checkpoints" / "step_100" / ".metadata"
    st = meta.stat()
    with open(meta, "r+b") as f:
        f.write(b"X")
    assert meta.stat().st_size == st.st_size
    proc = run_cli("ls", root, "--json")
    assert proc.returncode == 0, proc.stderr
    states = {os.path.basename(c["path"]): c["state"] for c in json.loads(proc.stdout)["checkpoints"]}
    assert states == {"step_100": "unreadable", "step_200": "complete", "step_300.pt": "complete"}
    with open(meta, "r+b") as f:
        f.write(b"\x80")
    os.utime(meta, ns=(st.st_atime_ns, st.st_mtime_ns))
    after, now = _walk(root)
    assert now["step_100"][0] == "complete" and after.hits == 2  # step_100 probed again, the others reused
    pt = root / "exp" / "step_300.pt"
    pt.write_bytes(b"XX" + bytes(62))  # same size, not a torch file any more
    assert _walk(root)[1]["step_300.pt"][:2] == ("unreadable", "not a torch.save file")


def test_a_damaged_listing_cache_is_ignored_with_one_line_in_the_log(root, caplog):
    # NOTE: the shardscope logger may not propagate (setup_logging ran in this process): listen to it directly
    logger = logging.getLogger("shardscope.backend.library.probe_cache")
    logger.addHandler(caplog.handler)
    try:
        _check_damage(root, caplog)
    finally:
        logger.removeHandler(caplog.handler)


def _check_damage(root: Path, caplog) -> None:
    _, first = _walk(root)
    path = Path(ProbeCache(str(root)).path)
    doc = json.loads(path.read_bytes())
    keys = sorted(doc["probes"])
    doc["probes"][keys[0]][1] = 7  # an index out of range
    doc["probes"][keys[1]] = {"a": 1}  # not an entry
    wrong_entries = json.dumps(doc).encode()
    for damage in (b"", b"{", b"\xff\xfe", b"[]", b'{"version":1}', b"[" * 100_000, b'{"version":1,"root":' +
                   json.dumps(str(root)).encode() + b',"facts":[[1,2,3,4,5,6,7]],"probes":{}}', wrong_entries):
        path.write_bytes(damage)
        caplog.clear()
        probes, again = _walk(root)
        # a set: the record reaches caplog twice when the logger also propagates to the root logger
        ignored = {id(r) for r in caplog.records if "ignoring the listing cache" in r.getMessage()}
        # not a cache: one line, then a cold listing; a cache with wrong entries: those are misses, silently
        assert len(ignored) == (damage != wrong_entries), (damage[:40], caplog.records)
        assert again == first and probes.hits == (1 if damage == wrong_entries else 0)
        assert json.loads(path.read_bytes())["version"] == 1  # rewritten whole
    # the command: one line in the log, the listing as ever, nothing on the terminal
    path.write_bytes(b"\0garbage")
    log = Path(os.environ["SHARDSCOPE_LOG"])
    proc = run_cli("ls", root)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "step_100" in proc.stdout and "3 complete" in proc.stdout
    lines = log.read_text().splitlines()
    assert [x for x in lines if " INFO " not in x] == [x for x in lines if "ignoring the listing cache" in x], lines
    assert len([x for x in lines if "ignoring the listing cache" in x]) == 1
