"""``shardscope inspect --json`` writes its document in large pieces (json's C encoder for the frame, the tensors
from the chunk table's columns); the text must stay exactly what ``json.dump`` of the document gives."""

from __future__ import annotations

import io
import json

import pytest
import torch
from shardscope.app.cli.inspect import inspect_json, write_inspect_json
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.formats import open_checkpoint


@pytest.mark.parametrize("name", ["fsdp2_r4", "ddp_r2", "nopg", "lightning_r2", "fsdp_nocoll_r2",
                                  "fsdp_safetensors_r2", "hf_r2"])
def test_streamed_json_is_json_dump_text(fixtures, name):
    ckpt = open_checkpoint(fixtures[name], use_cache=False)
    problems = verify(ckpt)
    want, got = io.StringIO(), io.StringIO()
    json.dump(inspect_json(ckpt, problems), want)
    write_inspect_json(ckpt, problems, got)
    assert got.getvalue() == want.getvalue()


def test_streamed_json_escapes_names_and_unstored_chunks(tmp_path, copy_of):
    """Non-ASCII and quoting in names, a 0-d tensor, an empty tensor, and (a damaged folder) a file missing."""
    pt = tmp_path / "ü \"odd\".pt"
    torch.save({"wé\\ight": torch.ones(2, 3), "scalar": torch.tensor(3.0), "empty": torch.zeros(0, 4)}, pt)
    folder = copy_of("fsdp2_r2")
    next(folder.glob("*.distcp")).unlink()
    for path in (pt, folder):
        ckpt = open_checkpoint(path, use_cache=False)
        problems = verify(ckpt)
        want, got = io.StringIO(), io.StringIO()
        json.dump(inspect_json(ckpt, problems), want)
        write_inspect_json(ckpt, problems, got)
        assert got.getvalue() == want.getvalue()


def test_inspect_takes_a_trainer_checkpoint_holding_an_fsdp_model_folder_as_export_does(tmp_path):
    """An HF Trainer checkpoint-500/ saved with FSDP holds pytorch_model_fsdp_0/ and optimizer_0/ (DCP):
    `export` took it (to its model folder) while `inspect` refused it."""
    from transformers import TrainerState

    ckpt = tmp_path / "out" / "checkpoint-500"
    ckpt.mkdir(parents=True)
    _save_fsdp_model_and_optimizer(ckpt)
    TrainerState(global_step=500).save_to_json(str(ckpt / "trainer_state.json"))
    _inspect_and_export_take_its_model_folder(ckpt, tmp_path)


def test_inspect_and_export_agree_on_an_accelerate_save_state_folder(tmp_path):
    """accelerate's save_state folder (any name, no trainer_state.json) holding pytorch_model_fsdp_0/ and
    optimizer_0/: `export` took it (to its model folder) while `inspect` refused it; both ask the door now."""
    from shardscope.backend.formats import model_folder

    ckpt = tmp_path / "run" / "checkpoint"
    _save_fsdp_model_and_optimizer(ckpt)
    (ckpt / "random_states_0.pkl").write_bytes(b"not read")
    target, note = model_folder(str(ckpt))
    assert target == str(ckpt / "pytorch_model_fsdp_0") and "left out optimizer_0, random_states_0.pkl" in note
    assert open_checkpoint(ckpt).path == target
    _inspect_and_export_take_its_model_folder(ckpt, tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert model_folder(str(empty)) == (str(empty), None)  # nothing inside to point to: the folder itself


def test_inspect_names_the_architecture_a_torchtitan_checkpoint_holds(tmp_path, fixtures):
    """``inspect`` says which architecture the weights' names are (what ``export --hf`` will do with them), in its
    text and its JSON; a checkpoint whose names fit no scheme says nothing of it."""
    from conftest import run_cli
    from titan_names import write

    write(tmp_path / "ckpt")
    words = "torchtitan Llama 3 (interleaved rotary: --hf permutes q/k)"
    shown = run_cli("inspect", tmp_path / "ckpt")
    assert shown.returncode == 0 and f"architecture: {words}" in shown.stdout, shown.stdout + shown.stderr
    assert json.loads(run_cli("inspect", "--json", tmp_path / "ckpt").stdout)["architecture"] == words
    plain = run_cli("inspect", fixtures["fsdp2_r2"])
    assert plain.returncode == 0 and "architecture" not in plain.stdout
    assert inspect_json(open_checkpoint(fixtures["fsdp2_r2"]), [])["architecture"] is None


@pytest.mark.parametrize("names, words", [
    (["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"], "Hugging Face names (--hf keeps them"),
    (["embedding.word_embeddings.weight", "decoder.layers.self_attention.linear_qkv.weight"],
     "Megatron-Core GPT (fused QKV and gate/up: --hf splits them"),
    (["tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention.q_norm.weight"],
     "torchtitan Qwen3 (rotary halves"),
    (["tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.moe.experts.w1"], "torchtitan Llama 3 MoE"),
    (["tok_embeddings.weight", "layers.0.weight"], None),  # a torchtitan-like embedding, no attention: no scheme
])
def test_the_architecture_is_said_from_the_names_of_each_scheme(tmp_path, names, words):
    from safetensors.torch import save_file
    from shardscope.app.cli.inspect import architecture

    save_file({n: torch.zeros(2) for n in names}, str(tmp_path / "m.safetensors"))
    said = architecture(open_checkpoint(tmp_path / "m.safetensors", use_cache=False))
    assert said == words if words is None else said.startswith(words), said


def _save_fsdp_model_and_optimizer(ckpt) -> None:
    """What accelerate's FSDP save writes in a checkpoint folder: the model's and the optimizer's DCP folders."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.arange(6.0).reshape(2, 3)}}, checkpoint_id=ckpt / "pytorch_model_fsdp_0")
    dcp.save({"optimizer": {"state": {"w": {"exp_avg": torch.zeros(2, 3)}}}}, checkpoint_id=ckpt / "optimizer_0")


def _inspect_and_export_take_its_model_folder(ckpt, tmp_path) -> None:
    from conftest import run_cli

    shown = run_cli("inspect", ckpt, "--tensors")
    assert shown.returncode == 0, shown.stderr
    assert "pytorch_model_fsdp_0" in shown.stdout.splitlines()[0] and "model.w  float32 [2, 3]" in shown.stdout
    exported = run_cli("export", ckpt, tmp_path / "w.safetensors")
    assert exported.returncode == 0, exported.stderr
    assert "exporting pytorch_model_fsdp_0/" in exported.stdout
