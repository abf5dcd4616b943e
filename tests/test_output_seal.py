"""Outputs carry their proof: export, import and reshard write the manifest of what they wrote (beside a file,
inside a folder), whose tensor digests equal a sealed source's for every tensor copied unchanged; a cast records
the source's digest it was derived from; a sealed source whose manifest disagrees with its bytes fails the output."""

from __future__ import annotations

import json
import os

import torch
from conftest import run_cli
from safetensors.torch import load_file
from shardscope.backend.filenames import MANIFEST_NAME
from test_seal import logical_sha, sealed

MANIFEST_SUFFIX = "." + MANIFEST_NAME


def manifest_of(path) -> dict:
    p = os.path.join(path, MANIFEST_NAME) if os.path.isdir(path) else str(path) + MANIFEST_SUFFIX
    with open(p, "rb") as f:
        return json.loads(f.read())


def test_export_reshard_and_import_outputs_carry_the_source_digests(copy_of, tmp_path):
    src = copy_of("fsdp2_r2")
    a = sealed(src)["tensors"]
    st, pt, r4 = tmp_path / "e.safetensors", tmp_path / "e.pt", tmp_path / "r4"
    for args in [("export", src, st, "--strip-prefix", ""), ("export", src, pt, "--strip-prefix", ""),
                 ("reshard", src, r4, "--ranks", "4")]:
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr
    for out in (st, pt, r4):
        m = manifest_of(out)["tensors"]
        assert m and m.keys() <= a.keys(), out
        assert all(m[k]["sha256"] == a[k]["sha256"] and "derived_from" not in m[k] for k in m), out
        assert run_cli("verify", out).returncode == 0, out  # the manifest is the output's own: plain verify agrees
    assert len(manifest_of(r4)["files"]) == 5 and manifest_of(r4)["tensors"].keys() == a.keys()
    assert list(manifest_of(st)["files"]) == ["e.safetensors"]
    # import of a sealed .pt: the DCP folder's digests are the file's
    torch.save({"w": torch.randn(300, 7), "b": torch.arange(5)}, tmp_path / "m.pt")
    p = sealed(tmp_path / "m.pt")["tensors"]
    proc = run_cli("import", tmp_path / "m.pt", tmp_path / "imported", "--ranks", "2")
    assert proc.returncode == 0, proc.stderr
    got = manifest_of(tmp_path / "imported")["tensors"]
    assert got.keys() == p.keys() and all(got[k]["sha256"] == p[k]["sha256"] for k in p)


def test_a_cast_records_the_digest_it_was_derived_from(copy_of, tmp_path):
    src = copy_of("fsdp2_r2")
    a = sealed(src)["tensors"]
    out = tmp_path / "bf.safetensors"
    proc = run_cli("export", src, out, "--strip-prefix", "", "--dtype", "bf16")
    assert proc.returncode == 0, proc.stderr
    m = manifest_of(out)["tensors"]
    loaded = load_file(out)
    cast = [k for k in m if a[k]["dtype"] != "bfloat16"]
    assert cast
    for k in cast:
        assert m[k]["derived_from"] == a[k]["sha256"] and "bfloat16" in m[k]["transform"]
        assert m[k]["sha256"] == logical_sha(loaded[k]) != a[k]["sha256"]


def test_a_sealed_source_whose_manifest_disagrees_fails_the_export(copy_of, tmp_path):
    src = copy_of("fsdp2_r2")
    doc = sealed(src)
    fqn = "model.emb.weight"
    doc["tensors"][fqn]["sha256"] = "0" * 64  # the manifest edited: it no longer vouches for these bytes
    with open(src / MANIFEST_NAME, "w") as f:
        json.dump(doc, f)
    out = tmp_path / "e.safetensors"
    proc = run_cli("export", src, out, "--strip-prefix", "")
    assert proc.returncode == 1
    assert fqn in proc.stdout + proc.stderr and "manifest" in proc.stdout + proc.stderr
    assert not os.path.lexists(out) and not os.path.lexists(str(out) + MANIFEST_SUFFIX)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary left behind
    proc = run_cli("reshard", src, tmp_path / "r4", "--ranks", "4")
    assert proc.returncode == 1 and fqn in proc.stdout + proc.stderr and not os.path.lexists(tmp_path / "r4")


def test_an_unsealed_source_gives_an_output_with_its_own_manifest_and_force_replaces_it(fixtures, tmp_path):
    out = tmp_path / "e.safetensors"
    assert run_cli("export", fixtures["fsdp2_r2"], out, "--strip-prefix", "").returncode == 0
    first = manifest_of(out)
    loaded = load_file(out)
    assert all(first["tensors"][k]["sha256"] == logical_sha(loaded[k]) for k in loaded)
    proc = run_cli("export", fixtures["fsdp2_r2"], out, "--only", "model.emb", "--strip-prefix", "", "--force")
    assert proc.returncode == 0, proc.stderr
    assert manifest_of(out)["tensors"].keys() == load_file(out).keys() != first["tensors"].keys()
    assert run_cli("verify", out).returncode == 0


def test_an_average_carries_the_manifest_of_its_new_values(fixtures, tmp_path):
    out = tmp_path / "avg.safetensors"
    proc = run_cli("average", fixtures["steps_r2"] / "step2", fixtures["steps_r2"] / "step3", out)
    assert proc.returncode == 0, proc.stderr
    m = manifest_of(out)["tensors"]
    loaded = load_file(out)
    assert m.keys() == loaded.keys() and all(m[k]["sha256"] == logical_sha(loaded[k]) for k in loaded)
    assert run_cli("verify", out).returncode == 0
