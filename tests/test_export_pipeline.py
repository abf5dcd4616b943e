"""The writer pipeline as users meet it: layouts written by real tools, the right keys by default,
atomic outputs under real signals and a really full disk, cheap verification that catches corruption."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import lightning_writer
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_cli
from safetensors import safe_open
from shardscope.backend.checkpoint import open_checkpoint
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.export import ExportError, export, plan_export
from shardscope.backend.export.atomic import TMP_PREFIX

HERE = Path(__file__).parent


def _save(state: dict, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # no_dist=True says so on purpose
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def _optimizer_state(model: torch.nn.Module) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt)


def _keys(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as h:
        return set(h.keys())


def _tmp_leftovers(folder: Path) -> list[str]:
    return [n for n in os.listdir(folder) if n.startswith(TMP_PREFIX)]


# ------------------------------------------------------------------ layouts, written by real tools
def test_lightning_trainer_checkpoint_exports_model_weights(tmp_path):
    """A real Lightning Trainer (ModelParallelStrategy: FSDP2 on 2 CPU processes) writes the folder."""
    lightning_writer.write(tmp_path)
    dst = tmp_path / "model.safetensors"
    out = run_cli("export", tmp_path / "ckpt", dst)
    assert out.returncode == 0, out.stderr
    assert "layout: Lightning Trainer" in out.stdout and "optimizer_0" in out.stdout
    ref = torch.load(tmp_path / "reference.pt", weights_only=True)
    with safe_open(str(dst), framework="pt") as h:
        assert set(h.keys()) == set(ref)
        for k in ref:
            assert torch.equal(h.get_tensor(k), ref[k]), k


def test_torchtitan_style_state(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    titan = {"tok_embeddings.weight": torch.randn(11, 8), **{f"layers.{k}": v for k, v in model.state_dict().items()},
             "optimizer": _optimizer_state(model), "lr_scheduler": {"last_epoch": 3},
             "dataloader": {"world_size": 1, "position": 12}, "train_state": {"step": 7}}
    src = _save(titan, tmp_path / "titan")
    dst = tmp_path / "m.safetensors"
    out = run_cli("export", src, dst, "--rename", r"^layers\.=model.layers.",
                  "--rename", r"^tok_embeddings\.=model.embed_tokens.")
    assert out.returncode == 0, out.stderr
    assert "torchtitan" in out.stdout and "optimizer" in out.stdout
    assert _keys(dst) == {"model.embed_tokens.weight", *(f"model.layers.{k}" for k in model.state_dict())}
    with safe_open(str(dst), framework="pt") as h:
        assert torch.equal(h.get_tensor("model.embed_tokens.weight"), titan["tok_embeddings.weight"])
    # --only model fails here (no such root) with a one-line error naming what exists
    bad = run_cli("export", src, tmp_path / "x.safetensors", "--only", "model")
    assert bad.returncode == 2 and "--only model matches no entry" in bad.stderr and "tok_embeddings" in bad.stderr
    # two rules mapping onto one name: refused before anything is written
    clash = run_cli("export", src, tmp_path / "y.safetensors", "--rename", r"^layers\.[01]\.=layers.X.")
    assert clash.returncode == 2 and "both become" in clash.stderr
    assert not (tmp_path / "y.safetensors").exists()


def test_accelerate_fsdp_folder_parent_or_model_subfolder(tmp_path):
    """The layout HF Trainer/accelerate write for SHARDED_STATE_DICT (``save_fsdp_model`` /
    ``save_fsdp_optimizer``: dcp.save of {"model": ...} and {"optimizer": ...}); written here with dcp.save,
    fast; tests/test_accelerate_writer.py runs accelerate's own writer on 2 gloo processes."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    run = tmp_path / "checkpoint-500"
    _save({"model": model.state_dict()}, run / "pytorch_model_fsdp_0")
    _save({"optimizer": _optimizer_state(model)}, run / "optimizer_0")
    (run / "trainer_state.json").write_text("{}")
    for src in (run, run / "pytorch_model_fsdp_0"):
        dst = tmp_path / f"{src.name}.safetensors"
        out = run_cli("export", src, dst)
        assert out.returncode == 0, out.stderr
        assert "accelerate FSDP" in out.stdout
        assert _keys(dst) == set(model.state_dict())
    assert "optimizer_0" in run_cli("export", run, tmp_path / "again.safetensors").stdout


def test_megatron_style_names_leave_optimizer_out(tmp_path):
    state = {"embedding.word_embeddings.weight": torch.randn(10, 4), "decoder.layers.0.mlp.weight": torch.randn(4, 4),
             "output_layer.weight": torch.randn(10, 4), "optimizer": {"state": {"0": {"exp_avg": torch.zeros(4)}}},
             "iteration": 100, "args": {"lr": 0.1}}
    src = _save(state, tmp_path / "mega")
    plan = plan_export(open_checkpoint(src, use_cache=False), "safetensors")
    assert "Megatron" in plan.layout.name
    assert {it.key for it in plan.items} == {"embedding.word_embeddings.weight", "decoder.layers.0.mlp.weight",
                                             "output_layer.weight"}
    assert any("optimizer" in n for n in plan.left_out)


def test_exclude_and_prefix_errors_and_plan_is_not_mutated(fixtures, tmp_path):
    ckpt = open_checkpoint(fixtures["fsdp2_r2"])
    plan = plan_export(ckpt, "safetensors", exclude=["model.head"])
    assert all(not it.entry.fqn.startswith("model.head") for it in plan.items)
    assert any("--exclude model.head" in n for n in plan.left_out)
    with pytest.raises(ExportError, match=r"--exclude model\.nosuch matches no entry"):
        plan_export(ckpt, "safetensors", exclude=["model.nosuch"])
    with pytest.raises(ExportError, match="--rename"):
        plan_export(ckpt, "safetensors", rename=["no-equals-sign"])
    before = (plan.items, plan.left_out)
    export(plan, str(tmp_path / "a.safetensors"))
    assert (plan.items, plan.left_out) == before


# ------------------------------------------------------------------ transformers, end to end
def test_llama_sharded_export_loads_with_from_pretrained(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    src = _save({"model": model.state_dict(), "optimizer": _optimizer_state(model), "step": 3}, tmp_path / "ckpt")
    config.save_pretrained(tmp_path / "cfg")
    dst = tmp_path / "hf"
    out = run_cli("export", src, dst, "--max-shard-size", "20KB", "--config", tmp_path / "cfg" / "config.json")
    assert out.returncode == 0, out.stderr
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and (dst / "config.json").exists()
    assert str(tmp_path) not in (dst / "model.safetensors.index.json").read_text()  # no local paths
    loaded = LlamaForCausalLM.from_pretrained(dst).eval()
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    # asked for: the source path is recorded
    out = run_cli("export", src, tmp_path / "hf2", "--max-shard-size", "20KB", "--record-source")
    assert json.loads((tmp_path / "hf2" / "model.safetensors.index.json").read_text())["metadata"]["source"]


# ------------------------------------------------------------------ atomic outputs
@pytest.fixture(scope="session")
def many_tensors(tmp_path_factory) -> Path:
    """2,000 tensors, 128 MiB: an export that takes long enough to be stopped in the middle."""
    path = tmp_path_factory.mktemp("many") / "ckpt"
    gen = torch.Generator().manual_seed(0)
    return _save({"model": {f"w{i}": torch.randn(128, 128, generator=gen) for i in range(2000)}}, path)


def _start_export(src: Path, dst: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shardscope.app.cli", "export", str(src), str(dst), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ})


def _stop_when_writing(proc: subprocess.Popen, folder: Path, deadline: float = 120) -> None:
    """SIGSTOP the export as soon as its temporary exists (it then has 128 MiB still to write)."""
    end = time.monotonic() + deadline
    while not _tmp_leftovers(folder):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "the export never created its temporary"
        time.sleep(0.0005)
    proc.send_signal(signal.SIGSTOP)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_export_removes_temp_and_keeps_destination(many_tensors, tmp_path, sig):
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "m.safetensors"
    dst.write_text("the previous export")
    proc = _start_export(many_tensors, dst, "--force", "--dtype", "bf16")
    _stop_when_writing(proc, out)
    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)
    _stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert sorted(os.listdir(out)) == ["m.safetensors"] and dst.read_text() == "the previous export"


def test_kill_leftover_is_removed_by_the_next_run(many_tensors, fixtures, tmp_path):
    proc = _start_export(many_tensors, tmp_path / "m.pt")
    _stop_when_writing(proc, tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)  # reaped: its pid is gone, as after a real kill -9
    left = _tmp_leftovers(tmp_path)
    assert left and not (tmp_path / "m.pt").exists()
    again = run_cli("export", fixtures["nopg"], tmp_path / "small.pt")
    assert again.returncode == 0, again.stderr
    assert sorted(os.listdir(tmp_path)) == ["small.pt"]


def test_long_destination_name(fixtures, tmp_path):
    dst = tmp_path / ("x" * 240 + ".safetensors")
    out = run_cli("export", fixtures["nopg"], dst)
    assert out.returncode == 0, out.stderr
    assert os.listdir(tmp_path) == [dst.name]


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_disk_full_up_front_and_mid_write(many_tensors, tmp_path, small_disk):
    # up front: 128 MiB do not fit in 20 MiB
    up = run_cli("export", many_tensors, small_disk / "m.safetensors")
    assert up.returncode == 2 and "only" in up.stderr and "free" in up.stderr and "Traceback" not in up.stderr
    assert os.listdir(small_disk) == []
    # mid-write: 16 MiB fit when the export starts; the disk fills up while it writes
    src = _save({"model": {f"w{i}": torch.randn(16, 128) for i in range(2000)}}, tmp_path / "mid")
    dst = small_disk / "m.pt"
    dst.write_text("keep me")
    proc = _start_export(src, dst, "--force")
    _stop_when_writing(proc, small_disk)
    fd = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * (1 << 16)):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    proc.send_signal(signal.SIGCONT)
    _stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr
    assert "disk full" in stderr and len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    os.unlink(small_disk / "filler")
    assert sorted(os.listdir(small_disk)) == ["m.pt"] and dst.read_text() == "keep me"


# ------------------------------------------------------------------ verification that catches corruption
def test_corrupt_source_bytes_fail_the_export(copy_of, tmp_path):
    src = copy_of("ddp_r2")
    ckpt = open_checkpoint(src, use_cache=False)
    entry = max((t for t in ckpt.tensors if t.fqn.startswith("model.")), key=lambda t: t.numel)
    chunk = entry.chunks[0]
    with ChunkReader(ckpt) as reader:
        where = reader.locate(entry.fqn, chunk).data_offset + 3
    data = bytearray((src / chunk.file).read_bytes())
    data[where] ^= 0x01  # one bit of the tensor's stored values
    (src / chunk.file).write_bytes(bytes(data))
    out = tmp_path / "out"
    out.mkdir()
    for name in ("m.safetensors", "m.pt"):
        proc = run_cli("export", src, out / name, "--only", "model")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert chunk.file in proc.stderr and "Traceback" not in proc.stderr
        assert "verified" not in proc.stdout
    assert os.listdir(out) == []


def test_progress_sizes_past_2_gib_cross_the_qt_boundary(qtbot, fixtures):
    from shardscope.widgets.export_dialog import ExportDialog
    from shardscope.widgets.workers import WorkerSignals

    dlg = ExportDialog(open_checkpoint(fixtures["nopg"]), "")
    qtbot.addWidget(dlg)
    signals = WorkerSignals()
    signals.progress.connect(dlg._on_progress)
    signals.progress.emit(3 << 30, 5 << 30, "exporting")
    assert dlg.progress.text().endswith("3.0 GiB of 5.0 GiB"), dlg.progress.text()
    assert dlg.progress.value() == dlg.progress.maximum() * 3 // 5


def test_dialog_shows_layout_and_takes_exclude_and_rename(qtbot, fixtures, tmp_path):
    from shardscope.widgets.export_dialog import ExportDialog

    dlg = ExportDialog(open_checkpoint(fixtures["fsdp2_r2"]), "")
    qtbot.addWidget(dlg)
    dlg.dst.setText(str(tmp_path / "m.safetensors"))
    assert "layout: torch DCP recipe" in dlg.summary.text()
    n = len(dlg.keys.stringList())
    dlg.exclude.setText("model.head")
    assert len(dlg.keys.stringList()) < n
    dlg.rename.setText(r"^emb\.=embed.")
    assert any(k.startswith("embed.weight") for k in dlg.keys.stringList())
    dlg.exclude.setText("model.nosuch")
    assert not dlg.export_button.isEnabled() and "matches no entry" in dlg.summary.text()


def test_crc32_of_pieces_combines_like_zlib():
    import zlib

    from shardscope.backend.crc import crc32_combine

    gen = torch.Generator().manual_seed(1)
    for a_len, b_len in ((0, 5), (3, 0), (1, 1), (1000, 12345), (17, 1 << 20)):
        a = bytes(torch.randint(0, 256, (a_len,), generator=gen, dtype=torch.uint8).tolist())
        b = bytes(torch.randint(0, 256, (b_len,), generator=gen, dtype=torch.uint8).tolist())
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
