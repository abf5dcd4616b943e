"""``import HF_FOLDER DST --as torchtitan``: a Hugging Face Llama as a DCP checkpoint in torchtitan's names that
torchtitan's own Llama 3 model loads with ``dcp.load`` and runs with the HF model's logits (within 1e-5, fp32), its
tensors equal to torchtitan's own ``Llama3StateDictAdapter.from_hf`` bit for bit (tests/torchtitan_import_check.py,
in a subprocess). The HF models are transformers' ``LlamaForCausalLM`` with torchtitan_writer's shapes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow  # a torchtitan subprocess
VARIANTS = {"gqa_untied": (4, 2, False), "gqa_tied": (4, 1, True)}  # name -> heads, kv heads, tied
IMPORTS = {"tt": (), "tt_ranks3": ("--ranks", "3")}  # folder -> the import's options


def _hf_model(root: Path, name: str, heads: int, kv: int, tied: bool) -> Path:
    """An HF Llama saved by ``save_pretrained``, with tokens and the logits it gives them (fp32)."""
    import torch
    from safetensors.torch import save_file
    from torchtitan_writer import SEQ, hf_config
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(len(name))
    cfg = hf_config(heads, kv, tied)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    with torch.no_grad():  # norms away from 1, so a wrong norm mapping shows in the logits
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    folder = root / name
    model.save_pretrained(folder / "hf")
    tokens = torch.randint(0, cfg["vocab_size"], (2, SEQ))
    with torch.no_grad():
        save_file({"logits": model(tokens).logits.float().contiguous()}, str(folder / "logits.safetensors"))
    save_file({"tokens": tokens}, str(folder / "tokens.safetensors"))
    return folder


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[Path, dict, dict]:
    """Each HF model imported as each of IMPORTS, with the CLI's output, and the oracle's report on them all."""
    pytest.importorskip("torchtitan")
    root = tmp_path_factory.mktemp("import_hf")
    out = {}
    for name, (heads, kv, tied) in VARIANTS.items():
        folder = _hf_model(root, name, heads, kv, tied)
        for dst, options in IMPORTS.items():
            out[f"{name}/{dst}"] = run_cli("import", folder / "hf", folder / dst, "--as", "torchtitan", *options,
                                           check=True).stdout
    proc = subprocess.run([sys.executable, str(HERE / "torchtitan_import_check.py"), str(root)], capture_output=True,
                          text=True, timeout=900, cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, out, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", [f"{v}/{i}" for v in VARIANTS for i in IMPORTS])
def test_torchtitan_loads_the_import_and_gives_the_hf_logits(imported, case):
    root, out, report = imported
    assert "Hugging Face LlamaForCausalLM -> torchtitan names" in out[case], out[case]
    assert "inverse rotary permutation of q and k" in out[case] and "verified:" in out[case], out[case]
    assert case in report, sorted(report)
    got = report[case]
    assert got["keys"] == [[], []], got["keys"]  # every key torchtitan's from_hf makes, and no other
    assert got["unequal"] == [], got["unequal"]  # bit for bit
    assert got["logits"] <= 1e-5, got["logits"]
    sidecar = json.loads((root / (case + ".shardscope.json")).read_text())
    heads = VARIANTS[case.split("/")[0]][1]
    assert sidecar["model"]["tensors"]["layers.1.attention.qkv_linear.wk.weight"] == {
        "source": "model.layers.1.self_attn.k_proj.weight",
        "transform": f"inverse rotary permutation over {heads} heads (halves to adjacent pairs)"}


def test_an_architecture_it_does_not_name_is_one_line_exit_2(imported, tmp_path):
    root = imported[0]
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((root / "gqa_untied" / "hf" / "model.safetensors").read_bytes())
    doc = json.loads((root / "gqa_untied" / "hf" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**doc, "architectures": ["Qwen3ForCausalLM"],
                                                    "model_type": "qwen3"}))
    proc = run_cli("import", folder, tmp_path / "tt", "--as", "torchtitan")
    assert proc.returncode == 2, proc.stderr
    assert "Qwen3ForCausalLM cannot be imported in torchtitan's names (the import takes LlamaForCausalLM)" in \
        proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    (folder / "config.json").write_text(json.dumps({**doc, "num_hidden_layers": 3}))
    proc = run_cli("import", folder, tmp_path / "tt", "--as", "torchtitan")
    assert proc.returncode == 2 and "model.layers.2." in proc.stderr and "lacks it" in proc.stderr, proc.stderr
    (folder / "config.json").unlink()
    proc = run_cli("import", folder, tmp_path / "tt", "--as", "torchtitan")
    assert proc.returncode == 2 and "no transformers config.json" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "tt").exists()


def test_the_inverse_rotary_permutation_undoes_the_export_s():
    import torch
    from shardscope.backend.export.hf_transforms import Step, Transform, TransformError

    w = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)
    forward = Transform((Step("rotary", (2,)),))
    assert torch.equal(forward.inverse().apply(forward.apply(w)), w)
    assert not torch.equal(forward.apply(w), w)
    with pytest.raises(TransformError, match="no inverse on one tensor"):
        Transform((Step("rows", (0, 4)),)).inverse()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_import_exported_back_is_the_hf_model_bit_for_bit(imported, tmp_path, variant):
    """HF -> torchtitan -> HF is the identity; the import's manifest (its output's proof) is the sealed source the
    export proves its untransformed tensors against, and records the transformed ones as derived from it."""
    import torch
    from safetensors.torch import load_file

    folder = imported[0] / variant
    proc = run_cli("export", folder / "tt", tmp_path / "hf", "--hf", "--config", folder / "hf" / "config.json",
                   check=True)
    assert "torchtitan names -> Hugging Face LlamaForCausalLM" in proc.stdout, proc.stdout
    written, original = load_file(str(tmp_path / "hf" / "model.safetensors")), \
        load_file(str(folder / "hf" / "model.safetensors"))
    assert sorted(written) == sorted(original)
    for key, value in original.items():
        assert torch.equal(written[key], value), key
    manifest = json.loads((tmp_path / "hf" / "shardscope-manifest.json").read_text())["tensors"]
    assert manifest["model.layers.0.self_attn.q_proj.weight"]["transform"].startswith("rotary permutation over 4")
