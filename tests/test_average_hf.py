"""An average written as a Hugging Face model: each output tensor is the combination of the inputs' source tensors
with the export's transform applied (torchtitan's rotary permutation here), so it equals the average of the inputs'
own ``export --hf`` outputs."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from shardscope.backend.export.average import average, make_recipe
from shardscope.backend.export.planner import plan_export
from shardscope.backend.export.writers import export
from shardscope.backend.formats import open_checkpoint
from titan_names import write, write_config


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_an_average_exported_as_an_hf_model_is_the_average_of_the_hf_exports(tmp_path):
    config = str(write_config(tmp_path / "config.json"))
    inputs = [tmp_path / "a", tmp_path / "b"]
    for seed, path in enumerate(inputs):
        write(path, seed=seed)
        export(plan_export(open_checkpoint(str(path), use_cache=False), "hf", config=config),
               str(tmp_path / f"{path.name}-hf"))
    average([str(p) for p in inputs], str(tmp_path / "avg-hf"), "hf", make_recipe(2, None, None),
            {"config": config})
    got, a, b = (_tensors(tmp_path / n) for n in ("avg-hf", "a-hf", "b-hf"))
    assert sorted(got) == sorted(a) and "model.layers.0.self_attn.q_proj.weight" in got
    for name, value in got.items():
        want = ((a[name].double() + b[name].double()) / 2).to(value.dtype)
        assert torch.equal(value, want), name
