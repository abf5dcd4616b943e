"""``export --hf`` of Megatron-Core GPT checkpoints, proven against Megatron's own forward.

tests/megatron_gpt_writer.py runs megatron-core's ``GPTModel`` (local layer spec, swiglu, RMSNorm, GQA, padded
vocabulary) on gloo at tensor-parallel 1 and 2, saves it with ``dist_checkpointing.save`` (``torch_dist``, ``args`` in
``common.pt``) and records its forward's logits. The export, given no ``--config`` (the HF config comes from the
arguments ``common.pt`` records), loads in transformers with no missing or unexpected key and gives those logits
within 1e-4 (fp32) over the tokenizer's vocabulary."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli
from test_export_hf import _check_logits, _load, _tensors

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow
ITER = "iter_0000010"
VOCAB = 100  # megatron_gpt_writer's NullTokenizer: vocab_size 99 plus its EOD token; padded to 128


@pytest.fixture(scope="module")
def megatron_gpt(tmp_path_factory) -> Path:
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("megatron_gpt")
    proc = subprocess.run([sys.executable, str(HERE / "megatron_gpt_writer.py"), str(root)], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def _reference(src: Path, tmp_path: Path, vocab: int = VOCAB) -> Path:
    """Megatron's ids and its logits cut to the first ``vocab`` columns (the padding's are no token's)."""
    import torch
    from safetensors.torch import load_file, save_file

    ref = tmp_path / "ref"
    ref.mkdir()
    shutil.copy(src / "tokens.safetensors", ref)
    logits = load_file(str(src / "logits.safetensors"))["logits"]
    assert logits.shape[-1] == 128 and vocab <= 128
    save_file({"logits": torch.clone(logits[..., :vocab]).contiguous()}, str(ref / "logits.safetensors"))
    return ref


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("variant,architecture", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                                  ("interleaved", "LlamaForCausalLM"), ("biased", "LlamaForCausalLM")])
def test_megatron_gpt_exports_without_a_config_and_runs_as_megatron_did(megatron_gpt, tmp_path, tp, variant,
                                                                        architecture):
    src = megatron_gpt / f"tp{tp}" / variant
    dst = tmp_path / "hf"
    proc = run_cli("export", src / "run", dst, "--hf", check=True)  # the save dir: its latest iteration
    out = proc.stdout
    assert f"Megatron save dir: exporting {ITER}/" in out, out
    assert f"Megatron-Core names -> Hugging Face {architecture}" in out, out
    assert "config: from Megatron's arguments in common.pt" in out, out
    assert ("rotary permutation of q and k" in out) == (variant == "interleaved"), out
    assert "fused QKV split by KV groups" in out, out
    assert "linear_qkv._extra_state/shard_0_2: a buffer Hugging Face's model does not load" in out, out
    config = json.loads((dst / "config.json").read_text())
    heads, groups, head_dim = {"llama": (4, 2, 16), "qwen2": (8, 2, 12), "interleaved": (4, 4, 16),
                               "biased": (4, 2, 16)}[variant]
    assert (config["vocab_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"]) == (VOCAB, heads, groups, head_dim), config
    written = _tensors(dst)
    assert written["model.embed_tokens.weight"].shape == (VOCAB, 64)
    assert ("lm_head.weight" in written) == (variant != "qwen2")  # qwen2's output layer is the embedding (tied)
    biases = {n.split(".", 3)[3] for n in written if n.endswith(".bias") and n.startswith("model.layers.1.")}
    assert biases == {"biased": {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                                 "self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias",
                                 "mlp.down_proj.bias"},
                      "qwen2": {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
                      }.get(variant, set()), biases
    _check_logits(_load(dst), _reference(src, tmp_path))
    sidecar = json.loads(Path(str(dst) + ".shardscope.json").read_text())
    assert sidecar["model"]["source_names"] == "Megatron-Core"
    assert sidecar["model"]["tensors"]["model.embed_tokens.weight"]["transform"] == f"rows 0:{VOCAB}"  # padding


def _config(src: Path, tmp_path: Path, **changes) -> Path:
    doc = {**json.loads((src / "config.json").read_text()), **changes}
    path = tmp_path / "user_config.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_given_config_wins_and_is_checked_against_the_shapes(megatron_gpt, tmp_path):
    """With ``--config`` the user's values are used (here: the padded vocabulary kept, so the logits are
    Megatron's over every padded column); a value that does not fit the shapes is one line, exit 2."""
    src = megatron_gpt / "tp2" / "llama"
    run_cli("export", src / "run" / ITER, tmp_path / "derived", "--hf", check=True)
    proc = run_cli("export", src / "run" / ITER, tmp_path / "hf", "--hf", "--config",
                   _config(tmp_path / "derived", tmp_path, vocab_size=128), check=True)
    assert "config: " + str(tmp_path / "user_config.json") in proc.stdout
    sidecar = json.loads(Path(str(tmp_path / "hf") + ".shardscope.json").read_text())
    assert "model.embed_tokens.weight" not in sidecar["model"]["tensors"]  # written as stored: padding kept
    _check_logits(_load(tmp_path / "hf"), _reference(src, tmp_path, vocab=128))
    bad = run_cli("export", src / "run" / ITER, tmp_path / "bad", "--hf", "--config",
                  _config(tmp_path / "derived", tmp_path, intermediate_size=80))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert re.search(r"linear_fc[12]\.weight: becomes model\.layers\.0\.mlp\.[\w.]+ of shape \[\d+, \d+\], but the "
                     r"config says \[(80, 64|64, 80)\]", bad.stderr), bad.stderr
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("variant,changes,words", [
    ("biased", {"attention_bias": False}, ("decoder.layers.self_attention.linear_", ".bias: becomes model.layers.0."
                                           "self_attn.", "a bias the config's llama model does not have")),
    ("biased", {"mlp_bias": False}, ("decoder.layers.mlp.linear_fc", ".bias: becomes model.layers.0.mlp.",
                                     "a bias the config's llama model does not have")),
    ("llama", {"attention_bias": True}, ("model.layers.0.self_attn.q_proj.bias: no source tensor makes it",)),
])
def test_a_config_whose_biases_are_not_the_checkpoints_is_one_line_exit_2(megatron_gpt, tmp_path, variant, changes,
                                                                          words):
    """Biases the config's model lacks would be unexpected keys, biases it has and the checkpoint lacks missing
    ones: both refused before anything is written."""
    src = megatron_gpt / "tp2" / variant / "run"
    run_cli("export", src, tmp_path / "derived", "--hf", check=True)
    proc = run_cli("export", src, tmp_path / "hf", "--hf", "--config", _config(tmp_path / "derived", tmp_path,
                                                                                 **changes))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert all(w in proc.stderr for w in words), proc.stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("changes,words", [
    ({"position_embedding_type": "learned_absolute"}, "position_embedding_type is 'learned_absolute'; the Hugging "
                                                      "Face export writes models with rotary position embeddings"),
    ({"normalization": "LayerNorm"}, "normalization is 'LayerNorm'"),
    ({"rotary_percent": 0.5}, "rotary_percent is 0.5"),
    ({"tokenizer_type": "HuggingFaceTokenizer"}, "records the padded vocabulary (128) but not the "
                                                 "HuggingFaceTokenizer's vocab_size; give the HF config.json"),
    ({"num_query_groups": None}, "gives no num_query_groups"),
    ({"num_layers": 3}, "is not 3 stacked layers (the config's num_hidden_layers)"),
    ({"hook": print}, "common.pt: cannot be read safely"),  # a global the allow-list refuses: no args at all
])
def test_arguments_the_export_cannot_follow_are_one_line_exit_2(megatron_gpt, tmp_path, changes, words):
    """``common.pt`` rewritten with other arguments (as Megatron's ``torch.save`` writes it): what no HF model
    computes, or a value the arguments lack, is one line naming it, exit 2, nothing written."""
    import torch
    from megatron_gpt_writer import VARIANTS, megatron_args

    folder = tmp_path / ITER
    shutil.copytree(megatron_gpt / "tp1" / "llama" / "run" / ITER, folder)
    args = megatron_args(VARIANTS["llama"], 1)
    for key, value in changes.items():
        setattr(args, key, value)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 10}, folder / "common.pt")
    proc = run_cli("export", folder, tmp_path / "hf", "--hf")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert words in proc.stderr, proc.stderr
    assert not (tmp_path / "hf").exists()
