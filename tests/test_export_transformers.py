"""Exports of a transformers model load back with ``from_pretrained`` and give the model's own logits: a tiny Llama,
tied and untied, as ``save_pretrained`` writes it (folder and file), as a torch DCP recipe save of the module with
its optimizer, as a ``transformers.Trainer`` run of 2 steps checkpoints it (tests/trainers_writer.py); exported by
the CLI and by ``watch``. An HF model's state dict has ``model.*`` and ``lm_head.*`` at the top: both are weights."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from gui_support import no_thread_left_running  # noqa: F401  (an autouse fixture: no worker outlives a test)
from safetensors import safe_open

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("transformers")
    proc = subprocess.run([sys.executable, str(HERE / "trainers_writer.py"), "transformers", str(root)],
                          capture_output=True, text=True, timeout=900, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return root


def _assert_same_logits(folder: Path, reference: Path) -> None:
    """``from_pretrained(folder)`` loads every key with none missing or unexpected and gives the logits of the
    model the reference was taken from."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref = torch.load(reference, weights_only=True)
    with torch.no_grad():
        got = model.eval()(ref["ids"]).logits
    assert torch.allclose(got, ref["logits"], rtol=0, atol=1e-6), (got - ref["logits"]).abs().max()


def _export(src: Path, dst: Path, config: Path) -> str:
    proc = run_cli("export", src, dst, "--config", config, "--max-shard-size", "60KB")
    assert proc.returncode == 0, proc.stderr
    assert "left out" not in proc.stdout + proc.stderr or "lm_head" not in proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("source, config, logits", [
    ("llama_untied", "llama_untied", "llama_untied"), ("llama_tied", "llama_tied", "llama_tied"),
    ("llama_untied/model.safetensors", "llama_untied", "llama_untied"),
    ("llama_tied/model.safetensors", "llama_tied", "llama_tied"),
    ("dcp_untied", "llama_untied", "llama_untied"), ("dcp_tied", "llama_tied", "llama_tied"),
    ("trainer/checkpoint-2", "trainer/checkpoint-2", "trainer")])
def test_every_export_of_a_transformers_llama_gives_its_logits(written, tmp_path, source, config, logits):
    """Each source exported with --config to a sharded folder, and that folder exported again (a re-export of an
    export): both load with every key and give the original logits."""
    config_json = written / config / "config.json"
    first = tmp_path / "first"
    out = _export(written / source, first, config_json)
    if source.startswith("dcp_"):
        assert "torch DCP recipe" in out and "of training state (optimizer)" in out and "'model.' prefix" in out
    keys = set(json.loads((first / "model.safetensors.index.json").read_text())["weight_map"])
    assert "model.embed_tokens.weight" in keys and all(k.startswith(("model.", "lm_head.")) for k in keys)
    assert ("lm_head.weight" in keys) == (not source.startswith("llama_tied"))  # save_pretrained: a tied head once
    _assert_same_logits(first, written / f"{logits}.logits.pt")
    again = tmp_path / "again"
    _export(first, again, config_json)
    _assert_same_logits(again, written / f"{logits}.logits.pt")


def test_a_single_file_export_keeps_lm_head(written, tmp_path):
    """A ``.safetensors`` file export of a save_pretrained folder holds ``lm_head.weight`` under its own name."""
    folder = tmp_path / "hf"
    folder.mkdir()
    proc = run_cli("export", written / "llama_untied", folder / "model.safetensors")
    assert proc.returncode == 0, proc.stderr
    assert "Hugging Face transformers names" in proc.stdout and "left out" not in proc.stdout
    with safe_open(str(folder / "model.safetensors"), framework="pt") as h:
        assert "lm_head.weight" in h.keys() and "model.embed_tokens.weight" in h.keys()
    shutil.copy(written / "llama_untied" / "config.json", folder)
    _assert_same_logits(folder, written / "llama_untied.logits.pt")


def _age(path: Path, seconds: float = 3600) -> None:
    t = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (t, t), follow_symlinks=False)


def test_watch_on_a_trainer_output_exports_every_weight_before_a_removal(written, tmp_path):
    """``watch --keep-last 1`` over a Trainer's output_dir: each checkpoint's export holds every weight (lm_head
    too) and loads with the trained model's logits; only then is the older checkpoint removed."""
    out = tmp_path / "root" / "out"
    shutil.copytree(written / "trainer", out)
    _age(tmp_path / "root")
    proc = run_cli("watch", tmp_path / "root", "--export", "safetensors", "--once", "--keep-last", "1", "--delete")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-2"]
    exports = out / "exports"
    for name in ("checkpoint-1", "checkpoint-2"):
        with safe_open(str(exports / f"{name}.safetensors"), framework="pt") as h:
            assert "lm_head.weight" in h.keys() and len(h.keys()) == 21, name
    folder = tmp_path / "loadable"
    folder.mkdir()
    shutil.copy(exports / "checkpoint-2.safetensors", folder / "model.safetensors")
    shutil.copy(out / "checkpoint-2" / "config.json", folder)
    _assert_same_logits(folder, written / "trainer.logits.pt")


def test_the_export_dialog_writes_every_weight_where_a_watch_adopts_it(qtbot, written, tmp_path):
    """The Export dialog on a Trainer checkpoint proposes the path a watch writes; its export holds lm_head and
    gives the trained logits, and a watch then adopts it (its lineage names this checkpoint) instead of failing on
    it every pass."""
    from shardscope.backend.formats import open_checkpoint
    from shardscope.widgets.export_dialog import ExportDialog

    out = tmp_path / "root" / "out"
    shutil.copytree(written / "trainer", out)
    _age(tmp_path / "root")
    dlg = ExportDialog(open_checkpoint(str(out / "checkpoint-2")), "")
    qtbot.addWidget(dlg)
    dst = out / "exports" / "checkpoint-2.safetensors"
    assert dlg.dst.text() == str(dst)
    qtbot.waitUntil(lambda: not dlg.planning, timeout=120000)  # the dialog plans in the background
    with qtbot.waitSignal(dlg.finished_export, timeout=120000) as blocker:
        dlg.export_button.click()
    assert blocker.args[0] is not None and blocker.args[0].verified is True, dlg.message.text()
    with safe_open(str(dst), framework="pt") as h:
        assert "lm_head.weight" in h.keys() and len(h.keys()) == 21
    proc = run_cli("watch", tmp_path / "root", "--export", "safetensors", "--once", "--keep-last", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"exported {out}/checkpoint-2 -> {dst} (adopted: its lineage names this checkpoint" in proc.stdout
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-2"]
