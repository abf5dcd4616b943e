"""diff and the Compare view past damaged entries (CRC mismatch, truncated .distcp, a rank's file missing),
and pairing names across a container prefix (a DCP checkpoint and its safetensors export, a Lightning
``state_dict.`` folder and an HF-style export), on checkpoints torch and Lightning wrote themselves."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import lightning_writer
import pytest
import torch
from conftest import run_cli
from PySide6.QtCore import Qt
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.compare import diff
from shardscope.backend.compare.pairing import pair_names
from shardscope.backend.export.layouts import Layout, layout_of_names
from shardscope.backend.formats import open_checkpoint, open_source
from torch_reference import flatten, torch_consolidated

HERE = Path(__file__).parent
HIT = "model.blocks.0.fc1.weight"


def _damage(path: Path, fqn: str, how: str) -> str:
    """Damage the rank-1 chunk of ``fqn`` in the copy at ``path`` (flip a value byte, or cut the file
    inside it); the file's name."""
    ck = open_checkpoint(path)
    entry = ck.tensor(fqn)
    chunk = next(c for c in entry.chunks if c.rank == 1)
    with ChunkReader(ck) as reader:
        st = reader.locate(fqn, chunk)
    name = path / chunk.file
    if how == "flip":
        data = bytearray(name.read_bytes())
        data[st.data_offset + 5] ^= 0xFF
        name.write_bytes(bytes(data))
    else:
        os.truncate(name, st.data_offset + 10)
    return chunk.file


def _diff_json(*args) -> tuple[subprocess.CompletedProcess, dict]:
    proc = run_cli("diff", "--json", *args)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc, json.loads(proc.stdout)


def _diff_in_process(a, b, exact_names: bool = False) -> dict:
    with open_source(a) as sa, open_source(b) as sb:
        return json.loads(json.dumps(diff(sa, sb, exact_names=exact_names).to_json()))


# ------------------------------------------------------------------ unreadable entries
def test_a_corrupt_chunk_is_reported_and_the_rest_compared(fixtures, copy_of):
    """step2 vs a step3 with one chunk failing its CRC32: every other change is still found, the damaged
    tensor is named with its file, and the exit code says "could not read" (2), not "differs" (1)."""
    a = fixtures["steps_r2"] / "step2"
    b = copy_of("steps_r2") / "step3"
    file = _damage(b, HIT, "flip")
    ra, rb = flatten(torch_consolidated(a)), flatten(torch_consolidated(fixtures["steps_r2"] / "step3"))
    truly_changed = {k for k, v in ra.items() if isinstance(v, torch.Tensor) and not torch.equal(v, rb[k])}
    proc, report = _diff_json(a, b)
    assert proc.returncode == 2
    assert [u["fqn"] for u in report["unreadable"]] == [HIT] and report["unreadable"][0]["side"] == "B"
    detail = report["unreadable"][0]["detail"]
    assert file in detail and HIT in detail and "CRC32" in detail and "\n" not in detail
    changed = {c["fqn"] for c in report["changed"] if c["kind"] == "values" and c["rel_l2"] is not None}
    assert changed == truly_changed - {HIT}
    assert len(proc.stderr.strip().splitlines()) == 1 and "the rest was compared" in proc.stderr
    text = run_cli("diff", "--all", a, b)
    assert text.returncode == 2 and "Traceback" not in text.stderr
    assert f"unreadable in B: {b / file}" in text.stdout and HIT in text.stdout
    assert "model.emb.weight" in text.stdout  # the other changes are listed too


def test_truncated_file_and_missing_rank_file_leave_the_other_entries_compared(fixtures, copy_of):
    cut = copy_of("fsdp2_r2")
    file = _damage(cut, HIT, "cut")
    proc, report = _diff_json(fixtures["fsdp2_r2"], cut)
    assert proc.returncode == 2 and report["unchanged"] > 0 and report["changed"] == []
    assert HIT in {u["fqn"] for u in report["unreadable"]}
    for u in report["unreadable"]:
        assert file in u["detail"] and u["fqn"] in u["detail"] and "truncated" in u["detail"]
    # the rank-0 entries of a DDP checkpoint stay readable without rank 1's file
    missing = copy_of("ddp_r2")
    (missing / "__1_0.distcp").unlink()
    proc, report = _diff_json(missing, fixtures["ddp_r2"])
    assert proc.returncode == 2 and report["unchanged"] > 0 and report["unreadable"]
    for u in report["unreadable"]:
        assert u["side"] == "A" and "__1_0.distcp" in u["detail"] and u["fqn"] in u["detail"]
    both = run_cli("diff", missing, missing)
    assert both.returncode == 2 and "unreadable in A and B: A: " in both.stdout


def test_compare_view_lists_an_unreadable_tensor_and_finishes(qtbot, fixtures, copy_of):
    from shardscope.widgets.compare_view import CompareView

    damaged = copy_of("fsdp2_r2")
    file = _damage(damaged, HIT, "flip")
    view = CompareView(str(fixtures["fsdp2_r2"]), str(damaged))
    qtbot.addWidget(view)
    view.resize(1280, 680)
    view.show()
    with qtbot.waitSignal(view.finished, timeout=120000) as sig:
        view.start()
    result = sig.args[0]
    assert result is not None and [c.fqn for c in result.unreadable] == [HIT] and result.unchanged == 74
    first = view.proxy.index(0, 0)  # nothing is known of an unreadable entry: listed first
    assert first.data() == HIT and view.proxy.index(0, 1).data() == "unreadable"
    assert file in view.proxy.index(0, 2).data() and view.table.columnSpan(0, 2) == 3
    assert "1 unreadable" in view.summary.text() and file in view.summary.text()
    with qtbot.waitSignal(view.detailDone, timeout=120000):
        assert view.select(HIT)
    assert "CRC32" in view.detail.text() and len(view.map_b.chunk_items) == 2
    view.shutdown()


# ------------------------------------------------------------------ pairing across a container prefix
def test_checkpoint_pairs_with_its_own_safetensors_export(fixtures, tmp_path):
    """step3's default safetensors export drops ``model.``; step2 vs that export finds the same changes
    as step2 vs step3, and says how it paired the names; --exact-names pairs nothing."""
    st = tmp_path / "step3.safetensors"
    assert run_cli("export", fixtures["steps_r2"] / "step3", st).returncode == 0
    a = fixtures["steps_r2"] / "step2"
    direct = _diff_in_process(a, fixtures["steps_r2"] / "step3")
    proc, report = _diff_json(a, st)
    assert proc.returncode == 1
    assert report["pairing"]["rule"] == "container" and report["pairing"]["prefix_a"] == "model."
    want = {c["fqn"]: c for c in direct["changed"] if c["fqn"].startswith("model.")}
    got = {c["fqn_a"]: c for c in report["changed"]}
    assert got.keys() == want.keys() and report["only_b"] == []
    for k, c in got.items():
        assert c["fqn_b"] == k.removeprefix("model.") and c["fqn"] == c["fqn_b"]
        assert c["max_abs_diff"] == want[k]["max_abs_diff"] and c["rel_l2"] == want[k]["rel_l2"]
    assert not any(n.startswith("model.") for n in report["only_a"])  # the optimizer is not in the export
    text = run_cli("diff", a, st).stdout
    assert "pairing: A's names without the container prefix 'model.'" in text and "--exact-names" in text
    exact = _diff_in_process(a, st, exact_names=True)
    assert exact["pairing"]["rule"] == "exact" and exact["unchanged"] == 0
    assert exact["changed"] == [] and len(exact["only_b"]) == 15
    proc = run_cli("diff", "--exact-names", a, st)
    assert proc.returncode == 1 and "B's entries are A's without the prefix 'model.'" in proc.stdout
    # the export against its DCP source: no differences among the paired entries
    same = _diff_in_process(st, fixtures["steps_r2"] / "step3")
    assert same["changed"] == [] and same["unchanged"] == 15 and same["pairing"]["prefix_b"] == "model."


def test_only_weights_compares_a_checkpoint_with_its_export_as_equal(fixtures, tmp_path):
    """diff of a checkpoint and its safetensors export listed the optimizer and trainer state as only in A
    and exited 1; --only-weights keeps only what export takes as the model on each side: 0 changed, exit 0.
    A change in the weights is still found."""
    st = tmp_path / "step3.safetensors"
    assert run_cli("export", fixtures["steps_r2"] / "step3", st).returncode == 0
    proc = run_cli("diff", "--json", "--only-weights", fixtures["steps_r2"] / "step3", st)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0, proc.stdout
    assert report["only_a"] == report["only_b"] == report["changed"] == [] and report["unchanged"] == 15
    assert report["not_weights"][0] > 0 and report["not_weights"][1] == 0
    text = run_cli("diff", "--only-weights", fixtures["steps_r2"] / "step3", st).stdout
    assert "0 changed, 15 unchanged" in text and "model weights only" in text
    proc = run_cli("diff", "--json", "--only-weights", fixtures["steps_r2"] / "step2", st)
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["changed"] and report["only_a"] == []


def test_lightning_state_dict_folder_pairs_with_an_hf_export(tmp_path):
    """A real Lightning Trainer folder (``state_dict.*``, ``optimizer_0.*``) against an HF-style sharded
    export (index + shards) with one tensor changed: only that one differs, in either order."""
    from safetensors.torch import load_file, save_file

    lightning_writer.write(tmp_path)
    hf = tmp_path / "hf"
    assert run_cli("export", tmp_path / "ckpt", hf, "--max-shard-size", "300B").returncode == 0
    index = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and not any(k.startswith("state_dict.") for k in index)
    key = sorted(index)[0]
    shard = hf / index[key]
    tensors = load_file(shard)
    tensors[key] = tensors[key] + 1
    save_file(tensors, shard, metadata={"format": "pt"})
    ref = torch.load(tmp_path / "reference.pt", weights_only=True)
    for a, b, side in ((tmp_path / "ckpt", hf, "prefix_a"), (hf, tmp_path / "ckpt", "prefix_b")):
        proc, report = _diff_json(a, b)
        assert proc.returncode == 1 and report["pairing"][side] == "state_dict."
        assert [c["fqn"] for c in report["changed"]] == [key]
        assert report["changed"][0]["max_abs_diff"] == pytest.approx(1.0)
        assert report["unchanged"] == len(ref) - 1
        only = report["only_a"] or report["only_b"]
        assert only and all(n.startswith("optimizer_0") for n in only) and not (report["only_a"] and report["only_b"])


def test_compare_view_pairs_a_checkpoint_with_its_export(qtbot, fixtures, tmp_path):
    from shardscope.widgets.compare_view import CompareView

    st = tmp_path / "step3.safetensors"
    assert run_cli("export", fixtures["steps_r2"] / "step3", st).returncode == 0
    view = CompareView(str(fixtures["steps_r2"] / "step2"), str(st))
    qtbot.addWidget(view)
    view.resize(1280, 680)
    view.show()
    with qtbot.waitSignal(view.finished, timeout=120000) as sig:
        view.start()
    assert sig.args[0].pairing.prefix_a == "model." and sig.args[0].only_b == []
    assert "Pairing: A's names without the container prefix 'model.'" in view.summary.text()
    tip = view.proxy.index(0, 0).data(Qt.ItemDataRole.ToolTipRole)
    assert "A: model." in tip
    assert view.select("emb.weight")
    qtbot.waitUntil(lambda: "elements differ" in view.detail.text(), timeout=120000)
    assert len(view.map_a.chunk_items) == 2 and len(view.map_b.chunk_items) == 1
    qtbot.waitUntil(view.exact_names.isEnabled, timeout=120000)
    with qtbot.waitSignal(view.finished, timeout=120000) as sig:
        view.exact_names.setChecked(True)
    assert sig.args[0].pairing.prefix_a == "" and len(sig.args[0].only_b) == 15 and sig.args[0].unchanged == 0
    assert "without the prefix 'model.'" in view.summary.text() and view.exact_names.isEnabled()
    view.shutdown()


def test_pairing_prefers_names_as_stored_and_refuses_collisions():
    dcp = layout_of_names(["model.w", "optimizer.state.w.exp_avg"])
    flat = layout_of_names(["w"])
    assert dcp.container == "model." and flat.container == ""
    p = pair_names(["model.w", "model.v"], ["model.w", "w"], dcp, dcp)
    assert not p.renamed and p.pairs == {"model.w": ("model.w", "model.w")}  # a tie keeps the stored names
    # "model.w" and "w" would both become "w": that side is paired as stored
    p = pair_names(["model.w", "w"], ["w"], dcp, flat)
    assert not p.renamed and p.pairs == {"w": ("w", "w")} and p.only_a == ["model.w"]
    # torch.compile's wrapper part is removed with the container, as export removes it
    compiled = Layout("torch DCP recipe", ("model",), "model.")
    p = pair_names(["model._orig_mod.w"], ["w"], compiled, flat)
    assert p.prefix_a == "model." and p.pairs == {"w": ("model._orig_mod.w", "w")}
    assert pair_names(["model.w"], ["w"], dcp, flat, exact=True).pairs == {}
