"""What a pickle may build (backend/checkpoint/unpickler/), against torch.load(weights_only=True) as the oracle:
the BUILD, SETITEM and APPEND attacks of issue 29 on torch files and DeepSpeed archives are refused in one line (exit
2) or read exactly as torch reads them; numpy arrays of numbers are read as torch reads them and written back."""

from __future__ import annotations

import io
import pickle
import shutil
import zipfile

import numpy as np
import pytest
import torch
from conftest import run_cli
from hostile_torch_files import uni, with_pickle
from shardscope.backend.checkpoint.torch_file_tree import TorchFileLoad
from shardscope.backend.checkpoint.unpickler import allow_torch_safe_globals
from shardscope.backend.errors import CheckpointError

_reconstruct = getattr(np, "_core", np).multiarray._reconstruct


class _Raw:
    """Stands for a hand-made reduce in a pickle written by pickle's own Pickler (protocol 2, as torch.save)."""

    def __init__(self, reduce: tuple) -> None:
        self.reduce = reduce


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, _Raw):
            return obj.reduce
        return NotImplemented


def _pickle(obj) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def _dtype(code: str, state: tuple) -> _Raw:
    return _Raw((np.dtype, (code, False, True), state))


def _array(dtype: _Raw, shape: tuple, raw: bytes) -> _Raw:
    return _Raw((_reconstruct, (np.ndarray, (0,), b"b"), (1, shape, dtype, False, raw)))


def _oracle_refuses(path) -> bool:
    allow_torch_safe_globals()
    try:
        torch.load(path, weights_only=True, map_location="cpu")
    except Exception:
        return True
    return False


def _refused_everywhere(path, *what: str) -> None:
    """The reader refuses ``path`` with one line naming it (and ``what``), ``show`` and ``inspect`` exit 2 with one
    line and no traceback, and torch.load(weights_only=True) refuses it too."""
    with pytest.raises(CheckpointError) as err:
        TorchFileLoad(str(path))
    text = str(err.value)
    assert str(path) in text and "\n" not in text and all(w in text for w in what), text
    for args in (("inspect", str(path)), ("verify", "--deep", str(path)), ("show", str(path), "a"),
                 ("export", str(path), str(path.parent / f"{path.stem}-out.safetensors"))):
        proc = run_cli(*args, timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, (args, proc)
    assert _oracle_refuses(path)


def test_a_numpy_object_dtype_whose_build_clears_its_object_flag_is_refused(tmp_path):
    """Attack 1: an object dtype given a BUILD state without its object flag, then an array of raw bytes over it
    (pointers the file chose). Before, inspect said healthy and show died of SIGSEGV."""
    dtype = _dtype("O8", (3, "|", None, None, None, -1, -1, 0))
    _refused_everywhere(with_pickle(tmp_path, _pickle({"a": _array(dtype, (2,), b"\x41" * 16)})),
                        "numpy dtype", "weights_only refuses")


def test_a_void_dtype_whose_build_enlarges_its_items_is_refused(tmp_path):
    """Attack 2: a void dtype whose BUILD makes each item 256 bytes after 8 were charged: the process's heap would be
    read past the array."""
    dtype = _dtype("V8", (3, "|", None, None, None, 256, 1, 0))
    _refused_everywhere(with_pickle(tmp_path, _pickle({"a": _array(dtype, (1,), b"\x00" * 8)})), "numpy dtype")


def test_a_number_dtype_given_another_item_size_is_read_as_numpy_reads_it(tmp_path):
    """numpy keeps a number dtype's item size whatever its BUILD state says (only the byte order is set): read as
    torch.load reads it, the size charged being the real one."""
    dtype = _dtype("u4", (3, ">", None, None, None, 64, 4, 0))
    path = with_pickle(tmp_path, _pickle({"a": _array(dtype, (2,), b"\x00\x00\x00\x01" * 2)}))
    got = TorchFileLoad(str(path)).objects()["a"]
    allow_torch_safe_globals()
    ref = torch.load(path, weights_only=True, map_location="cpu")["a"]
    assert got.dtype == ref.dtype and np.array_equal(got, ref) and list(got) == [1, 1]


def test_an_array_whose_bytes_are_not_its_shapes_is_refused(tmp_path):
    dtype = _dtype("u4", (3, "<", None, None, None, -1, -1, 0))
    _refused_everywhere(with_pickle(tmp_path, _pickle({"a": _array(dtype, (100_000,), b"\x00" * 8)})), "numpy array")


def _after_first_reduce(pkl: bytes) -> int:
    """Where the opcode after the pickle's first tensor rebuild (a REDUCE of a tuple) starts."""
    import pickletools

    ops = [o for o in pickletools.genops(pkl) if not o[0].name.endswith("PUT")]
    return next(ops[i + 1][2] for i, (op, _, _) in enumerate(ops)
                if op.name == "REDUCE" and ops[i - 1][0].name == "TUPLE")


def test_build_on_a_tensor_is_read_as_torch_reads_it_or_refused(tmp_path):
    """Attack 3: BUILD on the reader's own tensor record (its dtype, shape, offset replaced after their checks). The
    reader builds no such thing: the file is left to torch.load, whose legacy ``set_`` decides; what Shardscope then
    shows is torch's reading, never the record changed."""
    good = tmp_path / "good.pt"
    torch.save({"a": torch.arange(4, dtype=torch.float32), "b": torch.arange(4, dtype=torch.int32)}, good)
    with zipfile.ZipFile(good) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    # BUILD right after tensor "a" is rebuilt
    at = _after_first_reduce(pkl)
    hostile = pkl[:at] + b"}" + uni("dtype") + uni("int32") + b"sb" + pkl[at:]
    path = with_pickle(tmp_path, hostile, "build.pt", good)
    try:
        loaded = TorchFileLoad(str(path))
    except CheckpointError as exc:
        assert str(path) in str(exc) and _oracle_refuses(path)
    else:
        assert loaded.fallback and "BUILD" in loaded.fallback
        ref = torch.load(path, weights_only=True, map_location="cpu")
        assert {k: (v.dtype, tuple(v.shape)) for k, v in ref.items()} == {
            k: (getattr(torch, t.dtype), t.shape) for k, t in loaded.tensors().items()}


@pytest.mark.parametrize("opcodes", [
    b"ctorch._utils\n_rebuild_tensor_v2\n}" + uni("a") + b"K\x01sb",  # BUILD on a global
    b"ctorch\nfloat32\n}" + uni("a") + b"K\x01sb",  # BUILD on a torch dtype
    b"ccollections\nOrderedDict\n)R]K\x01ab",  # BUILD on an OrderedDict with a list state: torch sets __dict__
    b"]" + uni("k") + b"K\x01s",  # SETITEM on a list
    b"cbuiltins\nbytearray\nK\x04\x85RK\x01a",  # APPEND on a bytearray
    b"cbuiltins\nset\n)R(K\x01K\x02u",  # SETITEMS on a set
    b"ctorch\nSize\n)R]K\x01ab",  # BUILD on a torch.Size
])
def test_opcodes_acting_on_what_torch_does_not_allow_are_refused(tmp_path, opcodes):
    """BUILD, SETITEM(S) and APPEND(S) act only where torch's weights-only unpickler lets them: each file is refused
    (or, where torch's own unpickler fails on it too, not read), with one line, and torch.load agrees."""
    pkl = b"\x80\x02}" + uni("x") + opcodes + b"s."
    path = with_pickle(tmp_path, pkl)
    with pytest.raises(CheckpointError) as err:
        TorchFileLoad(str(path))
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    ordered = b"OrderedDict" in opcodes
    assert _oracle_refuses(path) or ordered


def test_a_numpy_rng_state_is_read_and_exported_to_a_torch_file(tmp_path):
    """Attack 9's file is benign: a tensor and a numpy uint32 array (an RNG state). Read as torch reads it, and
    exported to .pt (the writer's own check loads it with the same safe globals)."""
    state = np.random.RandomState(0).get_state()[1]
    src = tmp_path / "rng.pt"
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "rng": state, "big": np.arange(6, dtype=">i8")}, src)
    loaded = TorchFileLoad(str(src))
    assert not loaded.fallback
    assert np.array_equal(loaded.objects()["rng"], state) and loaded.objects()["rng"].dtype == state.dtype
    allow_torch_safe_globals()
    assert np.array_equal(loaded.objects()["big"], np.arange(6)) and \
        loaded.objects()["big"].dtype == torch.load(src, weights_only=True)["big"].dtype
    out = tmp_path / "out.pt"
    proc = run_cli("export", str(src), str(out), "--strip-prefix", "", timeout=180)
    assert proc.returncode == 0, proc.stderr
    allow_torch_safe_globals()
    back = torch.load(out, weights_only=True, map_location="cpu")
    assert torch.equal(back["w"], torch.arange(6.0).reshape(2, 3)) and np.array_equal(back["rng"], state)


def test_build_on_a_deepspeed_records_tensor_is_refused(tmp_path, deepspeed_checkpoints):
    """Attack 3 on a DeepSpeed optimizer file: a BUILD on the fp32 partition's tensor record (to point it at
    exp_avg_sq) makes the file unreadable with one line, exit 2; before, the export wrote Adam's moment as the
    model's weight, "verified"."""
    shutil.copytree(deepspeed_checkpoints["z1-fp32-2r"], tmp_path / "copy")
    save = next((tmp_path / "copy").rglob("latest")).parent
    optim = next(save.rglob("*optim_states.pt"))
    with zipfile.ZipFile(optim) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    at = _after_first_reduce(pkl)
    hostile = pkl[:at] + b"}" + uni("storage_offset") + b"K\x00sb" + pkl[at:]
    path = with_pickle(tmp_path, hostile, optim.name, optim)
    shutil.move(path, optim)
    for args in (("inspect", str(save)), ("export", str(save), str(tmp_path / "w.safetensors"))):
        proc = run_cli(*args, timeout=180)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and optim.name in proc.stderr, (args, proc)
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "w.safetensors").exists()


@pytest.mark.parametrize("target", [b"ctorch.serialization\n_get_layout\n", b"ctorch\nfloat32\n",
                                    b"cpathlib\nPosixPath\n"])
def test_build_on_a_metadata_global_is_refused_and_changes_nothing(target):
    """A DCP .metadata (plain pickle in torch) that BUILDs on one of the reader's own callables or dtype names: the
    reader's objects have nothing to set, so the load fails in one line, and the next load sees them unchanged."""
    from shardscope.backend.checkpoint.unpickler import METADATA_GLOBALS, unpickle_metadata

    pkl = b"\x80\x02" + target + b"}" + uni("polluted") + b"K\x01sb."
    with pytest.raises(CheckpointError) as err:
        unpickle_metadata(pkl, "ck/.metadata")
    assert "ck/.metadata" in str(err.value) and "\n" not in str(err.value)
    assert not any(hasattr(v, "polluted") for v in METADATA_GLOBALS.values())


def test_one_module_decides_what_a_pickle_may_build():
    """Every unpickler of checkpoint bytes (and its allow-list) is in backend/checkpoint/unpickler/; elsewhere only
    torch.load(weights_only=True), after the module's safe globals, and never plain pickle.load."""
    import re
    from pathlib import Path

    backend = Path(__file__).resolve().parent.parent / "backend"
    owners, plain, unsafe = set(), [], []
    for path in backend.rglob("*.py"):
        text = path.read_text()
        code = re.sub(r'"""[\s\S]*?"""|#[^\n]*', "", text)  # docstrings and comments say what others do
        if re.search(r"def find_class\s*\(|\(pickle\.Unpickler\)|_weights_only_unpickler\.Unpickler", code):
            owners.add(path.relative_to(backend).parent.as_posix())
        plain += [path.name for _ in re.finditer(r"\bpickle\.loads?\(", code)]
        calls = re.finditer(r"torch\.load\((?:[^()]|\([^()]*\))*\)", code)  # one level of nested parentheses
        unsafe += [m.group(0) for m in calls if "weights_only=True" not in m.group(0)]
    assert owners == {"checkpoint/unpickler"} and not plain and not unsafe, (owners, plain, unsafe)
