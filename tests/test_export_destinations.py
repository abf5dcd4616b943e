"""Where export, import and reshard may write (issue 19, items 1 and 2): never over what they did not write,
never onto or into their source, nor over a folder that holds it; and SIGINT/SIGTERM at a known moment of
the work (item 8) leaves no temporary and exits 130. The CLI runs in real subprocesses on real checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from safetensors.torch import save_file
from shardscope.backend.export.atomic import HOLD_ENV
from shardscope.backend.export.dcp_writer import import_file
from shardscope.backend.export.destination import check_destination
from shardscope.backend.export.plan import ExportError

pytestmark = pytest.mark.slow


def _tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` (links as their target) and a hash of its bytes: what must not change."""
    out = {}
    for p in sorted(path.rglob("*")):
        key = str(p.relative_to(path))
        if p.is_symlink():
            out[key] = "-> " + os.readlink(p)
        elif p.is_file():
            out[key] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _temporaries(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith(".shardscope-tmp-"))


def _refused(proc: subprocess.CompletedProcess, words: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr, proc.stderr


# ------------------------------------------------------------------ item 1: what is there already
@pytest.mark.parametrize("name", ["proj", "victim.pt"])
def test_a_file_export_never_replaces_a_folder(fixtures, tmp_path, name):
    folder = tmp_path / name
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "main.py").write_text("x")
    before = _tree(folder)
    _refused(run_cli("export", fixtures["nopg"], folder, "--format", "torch", "--force"), "is a folder")
    assert _tree(folder) == before and _temporaries(tmp_path) == []


def test_a_folder_output_never_replaces_a_file(fixtures, tmp_path):
    dst = tmp_path / "out"
    dst.write_text("not a folder")
    _refused(run_cli("export", fixtures["nopg"], dst, "--max-shard-size", "5GB", "--force"), "is a file")
    link = tmp_path / "link"
    link.symlink_to(fixtures["ddp_r2"], target_is_directory=True)  # a link to some other folder
    _refused(run_cli("reshard", fixtures["nopg"], link, "--ranks", "2", "--force"), "symbolic link")
    assert dst.read_text() == "not a folder" and link.is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["link", "out"]


# ---------------------------------------------- issue 29, item 4: --force replaces only what an export wrote
def test_force_into_a_folder_no_export_wrote_keeps_and_names_every_file(fixtures, tmp_path):
    """`export SRC dst --max-shard-size 1MB --force` into a folder no export ever wrote deleted the user's
    `my_finetune_run.pt` and `optimizer.bin` for good (their suffixes are an export's) and said only that it
    kept `notes.txt`. Now only what the earlier export's own record (its sidecar's ``files``) names is replaced:
    the user's files stay, each named; a later --force over that export drops its old shards."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "my_finetune_run.pt").write_bytes(b"a week of fine-tuning")
    (dst / "optimizer.bin").write_bytes(b"adam moments")
    (dst / "notes.txt").write_text("notes")
    users = _tree(dst)
    proc = run_cli("export", fixtures["fsdp2_r4"], dst, "--max-shard-size", "1MB", "--force")
    assert proc.returncode == 0, proc.stderr
    assert "kept in the folder (not written by an export): my_finetune_run.pt, notes.txt, optimizer.bin" \
        in proc.stdout
    assert {k: v for k, v in _tree(dst).items() if k in users} == users
    sidecar = json.loads(Path(f"{dst}.shardscope.json").read_text())
    assert sidecar["files"] == ["model-00001-of-00001.safetensors", "model.safetensors.index.json",
                                "shardscope-manifest.json"]
    proc = run_cli("export", fixtures["fsdp2_r4"], dst, "--max-shard-size", "4KB", "--force")
    assert proc.returncode == 0, proc.stderr
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert set(os.listdir(dst)) == {*index["weight_map"].values(), "model.safetensors.index.json", *users,
                                    "shardscope-manifest.json"}
    assert {k: v for k, v in _tree(dst).items() if k in users} == users


def test_force_refuses_to_write_over_a_file_no_export_wrote(fixtures, tmp_path):
    """A file of the user's that the export would write over (a DCP folder's `.metadata`, a save_pretrained
    index) is refused with one line, exit 2, and nothing is written: the folder is as it was."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / ".metadata").write_bytes(b"someone else's DCP metadata")
    (dst / "__0_0.distcp").write_bytes(b"someone else's shard")
    before = _tree(dst)
    proc = run_cli("reshard", fixtures["fsdp2_r4"], dst, "--ranks", "1", "--force")
    _refused(proc, f"{dst / '.metadata'}: exists and no earlier export recorded writing it")
    assert _tree(dst) == before and sorted(os.listdir(tmp_path)) == ["dst"]
    (dst / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {"w": "optimizer.bin"}}')
    before = _tree(dst)
    proc = run_cli("export", fixtures["fsdp2_r4"], dst, "--max-shard-size", "1MB", "--force")
    _refused(proc, "model.safetensors.index.json: exists and no earlier export recorded writing it")
    assert _tree(dst) == before and sorted(os.listdir(tmp_path)) == ["dst"]


def test_force_over_an_export_without_a_file_list_goes_by_its_own_index(fixtures, tmp_path):
    """An export whose sidecar records no ``files`` (an older Shardscope's): its own index (``producer:
    shardscope``) names the shards it wrote; they are replaced, the user's `optimizer.bin` is kept."""
    dst = tmp_path / "dst"
    run_cli("export", fixtures["fsdp2_r4"], dst, "--max-shard-size", "4KB", check=True)
    sidecar = Path(f"{dst}.shardscope.json")
    doc = json.loads(sidecar.read_text())
    doc.pop("files", None)
    sidecar.write_text(json.dumps(doc))
    (dst / "optimizer.bin").write_bytes(b"adam moments")
    proc = run_cli("export", fixtures["fsdp2_r4"], dst, "--max-shard-size", "1MB", "--force")
    assert proc.returncode == 0, proc.stderr
    assert "kept in the folder (not written by an export): optimizer.bin" in proc.stdout
    assert sorted(os.listdir(dst)) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json",
                                       "optimizer.bin", "shardscope-manifest.json"]


# ------------------------------------------------------------------ item 2: the source
def test_export_or_reshard_onto_its_source_is_refused(copy_of, tmp_path):
    ck = copy_of("fsdp2_r2")
    before = _tree(ck)
    _refused(run_cli("export", ck, ck, "--max-shard-size", "5GB", "--force"), "is the source")
    # the source inside the destination: --force over the parent would replace the folder that holds it
    _refused(run_cli("export", ck, tmp_path, "--max-shard-size", "5GB", "--force"), "holds the source")
    _refused(run_cli("reshard", ck, ck, "--ranks", "4", "--force"), "is the source")
    assert _tree(ck) == before and sorted(os.listdir(tmp_path)) == ["fsdp2_r2"]


def test_every_spelling_of_the_source_is_the_source(copy_of, tmp_path):
    """The check every writer calls (AtomicOutput), on the paths the CLI would give it."""
    ck = copy_of("nopg")
    (tmp_path / "lnk").symlink_to(ck, target_is_directory=True)
    (tmp_path / "up").symlink_to(tmp_path, target_is_directory=True)
    cases = [
        (ck, "dir", [ck], "is the source"),
        (f"{ck}/./", "dir", [ck], "is the source"),
        (f"{tmp_path}/up/{ck.name}", "dir", [ck], "is the source"),
        (tmp_path / "lnk", "dir", [ck], "is the source"),
        (ck, "dir", [tmp_path / "lnk"], "is the source"),
        (ck / "sub", "dir", [ck], "inside the source"),
        (ck / "model.safetensors", "file", [ck], "inside the source"),
        (tmp_path / "lnk" / "model.pt", "file", [ck], "inside the source"),
        (tmp_path, "dir", [tmp_path / "lnk"], "holds the source"),
        (ck / ".metadata", "file", [ck / ".metadata"], "is the source"),
    ]
    for dst, kind, sources, words in cases:
        with pytest.raises(ExportError, match=words):
            check_destination(str(dst), kind, True, [str(s) for s in sources])
    check_destination(str(tmp_path / f"{ck.name}2"), "dir", True, [str(ck)])  # a sibling whose name starts alike


def test_import_into_the_folder_that_holds_the_file_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    save_file({"a": torch.ones(3)}, run / "model.safetensors")
    (run / "notes.txt").write_text("mine")
    before = _tree(run)
    _refused(run_cli("import", run / "model.safetensors", run, "--force"), "holds the source")
    assert _tree(run) == before


def test_the_same_folder_by_a_bind_mount_is_the_source(copy_of, tmp_path):
    ck = copy_of("nopg")
    other = tmp_path / "mounted"
    other.mkdir()
    if subprocess.run(["mount", "--bind", str(ck), str(other)], capture_output=True).returncode != 0:
        pytest.skip("bind mounts need root (and a kernel that allows them here)")
    try:
        before = _tree(ck)
        assert os.path.realpath(other) != os.path.realpath(ck)  # only the inode says it is the same folder
        _refused(run_cli("reshard", ck, other, "--ranks", "2", "--force"), "is the source")
        _refused(run_cli("export", ck, other / "m.pt"), "inside the source")
        assert _tree(ck) == before
    finally:
        subprocess.run(["umount", str(other)], check=True)


def test_urls_on_the_same_storage_and_prefix_overlap(tmp_path):
    src = "memory://bucket/run/step_10"
    for dst, words in [(src, "is the source"), (src + "/", "is the source"), (src + "/out", "inside the source"),
                       ("memory://bucket/run", "holds the source")]:
        with pytest.raises(ExportError, match=words):
            check_destination(dst, "dir", True, [src])
    check_destination("memory://bucket/run/step_100", "dir", True, [src])  # a sibling whose name starts alike
    check_destination(str(tmp_path / "out"), "dir", True, [src])  # a local folder and a URL never overlap


def test_the_dialog_refuses_in_the_same_words(qtbot, copy_of):
    from shardscope.backend.formats import open_checkpoint
    from shardscope.widgets.export_dialog import ExportDialog

    ck = copy_of("fsdp2_r2")
    before = _tree(ck)
    dlg = ExportDialog(open_checkpoint(ck), "")
    qtbot.addWidget(dlg)
    dlg.shard.setText("5GB")
    dlg.dst.setText(str(ck))
    dlg.force.setChecked(True)
    qtbot.waitUntil(lambda: not dlg.planning, timeout=120000)  # the plan is made in a worker
    dlg.start()
    assert "is the source" in dlg.message.text() and dlg._worker is None
    assert _tree(ck) == before


# ------------------------------------------------------------------ item 8: signals at a known moment
def _start_held(point: str, announce: Path, *args: object) -> subprocess.Popen:
    """The CLI, held by the writer at ``point`` (SHARDSCOPE_TEST_HOLD) until a signal comes."""
    env = {**os.environ, HOLD_ENV: f"{point}:{announce}"}
    return subprocess.Popen([sys.executable, "-m", "shardscope.app.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _wait_held(proc: subprocess.Popen, announce: Path) -> str:
    """The temporary's path, once the process is held there."""
    end = time.monotonic() + 120
    while not (announce.exists() and announce.read_text()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "the job never reached its hold point"
        time.sleep(0.01)
    return announce.read_text()


@pytest.fixture(scope="module")
def many_entries(tmp_path_factory) -> Path:
    """A safetensors file of 3,000 small tensors (the issue's had 30,000)."""
    path = tmp_path_factory.mktemp("many") / "many.safetensors"
    save_file({f"layer{i}.w": torch.full((8,), float(i)) for i in range(3000)}, path)
    return path


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGTERM])
def test_signal_mid_import_leaves_no_temporary(many_entries, tmp_path, sig):
    out = tmp_path / "out"
    out.mkdir()
    proc = _start_held("written", tmp_path / "held", "import", many_entries, out / "ck", "--ranks", "2")
    tmp = _wait_held(proc, tmp_path / "held")
    assert os.path.isdir(tmp) and os.listdir(tmp)  # mid-work: the temporary exists and holds written pieces
    t0 = time.monotonic()
    proc.send_signal(sig)
    _stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert time.monotonic() - t0 < 30 and "Traceback" not in stderr
    assert os.listdir(out) == []


def test_sigterm_before_anything_is_written_exits_130(many_entries, tmp_path):
    """SIGTERM while the source was read killed the process (exit -15) instead of the one line and 130."""
    proc = _start_held("start", tmp_path / "held", "import", many_entries, tmp_path / "ck")
    _wait_held(proc, tmp_path / "held")
    proc.send_signal(signal.SIGTERM)
    _stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and stderr.strip() == "shardscope: interrupted by SIGTERM", stderr
    assert os.listdir(tmp_path) == ["held"]


def test_signal_mid_export_and_reshard_leaves_no_temporary(fixtures, tmp_path):
    for args in (("export", fixtures["fsdp2_r2"], tmp_path / "m.safetensors"),
                 ("reshard", fixtures["fsdp2_r2"], tmp_path / "r4", "--ranks", "4")):
        held = tmp_path / "held"
        held.unlink(missing_ok=True)
        proc = _start_held("written", held, *args)
        _wait_held(proc, held)
        held.unlink()
        proc.send_signal(signal.SIGTERM)
        _stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "nothing was written" in stderr, stderr
        assert os.listdir(tmp_path) == []


def test_signal_while_the_old_folder_is_swapped_out_keeps_a_whole_checkpoint(many_entries, tmp_path):
    """--force over an earlier import: the handler used to delete the new folder once the old one had been moved
    aside, leaving no checkpoint at the destination and the old one as a temporary the next run deletes."""
    dst = tmp_path / "ck"
    import_file(str(many_entries), str(dst))
    (dst / "notes.txt").write_text("kept")
    proc = _start_held("swap", tmp_path / "held", "import", many_entries, dst, "--ranks", "2", "--force")
    _wait_held(proc, tmp_path / "held")
    proc.send_signal(signal.SIGTERM)
    _stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "it is complete" in stderr, stderr
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck.shardscope.json", "held"]  # the reshard's lineage sidecar
    assert sorted(os.listdir(dst)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "notes.txt",
                                       "shardscope-manifest.json"]
    check = run_cli("verify", dst, "--deep")
    assert check.returncode == 0, check.stdout + check.stderr


# ---------------------------------------------------------------- the destination class of the fuzzers
SEGMENTS = ("ck", "inner", "sib", "link_ck", "link_top", "..", ".", "new", "out.safetensors", "out.pt",
            "__0_0.distcp", ".metadata")


def test_fuzzed_destinations_never_change_the_source(fixtures, tmp_path):
    """A fixed-seed pass over destinations built from the tree around a checkpoint (its own files, its parent,
    links to it and to its parent, `..` and `.`): every writer with --force either writes elsewhere or refuses
    in one line, and the source tree is byte for byte what it was, whatever the destination."""
    import shutil

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from shardscope.backend.errors import ShardscopeError
    from shardscope.backend.export import export, plan_export
    from shardscope.backend.export.dcp_writer import reshard
    from shardscope.backend.formats import open_checkpoint

    top = tmp_path / "top"
    ck = top / "ck"
    shutil.copytree(fixtures["fsdp2_r2"], ck)
    (ck / "inner").mkdir()
    (top / "sib").mkdir()
    os.symlink(ck, top / "link_ck")
    os.symlink(top, top / "sib" / "link_top")
    before = _tree(top)
    ckpt = open_checkpoint(ck)
    outcomes = {"refused": 0, "written": 0}

    @settings(max_examples=40, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=4), st.sampled_from(["st", "pt", "dir", "dcp"]))
    def check(parts: list[str], how: str) -> None:
        dst = os.path.join(str(top), *parts)
        try:
            if how == "dcp":
                reshard(str(ck), dst, 1, force=True, verify=False)
            else:
                fmt = "torch" if how == "pt" else "safetensors"
                plan = plan_export(ckpt, fmt, max_shard_size=10**9 if how == "dir" else None)
                export(plan, dst, force=True, verify=False)
            outcomes["written"] += 1
        except ShardscopeError as exc:
            assert "\n" not in str(exc), str(exc)
            outcomes["refused"] += 1
        now = {k: v for k, v in _tree(top).items() if k in before or k.startswith(("ck/", "ck"))}
        assert {k: v for k, v in now.items() if k.startswith("ck")} == \
            {k: v for k, v in before.items() if k.startswith("ck")}, (parts, how)
        assert all(now.get(k) == v for k, v in before.items()), (parts, how)
        assert not [n for n in os.listdir(top) if n.startswith(".shardscope-tmp-")]

    check()
    assert outcomes["refused"] > 5 and outcomes["written"] > 5, outcomes
