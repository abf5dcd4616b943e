"""Lineage (issue 22 §4): every export names its source in a sidecar (never a local path inside the exported
file unless --record-source), ``ls --json`` and the Library show the link and flag a source that changed or
went, and the Training header and the Library show one loss per step (the mean of the ranks)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli
from shardscope.backend.filenames import MANIFEST_NAME, lineage_sidecar

SIDECAR_KEYS = {"schema", "written", "export_format", "source"}


def _run_with_checkpoint(fixtures, tmp_path: Path, step: int = 20, name: str = "fsdp2_r2") -> Path:
    """A run folder holding a real DCP checkpoint as ``checkpoints/step_<step>``; the checkpoint's path."""
    ckpt = tmp_path / "run" / "checkpoints" / f"step_{step:06d}"
    shutil.copytree(fixtures[name], ckpt)
    return ckpt


def _sidecar(path: Path, folder: bool = False) -> dict:
    return json.loads(Path(lineage_sidecar(str(path), folder)).read_text())


def _ls(root: Path) -> dict[str, dict]:
    proc = run_cli("ls", root, "--json")
    assert proc.returncode == 0, proc.stderr
    return {c["path"]: c for c in json.loads(proc.stdout)["checkpoints"]}


def _age(path: Path) -> None:
    """Put a file's time a minute back, so ls calls it complete, not 'writing'."""
    t = time.time() - 60
    os.utime(path, (t, t))


def test_export_writes_a_sidecar_and_no_path_into_the_file(fixtures, tmp_path):
    ckpt = _run_with_checkpoint(fixtures, tmp_path)
    out = tmp_path / "run" / "exports" / "weights.safetensors"
    out.parent.mkdir()
    run_cli("export", ckpt, out, check=True)
    doc = _sidecar(out)
    assert set(doc) == SIDECAR_KEYS and doc["export_format"] == "safetensors"
    src = doc["source"]
    assert src["path"] == str(ckpt.resolve()) and src["name"] == "step_000020" and src["step"] == 20
    assert src["run"] == str((tmp_path / "run").resolve()) and src["format"] == "dcp"
    ident = src["identity"]
    meta = (ckpt / ".metadata").stat()
    assert ident["files"] == {".metadata": {"bytes": meta.st_size, "mtime_ns": meta.st_mtime_ns}}
    assert ident["crc32_of"] == [".metadata"] and len(ident["crc32"]) == 8 and ident["other_files"] == 2
    # people upload the exported file: no local path in it (the sidecar stays here)
    data = out.read_bytes()
    assert str(tmp_path).encode() not in data and b"step_000020" not in data
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []  # no temporaries left
    # --record-source still puts it into the file, by request
    run_cli("export", ckpt, out, "--force", "--record-source", check=True)
    assert str(ckpt.resolve()).encode() in out.read_bytes()


def test_ls_shows_source_step_and_flags_a_changed_or_missing_source(fixtures, tmp_path):
    ckpt = _run_with_checkpoint(fixtures, tmp_path)
    out = tmp_path / "run" / "exports" / "weights.safetensors"  # no step in its name
    out.parent.mkdir()
    for p in ckpt.iterdir():  # before the export: the export records the source's times
        _age(p)
    run_cli("export", ckpt, out, check=True)
    got = _ls(tmp_path)
    assert set(got) == {str(ckpt.resolve()), str(out.resolve())}  # the sidecar is no checkpoint
    exp, src = got[str(out.resolve())], got[str(ckpt.resolve())]
    assert exp["kind"] == "weights" and exp["step"] == 20  # from the sidecar
    assert exp["source"] == str(ckpt.resolve()) and exp["source_step"] == 20
    assert exp["source_changed"] is False and exp["source_missing"] is False
    assert src["exports"] == [str(out.resolve())] and "source" not in src
    text = run_cli("ls", tmp_path, check=True).stdout
    assert "[from step_000020]" in text and "[exported to weights.safetensors]" in text

    (ckpt / ".metadata").touch()  # the source was written again (a newer time is enough)
    exp = _ls(tmp_path)[str(out.resolve())]
    assert exp["source_changed"] is True and exp["source_missing"] is False
    assert "source changed" in run_cli("ls", out, check=True).stdout

    shutil.rmtree(ckpt)
    exp = _ls(tmp_path)[str(out.resolve())]
    assert exp["source_missing"] is True and exp["source_changed"] is False and exp["step"] == 20


def _flip_a_value_byte(ckpt_dir: Path) -> str:
    """Flip one byte inside the stored values of a model tensor's first chunk (bit rot only a CRC32 catches)."""
    from shardscope.backend.checkpoint.chunks import ChunkReader
    from shardscope.backend.formats import open_checkpoint

    ck = open_checkpoint(str(ckpt_dir))
    entry = next(t for t in ck.tensors if t.fqn.startswith("model."))
    chunk = entry.chunks[0]
    with ChunkReader(ck) as reader:
        at = reader.locate(entry.fqn, chunk).data_offset + 8
    with open(ckpt_dir / chunk.file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    return entry.fqn


def test_a_failed_export_leaves_no_sidecar(fixtures, tmp_path):
    ckpt = _run_with_checkpoint(fixtures, tmp_path)
    fqn = _flip_a_value_byte(ckpt)  # bit rot: the stored CRC32 fails on the way in
    out = tmp_path / "weights.safetensors"
    proc = run_cli("export", ckpt, out)
    assert proc.returncode != 0 and fqn.split(".", 1)[1] in proc.stderr + proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no output, no sidecar, no temporaries


def test_force_replaces_the_sidecar_with_its_output(fixtures, tmp_path):
    first = _run_with_checkpoint(fixtures, tmp_path, 10, "fsdp2_r2")
    second = _run_with_checkpoint(fixtures, tmp_path, 30, "fsdp2_r4")
    out = tmp_path / "weights.safetensors"
    run_cli("export", first, out, check=True)
    assert _sidecar(out)["source"]["step"] == 10
    assert run_cli("export", second, out).returncode == 2  # without --force: refused, the sidecar as it was
    assert _sidecar(out)["source"]["step"] == 10
    run_cli("export", second, out, "--force", check=True)
    assert _sidecar(out)["source"]["path"] == str(second.resolve()) and _sidecar(out)["source"]["step"] == 30

    folder = tmp_path / "sharded"  # a folder export keeps its sidecar inside, and --force replaces it too
    run_cli("export", first, folder, "--max-shard-size", "4KB", check=True)
    assert _sidecar(folder, True)["source"]["step"] == 10
    (folder / "config.json").write_text("{}")  # not the export's: kept by --force
    run_cli("export", second, folder, "--max-shard-size", "4KB", "--force", check=True)
    assert _sidecar(folder, True)["source"]["step"] == 30 and (folder / "config.json").exists()
    assert not any(p.name.endswith(".json") and p.name not in ("config.json", MANIFEST_NAME) and "index" not in p.name
                   for p in folder.iterdir())  # the sidecar lies beside the folder, never inside it (uploaded)
    assert [p.name for p in folder.parent.iterdir()].count(folder.name + ".shardscope.json") == 1


@pytest.mark.parametrize("folder", [False, True])
def test_force_never_removes_a_file_of_the_sidecars_name_that_is_not_ours(fixtures, tmp_path, folder):
    """``export --force`` replaces ``<dst>.shardscope.json`` by name: a user's own file of that name (no lineage
    schema) is refused with one line and exit 2, before anything is written; our own sidecar is replaced."""
    first = _run_with_checkpoint(fixtures, tmp_path, 10, "fsdp2_r2")
    second = _run_with_checkpoint(fixtures, tmp_path, 30, "fsdp2_r4")
    out = tmp_path / ("sharded" if folder else "weights.safetensors")
    shard = ["--max-shard-size", "4KB"] if folder else []
    run_cli("export", first, out, *shard, check=True)
    sidecar = Path(lineage_sidecar(str(out), folder))
    before = out.stat().st_mtime_ns
    notes = b'{"my": "notes about these weights"}\n'
    sidecar.write_bytes(notes)  # the user's own file, of our sidecar's name
    proc = run_cli("export", second, out, *shard, "--force")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"shardscope: {sidecar}: exists and is not a Shardscope lineage sidecar (the export writes its sidecar "
        "there); move it away. Nothing was written."]
    assert sidecar.read_bytes() == notes and out.stat().st_mtime_ns == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".shardscope-tmp-")]
    sidecar.unlink()
    run_cli("export", first, out, *shard, "--force", check=True)  # ours now: replaced by --force
    run_cli("export", second, out, *shard, "--force", check=True)
    assert _sidecar(out, folder)["source"]["step"] == 30


def test_reshard_and_import_outputs_name_their_source(fixtures, tmp_path):
    ckpt = _run_with_checkpoint(fixtures, tmp_path)
    resharded = tmp_path / "r3"
    run_cli("reshard", ckpt, resharded, "--ranks", "3", check=True)
    doc = _sidecar(resharded, True)
    assert doc["export_format"] == "dcp" and doc["source"]["path"] == str(ckpt.resolve())
    assert doc["source"]["step"] == 20 and doc["source"]["format"] == "dcp"
    run_cli("verify", resharded, check=True)  # the sidecar does not disturb the checkpoint
    single = tmp_path / "model.safetensors"
    run_cli("export", ckpt, single, check=True)
    imported = tmp_path / "imported"
    run_cli("import", single, imported, "--ranks", "2", check=True)
    assert _sidecar(imported, True)["source"]["path"] == str(single.resolve())
    # the export of an export: step still known (from its sidecar, through the library)
    assert _sidecar(imported, True)["source"]["step"] == 20


def test_library_model_shows_checkpoint_to_export_and_back(qtbot, fixtures, tmp_path):
    from PySide6.QtCore import Qt
    from shardscope.backend.library.snapshot import take_snapshot
    from shardscope.widgets.library_model import COLUMNS, LibraryModel

    ckpt = _run_with_checkpoint(fixtures, tmp_path)
    out = tmp_path / "run" / "exports" / "weights.safetensors"
    out.parent.mkdir()
    run_cli("export", ckpt, out, check=True)
    model = LibraryModel()
    col = COLUMNS.index("lineage")

    def rows() -> dict[str, tuple]:
        model.set_snapshot(take_snapshot([str(tmp_path)]))
        got = {}
        for r in range(model.rowCount()):
            run = model.index(r, 0)
            for i in range(model.rowCount(run)):
                ix = model.index(i, col, run)
                fg = model.data(ix, Qt.ItemDataRole.ForegroundRole)
                got[model.record(ix).name] = (model.data(ix), model.data(ix, Qt.ItemDataRole.ToolTipRole),
                                              fg.name() if fg is not None else None)
        return got

    got = rows()
    assert model.headerData(col, Qt.Orientation.Horizontal) == "source / exports"
    assert got["step_000020"][0] == "exported to weights.safetensors" and str(out.resolve()) in got["step_000020"][1]
    text, tip, color = got["weights.safetensors"]
    assert text == "from step_000020" and f"exported from {ckpt.resolve()} (step 20)" in tip and color is None
    (ckpt / ".metadata").touch()
    text, tip, color = rows()["weights.safetensors"]
    assert text == "from step_000020; \u26a0 source changed" and "source changed since" in tip and color


REPORT = """
import os, sys
from shardscope import report
for step in (1, 2, 3, 4):
    report(step=step, loss=float(sys.argv[1]) / step)
"""


def test_training_header_and_library_show_the_same_loss(qtbot, fixtures, tmp_path):
    """The header showed rank 0's loss, the Library the mean over ranks, for the same step."""
    from PySide6.QtCore import Qt
    from shardscope.backend.library.snapshot import take_snapshot
    from shardscope.backend.runs.follow import RunFollower
    from shardscope.widgets.library_model import COLUMNS, LibraryModel
    from shardscope.widgets.run_header import header_html

    run = tmp_path / "run"
    ckpt = _run_with_checkpoint(fixtures, tmp_path, 4)
    for rank, loss in ((0, "1.0"), (1, "3.0")):  # the real reporter, one process per rank
        subprocess.run([sys.executable, "-c", REPORT, loss], check=True, timeout=120,
                       env={**os.environ, "SHARDSCOPE_RUN_DIR": str(run), "RANK": str(rank)})
    follower = RunFollower(run)
    header = header_html(follower, follower.poll(), False, {})
    assert "loss (mean of ranks) 0.5000" in header  # (1.0/4 + 3.0/4) / 2, not rank 0's 0.2500

    model = LibraryModel()
    model.set_snapshot(take_snapshot([str(tmp_path)]))
    col = COLUMNS.index("loss")
    assert model.headerData(col, Qt.Orientation.Horizontal) == "mean loss"  # short: it fits at 1280x720
    assert "loss (mean of ranks)" in model.headerData(col, Qt.Orientation.Horizontal, Qt.ItemDataRole.ToolTipRole)
    run_ix = model.index(0, 0)
    row = next(i for i in range(model.rowCount(run_ix)) if model.record(model.index(i, 0, run_ix)).name == ckpt.name)
    assert model.data(model.index(row, col, run_ix)) == "0.5000"

    from shardscope.backend.runs.store import describe

    assert describe(run).loss == pytest.approx(0.5)  # what `shardscope runs` shows


@pytest.mark.parametrize("name", ["weights.safetensors.shardscope.json", "hf_export.shardscope.json"])
def test_a_sidecar_is_never_a_checkpoint(name):
    from shardscope.backend.filenames import is_checkpoint_file
    from shardscope.backend.formats.registry import detect_file

    assert detect_file(name) is None and not is_checkpoint_file(name)
