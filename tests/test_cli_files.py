"""The inspect, verify, show and export commands on every path the window opens besides a DCP folder: a
.safetensors file, a torch file (.pt, a Lightning .ckpt), an HF index folder and its index file (they once
refused every one of them: "is a file, not a checkpoint folder")."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from safetensors.torch import save_file


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("files")
    g = torch.Generator().manual_seed(0)
    save_file({"fc.weight": torch.randn(4, 3, generator=g), "fc.bias": torch.arange(4.0)}, str(root / "m.safetensors"),
              metadata={"shardscope_objects": json.dumps({"step": 7})})
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    torch.save({"state_dict": {"w": torch.full((3, 3), 2.5)}, "optimizer_states": [opt.state_dict()],
                "global_step": 5, "lr": 1.5}, root / "epoch=0-step=5.ckpt")
    torch.save({"w": torch.full((64,), 3.0)}, root / "w.pt")
    hf = root / "hf"
    hf.mkdir()
    save_file({"x": torch.ones(3)}, str(hf / "model-00001-of-00002.safetensors"))
    save_file({"y": torch.zeros(2)}, str(hf / "model-00002-of-00002.safetensors"))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}}))
    return root


@pytest.mark.parametrize("name, tensors, objects", [
    ("m.safetensors", 2, 1), ("epoch=0-step=5.ckpt", 1, None), ("w.pt", 1, 0), ("hf", 2, 0),
    ("hf/model.safetensors.index.json", 2, 0)])
def test_inspect_and_verify_take_files(files, name, tensors, objects):
    path = files / name
    proc = run_cli("inspect", path, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert len(doc["tensors"]) == tensors and (objects is None or len(doc["objects"]) == objects)
    text = run_cli("inspect", path)
    assert text.returncode == 0 and "healthy" in text.stdout, text.stdout + text.stderr
    for deep in ((), ("--deep",)):
        proc = run_cli("verify", path, *deep)
        assert proc.returncode == 0 and "healthy" in proc.stdout, proc.stdout + proc.stderr


def test_show_reads_values_of_files(files):
    proc = run_cli("show", files / "epoch=0-step=5.ckpt", "state_dict.w")
    assert proc.returncode == 0 and "min 2.5  max 2.5" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli("show", files / "epoch=0-step=5.ckpt", "lr")
    assert proc.returncode == 0 and "value  1.5" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli("show", files / "m.safetensors", "step")
    assert proc.returncode == 0 and "value  7" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli("show", files / "hf" / "model.safetensors.index.json", "x")
    assert proc.returncode == 0 and "min 1  max 1" in proc.stdout, proc.stdout + proc.stderr


def test_a_damaged_torch_file_is_found_by_verify_and_refused_by_show(files, tmp_path):
    """The tensor's record fails its stored CRC32: verify --deep says so (exit 1), show gives no value (exit 2)."""
    bad = tmp_path / "w.pt"
    data = bytearray((files / "w.pt").read_bytes())
    at = data.find(torch.full((64,), 3.0).numpy().tobytes())
    assert at > 0
    data[at + 10] ^= 0xFF
    bad.write_bytes(bytes(data))
    proc = run_cli("verify", bad, "--deep")
    assert proc.returncode == 1 and "CRC32" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli("show", bad, "w")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "CRC32" in proc.stderr, proc.stderr
    assert os.path.basename(bad) in proc.stderr


def test_a_file_that_is_no_checkpoint_is_one_line(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    for cmd in ("inspect", "verify"):
        proc = run_cli(cmd, notes)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not a checkpoint file" in proc.stderr


def test_export_takes_a_safetensors_file(files, tmp_path):
    """The window exports a .safetensors file it opened; so does the CLI (to a .pt, with its entries)."""
    out = tmp_path / "m.pt"
    proc = run_cli("export", files / "m.safetensors", out)
    assert proc.returncode == 0 and "verified" in proc.stdout, proc.stdout + proc.stderr
    got = torch.load(out, weights_only=True)
    assert got["step"] == 7 and torch.equal(got["fc.bias"], torch.arange(4.0)) and set(got) == {
        "fc.weight", "fc.bias", "step"}
    proc = run_cli("diff", files / "m.safetensors", out)
    assert proc.returncode == 0 and "0 changed, 3 unchanged" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli("export", files / "w.pt", tmp_path / "w.safetensors")  # a torch file too, read by its records
    assert proc.returncode == 0 and "verified" in proc.stdout, proc.stdout + proc.stderr
    assert run_cli("diff", files / "w.pt", tmp_path / "w.safetensors").returncode == 0


def test_inspect_says_what_kind_a_checkpoint_is(files, fixtures):
    """A checkpoint says what it is: resumable (optimizer state beside the weights) or weights, as `ls` does."""
    want = {files / "epoch=0-step=5.ckpt": "resumable", files / "w.pt": "weights", files / "m.safetensors": "weights",
            files / "hf": "weights", fixtures["fsdp2_r2"]: "resumable", fixtures["lightning_r2"]: "resumable"}
    for path, kind in want.items():
        proc = run_cli("inspect", path, "--json")
        assert proc.returncode == 0 and json.loads(proc.stdout)["kind"] == kind, (path, proc.stderr)
    text = run_cli("inspect", files / "w.pt")
    assert "kind       weights (weights only: no optimizer state to resume from)" in text.stdout


def test_export_progress_says_it_counts_reading_and_verifying(fixtures, tmp_path):
    """On a terminal, export's progress read "1.2 GiB/2.4 GiB" for a 1.2 GiB output: it counts each byte read
    and re-read to verify. The line says so."""
    leader, follower = pty.openpty()
    dst = tmp_path / "m.safetensors"
    proc = subprocess.run([sys.executable, "-m", "shardscope.app.cli", "export", str(fixtures["fsdp2_r2"]),
                           str(dst)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower, timeout=300,
                          text=True)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal's other end is closed: everything was read
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert proc.returncode == 0, shown
    lines = [x for x in shown.decode().replace("\r", "\n").split("\n") if "] " in x]
    assert lines and all("read+verified " in x and " of " in x for x in lines), lines
