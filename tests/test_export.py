"""Export against torch's own dcp_to_torch_save, on real multi-process checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess

import pytest
import torch
from conftest import run_cli, run_cli_peak
from make_fixtures import TinyNet
from safetensors import safe_open
from shardscope.backend.errors import Cancelled, CheckpointError
from shardscope.backend.export import ExportError, export, plan_export
from shardscope.backend.formats import open_checkpoint
from shardscope.backend.progress import Progress
from torch_reference import flatten, torch_consolidated


@pytest.mark.parametrize("name", ["fsdp2_r2", "fsdp2_r4", "ddp_r2", "lightning_r2"])
def test_torch_export_equals_dcp_to_torch_save(fixtures, tmp_path, name):
    dst = tmp_path / "out.pt"
    proc = run_cli("export", fixtures[name], dst)
    assert proc.returncode == 0, proc.stderr
    got = torch.load(dst, weights_only=True)
    ref = torch_consolidated(fixtures[name])
    if name == "lightning_r2":  # meta.pt merged at the top level, as Lightning's consolidation does
        assert {k: got.pop(k) for k in ("epoch", "global_step", "hparams")} == {
            "epoch": 1, "global_step": 2, "hparams": {"lr": 0.01}}
    fr, fg = flatten(ref), flatten(got)
    assert set(fr) == set(fg)
    for k, v in fr.items():
        assert (torch.equal(v, fg[k]) if isinstance(v, torch.Tensor) else v == fg[k]), k
    assert sorted(os.listdir(tmp_path)) == ["out.pt", "out.pt.shardscope-manifest.json", "out.pt.shardscope.json"]


@pytest.mark.parametrize("name", ["fsdp2_r4", "ddp_r2", "fsdp_safetensors_r2"])
def test_safetensors_export_equals_reference(fixtures, tmp_path, name):
    dst = tmp_path / "model.safetensors"
    proc = run_cli("export", fixtures[name], dst)
    assert proc.returncode == 0, proc.stderr
    assert "left out" in proc.stdout and "optimizer" in proc.stdout
    assert "layout: torch DCP recipe" in proc.stdout
    ref = flatten(torch_consolidated(fixtures["fsdp2_r2" if name == "fsdp_safetensors_r2" else name]))
    with safe_open(str(dst), framework="pt") as h:
        keys = set(h.keys())
        # by design the model weights come out under the module's own names (the 'model.' container removed)
        assert keys == {k.removeprefix("model.") for k in ref if k.startswith("model.")
                        and isinstance(ref[k], torch.Tensor)}
        for k in keys:
            assert torch.equal(h.get_tensor(k), ref["model." + k]), k
        assert "source" not in h.metadata()  # no local paths in outputs unless asked
        assert h.metadata()["format"] == "pt"
    header_len = int.from_bytes(dst.read_bytes()[:8], "little")
    assert header_len % 8 == 0


def test_model_only_export_loads_strict_and_matches_outputs(fixtures, tmp_path):
    dst = tmp_path / "weights.safetensors"
    assert run_cli("export", fixtures["ddp_r2"], dst, "--strip-prefix", "model.").returncode == 0
    from safetensors.torch import load_file

    fresh = TinyNet()
    fresh.load_state_dict(load_file(str(dst)), strict=True)
    trained = TinyNet()
    ref = torch_consolidated(fixtures["ddp_r2"])["model"]
    trained.load_state_dict(ref, strict=True)
    idx = torch.randint(0, 37, (3, 8))
    assert torch.equal(fresh(idx), trained(idx))


def test_sharded_output_respects_bound_and_index(fixtures, tmp_path):
    dst = tmp_path / "hf"
    proc = run_cli("export", fixtures["fsdp2_r4"], dst, "--max-shard-size", "3KB", "--only", "model",
                   "--only", "optimizer")
    assert proc.returncode == 0, proc.stderr
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    total = 0
    seen = []
    for f in files:
        with safe_open(str(dst / f), framework="pt") as h:
            size = sum(h.get_tensor(k).nbytes for k in h.keys())
            seen += list(h.keys())
        total += size
        assert size <= 3000 or len(list(safe_open(str(dst / f), framework="pt").keys())) == 1
    assert sorted(seen) == sorted(index["weight_map"]) and len(seen) == len(set(seen))
    assert index["metadata"]["total_size"] == total
    ckpt = open_checkpoint(fixtures["fsdp2_r4"])
    assert len(seen) == len(ckpt.tensors)


def test_bf16_keeps_integer_tensors(fixtures, tmp_path):
    dst = tmp_path / "o.pt"
    assert run_cli("export", fixtures["fsdp2_r2"], dst, "--dtype", "bf16").returncode == 0
    got = flatten(torch.load(dst, weights_only=True))
    ref = flatten(torch_consolidated(fixtures["fsdp2_r2"]))
    assert got["model.emb.weight"].dtype == torch.bfloat16
    assert torch.equal(got["model.emb.weight"], ref["model.emb.weight"].to(torch.bfloat16))
    ints = [k for k, v in ref.items() if isinstance(v, torch.Tensor) and not v.is_floating_point()]
    for k in ints:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k])


def test_missing_shard_leaves_nothing(copy_of, tmp_path):
    src = copy_of("fsdp2_r4")
    (src / "__1_0.distcp").unlink()
    out = tmp_path / "outdir"
    out.mkdir()
    proc = run_cli("export", src, out / "x.safetensors")
    assert proc.returncode == 2 and "__1_0.distcp" in proc.stderr and "Traceback" not in proc.stderr
    assert os.listdir(out) == []


def test_read_only_destination(fixtures, tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(stat.S_IRUSR | stat.S_IXUSR)
    immutable = False
    if os.access(out, os.W_OK) and shutil.which("chattr"):  # root ignores modes; not the immutable flag
        immutable = subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode == 0
    try:
        if os.access(out, os.W_OK):
            pytest.skip("cannot make a read-only folder here")
        proc = run_cli("export", fixtures["nopg"], out / "x.pt")
        assert proc.returncode == 2 and "cannot write" in proc.stderr
        assert os.listdir(out) == []
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(out)], check=True)
        out.chmod(stat.S_IRWXU)


def test_unwritable_destination_even_as_root(fixtures, tmp_path):
    proc = run_cli("export", fixtures["nopg"], tmp_path / "no" / "such" / "dir" / "x.pt")
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_cancel_leaves_nothing(fixtures, tmp_path):
    ckpt = open_checkpoint(fixtures["fsdp2_r4"])
    plan = plan_export(ckpt, "torch")
    progress = Progress(lambda done, total, msg: progress.cancel() if done > 1000 else None)
    with pytest.raises(Cancelled):
        export(plan, str(tmp_path / "x.pt"), progress=progress)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_truncated_shard_names_file_and_tensor(copy_of, tmp_path, fmt):
    src = copy_of("ddp_r2")
    f = src / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[:20000])
    ckpt = open_checkpoint(src, use_cache=False)
    plan = plan_export(ckpt, fmt, only=["model", "optimizer"])
    out = tmp_path / "out"
    out.mkdir()
    dst = out / f"x.{'pt' if fmt == 'torch' else 'safetensors'}"
    with pytest.raises((CheckpointError, ExportError)) as err:
        export(plan, str(dst))
    assert "__1_0.distcp" in str(err.value)
    cut = [t.fqn for t in ckpt.tensors if any(c.file == "__1_0.distcp" and c.offset + c.length > 20000
                                              for c in t.chunks)]
    cut += [o.fqn for o in ckpt.objects if o.file == "__1_0.distcp" and o.offset + o.length > 20000]
    assert any(name in str(err.value) for name in cut)
    assert list(out.iterdir()) == []


def test_refuses_to_overwrite_without_force(fixtures, tmp_path):
    dst = tmp_path / "x.pt"
    dst.write_text("keep me")
    assert run_cli("export", fixtures["nopg"], dst).returncode == 2
    assert dst.read_text() == "keep me"
    assert run_cli("export", fixtures["nopg"], dst, "--force").returncode == 0


def test_empty_and_tensorless_checkpoints_say_what_was_proven(tmp_path):
    """An empty state dict is refused in words that fit it; a .pt of non-tensor entries only is written,
    and "verified" does not claim tensor bytes that were never there."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... a single process"
        dcp.save({}, checkpoint_id=str(tmp_path / "empty"))
        dcp.save({"model": {}, "step": 3}, checkpoint_id=str(tmp_path / "objects"))
    for out in ("e.pt", "e.safetensors"):
        proc = run_cli("export", tmp_path / "empty", tmp_path / out)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "holds no entries" in proc.stderr and ".pt file" not in proc.stderr
        assert not (tmp_path / out).exists()
    proc = run_cli("export", tmp_path / "objects", tmp_path / "o.pt")
    assert proc.returncode == 0, proc.stderr
    assert "verified: nothing (no tensor was written" in proc.stdout and "every tensor's bytes" not in proc.stdout
    # the empty dict leaves no entry in the metadata: torch's dcp_to_torch_save gives the same
    assert torch.load(tmp_path / "o.pt", weights_only=True) == {"step": 3}


def test_force_over_a_model_folder_keeps_what_an_export_does_not_write(fixtures, tmp_path):
    """`export ... --max-shard-size ... --force` into an HF model folder replaced the whole folder, deleting
    its config.json and tokenizer files, and later every file of an export's kind (its pytorch_model.bin). Only
    what an earlier export recorded writing goes; everything else stays, hard-linked into the new folder (the
    same files, no copy)."""
    folder = tmp_path / "model"
    (folder / "tok").mkdir(parents=True)
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "tok" / "vocab.txt").write_text("x")
    (folder / "notes.md").symlink_to("config.json")
    (folder / "pytorch_model.bin").write_bytes(b"user weights")
    inode = (folder / "config.json").stat().st_ino
    proc = run_cli("export", fixtures["fsdp2_r4"], folder, "--max-shard-size", "4KB")
    assert proc.returncode == 2 and "allow overwriting it" in proc.stderr
    proc = run_cli("export", fixtures["fsdp2_r4"], folder, "--max-shard-size", "4KB", "--force")
    assert proc.returncode == 0, proc.stderr
    assert "kept in the folder (not written by an export): config.json, notes.md, pytorch_model.bin, tok" \
        in proc.stdout
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert {p.name for p in folder.iterdir()} == {*index["weight_map"].values(), "model.safetensors.index.json",
                                                  "config.json", "notes.md", "pytorch_model.bin", "tok"}
    # (no manifest: a kept symbolic link, notes.md, is not sealed, and a manifest never vouches for a folder in part)
    assert (folder / "config.json").stat().st_ino == inode and os.readlink(folder / "notes.md") == "config.json"
    assert (folder / "tok" / "vocab.txt").read_text() == "x"
    assert (folder / "pytorch_model.bin").read_bytes() == b"user weights"
    # --config writes config.json itself: over the user's own one (no export wrote it) it is refused
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "llama"}')
    proc = run_cli("export", fixtures["fsdp2_r4"], folder, "--max-shard-size", "8KB", "--config", cfg, "--force")
    assert proc.returncode == 2 and "config.json: exists and no earlier export recorded writing it" in proc.stderr
    assert json.loads((folder / "config.json").read_text()) == {"a": 1}
    # once an export wrote it (its sidecar records it), a later --config export replaces it
    (folder / "config.json").unlink()
    run_cli("export", fixtures["fsdp2_r4"], folder, "--max-shard-size", "8KB", "--config", cfg, "--force",
            check=True)
    cfg.write_text('{"model_type": "mistral"}')
    run_cli("export", fixtures["fsdp2_r4"], folder, "--max-shard-size", "8KB", "--config", cfg, "--force",
            check=True)
    assert json.loads((folder / "config.json").read_text()) == {"model_type": "mistral"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".shardscope-tmp")]


def test_export_from_a_safetensors_folder_streams_its_largest_tensor(tmp_path):
    """An HF folder's tensors have no stored CRC32: they are copied in blocks with their CRC32 taken as
    read, not loaded whole and copied once more (a 1 GiB tensor peaked at 2.3 GB; now about 240 MB)."""
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    big = torch.arange(96 << 20, dtype=torch.int32).view(-1, 1024)  # 384 MiB
    save_file({"w": big, "b": torch.ones(3)}, str(hf / "model-00001-of-00001.safetensors"))
    shard = "model-00001-of-00001.safetensors"
    index = {"metadata": {}, "weight_map": {"w": shard, "b": shard}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    del big
    for out in ("m.safetensors", "m.pt"):
        proc, peak_mib = run_cli_peak("export", hf, tmp_path / out, timeout=600)
        assert proc.returncode == 0, proc.stderr
        assert peak_mib < 384, f"{out}: peak {peak_mib} MiB for a 384 MiB tensor"
        assert "verified: every tensor's bytes" in proc.stdout
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("w"), torch.arange(96 << 20, dtype=torch.int32).view(-1, 1024))
    assert torch.equal(torch.load(tmp_path / "m.pt", weights_only=True, mmap=True)["w"][-1],
                       torch.arange((96 << 20) - 1024, 96 << 20, dtype=torch.int32))


def test_safetensors_header_is_the_json_of_its_entries_and_small_tensors_come_out_whole(tmp_path):
    """The header written entry by entry is exactly json.dumps of the dict it stands for (names with quotes,
    backslashes and non-ASCII characters, 0-d and empty tensors), and many small tensors written a run at a
    time come out equal, verified."""
    from safetensors.torch import load_file, save_file
    from shardscope.backend.export.safetensors_writer import build_header

    sd = {f"layer.{i}.w": torch.randn(3) for i in range(5000)}
    sd.update({'q"uote\\d': torch.arange(4), "naïve.π": torch.tensor(2.5), "empty": torch.zeros(0, 3),
               "big": torch.randn(300_000), "h": torch.ones(2, 2, dtype=torch.bfloat16)})
    save_file(sd, str(tmp_path / "in.safetensors"))
    plan = plan_export(open_checkpoint(str(tmp_path / "in.safetensors")), "safetensors")
    meta = {"format": "pt", 'k"ey': "välue\n"}
    head, offsets = build_header(list(plan.items), meta)
    expected: dict = {"__metadata__": meta}
    for it, off in zip(plan.items, offsets, strict=True):
        expected[it.key] = {"dtype": {"float32": "F32", "int64": "I64", "bfloat16": "BF16"}[it.dtype],
                            "shape": list(it.shape), "data_offsets": [off, off + it.nbytes]}
    text = json.dumps(expected, separators=(",", ":")).encode()
    assert head[8:].rstrip(b" ") == text
    result = export(plan, str(tmp_path / "out.safetensors"))
    assert result.verified
    out = load_file(str(tmp_path / "out.safetensors"))
    assert out.keys() == sd.keys() and all(torch.equal(out[k], v) for k, v in sd.items())
