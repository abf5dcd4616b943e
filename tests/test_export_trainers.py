"""Export from checkpoints written by the writers the other export tests do not use (tests/trainers_writer.py):
a Lightning ``Trainer(strategy="ddp")`` checkpoint file, a Lightning Fabric ``fabric.save`` (FSDP2 on 2 CPU
processes) whose model and optimizer carry the user's own names, and a torchtitan-style Llama state written by
``dcp.save`` from 2 gloo ranks with ``fully_shard``; exported to files and to a real S3 API server (moto),
against ``dcp_to_torch_save`` and ``transformers``' ``from_pretrained``."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import s3fs
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_cli
from s3_server import S3Server
from safetensors import safe_open
from shardscope.backend.export import ExportError, export, plan_export
from shardscope.backend.export.dcp_writer import import_file
from shardscope.backend.formats import open_checkpoint
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from trainers_writer import TITAN_TO_HF

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The three writers at once (each is mostly process start-up), and meanwhile a 34 MiB dcp.save (four
    8.5 MiB tensors) for the upload tests."""
    root = tmp_path_factory.mktemp("unseen")
    writer = str(HERE / "trainers_writer.py")
    procs = {name: subprocess.Popen([sys.executable, writer, name, str(root)], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, cwd=root,
                                    env={**os.environ, "MASTER_ADDR": "127.0.0.1",
                                         "MASTER_PORT": str(_free_port())})
             for name in ("trainer_ddp", "fabric", "titan")}
    g = torch.Generator().manual_seed(0)
    big = {"model": {f"layer{i}.weight": torch.randn(544, 4096, generator=g) for i in range(4)}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(big, checkpoint_id=str(root / "big"), no_dist=True)
    for name, p in procs.items():
        text = p.communicate(timeout=900)[0]
        assert p.returncode == 0, f"{name} writer failed:\n{text[-4000:]}"
    return root


def _flat_pt(path: Path) -> dict:
    with torch.serialization.safe_globals([io.BytesIO]):  # dcp_to_torch_save's file and ours alike hold one
        return torch.load(path, map_location="cpu", weights_only=True)


def _same(a, b, where: str = "") -> None:
    """Nested equality: tensors bit for bit with dtype and shape, BytesIO by content, the rest by value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, io.BytesIO):
        assert isinstance(b, io.BytesIO) and a.getvalue() == b.getvalue(), where
    else:
        assert type(a) is type(b) and a == b, where


def _one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


def test_lightning_ddp_checkpoint_file_exports_directly_as_import_then_export_does(written, tmp_path):
    """A Lightning DDP ``.ckpt`` (one torch.save file) exports directly, through the one door, to the same
    weights as turning it into a DCP folder first (``import``) and exporting that."""
    ckpt = written / "ddp.ckpt"
    out = run_cli("export", ckpt, tmp_path / "direct.safetensors")
    assert out.returncode == 0, out.stderr
    assert "layout: Lightning Trainer" in out.stdout and "optimizer_states" in out.stdout
    import_file(str(ckpt), str(tmp_path / "dcp"))  # what `shardscope import` runs
    out = run_cli("export", tmp_path / "dcp", tmp_path / "m.safetensors")
    assert out.returncode == 0, out.stderr
    assert "layout: Lightning Trainer" in out.stdout and "optimizer_states" in out.stdout
    ref = _flat_pt(written / "ddp_reference.pt")
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as h, \
            safe_open(str(tmp_path / "direct.safetensors"), framework="pt") as d:
        assert set(h.keys()) == set(d.keys()) == {f"body.{k}" for k in ref}
        for k in ref:
            assert torch.equal(h.get_tensor(f"body.{k}"), ref[k]), k
            assert torch.equal(d.get_tensor(f"body.{k}"), ref[k]), k


def test_fabric_save_with_the_users_own_names_exports_the_model_only(written, tmp_path):
    """``fabric.save(path, {"net": model, "opt": optimizer})``: the optimizer is known by its shape."""
    ckpt = open_checkpoint(written / "fabric", use_cache=False)
    plan = plan_export(ckpt, "safetensors")
    assert "Fabric" in plan.layout.name and "opt" in plan.layout.name
    ref = _flat_pt(written / "fabric_reference.pt")
    assert {it.key for it in plan.items} == set(ref)
    assert any("(opt)" in n for n in plan.left_out), plan.left_out
    export(plan, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as h:
        for k in ref:
            assert torch.equal(h.get_tensor(k), ref[k]), k
    # .pt: what dcp_to_torch_save gives, plus meta.pt merged in (as Lightning's own consolidation does)
    export(plan_export(ckpt, "torch"), str(tmp_path / "all.pt"))
    dcp_to_torch_save(written / "fabric", tmp_path / "torch.pt")
    ours, theirs = _flat_pt(tmp_path / "all.pt"), _flat_pt(tmp_path / "torch.pt")
    assert ours.pop("iteration") == 7 and ours.pop("hparams") == {"lr": 0.01}
    _same(ours, theirs)


def test_titan_fsdp2_state_to_hugging_face_llama_gives_the_same_logits(written, tmp_path):
    from transformers import LlamaForCausalLM

    dst = tmp_path / "hf"
    renames = [a for rule in TITAN_TO_HF for a in ("--rename", rule)]
    out = run_cli("export", written / "titan", dst, *renames, "--config", written / "cfg" / "config.json",
                  "--max-shard-size", "200KB")
    assert out.returncode == 0, out.stderr
    assert "layout: torchtitan-style" in out.stdout and "optimizer" in out.stdout and "dataloader" in out.stdout
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3 and (dst / "config.json").exists()
    for f in dst.iterdir():  # no local path anywhere in what people upload
        assert str(written).encode() not in f.read_bytes() and str(tmp_path).encode() not in f.read_bytes(), f
    model = LlamaForCausalLM.from_pretrained(dst).eval()
    ref = torch.load(written / "logits.pt", weights_only=True)
    with torch.no_grad():
        assert torch.equal(model(ref["ids"]).logits, ref["logits"])


def test_titan_pt_equals_dcp_to_torch_save_bytesio_included(written, tmp_path):
    export(plan_export(open_checkpoint(written / "titan", use_cache=False), "torch"), str(tmp_path / "a.pt"))
    dcp_to_torch_save(written / "titan", tmp_path / "torch.pt")
    ours = _flat_pt(tmp_path / "a.pt")
    assert isinstance(ours["train_state"]["global_avg_losses"], io.BytesIO)
    _same(ours, _flat_pt(tmp_path / "torch.pt"))


def test_titan_selection_errors_are_one_line_and_write_nothing(written, tmp_path):
    src = written / "titan"
    _one_line(run_cli("export", src, tmp_path / "x.safetensors", "--only", "model"),
              "model (a prefix to export) matches no entry", "tok_embeddings")
    ckpt = open_checkpoint(src, use_cache=False)
    with pytest.raises(ExportError, match=r"nosuch \(a prefix to leave out\) matches no entry"):
        plan_export(ckpt, "safetensors", exclude=["nosuch"])
    with pytest.raises(ExportError, match=r"both become 'L\.attention\.wq\.weight'"):
        plan_export(ckpt, "safetensors", rename=[r"^layers\.\d+\.=L."])
    with pytest.raises(ExportError, match="matches no exported key"):
        plan_export(ckpt, "safetensors", rename=["^optimizer=x"])  # left out by default: no key to rename
    plan = plan_export(ckpt, "safetensors", only=["layers"], exclude=["layers.1", "output"])
    assert {it.key.split(".")[0] for it in plan.items} == {"layers"}
    assert not any(it.key.startswith("layers.1.") for it in plan.items)
    # an --exclude outside what --only selects is no error, but it is said: it changed nothing
    assert "leaving out output changed nothing: what it names is left out anyway (outside layers)" in plan.left_out
    assert not any("leaving out layers.1 changed nothing" in n for n in plan.left_out)
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def s3(written):
    server = S3Server()
    try:
        fs = s3fs.S3FileSystem(key="testing", secret="testing", use_listings_cache=False, skip_instance_cache=True,
                               client_kwargs={"endpoint_url": server.endpoint})
        fs.mkdir("src")
        fs.mkdir("dst")
        for name in ("titan", "fabric"):
            fs.put(f"{written / name}/", f"src/{name}/", recursive=True)
        yield server, fs
    finally:
        server.stop()


def _cli(server, *args: str, options: bool = True, **kw) -> subprocess.Popen:
    """The CLI with credentials in the environment and the endpoint only in --storage-option."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    opts = ["--storage-option", f"client_kwargs.endpoint_url={server.endpoint}"] if options else []
    return subprocess.Popen([sys.executable, "-m", "shardscope.app.cli", *map(str, args), *opts],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)


def _done(p: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_export_from_and_to_s3_single_and_sharded(s3, written, tmp_path):
    server, fs = s3
    jobs = {"pt": _cli(server, "export", "s3://src/titan", tmp_path / "t.pt"),
            "file": _cli(server, "export", "s3://src/fabric", "s3://dst/fabric.safetensors"),
            "dir": _cli(server, "export", written / "titan", "s3://dst/hf/", "--max-shard-size", "200KB",
                        "--config", written / "cfg" / "config.json", *[a for r in TITAN_TO_HF for a in
                                                                      ("--rename", r)])}
    done = {k: _done(p) for k, p in jobs.items()}
    for k, proc in done.items():
        assert proc.returncode == 0, (k, proc.stderr)
    assert "uploaded: 6 objects" in done["dir"].stdout, done["dir"].stdout[-600:]  # 4 shards, index, manifest
    dcp_to_torch_save(written / "titan", tmp_path / "torch.pt")
    _same(_flat_pt(tmp_path / "t.pt"), _flat_pt(tmp_path / "torch.pt"))
    local = plan_export(open_checkpoint(written / "fabric", use_cache=False), "safetensors")
    export(local, str(tmp_path / "f.safetensors"))
    assert fs.cat("dst/fabric.safetensors") == (tmp_path / "f.safetensors").read_bytes()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find("dst/hf")) == [
        "config.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors", "model.safetensors.index.json", "shardscope-manifest.json"]
    index = fs.cat("dst/hf/model.safetensors.index.json")
    assert str(written).encode() not in index and b"model.embed_tokens.weight" in index


def test_remote_failures_are_one_line_naming_the_url_and_write_only_credentials_commit(s3, written, tmp_path):
    server, fs = s3
    closed = f"client_kwargs.endpoint_url=http://127.0.0.1:{_free_port()}"  # nothing listens there
    t0 = time.monotonic()
    jobs = {
        "unreachable": _cli(server, "export", "s3://src/titan", tmp_path / "a.pt", "--storage-option", closed,
                            options=False),
        "bad endpoint": _cli(server, "export", written / "fabric", "s3://dst/b.safetensors", "--storage-option",
                             "client_kwargs.endpoint_url=notaurl", options=False),
        "no bucket": _cli(server, "export", "s3://nobucket/titan", tmp_path / "c.pt"),
        "no key": _cli(server, "export", "s3://src/nokey", tmp_path / "d.pt"),
        "no dst bucket": _cli(server, "export", written / "fabric", "s3://nobucket/e.safetensors"),
        "denied": _cli(server, "export", "s3://src/fabric", tmp_path / "f.safetensors", "--storage-option",
                       "anon=true"),
        # moto lets an anonymous client PUT but not HEAD: the upload (checked by the server on receipt) stays,
        # and the summary says it could not be read back, instead of failing with the object committed
        "write-only": _cli(server, "export", written / "fabric", "s3://dst/anon.safetensors", "--storage-option",
                           "anon=true"),
    }
    done = {k: _done(p) for k, p in jobs.items()}
    wrote = done.pop("write-only")
    assert wrote.returncode == 0, wrote.stderr
    assert "could not be read back with these credentials" in wrote.stdout and fs.exists("dst/anon.safetensors")
    expect = {"unreachable": ("s3://src/titan", "cannot reach the storage endpoint"),
              "bad endpoint": ("s3://dst/b.safetensors", "bad storage options", "notaurl"),
              "no bucket": ("s3://nobucket/titan", "no such file"),
              "no key": ("s3://src/nokey", "no such file"),
              "no dst bucket": ("s3://nobucket/e.safetensors", "bucket nobucket does not exist"),
              "denied": ("s3://src/fabric/__", "access denied", "tensor net.")}
    for k, proc in done.items():
        _one_line(proc, *expect[k])
    assert time.monotonic() - t0 < 90  # all seven at once, on a busy machine; alone one takes a few seconds
    assert not list(tmp_path.iterdir()) and not fs.exists("dst/b.safetensors")


@pytest.mark.parametrize("dst, extra, held", [
    ("s3://dst/big.safetensors", (), "partNumber=2"),  # Ctrl-C while the parts go out
    ("s3://dst/bigdir", ("--max-shard-size", "9MB"), "PUT /dst/bigdir/model-00002-of-00004.safetensors<-"),
])
def test_ctrl_c_during_the_upload_commits_nothing(s3, written, dst, extra, held):
    """The server holds one request of the upload (a part, or the move of shard 2 into place) until the
    signal was sent, so the upload cannot finish first however fast the machine is."""
    server, fs = s3
    server.hold(held)
    try:
        proc = _cli(server, "export", written / "big", dst, *extra)
        server.wait_until_held(proc)
        proc.send_signal(signal.SIGINT)
    finally:
        server.hold("")
    done = _done(proc)
    assert done.returncode == 130, (done.stdout, done.stderr)
    fs.invalidate_cache()
    key = dst.removeprefix("s3://")
    assert not fs.exists(key) and not fs.find(key)
    assert not [p for p in fs.ls("dst") if ".shardscope-tmp-" in p]
    assert not fs.call_s3("list_multipart_uploads", Bucket="dst").get("Uploads")
