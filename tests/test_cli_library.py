"""The ``ls`` and ``prune`` commands: --storage-option."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import s3fs
from s3_server import S3Server


def test_ls_and_prune_take_storage_options(fixtures):
    server = S3Server()
    try:
        fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": server.endpoint})
        fs.mkdir("runs")
        for step in (100, 200):
            fs.put(f"{fixtures['fsdp2_r2']}/", f"runs/exp/step_{step}/", recursive=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        options = ["--storage-option", f"client_kwargs.endpoint_url={server.endpoint}",
                   "--storage-option", "key=testing", "--storage-option", "secret=testing"]
        cmd = [sys.executable, "-m", "shardscope.app.cli"]
        proc = subprocess.run([*cmd, "ls", "s3://runs", *options, "--json"], capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        steps = sorted(c["step"] for c in json.loads(proc.stdout)["checkpoints"])
        assert steps == [100, 200]
        proc = subprocess.run([*cmd, "prune", "s3://runs", "--keep-last", "1", *options], capture_output=True,
                              text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        # step_200 was uploaded a moment ago, so it may still count as being written: kept either way
        assert re.search(r"^plan: remove [01] of 2 checkpoints, freeing", proc.stdout, re.M), proc.stdout
        # without the options the endpoint is unknown: the same listing fails with one line, exit 2
        env["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"
        proc = subprocess.run([*cmd, "ls", "s3://runs"], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    finally:
        server.stop()


LS_IMPORTS = """
import sys
from shardscope.app.cli.main import main
rc = main(sys.argv[1:])
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "numpy", "fsspec", "safetensors"})
print("HEAVY", ",".join(heavy), file=sys.stderr)
sys.exit(rc)
"""


def test_ls_of_a_local_tree_imports_neither_torch_nor_numpy(fixtures, tmp_path):
    """A listing reads names, stat and a few header bytes: what torch, numpy or fsspec would add to every `ls` is
    their import time (about 1 s for torch), more than the whole listing of 10,000 checkpoints."""
    import shutil

    import torch
    from safetensors.torch import save_file

    run = tmp_path / "runs" / "exp"
    shutil.copytree(fixtures["fsdp2_r2"], run / "checkpoints" / "step_100")
    shutil.copytree(fixtures["fsdp2_r2"], run / "checkpoints" / "step_200")
    save_file({"w": torch.ones(2)}, str(run / "model_step_300.safetensors"))
    torch.save({"w": torch.ones(2), "optimizer": {"state": {}}}, str(run / "step_400.pt"))
    for extra in ([], ["--json"]):
        proc = subprocess.run([sys.executable, "-c", LS_IMPORTS, "ls", str(tmp_path / "runs"), *extra],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert "step_100" in proc.stdout and "step_400.pt" in proc.stdout and "model_step_300" in proc.stdout
        assert "HEAVY \n" in proc.stderr, proc.stderr  # none of them imported
