"""``export --hf`` of checkpoints whose names are already Hugging Face's, under a trainer's container: torch's DCP
recipe (``get_model_state_dict``/``get_optimizer_state_dict`` of a ``LlamaForCausalLM`` and ``dcp.save``, tied and
untied), Lightning (a LightningModule holding the model as ``self.model``: ``state_dict.model.model.*``),
DeepSpeed ZeRO-3 (its fp32 master weights) and an HF Trainer ``checkpoint-N/`` (its own ``config.json``, no
``--config``). Each export loads with ``from_pretrained`` with no missing or unexpected key and gives the saved
model's logits. The saves are made by the frameworks themselves (tests/hf_containers_writer.py, trainers_writer.py)."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import run_cli

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow  # Lightning, DeepSpeed and transformers' Trainer run in subprocesses


def _dcp_recipe(out: Path, tied: bool) -> None:
    """torch's DCP recipe: the model's and the optimizer's state dicts under ``model`` and ``optim``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from trainers_writer import _logits, tiny_llama

    model = tiny_llama(tied)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    model.config.to_json_file(str(out / "config.json"))
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process, as meant
        warnings.simplefilter("ignore")
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=str(out / "ckpt"), no_dist=True)
    _logits(model, out / "logits.pt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Every source under its name: ``<name>/`` with the checkpoint, ``config.json`` and ``logits.pt``."""
    root = tmp_path_factory.mktemp("hf_containers")
    for name in ("lightning", "deepspeed_z3", "dcp_tied", "dcp_untied"):
        (root / name).mkdir()
    writers = [("hf_containers_writer.py", "lightning", root / "lightning"),
               ("hf_containers_writer.py", "deepspeed", root / "deepspeed_z3", "3"),
               ("trainers_writer.py", "transformers", root)]  # its trainer/checkpoint-2 and trainer.logits.pt
    procs = [subprocess.Popen([sys.executable, str(HERE / script), *map(str, args)], cwd=root, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for script, *args in writers]
    for tied in (True, False):
        _dcp_recipe(root / f"dcp_{'tied' if tied else 'untied'}", tied)
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    return root


SOURCES = {  # name -> (the checkpoint under the saved root, its config (None: the checkpoint's own), its logits)
    "dcp_untied": ("dcp_untied/ckpt", "dcp_untied/config.json", "dcp_untied/logits.pt"),
    "dcp_tied": ("dcp_tied/ckpt", "dcp_tied/config.json", "dcp_tied/logits.pt"),
    "lightning": ("lightning/model.ckpt", "lightning/config.json", "lightning/logits.pt"),
    "deepspeed_z3": ("deepspeed_z3/ckpt", "deepspeed_z3/config.json", "deepspeed_z3/logits.pt"),
    "trainer": ("trainer/checkpoint-2", None, "trainer.logits.pt"),
}
NOTES = {"dcp_untied": "torch DCP recipe", "dcp_tied": "torch DCP recipe",
         "lightning": "Hugging Face names under the container 'model.' (removed)",
         "deepspeed_z3": "left out: 42 tensors of training state (optimizer)",
         "trainer": "checkpoint-2/config.json (the checkpoint's own)"}


@pytest.mark.parametrize("name", list(SOURCES))
def test_an_hf_model_saved_by_a_trainer_exports_as_itself(saved, tmp_path, name):
    from transformers import AutoModelForCausalLM

    src, config, logits = SOURCES[name]
    proc = run_cli("export", saved / src, tmp_path / "hf", "--hf", *(["--config", saved / config] if config else []),
                   check=True)
    assert "Hugging Face names -> Hugging Face LlamaForCausalLM" in proc.stdout, proc.stdout
    assert NOTES[name] in proc.stdout, proc.stdout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                           output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    ref = torch.load(saved / logits, weights_only=True)
    with torch.no_grad():
        got = model.eval()(ref["ids"]).logits
    assert torch.allclose(got, ref["logits"], rtol=0, atol=1e-4), (got - ref["logits"]).abs().max()


@pytest.mark.parametrize("keys,container", [
    (["model.model.embed_tokens.weight", "model.lm_head.weight"], "model."),
    (["_forward_module.model.model.embed_tokens.weight", "_forward_module.model.lm_head.weight"],
     "_forward_module.model."),
    (["module.model.embed_tokens.weight", "module.model.norm.weight"], "module."),
    (["model.embed_tokens.weight", "lm_head.weight"], ""),  # HF's own names
    (["layers.0.attention.wq.weight", "tok_embeddings.weight"], ""),  # another scheme's
])
def test_the_container_is_what_stands_before_the_embedding(keys, container):
    from shardscope.backend.export.hf_writer import hf_container

    assert hf_container(keys) == container
