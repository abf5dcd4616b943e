"""``shardscope watch`` on real checkpoints (copies of the session's dcp.save fixtures, and a real run of the
built-in trainer), in real subprocesses killed with real signals: each complete resumable checkpoint exported once,
verified, with the values of the checkpoint; the keep rules applied only after a verified export; nothing left
half-written by SIGKILL or SIGTERM."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli, wait_for
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.export import plan_export
from shardscope.backend.export.atomic import HOLD_ENV
from shardscope.backend.filenames import TMP_PREFIX, WATCH_STATE
from shardscope.backend.formats import open_checkpoint
from shardscope.backend.library.watch import model_prefixes

pytestmark = pytest.mark.slow

STEPS = [10, 20, 30]


SIDECAR = ".shardscope.json"  # each export's lineage sidecar (tests/test_lineage.py)


def _names(folder) -> list[str]:
    """What a folder holds, its exports' lineage sidecars and manifests left out (tests/test_output_seal.py)."""
    return sorted(p.name for p in folder.iterdir()
                  if not p.name.endswith(SIDECAR) and not p.name.endswith(".shardscope-manifest.json"))


def _age(path: Path, seconds: float = 3600) -> None:
    """Make every file of a tree look ``seconds`` old (nothing in it is being written)."""
    t = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (t, t), follow_symlinks=False)


def _run(root: Path, fixtures, steps=STEPS, writing: int | None = None) -> Path:
    """``root/run/checkpoints/step_N`` for each step (complete, old), and one being written (fresh files)."""
    ck = root / "run" / "checkpoints"
    for s in steps:
        shutil.copytree(fixtures["fsdp2_r2"], ck / f"step_{s:06d}")
    _age(root)
    if writing is not None:
        _fresh(shutil.copytree(fixtures["fsdp2_r2"], ck / f"step_{writing:06d}"))
    return root / "run"


def _fresh(folder: Path) -> None:
    """A save in progress: its data files changed just now (copytree keeps the fixture's times) and no `.metadata`
    yet (DCP writes it last; a folder with its `.metadata` is complete however fresh)."""
    (folder / ".metadata").unlink(missing_ok=True)
    for p in [folder, *folder.rglob("*")]:
        os.utime(p)


def _snapshot(folder: Path) -> dict[str, tuple[int, int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(TMP_PREFIX) or p.name.endswith(".tmp")]


def _assert_equal_values(ckpt_path: Path, export_path: Path, fmt: str = "safetensors") -> None:
    """Every tensor of the export holds the checkpoint's values (both read by the one chunk reader)."""
    src = open_checkpoint(str(ckpt_path))
    only = None if fmt == "safetensors" else model_prefixes(src)
    items = {it.key: it.entry for it in plan_export(src, fmt, only=only).items}
    out = open_checkpoint(str(export_path))
    assert sorted(t.fqn for t in out.tensors) == sorted(items)
    with ChunkReader(src) as a, ChunkReader(out) as b:
        for t in out.tensors:
            x, y = a.read_tensor(items[t.fqn]), b.read_tensor(t)
            assert x.dtype == y.dtype and x.shape == y.shape and (x == y).all(), t.fqn


def _state(exports: Path) -> dict:
    return json.loads((exports / WATCH_STATE).read_text())["exports"]


def _watch(*args: object, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shardscope.app.cli", "watch", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


@pytest.mark.parametrize("fmt, suffix", [("safetensors", ".safetensors"), ("torch", ".pt")])
def test_once_exports_each_complete_checkpoint_then_applies_the_rules(tmp_path, fixtures, fmt, suffix):
    run = _run(tmp_path / "root", fixtures, writing=40)
    writing = _snapshot(run / "checkpoints" / "step_000040")
    proc = run_cli("watch", tmp_path / "root", "--export", fmt, "--once", "--keep-last", "2", "--delete")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exports = run / "exports"
    assert _names(exports) == sorted(
        [WATCH_STATE, *(f"step_{s:06d}{suffix}" for s in STEPS)])
    for s in STEPS:
        assert f"exported {run}/checkpoints/step_{s:06d} -> {exports}/step_{s:06d}{suffix} (verified, 15 tensors" \
            in proc.stdout
        _assert_equal_values(fixtures["fsdp2_r2"], exports / f"step_{s:06d}{suffix}", fmt)
    # keep-last 2 among the complete ones; the one being written is untouched and not exported
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000020", "step_000030", "step_000040"]
    assert f"removed {run}/checkpoints/step_000010 (keep-last 2)" in proc.stdout
    assert f"kept {run}/checkpoints/step_000030: the newest resumable checkpoint of its run; keep-last 2" in proc.stdout
    assert f"waiting: {run}/checkpoints/step_000040 is being written" in proc.stdout
    assert _snapshot(run / "checkpoints" / "step_000040") == writing
    state = _state(exports)
    assert {e["state"] for e in state.values()} == {"done"} and "removed" in state[f"{run}/checkpoints/step_000010"]
    # exports are weights: listed as such, never exported again; a second pass does nothing
    kinds = {c["path"]: c["kind"] for c in json.loads(run_cli("ls", tmp_path / "root", "--json").stdout)["checkpoints"]}
    assert {kinds[str(exports / f"step_{s:06d}{suffix}")] for s in STEPS} == {"weights"}
    before = _snapshot(exports)
    _fresh(run / "checkpoints" / "step_000040")  # still being written (a loaded machine took over 5 s so far)
    again = run_cli("watch", tmp_path / "root", "--export", fmt, "--once", "--keep-last", "2", "--delete")
    assert again.returncode == 0 and "exported" not in again.stdout and "removed" not in again.stdout, again.stdout
    assert _snapshot(exports) == before
    assert not _temporaries(tmp_path)


def test_sigkill_during_an_export_then_restart_exports_each_checkpoint_once(tmp_path, fixtures):
    root = tmp_path / "root"
    run = _run(root, fixtures)
    exports = run / "exports"
    announce = tmp_path / "held"
    first = _watch(root, "--export", "safetensors", "--once", "--keep-last", "1", "--delete",
                   env={HOLD_ENV: f"written:{announce}"})
    try:
        wait_for(lambda: announce.exists() and announce.read_text(), "the first export to be written", timeout=120)
        tmp = Path(announce.read_text())
        assert tmp.exists() and tmp.parent == exports  # written, not yet verified nor renamed
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first.communicate(timeout=60)
    assert tmp.exists() and not list(exports.glob("*.safetensors"))
    assert _state(exports)[f"{run}/checkpoints/step_000010"]["state"] == "exporting"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{s:06d}" for s in STEPS]

    second = run_cli("watch", root, "--export", "safetensors", "--once", "--keep-last", "1", "--delete")
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.count("exported ") == 3
    assert _names(exports) == sorted([WATCH_STATE, *(f"step_{s:06d}.safetensors"
                                                                                for s in STEPS)])
    assert not _temporaries(tmp_path)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000030"]
    for s in STEPS:
        _assert_equal_values(fixtures["fsdp2_r2"], exports / f"step_{s:06d}.safetensors")

    # killed after the rename of an export but before it was recorded: found verified, not written again
    state = json.loads((exports / WATCH_STATE).read_text())
    state["exports"][f"{run}/checkpoints/step_000030"]["state"] = "exporting"
    (exports / WATCH_STATE).write_text(json.dumps(state))
    before = _snapshot(exports / "step_000030.safetensors")
    third = run_cli("watch", root, "--export", "safetensors", "--once", "--keep-last", "1", "--delete")
    assert third.returncode == 0, third.stdout + third.stderr
    assert "(verified before a restart, 15 tensors" in third.stdout and third.stdout.count("exported ") == 1
    assert _snapshot(exports / "step_000030.safetensors") == before
    assert _state(exports)[f"{run}/checkpoints/step_000030"]["state"] == "done"


def test_a_checkpoint_whose_export_failed_is_kept(tmp_path, fixtures):
    root = tmp_path / "root"
    run = _run(root, fixtures)
    (run / "exports").mkdir()
    foreign = run / "exports" / "step_000010.safetensors"
    foreign.write_bytes(b"not written by watch")
    proc = run_cli("watch", root, "--export", "safetensors", "--once", "--keep-last", "1", "--delete")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"FAILED export of {run}/checkpoints/step_000010: {foreign} exists and is not proven its export (this " \
        "watch did not write it)" in proc.stdout
    assert f"kept {run}/checkpoints/step_000010: its export is not verified" in proc.stdout
    assert foreign.read_bytes() == b"not written by watch"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000010", "step_000030"]


def test_a_forged_record_naming_another_file_never_removes_a_checkpoint(tmp_path, fixtures):
    """A stale or forged `exports/.shardscope-watch.json` marking step_000010 done with its export at another file
    (its identity copied from `ls --json`) made `watch --keep-last 1 --delete` remove step_000010, never exported:
    the record's export path was trusted if any file existed there. A record is trusted only when its export is
    the path this watch writes; else the checkpoint is kept and the line says why."""
    root = tmp_path / "root"
    run = _run(root, fixtures)
    exports = run / "exports"
    exports.mkdir()
    elsewhere = tmp_path / "hostname"
    elsewhere.write_text("host\n")
    (exports / "step_000010.safetensors").write_bytes(b"the user's file")  # the export cannot be written now
    ck = f"{run}/checkpoints/step_000010"
    listed = {c["path"]: c for c in json.loads(run_cli("ls", root, "--json").stdout)["checkpoints"]}
    (exports / WATCH_STATE).write_text(json.dumps({"version": 1, "exports": {ck: {
        "identity": {"bytes": listed[ck]["bytes"], "mtime": listed[ck]["mtime"]}, "export": str(elsewhere),
        "state": "done", "format": "safetensors", "step": 10}}}))
    proc = run_cli("watch", root, "--export", "safetensors", "--once", "--keep-last", "1", "--delete")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"kept {ck}: its record names the export {elsewhere}, not {exports}/step_000010.safetensors (the " \
        "export this watch writes)" in proc.stdout
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000010", "step_000030"]
    assert (exports / "step_000010.safetensors").read_bytes() == b"the user's file"


def test_a_record_whose_export_was_made_from_another_checkpoint_never_removes_it(tmp_path, fixtures):
    """The record names the right path, but the file there is another checkpoint's export (step_000020's, its
    sidecar with it): the export does not match, so step_000010 is kept, and the line names what it was made
    from; the checkpoint whose export it is goes by the rules."""
    root = tmp_path / "root"
    run = _run(root, fixtures)
    exports = run / "exports"
    run_cli("watch", root, "--export", "safetensors", "--once", check=True)
    for suffix in ("", SIDECAR):
        shutil.copyfile(exports / f"step_000020.safetensors{suffix}", exports / f"step_000010.safetensors{suffix}")
    proc = run_cli("watch", root, "--export", "safetensors", "--once", "--keep-last", "1", "--delete")
    ck = run / "checkpoints"
    assert f"kept {ck}/step_000010: {exports}/step_000010.safetensors was made from {ck}/step_000020, not from " \
        "this checkpoint" in proc.stdout, proc.stdout
    assert f"removed {ck}/step_000020 (keep-last 1)" in proc.stdout
    assert sorted(p.name for p in ck.iterdir()) == ["step_000010", "step_000030"]


def test_the_newest_readable_checkpoint_stays_when_the_newest_fails_its_crc32(tmp_path, fixtures):
    """The newest checkpoint's bytes rotted (a CRC32 the export's verification refuses): the one before it, whose
    export is verified, is the run's newest readable resumable checkpoint and stays; the older one goes."""
    root = tmp_path / "root"
    run = _run(root, fixtures)
    newest = run / "checkpoints" / "step_000030"
    ckpt = open_checkpoint(str(newest))
    chunk = ckpt.tensor("model.blocks.0.fc1.weight").chunks[0]
    with ChunkReader(ckpt) as reader:
        offset = reader.locate("model.blocks.0.fc1.weight", chunk).data_offset
    data = bytearray((newest / chunk.file).read_bytes())
    data[offset + 10] ^= 0x40
    (newest / chunk.file).write_bytes(bytes(data))
    _age(root)
    proc = run_cli("watch", root, "--export", "safetensors", "--once", "--keep-last", "1", "--delete")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"FAILED export of {newest}" in proc.stdout and "CRC32" in proc.stdout
    assert f"kept {run}/checkpoints/step_000020: the newest resumable checkpoint of its run whose export is " \
        "verified" in proc.stdout
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000020", "step_000030"]


def test_an_export_made_of_this_checkpoint_at_the_watch_path_is_adopted(tmp_path, fixtures):
    """``export`` (the Export dialog's backend, to its default destination RUN/exports/<name>.safetensors) made
    step 10's export before any watch: its lineage sidecar names step 10 as it is, and it holds every tensor, so a
    watch adopts it (no failed pass). A partial export (--only) at step 20's path is not taken for step 20's. The
    removed checkpoint's export is not "source missing" (a watch removed it by its rules), and the plan counts the
    verified exports the record holds."""
    root = tmp_path / "root"
    run = _run(root, fixtures)
    ck, exports = run / "checkpoints", run / "exports"
    exports.mkdir()  # the Export dialog makes it (its default destination's folder)
    made = run_cli("export", ck / "step_000010", exports / "step_000010.safetensors")
    assert made.returncode == 0, made.stderr
    partial = run_cli("export", ck / "step_000020", exports / "step_000020.safetensors", "--only", "model.blocks.0")
    assert partial.returncode == 0, partial.stderr
    proc = run_cli("watch", root, "--export", "safetensors", "--once", "--keep-last", "1", "--delete")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"exported {ck}/step_000010 -> {exports}/step_000010.safetensors (adopted: its lineage names this " \
        "checkpoint, 15 tensors" in proc.stdout
    assert f"FAILED export of {ck}/step_000020: {exports}/step_000020.safetensors exists and is not this watch's " \
        "export of it (it lacks" in proc.stdout
    assert f"removed {ck}/step_000010 (keep-last 1)" in proc.stdout
    assert sorted(p.name for p in ck.iterdir()) == ["step_000020", "step_000030"]
    listed = {c["path"]: c for c in json.loads(run_cli("ls", root, "--json").stdout)["checkpoints"]}
    gone = listed[str(exports / "step_000010.safetensors")]
    assert gone["source_missing"] is False and gone["source_removed_by_watch"] is True, gone
    plan = json.loads(run_cli("watch", root, "--export", "safetensors", "--keep-last", "1", "--dry-run",
                              "--json").stdout)
    assert plan["runs"][0]["verified_exports"] == 2, plan["runs"][0]


def test_a_checkpoint_a_live_run_resumed_from_is_never_removed(tmp_path, fixtures):
    """The live run's own checkpoints are thinned while it runs (not what is written, not the newest); the
    checkpoint it resumed from (config.json's "resume", here in an older run) stays."""
    root = tmp_path / "root"
    old = _run(root, fixtures)
    live = root / "live"
    for s in (40, 50, 60):
        shutil.copytree(fixtures["fsdp2_r2"], live / "checkpoints" / f"step_{s:06d}")
    _age(live)
    _fresh(shutil.copytree(fixtures["fsdp2_r2"], live / "checkpoints" / "step_000070"))  # being written
    keeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (live / "config.json").write_text(json.dumps({"resume": str(old / "checkpoints" / "step_000010")}))
        (live / "status.json").write_text(json.dumps({"state": "running", "pid": keeper.pid}))
        proc = run_cli("watch", root, "--export", "safetensors", "--once", "--keep-last", "1", "--delete")
    finally:
        keeper.kill()
        keeper.wait()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"kept {old}/checkpoints/step_000010: a live run resumed from it ({live})" in proc.stdout
    assert sorted(p.name for p in (old / "checkpoints").iterdir()) == ["step_000010", "step_000030"]
    assert sorted(p.name for p in (live / "checkpoints").iterdir()) == ["step_000060", "step_000070"]
    assert sorted(p.name for p in (live / "exports").glob("*.safetensors")) == [
        "step_000040.safetensors", "step_000050.safetensors", "step_000060.safetensors"]


@pytest.mark.parametrize("when", ["between passes", "during an export"])
def test_sigterm_ends_the_loop_cleanly(tmp_path, fixtures, when):
    root = tmp_path / "root"
    run = _run(root, fixtures)
    exports = run / "exports"
    announce = tmp_path / "held"
    env = {HOLD_ENV: f"written:{announce}"} if when == "during an export" else {}
    proc = _watch(root, "--export", "safetensors", "--interval", "0.2", "--keep-last", "1", "--delete",
                   env=env)
    try:
        if env:
            wait_for(lambda: announce.exists() and announce.read_text(), "an export in flight", timeout=120)
        else:
            wait_for(lambda: len(list(exports.glob("*.safetensors"))) == 3 and "removed" in
                     (exports / WATCH_STATE).read_text(), "three exports and a removal", timeout=120)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out + err
    assert "stopped by SIGTERM; every export is whole or absent" in out
    assert not _temporaries(tmp_path)
    if env:
        assert f"cancelled: the export of {run}/checkpoints/step_000010" in out
        assert not list(exports.glob("*.safetensors"))
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{s:06d}" for s in STEPS]
    else:
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000030"]


def test_watch_over_a_live_run_killed_and_restarted(tmp_path):
    """A real run of the built-in trainer (torchrun, 2 gloo ranks, a DCP checkpoint every 10 steps) watched while it
    trains; the watch is SIGKILLed once its first export is recorded, started again after the run: one verified
    export per checkpoint, only the kept checkpoints, nothing temporary."""
    from shardscope.backend.library.names import WRITING_SECONDS

    run = tmp_path / "runs" / "live"
    small = ["--strategy", "ddp", "--nproc", "2", "--width", "32", "--depth", "1", "--heads", "2", "--seq-len", "16",
             "--batch-size", "2"]
    started = run_cli("train", "--detach", *small, "--steps", "40", "--checkpoint-every", "10", "--run-dir", run)
    assert started.returncode == 0, started.stdout + started.stderr
    exports = run / "exports"
    watch = _watch(tmp_path / "runs", "--export", "safetensors", "--interval", "0.5", "--keep-last", "2", "--delete")
    try:
        wait_for(lambda: (exports / WATCH_STATE).exists() and "done" in {
            e["state"] for e in _state(exports).values()}, "the first export", timeout=400)
        watch.send_signal(signal.SIGKILL)
    finally:
        watch.kill()
        out, _ = watch.communicate(timeout=60)
    assert "exported " in out, out
    follow = run_cli("follow", run, timeout=600)
    assert follow.returncode == 0 and "run finished" in follow.stdout, follow.stdout + follow.stderr
    time.sleep(WRITING_SECONDS + 1)  # the last save's files are no longer fresh
    again = run_cli("watch", tmp_path / "runs", "--export", "safetensors", "--once", "--keep-last", "2", "--delete")
    assert again.returncode == 0, again.stdout + again.stderr
    names = [f"step_{s:06d}" for s in (10, 20, 30, 40)]
    assert _names(exports) == sorted([WATCH_STATE, *(f"{n}.safetensors" for n in names)])
    state = _state(exports)
    assert {Path(k).name: e["state"] for k, e in state.items()} == dict.fromkeys(names, "done")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == names[2:]
    assert not _temporaries(tmp_path)
    for n in names[2:]:
        _assert_equal_values(run / "checkpoints" / n, exports / f"{n}.safetensors")


def _tree(root: Path) -> dict[str, tuple[bool, int, int]]:
    """Every path under ``root`` (folders too): (is a folder, size, mtime in ns)."""
    return {str(p.relative_to(root)): (p.is_dir(), p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def _acted(stdout: str) -> tuple[set[tuple[str, str]], set[str], set[str]]:
    """What a pass's log says it did: (checkpoint, export) exported, checkpoints removed, ``kept`` lines."""
    exported = set(re.findall(r" exported (\S+) -> (\S+) \(", stdout))
    removed = set(re.findall(r" removed (\S+) \(", stdout))
    kept = {line.split(" ", 3)[3] for line in stdout.splitlines() if line.split(" ")[2:3] == ["kept"]}
    return exported, removed, kept


def test_the_plan_is_what_once_then_does(tmp_path, fixtures):
    """``plan_watch`` (what --dry-run prints and the Library shows) takes the decisions a pass takes: what it says
    is exported, removed and kept (and why) is what ``watch --once`` then does, and says, on the same run."""
    from shardscope.backend.library import Rules
    from shardscope.backend.library.watch import VERIFIED, WAITING, plan_watch

    root = tmp_path / "root"
    run = _run(root, fixtures, steps=[10, 20])
    first = run_cli("watch", root, "--export", "safetensors", "--once")  # exports 10 and 20; no rules
    assert first.returncode == 0, first.stdout + first.stderr
    for s in (30, 40, 50):
        _age(shutil.copytree(fixtures["fsdp2_r2"], run / "checkpoints" / f"step_{s:06d}"))
    _fresh(shutil.copytree(fixtures["fsdp2_r2"], run / "checkpoints" / "step_000060"))  # being written
    rules = ["--keep-last", "2", "--keep-every", "20"]
    plan = plan_watch([str(root)], "safetensors", Rules(keep_last=2, keep_every=20))
    (rp,) = plan.runs
    ck = f"{run}/checkpoints"
    assert {s.checkpoint.name: s.action for s in rp.exports} == {
        "step_000010": VERIFIED, "step_000020": VERIFIED, "step_000030": "export", "step_000040": "export",
        "step_000050": "export", "step_000060": WAITING}
    assert rp.exports[0].record["state"] == "done"  # what a watch did, from its record
    assert {d.checkpoint.name for d in plan.to_remove} == {"step_000010", "step_000030"}
    assert "  remove " + f"{ck}/step_000010 after its export is verified: no rule keeps it" in plan.lines()

    _fresh(run / "checkpoints" / "step_000060")  # still being written (a loaded machine may have passed 5 s)
    proc = run_cli("watch", root, "--export", "safetensors", "--once", *rules, "--delete")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exported, removed, kept = _acted(proc.stdout)
    assert exported == {(s.checkpoint.path, s.export) for s in plan.to_export}
    assert removed == {d.checkpoint.path for d in plan.to_remove}
    assert kept == {f"{d.checkpoint.path}: {'; '.join(d.reasons)}" for r in plan.runs for d in r.decisions
                    if not d.remove}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_000020", "step_000040", "step_000050", "step_000060"]
    # what it did, as the next plan shows it: every export verified, the removed ones in the record
    after = plan_watch([str(root)], "safetensors", Rules(keep_last=2, keep_every=20)).runs[0]
    assert {s.checkpoint.name: s.action for s in after.exports if s.checkpoint.name != "step_000060"} == dict.fromkeys(
        ["step_000020", "step_000040", "step_000050"], VERIFIED)
    assert sorted(after.removed) == [f"{ck}/step_000010", f"{ck}/step_000030"]
    assert all(e["state"] == "done" and e["removed"] > 0 for e in after.removed.values())


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, fixtures):
    root = tmp_path / "root"
    run = _run(root, fixtures, writing=40)
    exports = run / "exports"
    exports.mkdir()
    # what a pass would clean up or finish is left as it is by a plan
    (exports / f".{WATCH_STATE}.abc123.tmp").write_text("{")
    (exports / f"{TMP_PREFIX}999999-x.safetensors").write_bytes(b"half")
    hidden = run / "checkpoints" / ".shardscope-prune-delete-step_000005"
    shutil.copytree(fixtures["fsdp2_r2"], hidden)
    _age(root)
    _fresh(run / "checkpoints" / "step_000040")
    before = _tree(tmp_path)
    proc = run_cli("watch", root, "--export", "torch", "--keep-last", "1", "--delete", "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _tree(tmp_path) == before
    ck = f"{run}/checkpoints"
    for s in STEPS:
        assert f"  export {ck}/step_{s:06d} -> {exports}/step_{s:06d}.pt" in proc.stdout
    assert f"  wait: {ck}/step_000040 is being written" in proc.stdout
    # a folder of a prune's name that no record of a Shardscope prune names: kept and named, never finished
    assert f"  kept {ck}/.shardscope-prune-delete-step_000005: no record of a Shardscope prune names it" \
        in proc.stdout and "finish an interrupted removal" not in proc.stdout
    assert f"  remove {ck}/step_000010 after its export is verified: no rule keeps it" in proc.stdout
    assert f"  keep {ck}/step_000030: the newest resumable checkpoint of its run; keep-last 1" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "plan: export 3 checkpoints to torch, remove 2 checkpoints, rules: " \
        "keep-last 1"
    as_json = run_cli("watch", root, "--export", "torch", "--keep-last", "1", "--dry-run", "--json")
    assert as_json.returncode == 0 and _tree(tmp_path) == before
    got = json.loads(as_json.stdout)
    assert (got["export"], got["remove"], got["acted"]) == (3, 2, False)
    bad = run_cli("watch", root, "--export", "torch", "--once", "--json")
    assert bad.returncode == 2 and bad.stderr == "shardscope: watch: --json prints the plan of --dry-run; give " \
        "both.\n" and _tree(tmp_path) == before


def _cli_env(*args: object, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardscope.app.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


def test_watch_on_s3_only_plans_and_ls_reads_the_exports_lineage(tmp_path, fixtures):
    """A real S3 API server (moto): a run folder watched locally, then uploaded. ``ls --json`` gives its exports'
    kind, step and source (the sidecars read in one batch after the one listing); ``watch`` there lists, prints the
    plan, writes and deletes nothing, and exits 2 with one line saying it only plans on URLs (``--dry-run``: 0)."""
    import s3fs
    from s3_server import S3Server

    root = tmp_path / "root"
    run = _run(root, fixtures, steps=[10, 20])
    assert run_cli("watch", root, "--export", "safetensors", "--once").returncode == 0
    shutil.copytree(fixtures["fsdp2_r2"], run / "checkpoints" / "step_000030")  # not exported yet
    server = S3Server()
    try:
        fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": server.endpoint})
        fs.mkdir("lib")
        fs.put(f"{run}/", "lib/runs/run/", recursive=True)
        url = "s3://lib/runs/run"
        deadline = time.monotonic() + 120
        while True:  # objects uploaded seconds ago read as being written; wait until they settle
            server.reset()
            proc = _cli_env("ls", "s3://lib/runs", "--json", env=server.env())
            assert proc.returncode == 0, proc.stderr
            got = {c["path"]: c for c in json.loads(proc.stdout)["checkpoints"]}
            if all(c["state"] != "writing" for c in got.values()) or time.monotonic() > deadline:
                break
        for s in (10, 20):
            export = got[f"{url}/exports/step_{s:06d}.safetensors"]
            assert (export["kind"], export["step"], export["source"], export["source_step"]) == \
                ("weights", s, f"{run}/checkpoints/step_{s:06d}", s)
            assert export["source_changed"] is False and export["source_missing"] is False  # not compared there
        # one listing, a status.json per run (none here), one GET per sidecar (two), nothing else
        assert server.requests() == {"GET": 3}, server.requests()

        before = {k: v["ETag"] for k, v in fs.find("lib", detail=True).items()}
        server.reset()
        proc = _cli_env("watch", "s3://lib/runs", "--export", "safetensors", "--keep-last", "1", "--once",
                        env=server.env())
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.strip().splitlines() == [
            "shardscope: s3://lib/runs: watch acts on local (or mounted network) folders only: on URLs it only "
            "plans (object stores have no atomic rename); nothing was exported or removed (the plan above; "
            "--dry-run shows it and exits 0)."]
        ck, ex = f"{url}/checkpoints", f"{url}/exports"
        for s in (10, 20):
            assert f"  not exported {ck}/step_0000{s}: {ex}/step_0000{s}.safetensors exists (on a URL the watch's " \
                "record is not read)" in proc.stdout
        assert f"  export {ck}/step_000030 -> {ex}/step_000030.safetensors" in proc.stdout
        assert f"  remove {ck}/step_000020 after its export is verified" not in proc.stdout  # its export unverified
        assert f"  keep {ck}/step_000020: its export is not verified" in proc.stdout
        assert f"  remove {ck}/step_000010" not in proc.stdout
        assert set(server.requests()) == {"GET"}, server.requests()  # no PUT, POST nor DELETE
        dry = _cli_env("watch", "s3://lib/runs", "--export", "safetensors", "--keep-last", "1", "--dry-run",
                       env=server.env())
        assert dry.returncode == 0 and dry.stderr == "" and dry.stdout == proc.stdout, dry.stderr
        assert set(server.requests()) == {"GET"}
        assert {k: v["ETag"] for k, v in fs.find("lib", detail=True).items()} == before
    finally:
        server.stop()


def test_a_damaged_checkpoint_is_never_the_newest_resumable_one(tmp_path, fixtures):
    """Sealed checkpoints; the newest holds a file its manifest does not list (ls: damaged). Its values export
    fine, yet it is not the run's newest resumable state: the rules keep it (damaged) and the one before it, and
    the exports carry the manifests of what they wrote."""
    root = tmp_path / "root"
    run = _run(root, fixtures)
    for s in STEPS:
        assert run_cli("seal", run / "checkpoints" / f"step_{s:06d}").returncode == 0
    (run / "checkpoints" / "step_000030" / "stray.bin").write_bytes(b"not sealed")
    _age(root)
    proc = run_cli("watch", root, "--export", "safetensors", "--once", "--keep-last", "1", "--delete")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000020", "step_000030"], proc.stdout
    assert "damaged" in proc.stdout
    assert len(list(root.rglob("*.safetensors.shardscope-manifest.json"))) == len(STEPS)


def test_watch_exports_a_hugging_face_model_of_each_checkpoint_as_the_cli_does(tmp_path):
    """``watch --export hf --config``: each complete checkpoint becomes RUN/exports/<name>-hf, the folder
    ``export --hf`` writes (weights and config.json byte for byte), verified, so the keep rules may remove the
    checkpoint; a second pass finds the folders verified. ``--config`` belongs to ``--export hf`` only, and a
    checkpoint that records no HF config fails with the export's one line and is kept."""
    from titan_names import same_model_folder, write, write_config

    root = tmp_path / "root"
    ck, exports = root / "run" / "checkpoints", root / "run" / "exports"
    for s in (10, 20):
        write(ck / f"step_{s:06d}", seed=s)
    _age(root)
    config = write_config(tmp_path / "config.json")
    plan = run_cli("watch", root, "--export", "hf", "--config", config, "--dry-run", "--json")
    assert plan.returncode == 0, plan.stderr
    assert [s["export"] for s in json.loads(plan.stdout)["runs"][0]["exports"]] == \
        [str(exports / "step_000010-hf"), str(exports / "step_000020-hf")], plan.stdout
    bare = run_cli("watch", root, "--export", "hf", "--once")
    assert bare.returncode == 1 and "records no Hugging Face config" in bare.stdout and not list(exports.glob("*-hf"))
    names = ["step_000010", "step_000020"]
    for name in names:  # what the CLI writes (step 10's checkpoint is removed below)
        run_cli("export", ck / name, tmp_path / name, "--hf", "--config", config, check=True)
    proc = run_cli("watch", root, "--export", "hf", "--config", config, "--once", "--keep-last", "1", "--delete")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"exported {ck}/step_000020 -> {exports}/step_000020-hf (verified, 21 tensors" in proc.stdout
    assert sorted(p.name for p in ck.iterdir()) == ["step_000020"]  # step 10 removed once its export was verified
    for name in names:
        same_model_folder(exports / f"{name}-hf", tmp_path / name)
    again = run_cli("watch", root, "--export", "hf", "--config", config, "--once")
    assert again.returncode == 0 and "exported" not in again.stdout, again.stdout
    other = run_cli("watch", root, "--export", "safetensors", "--config", config, "--once")
    assert other.returncode == 2 and "--config is the Hugging Face config of --export hf" in other.stderr
