"""Which keys are the model: layouts recognised from real saves (export/layouts.py), and the default export of
what real tools write (a Lightning Trainer, torchtitan, accelerate's FSDP folders, Megatron-style names, a
sharded Llama that ``from_pretrained`` loads)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import lightning_writer
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_cli
from safetensors import safe_open
from safetensors.torch import load_file
from shardscope.backend.export import plan_export
from shardscope.backend.export.layouts import layout_of_names
from shardscope.backend.formats import open_checkpoint

TUTORIAL = r'''
import sys, warnings
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

warnings.filterwarnings("ignore")


class AppState(Stateful):  # as torch's "Getting Started with DCP" tutorial writes it
    def __init__(self, model, optimizer=None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
model(torch.rand(8, 8)).sum().backward()
optimizer.step()
dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=sys.argv[1])
torch.save(model.state_dict(), sys.argv[1] + ".reference.pt")
'''


def test_the_dcp_tutorial_wrapper_key_is_recognised(tmp_path):
    """torch's DCP tutorial saves {"app": AppState(model, optimizer)}: keys app.model.* and app.optim.*. Export
    once called it a flat state dict and shipped 45 optimizer tensors and the param groups by default."""
    ckpt = tmp_path / "tutorial"
    subprocess.run([sys.executable, "-c", TUTORIAL, str(ckpt)], check=True, timeout=300)
    out = tmp_path / "model.safetensors"
    proc = run_cli("export", ckpt, out)
    assert proc.returncode == 0, proc.stderr
    assert "under the wrapper key 'app'" in proc.stdout + proc.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = torch.load(str(ckpt) + ".reference.pt", weights_only=True)
    got = load_file(out)
    assert sorted(got) == sorted(ref)  # the module's own names: app.model. removed, no optimizer state
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_a_lone_key_is_not_taken_for_a_wrapper():
    assert layout_of_names(["net.fc.weight", "net.fc2.weight"]).wrapper == ""
    assert layout_of_names(["model.fc.weight"]).name.startswith("torch DCP recipe")
    wrapped = layout_of_names(["state.model.w", "state.optimizer.state.w.exp_avg"])
    assert wrapped.wrapper == "state." and wrapped.is_model("state.model.w")
    assert not wrapped.is_model("state.optimizer.state.w.exp_avg")


def test_a_plain_state_dict_container_is_not_called_lightning():
    from shardscope.backend.export.layouts import layout_of_names

    plain = layout_of_names(["state_dict.fc.weight", "optim.state.0.exp_avg", "optim.state.0.step"])
    assert plain.container == "state_dict." and "Lightning" not in plain.name
    assert plain.is_model("state_dict.fc.weight") and not plain.is_model("optim.state.0.exp_avg")
    lightning = layout_of_names(["state_dict.fc.weight", "optimizer_states.0.state.0.exp_avg"])
    assert lightning.name.startswith("Lightning Trainer")


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
    assert bad.returncode == 2 and "model (a prefix to export) matches no entry" in bad.stderr
    assert "tok_embeddings" in bad.stderr
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


def test_left_out_names_the_training_state_below_a_wrapper_and_keeps_every_other_tensor(tmp_path):
    """``{"app": {"model": ..., "optim": ...}}``: the line names ``app.optim``, not the wrapper; a tensor beside the
    DCP recipe's ``model`` that is not training state (an ``ema`` copy) is written, not left out by a guess."""
    model = torch.nn.Linear(4, 2)
    app = _save({"app": {"model": model.state_dict(), "optim": _optimizer_state(model)}}, tmp_path / "app")
    plan = plan_export(open_checkpoint(str(app), use_cache=False), "safetensors")
    assert {it.key for it in plan.items} == {"weight", "bias"}
    assert plan.left_out[0] == "6 tensors of training state (app.optim)", plan.left_out
    recipe = {"model": model.state_dict(), "optimizer": _optimizer_state(model), "ema": {"weight": torch.ones(2, 4)}}
    plan = plan_export(open_checkpoint(str(_save(recipe, tmp_path / "ema")), use_cache=False), "safetensors")
    assert {it.key for it in plan.items} == {"model.weight", "model.bias", "ema.weight"}
    assert all("optimizer" in line for line in plan.left_out), plan.left_out
