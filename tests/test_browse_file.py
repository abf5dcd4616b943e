"""Hostile single files and HF folders, opened through backend/compare/browse_file.py (the entry points besides
a DCP folder): real ``torch.save`` and ``safetensors.torch.save_file`` output, then damaged or oddly built.
Each one gives exit 2 with one line naming the file (never exit 3, a traceback, a hang or memory driven by a
number in the file), and a damaged header is never read as good values."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from conftest import cli_in_process as cli
from conftest import run_cli_peak
from hostile_torch_files import uni, with_pickle
from safetensors.torch import save_file
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.formats import open_checkpoint
from shardscope.backend.text import escape_name


def bad_input(rc: int, err: str, path) -> None:
    assert rc == 2, (rc, err)
    assert len(err.strip().splitlines()) == 1 and str(path) in err, err
    assert "Traceback" not in err and "internal error" not in err, err


@pytest.fixture
def base(tmp_path):
    """A small real safetensors file to compare against."""
    torch.manual_seed(0)
    tensors = {"a.weight": torch.randn(16, 8), "a.bias": torch.randn(16), "b.weight": torch.randn(4, 16).half()}
    save_file(tensors, tmp_path / "base.safetensors")
    return tmp_path / "base.safetensors", tensors


# ---------------------------------------------------------------- torch files
def _nested(kind: str) -> dict:
    t = torch.ones(3)
    if kind == "cycle_dict":  # pickle memo references make a dict that holds itself
        d: dict = {"t": t}
        d["self"] = d
        return {"x": d}
    if kind == "cycle_list":
        lst: list = [t]
        lst.append(lst)
        return {"x": lst}
    if kind == "collision":  # DCP's flatten_state_dict refuses it; one entry must not silently vanish
        return {"a.b": t, "a": {"b": t * 2}}
    if kind == "sparse":
        return {"s": torch.eye(3).to_sparse(), "t": t}
    if kind == "meta":
        return {"m": torch.empty(2**40, device="meta"), "t": t}
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["cycle_dict", "cycle_list", "collision", "sparse", "meta"])
def test_odd_torch_files_are_one_line(capsys, tmp_path, base, kind):
    path = tmp_path / f"{kind}.pt"
    torch.save(_nested(kind), path)
    for args in (("diff", path, base[0]), ("import", path, tmp_path / "imported")):
        bad_input(*cli(capsys, *args)[::2], path)
    assert not (tmp_path / "imported").exists()


def test_deep_nesting_in_a_torch_file(capsys, tmp_path, base):
    n = 20_000  # a value torch.save cannot write (recursion), but a pickle can say
    path = with_pickle(tmp_path, b"\x80\x02}" + uni("x") + b"]" * n + b"a" * (n - 1) + b"s.")
    bad_input(*cli(capsys, "diff", path, base[0])[::2], path)
    path = with_pickle(tmp_path, b"\x80\x02" + (b"}" + uni("a")) * n + b"N" + b"s" * n + b".")
    bad_input(*cli(capsys, "import", path, tmp_path / "imported")[::2], path)


def _measured(*args, timeout: float = 90) -> tuple[subprocess.CompletedProcess, int]:
    return run_cli_peak(*args, timeout=timeout)


def test_shared_references_do_not_expand(tmp_path, base):
    """A dict referenced twice at each of 40 levels: a few hundred bytes that flatten to 2**40 entries."""
    d: dict = {"t": torch.ones(2)}
    for _ in range(40):
        d = {"x": d, "y": d}
    path = tmp_path / "laughs.pt"
    torch.save(d, path)
    proc, peak = _measured("diff", path, base[0])
    assert proc.returncode == 2 and "referenced many times" in proc.stderr, proc.stderr[-2000:]
    assert peak < 1500, peak


def test_bytearray_bomb_in_a_torch_file(tmp_path, base):
    """weights_only allows ``bytearray(n)``: a 100-byte data.pkl must not allocate 3 GB."""
    glob = b"cbuiltins\nbytearray\n"
    path = with_pickle(tmp_path, b"\x80\x02}" + uni("x") + glob + b"\x8a\x05" +
                          (3_000_000_000).to_bytes(5, "little") + b"\x85Rs.")
    proc, peak = _measured("diff", path, base[0])
    assert proc.returncode == 2 and "bytearray" in proc.stderr and str(path) in proc.stderr, proc.stderr[-2000:]
    assert peak < 1500, peak


# ---------------------------------------------------------------- safetensors headers
def _rewrite_header(src, dst, change) -> None:
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    dst.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def _shorter_shape(h):
    h["a.bias"]["shape"] = [15]  # 64 bytes stored, 60 described: a prefix must not be read as the tensor


def _overflowing_shape(h):
    h["a.bias"]["shape"] = [2**40, 2**40, 2**40]


def _overlapping(h):
    a0, _ = h["a.bias"]["data_offsets"]
    h["b.weight"]["data_offsets"] = [a0 + 32, a0 + 32 + 128]


@pytest.mark.parametrize("change", [_shorter_shape, _overflowing_shape, _overlapping])
def test_safetensors_headers_the_library_refuses(capsys, tmp_path, base, change):
    path = tmp_path / "hostile.safetensors"
    _rewrite_header(base[0], path, change)
    for args in (("diff", path, base[0]), ("import", path, tmp_path / "imported")):
        rc, _, err = cli(capsys, *args)
        bad_input(rc, err, path)
        assert "a.bias" in err or "b.weight" in err, err
    assert not (tmp_path / "imported").exists()


def test_lone_surrogate_names_print_and_are_refused_in_a_header_as_safetensors_refuses_them(tmp_path, base):
    assert escape_name("a.\ud800b").encode("utf-8") == b"a.\\ud800b"
    path = tmp_path / "surrogate.safetensors"
    _rewrite_header(base[0], path, lambda h: h.update({"a.\ud800b": h.pop("a.bias")}))
    proc = subprocess.run([sys.executable, "-m", "shardscope.app.cli", "diff", path, base[0]], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    # the safetensors library refuses a header holding a lone surrogate escape: so does every command, in one line
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "surrogate" in proc.stderr, proc.stderr[-2000:]
    from safetensors import safe_open

    with pytest.raises(Exception):  # noqa: B017 - the library's own error type varies by version
        safe_open(str(path), "pt")


# ---------------------------------------------------------------- HF index folders
def _hf_folder(tmp_path, tensors) -> tuple:
    folder = tmp_path / "hf"
    folder.mkdir()
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({k: tensors[k] for k in ("a.weight", "a.bias")}, folder / s1)
    save_file({"b.weight": tensors["b.weight"]}, folder / s2)
    weight_map = {"a.weight": s1, "a.bias": s1, "b.weight": s2}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder, s2


def test_hf_folder_missing_a_shard_is_not_healthy(capsys, tmp_path, base):
    folder, s2 = _hf_folder(tmp_path, base[1])
    assert cli(capsys, "verify", folder)[0] == 0
    outside = tmp_path / "outside.safetensors"
    (folder / s2).rename(outside)
    rc, out, _ = cli(capsys, "verify", folder)
    assert rc == 1 and "[missing_file]" in out and s2 in out and "b.weight" in out, out
    os.symlink(outside, folder / s2)  # a link leading out of the folder: refused, and said so
    problems = verify(open_checkpoint(folder, use_cache=False))
    assert [p.kind for p in problems] == ["missing_file"] and "outside the checkpoint folder" in problems[0].message
