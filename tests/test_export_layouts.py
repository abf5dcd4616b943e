"""Which keys are the model: layouts recognised from real saves (export/layouts.py)."""

from __future__ import annotations

import subprocess
import sys
import warnings

import torch
from conftest import run_cli
from safetensors.torch import load_file
from shardscope.backend.export.layouts import layout_of_names

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
