"""``shardscope seal`` and the manifest checks: tensor digests equal across layouts (DCP at 2 and 4 ranks, a
safetensors export, the bytes torch loads), every file's SHA-256 checked by plain ``verify``, fail closed."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from conftest import run_cli
from safetensors.torch import save_file
from shardscope.backend.checkpoint.manifest import SCHEMA, parse_manifest
from shardscope.backend.filenames import MANIFEST_NAME

MANIFEST_SUFFIX = "." + MANIFEST_NAME


def logical_sha(t: torch.Tensor) -> str:
    """SHA-256 of the bytes torch loads: C-contiguous, in the stored dtype (bfloat16 viewed as int16)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def sealed(path) -> dict:
    p = os.path.join(path, MANIFEST_NAME) if os.path.isdir(path) else str(path) + MANIFEST_SUFFIX
    proc = run_cli("seal", path)
    assert proc.returncode == 0, proc.stderr
    with open(p, "rb") as f:
        return json.loads(f.read())


def flatten(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}{i}.")
    elif isinstance(obj, torch.Tensor):
        yield prefix[:-1], obj


def test_digests_equal_across_reshard_export_and_torch_load(copy_of, tmp_path):
    src = copy_of("fsdp2_r2")
    a = sealed(src)
    assert a["schema"] == SCHEMA and set(a["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    r4, exported = tmp_path / "r4", tmp_path / "e.safetensors"
    assert run_cli("reshard", src, r4, "--ranks", "4").returncode == 0
    assert run_cli("export", src, exported, "--strip-prefix", "").returncode == 0
    b, e = sealed(r4), sealed(exported)
    assert len(b["files"]) == 5 and a["tensors"].keys() == b["tensors"].keys()
    for fqn, t in a["tensors"].items():
        assert b["tensors"][fqn]["sha256"] == t["sha256"], fqn
        assert len(b["tensors"][fqn]["chunks"]) >= len(t["chunks"])
    assert e["tensors"] and all(e["tensors"][k]["sha256"] == a["tensors"][k]["sha256"] for k in e["tensors"])
    # torch's own load of the DCP checkpoint
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(src), str(tmp_path / "full.pt"))
    loaded = dict(flatten(torch.load(tmp_path / "full.pt", weights_only=True)))
    assert loaded.keys() >= a["tensors"].keys()
    for fqn, t in a["tensors"].items():
        assert t["sha256"] == logical_sha(loaded[fqn]), fqn


def test_bfloat16_file_and_safetensors_digests_equal(tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {"w": torch.randn(33, 7, generator=g).to(torch.bfloat16), "b": torch.randn(5, generator=g),
               "t": torch.randn(4, 6, generator=g).t().contiguous().to(torch.float16)}
    torch.save(tensors, tmp_path / "m.pt")
    save_file(tensors, tmp_path / "m.safetensors")
    pt, st = sealed(tmp_path / "m.pt"), sealed(tmp_path / "m.safetensors")
    assert (tmp_path / ("m.pt" + MANIFEST_SUFFIX)).is_file()
    for k, t in tensors.items():
        assert pt["tensors"][k]["sha256"] == st["tensors"][k]["sha256"] == logical_sha(t), k
        assert pt["tensors"][k]["dtype"] == str(t.dtype).removeprefix("torch.")
    assert list(pt["files"]) == ["m.pt"]
    assert pt["files"]["m.pt"]["sha256"] == hashlib.sha256((tmp_path / "m.pt").read_bytes()).hexdigest()


def test_flipped_byte_is_found_by_plain_verify_and_named(copy_of):
    src = copy_of("fsdp2_r2")
    m = sealed(src)
    assert run_cli("verify", src).returncode == 0
    name, fqn = "__1_0.distcp", "model.emb.weight"
    chunk = next(c for c in m["tensors"][fqn]["chunks"] if c["file"] == name)
    with open(src / name, "r+b") as f:  # one bit inside the tensor's stored bytes
        f.seek(chunk["offset"] + chunk["length"] - 9)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    proc = run_cli("verify", src)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "digest_mismatch" in ln)
    assert name in line and fqn in line and f"bytes {chunk['offset']}..{chunk['offset'] + chunk['length']}" in line
    deep = run_cli("verify", "--deep", src, "--json")
    assert deep.returncode == 1
    report = json.loads(deep.stdout)
    assert report["seal"]["state"] == "damaged"
    assert any(p["fqn"] == fqn and p["kind"] == "digest_mismatch" and p["file"] is None for p in report["problems"])


@pytest.mark.parametrize("damage", ["extra", "missing", "truncated"])
def test_fail_closed_extra_missing_truncated(copy_of, damage):
    src = copy_of("fsdp2_r2")
    sealed(src)
    if damage == "extra":
        (src / "notes.txt").write_text("hello")
    elif damage == "missing":
        os.remove(src / "__0_0.distcp")
    else:
        os.truncate(src / "__0_0.distcp", 1000)
    proc = run_cli("verify", src, "--json")
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    kind = {"extra": "unsealed_file", "missing": "missing_file", "truncated": "digest_mismatch"}[damage]
    file = "notes.txt" if damage == "extra" else "__0_0.distcp"
    assert any(p["kind"] == kind and p["file"] == file for p in report["problems"]), report["problems"]
    assert report["seal"]["state"] == "damaged" and not report["healthy"]


def test_manifest_is_untrusted_input(copy_of):
    src = copy_of("fsdp2_r2")
    m = sealed(src)
    path = src / MANIFEST_NAME
    m["files"]["../outside"] = m["files"].pop("__0_0.distcp")
    path.write_text(json.dumps(m))
    proc = run_cli("verify", src)
    assert proc.returncode == 1 and "leads outside the checkpoint" in proc.stdout
    path.write_text("{not json")
    proc = run_cli("verify", src)
    assert proc.returncode == 1 and "bad_manifest" in proc.stdout and "Traceback" not in proc.stderr
    with pytest.raises(Exception, match="SHA-256 in hex"):
        parse_manifest(json.dumps({**m, "files": {"a": {"bytes": 1, "sha256": "zz"}}}).encode(), "x")


def test_seal_refuses_a_damaged_checkpoint(copy_of):
    src = copy_of("fsdp2_r2")
    os.truncate(src / "__1_0.distcp", 100)
    proc = run_cli("seal", src)
    assert proc.returncode == 2 and "not sealed" in proc.stderr and "Traceback" not in proc.stderr
    assert not (src / MANIFEST_NAME).exists()


def ec_keys(tmp_path):
    from cryptography.hazmat.primitives import serialization as s
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    priv, pub = tmp_path / "key.pem", tmp_path / "pub.pem"
    priv.write_bytes(key.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(s.Encoding.PEM, s.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


def test_signed_manifest_verifies_with_model_signing_and_a_changed_byte_fails(copy_of, tmp_path):
    from model_signing import verifying

    src = copy_of("fsdp2_r2")
    priv, pub = ec_keys(tmp_path)
    assert run_cli("seal", src, "--sign", priv).returncode == 0
    bundle = src / "shardscope-manifest.sig"
    verifying.Config().use_elliptic_key_verifier(public_key=pub).verify(src, bundle)  # the library's own check
    proc = run_cli("verify", src, "--signature", pub)
    assert proc.returncode == 0 and "signature  verified" in proc.stdout, proc.stdout + proc.stderr
    manifest = src / MANIFEST_NAME
    data = bytearray(manifest.read_bytes())
    data[data.index(b'"sha256":"') + 10] ^= 1  # a tensor or file digest changed: the manifest itself is signed
    manifest.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="Signature mismatch"):
        verifying.Config().use_elliptic_key_verifier(public_key=pub).verify(src, bundle)
    proc = run_cli("verify", src, "--signature", pub)
    assert proc.returncode == 1 and "bad_signature" in proc.stdout


def test_megatron_seal_writes_integrity_json_and_verify_checks_it(megatron_run, tmp_path):
    import shutil

    src = tmp_path / "iter"
    shutil.copytree(megatron_run / "iter_0000300", src)
    sealed(src)
    integrity = json.loads((src / "integrity.json").read_text())
    assert integrity["algorithm"] == "sha256"
    assert integrity["files"]["common.pt"] == hashlib.sha256((src / "common.pt").read_bytes()).hexdigest()
    os.remove(src / MANIFEST_NAME)  # integrity.json alone is still checked
    with open(src / "common.pt", "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x20]))
    proc = run_cli("verify", src, "--json")
    assert proc.returncode == 1
    assert any(p["file"] == "common.pt" and "integrity.json" in p["message"]
               for p in json.loads(proc.stdout)["problems"])


def test_diff_of_sealed_copies_reads_no_tensor_bytes_and_a_later_change_is_read(copy_of, tmp_path):
    import shutil

    a = copy_of("fsdp2_r2")
    b = tmp_path / "copy"
    shutil.copytree(a, b)
    m = sealed(a)
    sealed(b)
    before = json.loads(run_cli("diff", a, b, "--json").stdout)
    assert before["unchanged_by_digest"] == len(m["tensors"]) and not before["changed"]
    # a byte flipped behind the file system's back (size and time kept): diff trusts the digests and reads nothing
    name, fqn = "__1_0.distcp", "model.emb.weight"
    chunk = next(c for c in m["tensors"][fqn]["chunks"] if c["file"] == name)
    st = os.stat(b / name)
    with open(b / name, "r+b") as f:
        f.seek(chunk["offset"] + chunk["length"] - 9)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(b / name, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert json.loads(run_cli("diff", a, b, "--json").stdout)["unchanged_by_digest"] == len(m["tensors"])
    assert run_cli("verify", b).returncode == 1  # verify reads the bytes
    os.utime(b / name)  # now modified after the seal: diff no longer trusts B's manifest and reads the bytes
    proc = run_cli("diff", a, b, "--json")
    after = json.loads(proc.stdout)
    assert after["unchanged_by_digest"] == 0 and proc.returncode != 0
    assert fqn in json.dumps(after["changed"]) + json.dumps(after["unreadable"])


READ_BYTES = """
import sys
from shardscope.backend.checkpoint.seal import compute_manifest
from shardscope.backend.formats import open_checkpoint

def rchar():
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))

ckpt = open_checkpoint(sys.argv[1], use_cache=False)
compute_manifest(ckpt)  # once first: the modules it imports on the way are read then
before = rchar()
compute_manifest(ckpt)
print(rchar() - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="Linux's per-process I/O counters")
def test_seal_reads_each_byte_once(tmp_path):
    """The file digests, the chunk digests and the tensors' logical digests come from one read of every byte
    (the kernel's count of bytes this process read), for a safetensors file and a DCP folder (CRC32s checked)."""
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp

    state = {f"w{i}": torch.randn(512, 1024) for i in range(4)}  # 8 MiB
    save_file(state, str(tmp_path / "m.safetensors"))
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "dcp"))
    for path in (tmp_path / "m.safetensors", tmp_path / "dcp"):
        size = sum(p.stat().st_size for p in ([path] if path.is_file() else path.iterdir()))
        proc = subprocess.run([sys.executable, "-c", READ_BYTES, str(path)], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert size <= int(proc.stdout) < 1.2 * size, (path, size, proc.stdout)


def test_seal_of_a_chunk_failing_its_crc32_is_refused_naming_it(copy_of):
    """The one-pass digest checks each record's stored CRC32 on the bytes it hashes: a flipped value byte is never
    sealed (the second pass names the tensor)."""
    from test_health_panel import flip_a_value_byte

    ckpt = copy_of("fsdp2_r2")
    flip_a_value_byte(ckpt, "model.blocks.0.fc1.weight")
    proc = run_cli("seal", ckpt)
    assert proc.returncode != 0 and "model.blocks.0.fc1.weight" in proc.stderr, proc.stderr
    assert not (ckpt / MANIFEST_NAME).exists()
