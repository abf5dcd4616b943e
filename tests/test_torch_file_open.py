"""Opening a torch.save file without torch.load (backend/checkpoint/torch_file_tree.py): on files torch.save
itself wrote,
what the reader lists (dotted names, key paths, dtypes, shapes, strides, storage offsets, non-tensor values) and
the values the chunk reader then reads from the file's records are what ``torch.load(weights_only=True)`` gives;
what it does not build is left to torch.load (and says so); a global weights_only refuses is refused with one line
naming the file before anything is unpickled, and nothing from the file runs."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
import torch
from conftest import run_cli
from hostile_torch_files import uni, with_pickle
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.checkpoint.flatten import dotted, flatten
from shardscope.backend.checkpoint.torch_file_tree import TorchFileLoad
from shardscope.backend.checkpoint.unpickler import TORCH_FILE, Budget, NotBuilt
from shardscope.backend.checkpoint.unpickler import allow_torch_safe_globals as allow_safe_globals
from shardscope.backend.errors import CheckpointError
from shardscope.backend.formats import open_checkpoint


def _module_state() -> dict:
    """A small model's parameters (nn.Parameter), its state dict's buffers, and an AdamW state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return {"params": dict(model.named_parameters()), "model": model.state_dict(), "optimizer": opt.state_dict()}


def _views_and_values() -> dict:
    torch.manual_seed(1)
    base = torch.randn(6, 4)
    flat = torch.arange(24, dtype=torch.int64)
    return {
        "shared": {"whole": base, "rows": base[1:3], "column": base[:, 2], "t": base.t(), "step": base[::2, 1::2]},
        "flat": flat, "grid": flat.view(4, 6)[1:, 2:5],  # a second view of another storage, at an offset
        "dtypes": {"bf16": torch.randn(5).bfloat16(), "f16": torch.randn(3).half(), "f64": torch.randn(2).double(),
                   "i8": torch.arange(-3, 4, dtype=torch.int8), "u8": torch.arange(5, dtype=torch.uint8),
                   "bool": torch.tensor([True, False, True]), "c64": torch.randn(3, dtype=torch.complex64),
                   "c128": torch.randn(2, dtype=torch.complex128), "i32": torch.tensor([7, -9], dtype=torch.int32)},
        "scalar": torch.tensor(3.25), "empty": torch.empty(0, 3), "empty_int": torch.zeros(2, 0, dtype=torch.int16),
        "grad": torch.randn(2, requires_grad=True).detach().requires_grad_(),
        "layers": [torch.ones(2), {"a": torch.zeros(1)}],
    }


def _leaves() -> dict:
    meta = OrderedDict(w=torch.ones(2))
    meta._metadata = {"": {"version": 1}}  # what a module's state_dict carries
    return {"step": 3, "lr": 0.5, "name": "run-1", "flags": [1, 2, 3], "nothing": None, "ok": True,
            "pair": (1, "b"), "bytes": b"\x00\xff", "blob": io.BytesIO(b"train state"),  # how an export keeps one
            "shape": torch.Size([2, 3]), "dtype": torch.bfloat16, "device": torch.device("cpu"), "ids": {4, 5},
            "z": 1 + 2j, "raw": bytearray(b"ab"), "nested": {"deep": {"deeper": [0.5, "x"]}}, "sd": meta,
            "rng": np.random.RandomState(0).get_state(), "array": np.arange(6, dtype=np.float32).reshape(2, 3)}


def _lightning() -> dict:
    """What a Lightning ``.ckpt`` holds (hyperparameters as a plain dict, as weights_only reads them)."""
    torch.manual_seed(2)
    state = _module_state()
    return {"epoch": 1, "global_step": 20, "pytorch-lightning_version": "2.4.0",
            "state_dict": {f"model.{k}": v for k, v in state["model"].items()},
            "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 2, "completed": 1}}}},
            "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_path": "", "best_k_models": {}}},
            "optimizer_states": [state["optimizer"]], "lr_schedulers": [],
            "hparams_name": "kwargs", "hyper_parameters": {"lr": 0.01, "dims": [4, 3, 2], "name": "mlp"}}


FILES = {"module.pt": _module_state, "views.pt": _views_and_values, "leaves.pt": _leaves,
         "epoch=1-step=20.ckpt": _lightning}


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, io.BytesIO):
        return a.getvalue() == b.getvalue() and a.tell() == b.tell()
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("file", list(FILES))
def test_what_the_reader_lists_is_what_torch_load_gives(tmp_path, file):
    path = tmp_path / file
    torch.save(FILES[file](), path)
    allow_safe_globals()
    ref = {dotted(k): (k, v) for k, v in flatten(torch.load(path, weights_only=True)).items()}
    loaded = TorchFileLoad(str(path))
    assert loaded.fallback is None  # read without torch.load
    assert list(loaded.paths()) == list(ref) and loaded.paths() == {n: k for n, (k, _) in ref.items()}
    tensors, objects = loaded.tensors(), loaded.objects()
    assert list(tensors) == [n for n, (_, v) in ref.items() if isinstance(v, torch.Tensor)]
    for n, view in tensors.items():
        t = ref[n][1]
        assert (view.dtype, view.shape, view.stride, view.storage_offset) == \
            (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.stride(), t.storage_offset()), n
        assert view.nbytes == t.untyped_storage().nbytes(), n
    assert set(objects) == {n for n, (_, v) in ref.items() if not isinstance(v, torch.Tensor)}
    for n, v in objects.items():
        assert _same(v, ref[n][1]), (n, v, ref[n][1])

    ckpt = open_checkpoint(path)
    assert ckpt.problems == [] and ckpt.planner_data == loaded.paths()
    assert [t.fqn for t in ckpt.tensors] == list(tensors)
    with ChunkReader(ckpt) as reader:
        for n in tensors:
            got, want = reader.read_tensor(ckpt.tensor(n)), ref[n][1]
            assert got.dtype == want.dtype and torch.equal(got, want.detach()), n
    assert {o.fqn: o.value for o in ckpt.objects}.keys() == objects.keys()


def test_shared_storages_are_one_record(tmp_path):
    """Views of one storage (rows, a column, a transpose, a strided slice) are located in the same record."""
    path = tmp_path / "views.pt"
    torch.save(_views_and_values(), path)
    ckpt = open_checkpoint(path)
    offsets = {t.fqn: t.chunks[0].offset for t in ckpt.tensors}
    assert len({offsets[f"shared.{k}"] for k in ("whole", "rows", "column", "t", "step")}) == 1
    assert offsets["flat"] == offsets["grid"] and offsets["flat"] != offsets["shared.whole"]
    assert ckpt.located[("grid", "views.pt", offsets["grid"])].storage_offset == 8


def test_opening_a_state_dict_imports_no_torch(tmp_path):
    """The point of the reader: no torch import (a second and 200 MB) and no torch tensor per entry."""
    path = tmp_path / "many.pt"
    torch.save({f"layer.{i}.w": torch.randn(4) for i in range(2000)} | {"step": 7}, path)
    code = ("import sys\nfrom shardscope.backend.formats import open_checkpoint\n"
            f"c = open_checkpoint({str(path)!r})\n"
            "assert len(c.tensors) == 2000 and c.located and not c.problems, c.problems\n"
            "assert 'torch' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_native_globals_are_ones_weights_only_accepts():
    """Every global the torch-file rules build is one torch.load(weights_only=True) accepts once allow_safe_globals()
    ran (its Python 2 names renamed as torch renames them): the reader accepts nothing wider. Candidates: torch's own
    list, the safe globals, and globals torch refuses."""
    from torch import _weights_only_unpickler as wo
    from torch._utils import IMPORT_MAPPING

    allow_safe_globals()
    accepted = set(wo._get_allowed_globals()) | set(wo._get_user_allowed_globals())
    refused = {"os.system", "builtins.eval", "builtins.getattr", "numpy.dtypes.ObjectDType", "numpy.dtypes.VoidDType",
               "argparse.Namespace", "builtins.list", "builtins.dict", "builtins.object", "copyreg._reconstructor",
               "numpy.core.multiarray.scalar", "torch.serialization._get_layout", "__builtin__.set", "io.BytesIO"}
    built = []
    for full in sorted(accepted | refused):
        module, _, name = full.rpartition(".")
        try:
            TORCH_FILE.resolve(module, name, Budget(1 << 20, "f"))
        except (NotBuilt, CheckpointError):
            continue
        built.append(full)
        assert f"{IMPORT_MAPPING.get(module, module)}.{name}" in accepted, full
    assert "torch._utils._rebuild_tensor_v2" in built and "numpy.dtype" in built and len(built) > 40, built


# ---------------------------------------------------------------- what is left to torch.load
def _fallback_cases() -> dict:
    torch.manual_seed(3)
    tagged = torch.ones(3)
    tagged.tag = "x"  # a tensor with attributes: torch.save writes _rebuild_from_type_v2
    param = torch.nn.Parameter(torch.randn(2))
    param.ds_id = 4  # a parameter with attributes: _rebuild_parameter_with_state
    key = torch.ones(1)
    return {"attributes": {"t": tagged, "u": torch.zeros(2)}, "parameter_state": {"p": param},
            "tensor_key": {"a": {key: 1}, "b": torch.ones(2)}, "tensor_in_tuple": {"pair": (torch.ones(2), 3)}}


@pytest.mark.parametrize("case", ["attributes", "parameter_state", "tensor_key", "tensor_in_tuple"])
def test_what_the_reader_does_not_build_is_loaded_by_torch(tmp_path, case):
    path = tmp_path / f"{case}.pt"
    torch.save(_fallback_cases()[case], path)
    loaded = TorchFileLoad(str(path))
    assert loaded.fallback, case  # and why, for the log
    ref = {dotted(k): v for k, v in flatten(torch.load(path, weights_only=True)).items()}
    assert list(loaded.paths()) == list(ref)
    for n, v in ref.items():
        if isinstance(v, torch.Tensor):
            view = loaded.tensors()[n]
            assert (view.dtype, view.shape, view.stride) == (str(v.dtype).removeprefix("torch."), tuple(v.shape),
                                                            v.stride()), n
    ckpt = open_checkpoint(path)
    if case == "tensor_key":  # the key's storage holds no entry: not located, as torch.load's mapping shows
        assert [p.kind for p in ckpt.problems] == ["unlocated"]
        return
    assert ckpt.problems == []
    with ChunkReader(ckpt) as reader:
        for n, v in ref.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(reader.read_tensor(ckpt.tensor(n)), v.detach()), n


def test_a_legacy_file_is_left_to_torch_load(tmp_path):
    """torch.save's pre-zip format has no records: torch.load says why it cannot map it, as before."""
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.randn(3)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match=r"cannot be loaded safely with weights_only=True \(mmap can only"):
        TorchFileLoad(str(path))


def test_sparse_tensors_are_refused_in_the_same_words(tmp_path):
    path = tmp_path / "sparse.pt"
    torch.save({"s": torch.eye(3).to_sparse(), "t": torch.ones(2)}, path)
    with pytest.raises(CheckpointError, match=r"tensor s\): a sparse_coo tensor; only dense tensors are read"):
        TorchFileLoad(str(path))


# ---------------------------------------------------------------- hostile pickles
def _call(module: str, name: str, arg: str) -> bytes:
    """``{"x": module.name(arg)}`` as protocol 2 writes it."""
    return b"\x80\x02}" + uni("x") + f"c{module}\n{name}\n".encode() + uni(arg) + b"\x85Rs."


@pytest.mark.parametrize(("module", "name"), [("os", "system"), ("posix", "system"), ("subprocess", "getoutput"),
                                              ("builtins", "exec"), ("__builtin__", "eval")])
def test_a_global_weights_only_refuses_is_refused_and_never_run(tmp_path, module, name):
    marker = tmp_path / "ran"
    path = with_pickle(tmp_path, _call(module, name, f"touch {marker}" if "exec" not in name and "eval" not in name
                                        else f"open({str(marker)!r}, 'w')"))
    with pytest.raises(CheckpointError) as err:
        TorchFileLoad(str(path))
    text = str(err.value)
    assert str(path) in text and f"{module}.{name}" in text and "refuses" in text and "\n" not in text, text
    proc = run_cli("inspect", str(path), timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and str(path) in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not marker.exists()


def test_a_global_behind_an_opcode_weights_only_does_not_run_is_refused_too(tmp_path):
    """STACK_GLOBAL (protocol 4) is not an opcode torch's weights-only unpickler runs: torch.load refuses the file."""
    marker = tmp_path / "ran"
    pkl = b"\x80\x02}" + uni("x") + uni("os") + uni("system") + b"\x93" + uni(f"touch {marker}") + b"\x85Rs."
    path = with_pickle(tmp_path, pkl)
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        TorchFileLoad(str(path))
    assert not marker.exists()


def test_a_set_built_many_times_from_one_list_is_refused(tmp_path):
    """``set(L)`` a hundred times over one memoized 100,000-element list: a 300 KB pickle that builds 10 million
    set entries is an allocation bomb (weights_only would build them all)."""
    items = b"".join(b"J" + struct.pack("<i", i) for i in range(100_000))
    pkl = b"\x80\x02}(" + uni("L") + b"](" + items + b"er\x00\x00\x01\x00"
    for i in range(100):
        pkl += uni(f"s{i}") + b"c__builtin__\nset\nj\x00\x00\x01\x00\x85R"
    path = with_pickle(tmp_path, pkl + b"u.")
    with pytest.raises(CheckpointError, match="allocation bomb"):
        TorchFileLoad(str(path))


def test_build_on_a_rebuild_function_changes_nothing(tmp_path):
    """BUILD (set attributes) on the rebuild function a global names: weights_only refuses it; the reader's
    functions have no attributes to set, so the file goes to torch.load, which refuses it, and the function the
    next file is read with is unchanged."""
    pkl = b"\x80\x02}" + uni("x") + b"ctorch._utils\n_rebuild_tensor_v2\n}" + uni("a") + b"K\x01sbs."
    path = with_pickle(tmp_path, pkl)
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        TorchFileLoad(str(path))
    fresh = TORCH_FILE.resolve("torch._utils", "_rebuild_tensor_v2", Budget(1, "f"))
    assert not hasattr(fresh, "a") and not hasattr(fresh.call, "a")


def test_a_memo_index_past_the_pickle_is_read_as_torch_reads_it(tmp_path):
    """Python's C unpickler sizes its memo table by a LONG_BINPUT's index (16 million: 256 MB); torch's weights-only
    unpickler keeps a dict, and so does the reader: the memo index is no reason to leave the file to torch.load."""
    path = with_pickle(tmp_path, b"\x80\x02}r\xf0\xff\xff\x00" + uni("a") + b"K\x01s.")
    loaded = TorchFileLoad(str(path))
    assert "memo" not in (loaded.fallback or "") and loaded.objects() == {"a": 1}


# ---------------------------------------------------------------- mutated pickles against torch's own loader
# opcodes that act on the object under them (BUILD, SETITEM(S), APPEND(S)) with a state or item in front, and memo
# references into what was built (numpy state, tensors, globals): each inserted between two opcodes of the pickle
_ACTING = (b"}b", b"]b", b")b", b"K\x01K\x02s", b"K\x01a", b"(K\x01K\x02u", b"(K\x01e", b"h\x01b", b"h\x02}b",
           b"h\x03K\x01a", b"N\x85b", b"(}}tb")


def _mutated(data: bytes, rng) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(out))
        how = rng.randrange(6)
        if how >= 4:  # an opcode that acts on an object, at an opcode boundary
            import pickletools

            starts = [pos for _, _, pos in pickletools.genops(bytes(out))] if how == 4 else []
            at = rng.choice(starts) if starts else i
            out[at:at] = rng.choice(_ACTING)
        elif how == 0:
            out[i] = rng.randrange(256)
        elif how == 1:
            del out[i]
        elif how == 2:
            out.insert(i, rng.randrange(256))
        else:  # a small number changed: a length, an index, a memo slot
            out[i] = (out[i] + rng.choice((-1, 1))) % 256
    return bytes(out)


def mutation_seed(kind: str) -> dict:
    """The state dicts the mutation passes start from: tensors, views and plain values; or numpy state (an RNG state,
    arrays of numbers in both byte orders, a 0-d one) beside a tensor, for memo references into numpy's state."""
    if kind == "numpy":
        return {"w": torch.arange(6.0).reshape(2, 3), "rng": np.random.RandomState(0).get_state(),
                "array": np.arange(6, dtype=np.float32).reshape(2, 3), "big": np.arange(3, dtype=">i8"),
                "zero_d": np.array(2.5), "same": [np.arange(2, dtype=np.uint8)] * 2}
    return _views_and_values() | {k: v for k, v in _leaves().items() if k not in ("rng", "array", "sd")}


@pytest.mark.parametrize(("seed", "cases"), [("values", 600), ("numpy", 300)])
def test_mutated_pickles_read_as_torch_load_reads_them_or_not_at_all(tmp_path, seed, cases):
    """A fixed-seed pass over data.pkl mutations of a real file: the reader gives entries or one CheckpointError;
    what it reads without torch.load, torch.load reads too, to the same names, key paths, tensors and values;
    what it refuses, torch.load refuses."""
    import random

    rng = random.Random(0)
    src = tmp_path / "seed.pt"
    torch.save(mutation_seed(seed), src)
    with zipfile.ZipFile(src) as z:
        pkl_name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        pkl = z.read(pkl_name)
    allow_safe_globals()
    outcomes: dict[str, int] = {}
    for case in range(cases):
        try:
            mutated = _mutated(pkl, rng)
        except ValueError:  # an earlier mutation broke the opcode walk itself
            continue
        path = with_pickle(tmp_path, mutated, f"case{case}.pt", src)
        try:
            loaded = TorchFileLoad(str(path))
            kind = "torch.load" if loaded.fallback else "read"
        except CheckpointError as exc:
            loaded, kind = None, "refused" if "weights_only refuses" in str(exc) else "error"
        outcomes[kind] = outcomes.get(kind, 0) + 1
        if kind in ("read", "refused"):
            try:
                ref = torch.load(path, weights_only=True, map_location="cpu")  # as the product loads (fallback)
            except Exception as exc:  # any failure of torch's loader
                ref = exc
            if kind == "refused":
                assert isinstance(ref, Exception), (case, "torch.load reads what the reader refused")
                continue
            assert not isinstance(ref, Exception), (case, f"torch.load refuses what the reader read: {ref}")
            flat = {dotted(k): (k, v) for k, v in flatten(ref).items()}
            assert loaded.paths() == {n: k for n, (k, _) in flat.items()}, case
            for n, view in loaded.tensors().items():
                t = flat[n][1]
                assert (view.dtype, view.shape, view.stride, view.storage_offset) == (
                    str(t.dtype).removeprefix("torch."), tuple(t.shape), t.stride(), t.storage_offset()), (case, n)
            for n, v in loaded.objects().items():
                assert _same(v, flat[n][1]), (case, n, v, flat[n][1])
        path.unlink()
    assert outcomes.get("read", 0) > 0 and outcomes.get("error", 0) + outcomes.get("torch.load", 0) > 0, outcomes


def test_numpy_arrays_sharing_one_string_are_charged_for_their_bytes(tmp_path):
    """A memo reference gives one 1 MiB string to 300 big-endian numpy arrays (numpy copies it into each: 300 MiB
    from a 1 MiB file): refused as an allocation bomb before the arrays are all made; a shape given as a bare
    int to numpy's _reconstruct is charged too."""
    import pickle as pk

    from numpy._core.multiarray import _reconstruct
    from shardscope.backend.errors import RefusedPickleError

    raw = bytes(1 << 20)
    dtype = np.dtype(">u4")

    class Shared:
        pass

    class P(pk.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, Shared):
                return _reconstruct, (np.ndarray, (0,), b"b"), (1, (len(raw) // 4,), dtype, False, raw)
            return NotImplemented

    buf = io.BytesIO()
    P(buf, protocol=2).dump({"a": [Shared() for _ in range(300)]})
    assert len(buf.getvalue()) < 2 << 20  # the string once, then memo references
    path = with_pickle(tmp_path, buf.getvalue(), "shared.pt")
    with pytest.raises(RefusedPickleError, match="allocation bomb"):
        TorchFileLoad(str(path))
    bare = io.BytesIO()

    class Q(pk.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, Shared):
                return _reconstruct, (np.ndarray, 400_000_000, b"b")
            return NotImplemented

    Q(bare, protocol=2).dump({"a": Shared()})
    with pytest.raises(RefusedPickleError, match="allocation bomb"):
        TorchFileLoad(str(with_pickle(tmp_path, bare.getvalue(), "bare.pt")))
