"""The checkpoint library: `shardscope ls` and `shardscope prune` on real trees.

The tree holds a real run of the built-in trainer (torchrun, FSDP2 on gloo, several checkpoints and
metrics), a Lightning-style run (a DCP folder with meta.pt, a torch.save .ckpt file and CSVLogger
metrics), HF Trainer-style checkpoint-N folders, consolidated files (one truncated), an incomplete save
and a run that is running (live process) with a save in progress."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from safetensors.torch import save_file
from shardscope.backend.library import Rules, execute, make_plan, scan
from shardscope.backend.library.names import step_from_name
from shardscope.backend.library.prune import PAUSE_ENV
from shardscope.backend.library.prune_record import PRUNE_PREFIX
from shardscope.backend.runs.launcher import RunConfig, RunLauncher

pytestmark = pytest.mark.slow

SMALL = {"width": 32, "depth": 2, "heads": 2, "seq_len": 32, "batch_size": 4}
RUN_STEPS = [5, 10, 15, 20]


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A real run of the built-in trainer: 20 steps, a DCP checkpoint every 5, per-rank metrics."""
    run_dir = tmp_path_factory.mktemp("library_run") / "run-real"
    cfg = RunConfig(strategy="fsdp", nproc=2, steps=20, checkpoint_every=5, model=dict(SMALL, lr=1e-2))
    status = RunLauncher(run_dir, cfg).start().wait(600)
    assert status["state"] == "finished", (run_dir / "logs" / "launcher.log").read_text()
    return run_dir


@pytest.fixture(scope="session")
def live_process():
    """A process that stays alive: the pid a "running" run's status.json names."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    yield proc
    proc.kill()
    proc.wait()


def _age(path: Path, seconds: float = 3600) -> None:
    """Make every file of a tree look ``seconds`` old (nothing in it is being written)."""
    t = time.time() - seconds
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (t, t), follow_symlinks=False)


def _without_metadata(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / ".metadata").unlink()
    return dst


def _hf_trainer(folder: Path, step: int, loss: float) -> None:
    folder.mkdir(parents=True)
    save_file({"w": torch.full((8, 4), float(step))}, str(folder / "model.safetensors"))
    torch.save({"state": {}, "param_groups": []}, folder / "optimizer.pt")
    history = [{"step": s, "loss": loss + (step - s) / 1000} for s in range(100, step + 1, 100)]
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))


def build_tree(root: Path, fixtures: dict[str, Path], trained_run: Path, pid: int) -> Path:
    """Every kind of checkpoint the library must find, under ``root``."""
    runs = root / "runs"
    shutil.copytree(trained_run, runs / "run-real")
    # Lightning: version_0/checkpoints/ with a sharded (DCP + meta.pt) folder and a torch.save file
    lv = root / "lightning_logs" / "version_0"
    shutil.copytree(fixtures["lightning_r2"], lv / "checkpoints" / "epoch=1-step=20.ckpt")
    torch.save({"state_dict": {"w": torch.ones(3)}, "global_step": 10}, lv / "checkpoints" / "epoch=0-step=10.ckpt")
    (lv / "metrics.csv").write_text("epoch,step,train_loss,val_loss\n0,10,2.5,2.0\n0,10,,1.9\n1,20,2.1,\n1,20,,2.2\n")
    # HF Trainer output_dir
    _hf_trainer(root / "hf_out" / "checkpoint-500", 500, 1.5)
    _hf_trainer(root / "hf_out" / "checkpoint-1000", 1000, 1.2)
    # consolidated files; one truncated the way a killed torch.save leaves it
    ex = root / "exports"
    ex.mkdir()
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(ex / "model_step_300.safetensors"))
    torch.save({"w": torch.arange(64)}, ex / "model.pt")
    data = (ex / "model.pt").read_bytes()
    (ex / "broken.pt").write_bytes(data[: len(data) // 2])
    # an incomplete save next to a complete one: data files, no .metadata, a .metadata.tmp left
    other = root / "other"
    shutil.copytree(fixtures["fsdp2_r2"], other / "step_000100")
    bad = _without_metadata(fixtures["fsdp2_r2"], other / "step_000200")
    (bad / ".metadata.tmp").write_bytes(b"\x80partial")
    _age(root)
    # a run that is running (live pid), with a save in progress (no .metadata yet, files still fresh)
    live = runs / "run-live"
    (live / "checkpoints").mkdir(parents=True)
    (live / "config.json").write_text(json.dumps({"strategy": "fsdp", "nproc": 2}))
    (live / "status.json").write_text(json.dumps({"state": "running", "pid": pid, "start_time": time.time()}))
    shutil.copytree(fixtures["fsdp2_r2"], live / "checkpoints" / "step_000010")
    _age(live / "checkpoints" / "step_000010")
    _without_metadata(fixtures["fsdp2_r2"], live / "checkpoints" / "step_000020")
    return root


@pytest.fixture
def tree(tmp_path, fixtures, trained_run, live_process) -> Path:
    return build_tree(tmp_path.resolve() / "tree", fixtures, trained_run, live_process.pid)


def _ls(root: Path) -> dict:
    proc = run_cli("ls", root, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _by_rel(listing: dict, root: Path) -> dict[str, dict]:
    return {os.path.relpath(c["path"], root): c for c in listing["checkpoints"]}


@pytest.mark.parametrize("name, step", [
    ("step_000100", 100), ("step-100", 100), ("global_step100", 100), ("checkpoint-500", 500),
    ("epoch=3-step=12000.ckpt", 12000), ("iter_0000100", 100), ("model_step_300.safetensors", 300), ("250", 250),
    ("model.pt", None), ("epoch=3.ckpt", None), ("best", None)])
def test_step_from_the_name(name, step):
    assert step_from_name(name) == step


def test_ls_finds_every_kind(tree):
    listing = _ls(tree)
    assert set(listing) == {"roots", "runs", "checkpoints"}
    assert listing["roots"] == [str(tree.resolve())]
    got = _by_rel(listing, tree)
    for c in got.values():
        assert set(c) == {"path", "run", "step", "format", "kind", "ranks", "bytes", "mtime", "state", "pinned",
                          "seal"}
    expect = {  # path: (run, step, format, ranks, state)
        **{f"runs/run-real/checkpoints/step_{s:06d}": ("runs/run-real", s, "dcp", [0, 1], "complete")
           for s in RUN_STEPS},
        "lightning_logs/version_0/checkpoints/epoch=1-step=20.ckpt": ("lightning_logs/version_0", 20, "lightning",
                                                                      [0, 1], "complete"),
        "lightning_logs/version_0/checkpoints/epoch=0-step=10.ckpt": ("lightning_logs/version_0", 10, "torch", [],
                                                                      "complete"),
        "hf_out/checkpoint-500": ("hf_out", 500, "hf-trainer", [], "complete"),
        "hf_out/checkpoint-1000": ("hf_out", 1000, "hf-trainer", [], "complete"),
        "exports/model_step_300.safetensors": ("exports", 300, "safetensors", [], "complete"),
        "exports/model.pt": ("exports", None, "torch", [], "complete"),
        "exports/broken.pt": ("exports", None, "torch", [], "incomplete"),
        "other/step_000100": ("other", 100, "dcp", [0, 1], "complete"),
        "other/step_000200": ("other", 200, "dcp", [0, 1], "incomplete"),
        "runs/run-live/checkpoints/step_000010": ("runs/run-live", 10, "dcp", [0, 1], "complete"),
        "runs/run-live/checkpoints/step_000020": ("runs/run-live", 20, "dcp", [0, 1], "writing"),
    }
    assert set(got) == set(expect)
    for rel, (run, step, fmt, ranks, state) in expect.items():
        c = got[rel]
        assert (os.path.relpath(c["run"], tree), c["step"], c["format"], c["ranks"], c["state"]) == \
            (run, step, fmt, ranks, state), rel
    # bytes on disk from stat (st_blocks), the folder's files summed
    ck = tree / "runs/run-real/checkpoints/step_000020"
    assert got[str(ck.relative_to(tree))]["bytes"] == sum(p.stat().st_blocks * 512 for p in ck.iterdir())
    assert got[str(ck.relative_to(tree))]["mtime"] == pytest.approx(max(p.stat().st_mtime for p in [ck, *ck.iterdir()]))
    runs = {os.path.relpath(r["path"], tree): r for r in listing["runs"]}
    assert set(runs["runs/run-real"]) == {"path", "name", "bytes", "checkpoints"}
    assert runs["runs/run-real"]["name"] == "run-real"
    assert runs["runs/run-real"]["checkpoints"] == [str(tree.resolve() / f"runs/run-real/checkpoints/step_{s:06d}")
                                                    for s in RUN_STEPS]
    assert runs["runs/run-real"]["bytes"] == sum(got[f"runs/run-real/checkpoints/step_{s:06d}"]["bytes"]
                                                 for s in RUN_STEPS)


def test_ls_table_ends_with_totals_and_missing_root_exits_2(tree):
    proc = run_cli("ls", tree)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("total: 15 checkpoints in 6 runs")
    assert "12 complete, 2 incomplete, 1 writing, 0 unreadable" in lines[-1]
    assert any("step_000020" in line and "writing" in line for line in lines)
    proc = run_cli("ls", tree, tree / "nope")
    assert proc.returncode == 2 and "nope: no such file or folder" in proc.stderr and not proc.stdout


def test_ls_never_follows_symlinks_nor_descends_into_checkpoints(tmp_path, fixtures):
    root, outside = tmp_path / "root", tmp_path / "outside"
    shutil.copytree(fixtures["fsdp2_r2"], outside / "step_000001")
    shutil.copytree(fixtures["steps_r2"], root / "run")
    (root / "linked").symlink_to(outside)  # a link out of the root
    (root / "run" / "latest").symlink_to(root / "run" / "step3")  # a link inside it
    nested = root / "run" / "step3" / "sub" / "step_000009"  # inside a checkpoint: not a checkpoint of its own
    shutil.copytree(fixtures["fsdp2_r2"], nested)
    listing = scan([root])
    assert sorted(c.name for c in listing.checkpoints) == ["step2", "step3"]


def _plan(tree: Path, **rules) -> dict[str, tuple[str, list[str]]]:
    plan = make_plan(scan([tree]), Rules(**rules))
    return {os.path.relpath(d.checkpoint.path, tree): (d.action, d.reasons) for d in plan.decisions}


def _removed(plan: dict) -> set[str]:
    return {p for p, (action, _r) in plan.items() if action == "remove"}


REAL = "runs/run-real/checkpoints/step_{:06d}"


def test_plan_of_each_rule(tree, trained_run):
    real = {REAL.format(s) for s in RUN_STEPS}
    last2 = _plan(tree, keep_last=2)
    assert _removed(last2) & real == {REAL.format(5), REAL.format(10)}
    assert "keep-last 2" in last2[REAL.format(15)][1]
    # the newest resumable checkpoint of each run is never removed, whatever the rules
    assert "the newest resumable checkpoint of its run" in last2[REAL.format(20)][1]
    assert last2["hf_out/checkpoint-500"] == ("keep", ["keep-last 2"])
    last1 = _plan(tree, keep_last=1)
    assert last1["hf_out/checkpoint-500"] == ("remove", ["no rule keeps it"])
    assert _removed(last1) & real == real - {REAL.format(20)}
    every10 = _plan(tree, keep_every=10)
    assert _removed(every10) & real == {REAL.format(5), REAL.format(15)}
    assert "keep-every 10" in every10[REAL.format(10)][1]
    # keep-best: the mean over ranks of the loss at the checkpoint's step, from metrics/rank_N.jsonl
    recs = [[json.loads(line) for line in (trained_run / "metrics" / f"rank_{r}.jsonl").read_text().splitlines()]
            for r in (0, 1)]
    mean = {s: sum(next(x["loss"] for x in rank if x["step"] == s) for rank in recs) / 2 for s in RUN_STEPS}
    best = min(RUN_STEPS, key=mean.__getitem__)
    plan = _plan(tree, keep_best="loss", mode="min", top=1)
    assert _removed(plan) & real == {REAL.format(s) for s in RUN_STEPS if s not in (best, 20)}
    assert any(r.startswith("keep-best loss (min, top 1)") for r in plan[REAL.format(best)][1])
    worst = max(RUN_STEPS, key=mean.__getitem__)
    plan = _plan(tree, keep_best="loss", mode="max", top=1)
    assert any(r.startswith("keep-best") for r in plan[REAL.format(worst)][1])
    # Lightning's CSVLogger metrics.csv; HF Trainer's trainer_state.json log_history
    plan = _plan(tree, keep_best="val_loss", mode="min")
    assert plan["lightning_logs/version_0/checkpoints/epoch=0-step=10.ckpt"][0] == "keep"  # 1.9 < 2.2
    plan = _plan(tree, keep_best="loss", mode="max")
    assert plan["hf_out/checkpoint-500"][0] == "keep" and "keep-best" in plan["hf_out/checkpoint-500"][1][0]
    globbed = _plan(tree, keep=("step_00001*",))
    assert _removed(globbed) & real == {REAL.format(5)}
    assert "keep step_00001*" in globbed[REAL.format(15)][1]
    young = _plan(tree, min_age=10 * 86400)  # everything is younger than ten days
    assert not _removed(young)
    # incomplete saves go only with --incomplete; the one being written never
    assert "other/step_000200" not in _removed(_plan(tree, keep_last=1))
    inc = _plan(tree, incomplete=True)
    assert _removed(inc) == {"other/step_000200", "exports/broken.pt"}
    assert inc["runs/run-live/checkpoints/step_000020"][0] == "keep"


def _dcp_steps(folder: Path, fixtures, steps: list[int], name: str = "step_{:06d}") -> None:
    for s in steps:
        shutil.copytree(fixtures["fsdp2_r2"], folder / name.format(s))


def test_prune_counts_weights_files_apart_and_keeps_the_newest_resumable(tmp_path, fixtures):
    """An export next to a run's DCP checkpoints (the Export dialog's old default, RUN/checkpoints/) once took the
    newest slot: --keep-last 1 kept the 460 KiB export and trashed the only resumable state, step 30."""
    root = tmp_path / "root"
    ck = root / "run" / "checkpoints"
    _dcp_steps(ck, fixtures, [10, 20, 30])
    save_file({"w": torch.ones(4)}, str(ck / "step_000030.safetensors"))
    plain = root / "plain" / "ckpts"  # a plain script: step folders and a reference .pt beside them
    _dcp_steps(plain, fixtures, [10, 20], "step_{}")
    torch.save({"w": torch.ones(4)}, plain / "step_20_reference.pt")
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    torch.save({"model": {"w": torch.ones(2)}, "optimizer": opt.state_dict()}, plain / "step_5_full.pt")
    _age(root)
    kinds = {os.path.relpath(c["path"], root): c["kind"] for c in _ls(root)["checkpoints"]}
    assert kinds == {"run/checkpoints/step_000010": "resumable", "run/checkpoints/step_000020": "resumable",
                     "run/checkpoints/step_000030": "resumable", "run/checkpoints/step_000030.safetensors": "weights",
                     "plain/ckpts/step_10": "resumable", "plain/ckpts/step_20": "resumable",
                     "plain/ckpts/step_20_reference.pt": "weights", "plain/ckpts/step_5_full.pt": "resumable"}
    last1 = _plan(root, keep_last=1)
    assert _removed(last1) == {"run/checkpoints/step_000010", "run/checkpoints/step_000020", "plain/ckpts/step_10",
                               "plain/ckpts/step_5_full.pt"}
    assert "the newest resumable checkpoint of its run" in last1["run/checkpoints/step_000030"][1]
    assert last1["run/checkpoints/step_000030.safetensors"] == (
        "keep", ["weights file (an export): removed only when the rules apply to weights files"])
    last2 = _plan(root, keep_last=2)
    assert _removed(last2) == {"run/checkpoints/step_000010", "plain/ckpts/step_5_full.pt"}
    # with --weights the rules count weights files among themselves; the resumable ones as before
    save_file({"w": torch.ones(4)}, str(ck / "step_000020.safetensors"))
    _age(ck / "step_000020.safetensors")
    weights = _plan(root, keep_last=1, weights=True)
    assert _removed(weights) == _removed(last1) | {"run/checkpoints/step_000020.safetensors"}
    assert weights["run/checkpoints/step_000030.safetensors"] == ("keep", ["keep-last 1 weights files"])
    proc = run_cli("prune", root, "--keep-last", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    assert {os.path.relpath(c["path"], root): c["kind"] for c in json.loads(proc.stdout)["checkpoints"]
            if c["action"] == "keep"}["run/checkpoints/step_000030.safetensors"] == "weights"
    text = run_cli("prune", root, "--keep-last", "1", "--weights", "--yes", "--delete")
    assert text.returncode == 0, text.stderr
    assert sorted(p.name for p in ck.iterdir()) == ["step_000030", "step_000030.safetensors"]


def test_plan_cli_json_and_no_rule_is_an_error(tree):
    proc = run_cli("prune", tree, "--keep-last", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["acted"] is False
    removed = {os.path.relpath(c["path"], tree) for c in plan["checkpoints"] if c["action"] == "remove"}
    assert removed == _removed(_plan(tree, keep_last=1))
    assert plan["bytes_freed"] == sum(c["bytes"] for c in plan["checkpoints"] if c["action"] == "remove")
    assert all((tree / p).exists() for p in removed)  # only a plan
    text = run_cli("prune", tree, "--keep-last", "1")
    assert "REMOVE" in text.stdout and "run again with --yes" in text.stdout
    assert "the newest resumable checkpoint of its run" in text.stdout
    proc = run_cli("prune", tree)
    assert proc.returncode == 2 and "give at least one rule" in proc.stderr


def _trash_env(tmp_path: Path) -> dict[str, str]:
    return {"XDG_DATA_HOME": str(tmp_path / "xdg")}


def _cli_env(*args, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardscope.app.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


def _snapshot(root: Path) -> dict[str, tuple[int, ...]]:
    """Every checkpoint's files and sizes (to prove what survived is whole)."""
    out = {}
    for c in scan([root]).checkpoints:
        p = Path(c.path)
        files = sorted(p.rglob("*")) if p.is_dir() else [p]
        out[os.path.relpath(c.path, root)] = tuple((str(f.relative_to(p)) if p.is_dir() else "", f.stat().st_size)
                                                   for f in files if f.is_file())
    return out


@pytest.mark.parametrize("delete", [False, True])
def test_yes_removes_exactly_the_plan(tree, tmp_path, delete):
    before = _snapshot(tree)
    planned = _removed(_plan(tree, keep_last=2, keep_every=10, incomplete=True))
    assert planned == {REAL.format(5), "exports/broken.pt", "other/step_000200"}
    args = ["prune", tree, "--keep-last", "2", "--keep-every", "10", "--incomplete", "--yes", "--json"]
    proc = _cli_env(*args, *(["--delete"] if delete else []), env=_trash_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["acted"] and out["result"]["failed"] == 0
    assert {os.path.relpath(o["path"], tree) for o in out["result"]["outcomes"]} == planned
    after = _snapshot(tree)
    assert set(after) == set(before) - planned  # exactly the plan went
    assert all(after[k] == before[k] for k in after)  # and what stayed is untouched
    assert not list(tree.rglob(f"{PRUNE_PREFIX}*"))
    trash = tmp_path / "xdg" / "Trash"
    trashed = sorted(p.name for p in (trash / "files").iterdir()) if (trash / "files").exists() else []
    if delete:
        assert trashed == []
    else:
        # the trash entries keep the checkpoints' own names, so Restore brings back `step_000200`
        assert trashed == sorted(os.path.basename(k) for k in planned)
        restore_paths = {line.split("=", 1)[1] for info in (trash / "info").iterdir()
                         for line in info.read_text().splitlines() if line.startswith("Path=")}
        assert {os.path.basename(urllib.parse.unquote(p)) for p in restore_paths} == set(trashed)
        assert len(list((trash / "info").iterdir())) == len(planned)
        assert sum(p.stat().st_size for p in (trash / "files").rglob("*") if p.is_file()) == \
            sum(size for k in planned for _n, size in before[k])


def test_protected_checkpoints_survive(tree, tmp_path):
    keep_nothing = ["--keep-every", "1000000", "--incomplete"]
    proc = _cli_env("prune", tree, *keep_nothing, "--yes", "--delete", env=_trash_env(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    left = set(_snapshot(tree))
    assert {REAL.format(20),  # the newest complete of its run
            "runs/run-live/checkpoints/step_000010",  # its run is running
            "runs/run-live/checkpoints/step_000020",  # being written
            "other/step_000100", "hf_out/checkpoint-1000", "exports/model_step_300.safetensors",
            "exports/model.pt",  # no step number: no rule can place it in a series
            "lightning_logs/version_0/checkpoints/epoch=1-step=20.ckpt",
            "lightning_logs/version_0/checkpoints/epoch=0-step=10.ckpt",  # weights only: goes only with --weights
            } == left
    assert (tree / "runs/run-real/metrics").is_dir() and (tree / "runs/run-real/config.json").is_file()


def test_a_checkpoint_that_starts_changing_is_skipped(tree, tmp_path):
    plan = make_plan(scan([tree]), Rules(keep_last=3))
    target = tree / REAL.format(5)
    assert target.as_posix() in {d.checkpoint.path for d in plan.remove}
    (target / "__0_0.distcp").touch()  # written again after the plan was made
    result = execute(plan, delete=True)
    assert any(o.path == str(target) and o.result == "skipped" for o in result.outcomes)
    assert (target / ".metadata").exists()



def kill_after_first_rename(proc: subprocess.Popen) -> Path:
    """SIGKILL a prune once it says it renamed something (its test hook pauses it there); where that went."""
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "renamed to" not in line:
            assert time.monotonic() < deadline and proc.poll() is None
            line = proc.stderr.readline()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    return Path(line.split("renamed to", 1)[1].strip())

def test_killed_prune_leaves_no_half_checkpoint(tree, tmp_path):
    before = _snapshot(tree)
    env = {**os.environ, **_trash_env(tmp_path), PAUSE_ENV: "120"}
    proc = subprocess.Popen([sys.executable, "-m", "shardscope.app.cli", "prune", tree, "--keep-last", "1", "--yes",
                             "--delete"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    hidden = kill_after_first_rename(proc)  # the hook pauses right after the first rename
    assert hidden.name.startswith(PRUNE_PREFIX + "delete-") and hidden.exists()
    after = _snapshot(tree)
    gone = set(before) - set(after)
    assert len(gone) == 1 and str(tree / next(iter(gone))) == str(hidden.parent / hidden.name.split("-", 3)[-1])
    assert all(after[k] == before[k] for k in after)  # every other checkpoint is whole
    # the next ls finishes the interrupted prune (it was asked to delete) and says so
    proc = _cli_env("ls", tree, "--json", env=_trash_env(tmp_path))
    assert proc.returncode == 0 and "finished an interrupted prune" in proc.stderr
    assert not hidden.exists() and set(_snapshot(tree)) == set(after)


def test_ls_and_prune_never_remove_a_prune_name_no_prune_record_proves(tmp_path, fixtures):
    """`shardscope ls` (a listing) permanently deleted any folder named `.shardscope-prune-delete-<anything>`
    ("finished an interrupted prune"), and so did prune: nothing recorded that a prune made it. Now an entry of
    that name is finished only when its prune's own record names it and it is still that very file; anything
    else (a user's folder, a record whose file was replaced) is kept and named."""
    root = tmp_path / "r"
    for s in (1, 2):
        shutil.copytree(fixtures["fsdp2_r2"], root / f"step_{s}")
    mine = root / f"{PRUNE_PREFIX}delete-my_stuff"
    mine.mkdir()
    (mine / "data.bin").write_bytes(b"years of work")
    other = root / f"{PRUNE_PREFIX}trash-old.pt"
    other.write_bytes(b"mine too")
    # a record naming the folder, but another file (as a stale record of an earlier prune would be)
    (root / f"{mine.name}.prune-record.json").write_text(json.dumps({
        "schema": "shardscope-prune-record/1", "mode": "delete",
        "moved": [{"from": "my_stuff", "to": mine.name, "dev": 1, "ino": 1}]}))
    _age(root)
    for args in (["ls", root], ["ls", root, "--json"], ["prune", root, "--keep-last", "1"],
                 ["prune", root, "--keep-last", "1", "--yes", "--delete"]):
        proc = _cli_env(*args, env=_trash_env(tmp_path))
        assert proc.returncode == 0, proc.stderr
        said = proc.stdout + proc.stderr
        assert "finished an interrupted prune" not in said, said
        assert f"{mine}: no record of a Shardscope prune names it; kept" in said, said
        assert f"{other}: no record of a Shardscope prune names it; kept" in said, said
        assert (mine / "data.bin").read_bytes() == b"years of work" and other.read_bytes() == b"mine too"
    assert not (root / "step_1").exists() and (root / "step_2").exists()  # the rules were applied


def test_prune_min_age_keeps_young_ones(tmp_path, fixtures):
    root = tmp_path / "r"
    for s in (1, 2, 3):
        shutil.copytree(fixtures["fsdp2_r2"], root / f"step_{s}")
    _age(root / "step_1", 3 * 3600)
    _age(root / "step_2", 600)
    _age(root / "step_3", 60)
    plan = _plan(root, min_age=3600)
    assert plan["step_1"][0] == "remove" and plan["step_2"][0] == "keep"
    assert any(r.startswith("min-age 1h") for r in plan["step_2"][1])
    proc = run_cli("prune", root, "--min-age", "soon")
    assert proc.returncode == 2 and "not an age" in proc.stderr


def test_step_folders_of_parts_are_one_checkpoint(tmp_path, fixtures):
    root = tmp_path.resolve() / "r"
    for tp in (0, 1):  # Megatron-LM's legacy layout: iter_N/mp_rank_NN/model_optim_rng.pt
        part = root / "mega" / "checkpoints" / "iter_0000100" / f"mp_rank_{tp:02d}"
        part.mkdir(parents=True)
        torch.save({"model": {"w": torch.ones(4)}, "iteration": 100}, part / "model_optim_rng.pt")
    (root / "mega" / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("100")
    plain = root / "plain" / "step_200"  # model and optimizer saved side by side
    plain.mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, plain / "model.pt")
    torch.save({"state": {}}, plain / "optim.pt")
    for s in (1, 2):  # a run whose own name holds a step number: its checkpoints stay separate
        shutil.copytree(fixtures["fsdp2_r2"], root / "exp-step-5" / "checkpoints" / f"step_{s}")
    _age(root)
    got = {os.path.relpath(c.path, root): c for c in scan([root]).checkpoints}
    assert sorted(got) == ["exp-step-5/checkpoints/step_1", "exp-step-5/checkpoints/step_2",
                           "mega/checkpoints/iter_0000100", "plain/step_200"]
    mega = got["mega/checkpoints/iter_0000100"]
    assert (mega.format, mega.ranks, mega.step, mega.state, mega.run) == \
        ("megatron", [0, 1], 100, "complete", str(root / "mega"))
    assert mega.bytes == sum(p.stat().st_blocks * 512 for p in (root / "mega/checkpoints/iter_0000100").rglob("*.pt"))
    assert (got["plain/step_200"].format, got["plain/step_200"].files) == ("torch", 2)
    plan = make_plan(scan([root]), Rules(keep_last=1))
    assert [os.path.relpath(d.checkpoint.path, root) for d in plan.remove] == ["exp-step-5/checkpoints/step_1"]


def test_ls_on_s3_lists_and_prune_only_plans(tmp_path, fixtures):
    """A real S3 API server (moto): `ls s3://...` from one listing; prune shows the plan but never acts there."""
    import s3fs
    from s3_server import S3Server

    server = S3Server()
    try:
        fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": server.endpoint})
        fs.mkdir("lib")
        run = "lib/runs/run-x"
        fs.pipe(f"{run}/config.json", b'{"strategy": "fsdp"}')
        fs.pipe(f"{run}/status.json", b'{"state": "finished"}')
        fs.put(f"{fixtures['fsdp2_r2']}/", f"{run}/checkpoints/step_000010/", recursive=True)
        fs.put(f"{fixtures['steps_r2'] / 'step3'}/", f"{run}/checkpoints/step_000020/", recursive=True)
        for name in ("__0_0.distcp", "__1_0.distcp"):  # a save that never wrote its .metadata
            fs.put(str(fixtures["fsdp2_r2"] / name), f"{run}/checkpoints/step_000030/{name}")
        fs.put(str(fixtures["hf_r2"] / "shard-00001-model-00001-of-00001.safetensors"),
               "lib/runs/exports/model_step_300.safetensors")
        base = "s3://lib/runs/run-x/checkpoints/"
        deadline = time.monotonic() + 120
        while True:  # objects uploaded seconds ago read as being written; wait until they settle
            proc = _cli_env("ls", "s3://lib/runs", "--json", env=server.env())
            assert proc.returncode == 0, proc.stderr
            got = {c["path"]: c for c in json.loads(proc.stdout)["checkpoints"]}
            if all(c["state"] != "writing" for c in got.values()) or time.monotonic() > deadline:
                break
        assert sorted(got) == ["s3://lib/runs/exports/model_step_300.safetensors", *(f"{base}step_0000{s}0"
                                                                                    for s in (1, 2, 3))]
        assert [(got[f"{base}step_0000{s}0"]["state"], got[f"{base}step_0000{s}0"]["run"]) for s in (1, 2, 3)] == \
            [("complete", "s3://lib/runs/run-x")] * 2 + [("incomplete", "s3://lib/runs/run-x")]
        assert got[f"{base}step_000010"]["ranks"] == [0, 1]
        assert got[f"{base}step_000010"]["bytes"] == sum(p.stat().st_size for p in fixtures["fsdp2_r2"].iterdir())
        assert got["s3://lib/runs/exports/model_step_300.safetensors"]["step"] == 300
        plan = _cli_env("prune", "s3://lib/runs", "--keep-last", "1", "--incomplete", "--json", env=server.env())
        assert plan.returncode == 0, plan.stderr
        assert {c["path"] for c in json.loads(plan.stdout)["checkpoints"] if c["action"] == "remove"} == \
            {f"{base}step_000010", f"{base}step_000030"}
        acted = _cli_env("prune", "s3://lib/runs", "--keep-last", "1", "--yes", env=server.env())
        assert acted.returncode == 2 and "nothing was removed" in acted.stderr
        assert fs.exists(f"{run}/checkpoints/step_000010/.metadata")
        missing = _cli_env("ls", "s3://lib/nope", env=server.env())
        assert missing.returncode == 2 and "s3://lib/nope" in missing.stderr
    finally:
        server.stop()


def test_s3_listing_walks_as_a_local_disk_does(tmp_path):
    """The remote walk is the local one over another listing: step folders of parts are one checkpoint (it
    listed each part), an entry of a prune's name is found (it was skipped) and kept (no prune record proves it),
    runs are named alike."""
    import s3fs
    from s3_server import S3Server

    root = tmp_path.resolve() / "tree"
    for tp in (0, 1):  # Megatron-LM's legacy layout: iter_N/mp_rank_NN/model_optim_rng.pt
        part = root / "mega" / "checkpoints" / "iter_0000100" / f"mp_rank_{tp:02d}"
        part.mkdir(parents=True)
        torch.save({"model": {"w": torch.ones(4)}}, part / "model_optim_rng.pt")
    plain = root / "plain" / "step_200"  # two parts side by side
    plain.mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, plain / "model.pt")
    torch.save({"b": torch.ones(2)}, plain / "head.pt")
    hidden = root / "plain" / f"{PRUNE_PREFIX}trash-step_100"
    hidden.mkdir()
    torch.save({"w": torch.ones(2)}, hidden / "model.pt")
    _age(root)
    local = scan([root])

    def view(paths: list[tuple[str, str, int | None, str, list[int], str]], base: str) -> list[tuple]:
        return sorted((p[len(base):], run[len(base):], *rest) for p, run, *rest in paths)

    want = view([(c.path, c.run, c.step, c.format, c.ranks, c.state) for c in local.checkpoints], str(root))
    assert [w[0] for w in want] == ["/mega/checkpoints/iter_0000100", "/plain/step_200"]
    server = S3Server()
    try:
        fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": server.endpoint})
        fs.mkdir("lib")
        fs.put(f"{root}/", "lib/tree/", recursive=True)
        deadline = time.monotonic() + 120
        while True:  # objects uploaded seconds ago read as being written; wait until they settle
            proc = _cli_env("ls", "s3://lib/tree", "--json", env=server.env())
            assert proc.returncode == 0, proc.stderr
            got = json.loads(proc.stdout)["checkpoints"]
            if all(c["state"] != "writing" for c in got) or time.monotonic() > deadline:
                break
        assert view([(c["path"], c["run"], c["step"], c["format"], c["ranks"], c["state"]) for c in got],
                    "s3://lib/tree") == want
        plan = _cli_env("prune", "s3://lib/tree", "--keep-last", "1", "--json", env=server.env())
        assert plan.returncode == 0, plan.stderr
        assert [x[len("s3://lib/tree"):] for x in json.loads(plan.stdout)["kept_unrecorded"]] == \
            [p[len(str(root)):] for p, _ in local.strays] == [f"/plain/{PRUNE_PREFIX}trash-step_100"]
        assert json.loads(plan.stdout)["leftovers"] == [] and local.leftovers == []
    finally:
        server.stop()


def test_unreadable_is_listed_and_never_pruned(tmp_path, fixtures):
    root = tmp_path.resolve() / "r"
    for s in (1, 2, 3):
        shutil.copytree(fixtures["fsdp2_r2"], root / f"step_{s}")
    (root / "step_2" / ".metadata").write_bytes(b"")  # emptied by a full disk
    _age(root)
    states = {c.name: (c.state, c.reason) for c in scan([root]).checkpoints}
    assert states["step_2"] == ("unreadable", ".metadata is empty or not DCP metadata")
    assert states["step_1"][0] == states["step_3"][0] == "complete"
    plan = _plan(root, keep_last=1, incomplete=True)
    assert plan["step_1"][0] == "remove" and plan["step_2"][0] == "keep"
    assert "check it with `shardscope verify`" in plan["step_2"][1][0]


def test_safetensors_file_states(tmp_path):
    """A consolidated safetensors file is whole, cut short, or not safetensors at all."""
    from shardscope.backend.formats import format_named

    def file_state(path, size):
        f = format_named("safetensors").probe_file(path, size)
        return f.state, f.reason

    whole = tmp_path / "whole.safetensors"
    save_file({"w": torch.arange(1000, dtype=torch.float32)}, whole)
    data = whole.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-100])
    head = tmp_path / "head.safetensors"
    head.write_bytes(data[:20])
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(len(b"[1, 2]").to_bytes(8, "little") + b"[1, 2]" + bytes(64))
    states = {p.name: file_state(str(p), p.stat().st_size)[:2] for p in (whole, cut, head, junk)}
    assert states["whole.safetensors"] == ("complete", "")
    assert states["cut.safetensors"] == ("incomplete", f"truncated: the header needs {len(data)} bytes, "
                                                       f"the file has {len(data) - 100}")
    assert states["head.safetensors"] == ("incomplete", "truncated inside its header")
    assert states["junk.safetensors"][0] == "unreadable" and "not a JSON object" in states["junk.safetensors"][1]


def test_keep_best_reads_tensorboard_event_files(tmp_path):
    """Lightning's default logger: lightning_logs/version_N/events.out.tfevents.* next to checkpoints/."""
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path.resolve() / "lightning_logs" / "version_3"
    (run / "checkpoints").mkdir(parents=True)
    writer = SummaryWriter(str(run))
    for step, val in ((10, 1.5), (20, 1.8), (30, 1.6)):
        writer.add_scalar("val_loss", val, step)
        torch.save({"global_step": step, "optimizer_states": [{"state": {}, "param_groups": []}]},
                   run / "checkpoints" / f"epoch={step // 10}-step={step}.ckpt")
    writer.close()
    _age(tmp_path / "lightning_logs")
    plan = _plan(tmp_path, keep_best="val_loss", mode="min", top=1)
    names = {os.path.basename(p): v for p, v in plan.items()}
    assert names["epoch=1-step=10.ckpt"][0] == "keep" and "keep-best val_loss (min, top 1): 1.5" in \
        names["epoch=1-step=10.ckpt"][1]
    assert names["epoch=2-step=20.ckpt"][0] == "remove"
    assert names["epoch=3-step=30.ckpt"][0] == "keep"  # the newest


def _exported_run(tmp_path: Path, fixtures) -> tuple[Path, Path]:
    """A run with two DCP checkpoints, each exported by ``watch --once`` (an export and its lineage sidecar)."""
    root = tmp_path / "root"
    for s in (10, 20):
        shutil.copytree(fixtures["fsdp2_r2"], root / "run" / "checkpoints" / f"step_{s:06d}")
    _age(root)
    proc = run_cli("watch", root, "--export", "safetensors", "--once")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exports = root / "run" / "exports"
    _age(exports)
    assert (exports / "step_000010.safetensors.shardscope.json").is_file()
    return root, exports


PRUNE_WEIGHTS = ("--keep-last", "1", "--weights", "--keep", "*/checkpoints/*", "--delete")


def test_prune_weights_removes_an_exports_sidecar_with_it(tmp_path, fixtures):
    root, exports = _exported_run(tmp_path, fixtures)
    mine = exports / "step_000020.safetensors.shardscope.json"
    plan = run_cli("prune", root, *PRUNE_WEIGHTS)
    assert plan.returncode == 0, plan.stderr
    line = next(ln for ln in plan.stdout.splitlines() if "step_000010.safetensors" in ln)
    assert line.lstrip().startswith("REMOVE") and \
        line.endswith("(with its lineage sidecar step_000010.safetensors.shardscope.json)")
    as_json = json.loads(run_cli("prune", root, *PRUNE_WEIGHTS, "--json").stdout)
    assert {c["path"]: c["sidecar"] for c in as_json["checkpoints"] if c["action"] == "remove"} == {
        str(exports / "step_000010.safetensors"): str(exports / "step_000010.safetensors.shardscope.json")}
    kept = mine.read_bytes()
    acted = run_cli("prune", root, *PRUNE_WEIGHTS, "--yes")
    assert acted.returncode == 0, acted.stdout + acted.stderr
    assert sorted(p.name for p in exports.iterdir()) == [  # step_000010's manifest went with it
        ".shardscope-watch.json", "step_000020.safetensors", "step_000020.safetensors.shardscope-manifest.json",
        "step_000020.safetensors.shardscope.json"]
    assert mine.read_bytes() == kept
    assert sorted(p.name for p in (root / "run" / "checkpoints").iterdir()) == ["step_000010", "step_000020"]


def test_prune_killed_between_an_export_and_its_sidecar_is_finished_by_ls(tmp_path, fixtures):
    """SIGKILL right after the export's rename, before its sidecar's: the export is gone, the sidecar still at its
    name; the next ``ls`` finishes the removal, sidecar included. A file of that name that is not ours stays."""
    root, exports = _exported_run(tmp_path, fixtures)
    env = {**os.environ, **_trash_env(tmp_path), PAUSE_ENV: "120"}
    proc = subprocess.Popen([sys.executable, "-m", "shardscope.app.cli", "prune", root, *PRUNE_WEIGHTS, "--yes"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    hidden = kill_after_first_rename(proc)  # the hook pauses right after the export's rename
    assert hidden.name == f"{PRUNE_PREFIX}delete-step_000010.safetensors" and hidden.exists()
    sidecar = exports / "step_000010.safetensors.shardscope.json"
    assert sidecar.exists() and not (exports / "step_000010.safetensors").exists()
    done = _cli_env("ls", root, "--json", env=_trash_env(tmp_path))
    assert done.returncode == 0 and "finished an interrupted prune" in done.stderr, done.stderr
    # the export's manifest is among the record's moves too: left at its name by the kill, removed with the export
    assert sorted(p.name for p in exports.iterdir()) == [
        ".shardscope-watch.json", "step_000020.safetensors", "step_000020.safetensors.shardscope-manifest.json",
        "step_000020.safetensors.shardscope.json"]

    # a user's file of a sidecar's name (not ours) is never taken for one: the export goes, the file stays
    notes = exports / "step_000020.safetensors.shardscope.json"
    notes.write_text('{"my": "notes"}')
    (exports / "step_000030.safetensors").write_bytes((exports / "step_000020.safetensors").read_bytes())
    _age(exports)
    acted = run_cli("prune", root, *PRUNE_WEIGHTS, "--yes")
    assert acted.returncode == 0, acted.stdout + acted.stderr
    assert sorted(p.name for p in exports.iterdir()) == [
        ".shardscope-watch.json", "step_000020.safetensors.shardscope.json",
        "step_000030.safetensors"]  # step_000020's manifest went with it
    assert notes.read_text() == '{"my": "notes"}'


def test_keep_best_reads_lightning_csvlogger_where_lightning_writes_it(tmp_path):
    """CSVLogger writes RUN/lightning_logs/version_0/metrics.csv: the Training panel plotted its train_loss
    while `prune --keep-best train_loss` said "the run logs no train_loss" (it looked one level down)."""
    from shardscope.backend.runs.rundir import scalar_logs

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "lightning_csv_run.py"), str(run)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    csv_log = run / "lightning_logs" / "version_0" / "metrics.csv"
    assert scalar_logs(run) == [csv_log]  # what the Training panel plots
    rows = [ln.split(",") for ln in csv_log.read_text().splitlines()[1:]]
    logged = {int(step): float(loss) for _epoch, step, loss in rows}
    losses = {s: logged[max(k for k in logged if k <= s)] for s in (2, 4, 6)}  # the last logged by the step
    _age(run)
    plan = run_cli("prune", tmp_path, "--keep-best", "train_loss", "--top", "2")
    assert plan.returncode == 0, plan.stderr
    assert "logs no train_loss" not in plan.stdout
    ranked = sorted((2, 4, 6), key=lambda s: losses[s])
    lines = {s: next(ln.lstrip() for ln in plan.stdout.splitlines() if f"step={s}.ckpt" in ln) for s in ranked}
    for s in ranked[:2]:
        assert lines[s].startswith("KEEP") and f"keep-best train_loss (min, top 2): {losses[s]:.6g}" in lines[s]
    if ranked[2] != 6:  # the newest is kept whatever its loss
        assert lines[ranked[2]].startswith("REMOVE")


def test_a_finished_dcp_save_is_complete_however_fresh_its_files(tmp_path, fixtures):
    """A DCP save's coordinator writes .metadata last: a whole DCP folder just copied (or just saved) read
    "writing" for seconds after, and prune then called an older step "the newest resumable". A save without
    its .metadata is still being written."""
    run = tmp_path / "run" / "checkpoints"
    shutil.copytree(fixtures["fsdp2_r2"], run / "step_000010")
    _age(run / "step_000010")
    shutil.copytree(fixtures["fsdp2_r2"], run / "step_000020", copy_function=shutil.copy)  # fresh times
    _without_metadata(fixtures["fsdp2_r2"], run / "step_000030")
    states = {c.name: c.state for c in scan([tmp_path]).checkpoints}
    assert states == {"step_000010": "complete", "step_000020": "complete", "step_000030": "writing"}
    plan = _plan(tmp_path, keep_last=1)
    assert "the newest resumable" in " ".join(plan["run/checkpoints/step_000020"][1])
