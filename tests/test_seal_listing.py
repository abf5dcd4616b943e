"""``ls`` and prune see a checkpoint's seal cheaply (its manifest's file list against the file system, no byte of the
checkpoint read): sealed, unsealed, damaged (a file missing, extra or of another size), modified (a file modified
after the seal); a damaged checkpoint is never the newest resumable state prune keeps, and no rule removes it."""

from __future__ import annotations

import json
import os
import shutil

import torch
from conftest import run_cli
from test_seal import sealed


def _ls(root) -> dict[str, str]:
    proc = run_cli("ls", root, "--json")
    assert proc.returncode == 0, proc.stderr
    return {os.path.relpath(c["path"], root): c["seal"] for c in json.loads(proc.stdout)["checkpoints"]}


def test_ls_says_sealed_unsealed_damaged_and_modified(fixtures, tmp_path):
    for name in ("a", "b", "c", "d"):
        shutil.copytree(fixtures["fsdp2_r2"], tmp_path / name)
    torch.save({"w": torch.ones(3)}, tmp_path / "m.pt")
    for name in ("b", "c", "d", "m.pt"):
        sealed(tmp_path / name)
    with open(tmp_path / "c" / "__1_0.distcp", "ab") as f:  # grown: its size is not the manifest's
        f.write(b"x")
    os.utime(tmp_path / "d" / "__0_0.distcp", ns=(1, os.stat(tmp_path / "d" / "shardscope-manifest.json")
                                                   .st_mtime_ns + 10**9))  # same size, modified after the seal
    assert _ls(tmp_path) == {"a": "unsealed", "b": "sealed", "c": "damaged", "d": "modified", "m.pt": "sealed"}
    text = run_cli("ls", tmp_path).stdout
    assert "damaged (its files differ from its manifest)" in text and "[sealed]" in text


def test_prune_never_keeps_a_damaged_checkpoint_as_the_newest_and_never_removes_it(fixtures, tmp_path):
    ck = tmp_path / "run" / "checkpoints"
    for step in (10, 20):
        shutil.copytree(fixtures["fsdp2_r2"], ck / f"step_{step}")
        sealed(ck / f"step_{step}")
    (ck / "step_20" / "extra.bin").write_bytes(b"not sealed")  # a file the manifest does not list: damaged
    proc = run_cli("prune", tmp_path, "--keep-last", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = {os.path.basename(c["path"]): c for c in json.loads(proc.stdout)["checkpoints"]}
    assert plan["step_10"]["action"] == "keep"
    assert "the newest resumable checkpoint of its run" in " ".join(plan["step_10"]["reasons"])
    assert plan["step_20"]["action"] == "keep" and "damaged" in " ".join(plan["step_20"]["reasons"])


def test_the_library_shows_the_seal_beside_the_state(qtmodeltester, fixtures, tmp_path):
    from PySide6.QtCore import Qt
    from shardscope.backend.library.snapshot import take_snapshot
    from shardscope.widgets.library_model import COLUMNS, LibraryModel

    for name in ("a", "b", "c"):
        shutil.copytree(fixtures["fsdp2_r2"], tmp_path / name)
    sealed(tmp_path / "b")
    sealed(tmp_path / "c")
    (tmp_path / "c" / "extra.bin").write_bytes(b"x")
    model = LibraryModel()
    model.set_snapshot(take_snapshot([str(tmp_path)]))
    qtmodeltester.check(model)
    col = list(COLUMNS).index("state")
    states = {}
    for r in range(model.rowCount()):
        run = model.index(r, 0)
        for k in range(model.rowCount(run)):
            name = model.index(k, 0, run).data()
            states[name] = model.index(k, col, run).data()
            if name == "c":
                assert "damaged" in model.index(k, col, run).data(Qt.ItemDataRole.ToolTipRole)
    assert states == {"a": "complete", "b": "complete · sealed", "c": "complete · damaged"}
