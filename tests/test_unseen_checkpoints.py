"""Issue 10 re-checked on checkpoint kinds the fixtures lack, written by torch itself: DTensors sharded on
dim 1 and over 2-D meshes (FSDP+TP), uneven and zero-size shards, every dtype including float8 and
uint16/32, 0-dim and empty tensors, non-tensor objects of many kinds (io.BytesIO too), long and unicode
names, ``_extra_state``, ``dcp.async_save``, optimizer states, ``thread_count > 1``; and hostile folders.
Every command runs on each; values are compared with torch's own ``dcp_to_torch_save``.

Run as ``python tests/test_unseen_checkpoints.py OUTDIR`` to write the checkpoints (the module fixture does).
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

HERE = Path(__file__).parent
SPAWNED = ("dtensor", "async", "threads")  # written together by one 4-rank gloo run
SINGLE = ("dtypes", "objects", "names", "extra_state", "optim")  # dcp.save(no_dist=True)
RTL_NAME = "model.rtl\u202eevil.w"


# ------------------------------------------------------------------ writing (also runs in spawned ranks)
def _dtensor_state() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.randn(6, 10, generator=torch.Generator().manual_seed(7))
    mesh = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {
        "col": distribute_tensor(full, mesh, [Shard(1)]),  # 10 columns over 4 ranks: 3, 3, 3, 1
        "tiny_rows": distribute_tensor(torch.arange(15.0).reshape(3, 5), mesh, [Shard(0)]),  # rank 3: 0 rows
        "narrow_cols": distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(1)]),  # 2 ranks: 0 columns
        "tiny_2d": distribute_tensor(torch.arange(3.0).reshape(1, 3), mesh2, [Shard(0), Shard(1)]),  # 1 row, 2x2
        "rep": distribute_tensor(torch.arange(7.0), mesh, [Replicate()]),
        "sr": distribute_tensor(full, mesh2, [Shard(0), Replicate()]),
        "ss": distribute_tensor(full, mesh2, [Shard(0), Shard(1)]),
        "s00": distribute_tensor(torch.arange(40.0).reshape(8, 5), mesh2, [Shard(0), Shard(0)]),
        "rs": distribute_tensor(full, mesh2, [Replicate(), Shard(1)]),
        "fsdp_tp": _fsdp_tp(mesh2),
    }


def _fsdp_tp(mesh2) -> dict:
    """A tensor-parallel MLP sharded again by FSDP2 on the other mesh dimension (_StridedShard placements)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(3)
    m = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 6))
    parallelize_module(m, mesh2["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(m, mesh=mesh2["dp"])
    return m.state_dict()


def _rank(rank: int, world: int, store: str, root: str) -> None:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        dcp.save(_dtensor_state(), checkpoint_id=os.path.join(root, "dtensor"))
        dcp.async_save({"w": torch.arange(12.0).reshape(4, 3), "step": 5},
                       checkpoint_id=os.path.join(root, "async")).result()
        mesh = init_device_mesh("cpu", (world,))
        layers = {f"layer{i}.w": distribute_tensor(torch.full((5, 3), float(i)), mesh, [Shard(0)]) for i in range(6)}
        dcp.save(layers, storage_writer=dcp.FileSystemWriter(os.path.join(root, "threads"), thread_count=3))
        dist.barrier()
    finally:
        dist.destroy_process_group()


class WithExtraState(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.payload = torch.arange(4, dtype=torch.uint8)

    def get_extra_state(self):
        return {"version": 3, "blob": self.payload.clone()}

    def set_extra_state(self, state):
        self.payload = state["blob"]


def _optim_state() -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    adam = torch.optim.Adam(m.parameters(), lr=1e-3)
    for _ in range(2):
        loss = m(torch.randn(5, 4)).square().mean()
        sgd.zero_grad()
        adam.zero_grad()
        loss.backward()
        sgd.step()
        adam.step()
    msd, asd = get_state_dict(m, adam)
    return {"model": msd, "adam": asd, "sgd": sgd.state_dict()}


def _single_state(kind: str) -> dict:
    if kind == "dtypes":
        return {
            "b": torch.tensor([True, False, True]), "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
            "u8": torch.tensor([0, 200, 255], dtype=torch.uint8), "f16": torch.tensor([1.5, -2.0], dtype=torch.float16),
            "bf16": torch.tensor([1.5, -2.0, 3e38], dtype=torch.bfloat16),
            "c64": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
            "c128": torch.tensor([1j], dtype=torch.complex128),
            "f8": torch.tensor([0.5, -1.0, 448.0], dtype=torch.float8_e4m3fn),
            "f8b": torch.tensor([0.5, -1.0], dtype=torch.float8_e5m2),
            "u16": torch.tensor([1, 65535], dtype=torch.uint16), "u32": torch.tensor([7], dtype=torch.uint32),
            "scalar": torch.tensor(3.25), "iscalar": torch.tensor(7, dtype=torch.int64),
            "empty": torch.zeros(0), "empty2": torch.zeros(0, 4), "noncontig": torch.arange(12.0).reshape(3, 4).t(),
        }
    if kind == "objects":
        return {"bio": io.BytesIO(b"hello bytes"), "nested": {"a": {"b": [1, 2, {"c": "deep"}]}, "t": (1, "x", None)},
                "s": "a string", "none": None, "tup": (1, 2.5, "z"), "lst": [torch.ones(2), "mixed", 3],
                "f": 0.125, "i": 2**40, "by": b"raw bytes", "flag": True}
    if kind == "names":
        return {f"model.{'a' * 300}.weight": torch.ones(2), "model.ünïcödé.权重": torch.arange(3.0),
                "model.emoji.🔥.bias": torch.zeros(2), "model.sp ace.w": torch.ones(1), RTL_NAME: torch.ones(1),
                "model.new\nline.w": torch.ones(1), "model.tab\tw": torch.ones(1)}
    if kind == "extra_state":
        torch.manual_seed(0)
        return {"model": torch.nn.Sequential(WithExtraState(), torch.nn.LayerNorm(2)).state_dict()}
    return _optim_state()


def write_all(root: Path) -> None:
    """Every healthy checkpoint of this module under ``root``."""
    import warnings

    import torch.multiprocessing as mp

    warnings.filterwarnings("ignore")
    for kind in SINGLE:
        dcp.save(_single_state(kind), checkpoint_id=str(root / kind), no_dist=True)
    with tempfile.TemporaryDirectory(prefix="shardscope-unseen-") as tmp:
        mp.start_processes(_rank, args=(4, os.path.join(tmp, "store"), str(root)), nprocs=4, start_method="spawn")



def write_hostile(root: Path, good: Path) -> None:
    """Hostile and odd folders, made from ``good`` (a one-file healthy checkpoint) with torch's own classes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    def folder(name: str, copy: bool = False) -> Path:
        p = root / name
        shutil.copytree(good, p) if copy else p.mkdir()
        return p

    tops = {"top_dict": {"state_dict_metadata": {}}, "top_list": [1, 2], "top_none": None, "top_str": "Metadata",
            "top_tsm": TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([2]), []),
            "top_bytes": BytesStorageMetadata(), "top_index": MetadataIndex("x", torch.Size([0]))}
    for name, obj in tops.items():
        (folder(name, copy=True) / ".metadata").write_bytes(pickle.dumps(obj))
    chunk_entry = Metadata(state_dict_metadata={"a": ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))})
    (folder("entry_is_chunk") / ".metadata").write_bytes(pickle.dumps(chunk_entry))
    n = 100_000  # one tensor, one element in each of 100,000 files (none of which exist)
    big = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([n]),
                                [ChunkStorageMetadata(torch.Size([i]), torch.Size([1])) for i in range(n)])
    data = {MetadataIndex("big", torch.Size([i])): _StorageInfo(f"__{i}_0.distcp", 0, 500) for i in range(n)}
    (folder("files_100k") / ".metadata").write_bytes(pickle.dumps(Metadata({"big": big}, storage_data=data)))
    folder("empty")
    (root / "is_a_file").write_bytes(b"not a folder")
    (folder("metadata_is_dir") / ".metadata").mkdir()
    os.mkfifo(folder("metadata_fifo") / ".metadata")
    os.symlink("/etc/hostname", folder("metadata_link_out") / ".metadata")
    p = folder("shard_link_out", copy=True)
    os.remove(p / "__0_0.distcp")
    os.symlink((good / "__0_0.distcp").resolve(), p / "__0_0.distcp")
    p = folder("shard_link_in", copy=True)
    os.rename(p / "__0_0.distcp", p / "real.bin")
    os.symlink("real.bin", p / "__0_0.distcp")
    p = folder("stray", copy=True)  # things a real folder collects
    (p / "README.txt").write_text("notes")
    (p / "sub").mkdir()
    (p / "sub" / ".metadata").write_bytes(b"x")
    os.mkfifo(p / "a_fifo")
    os.symlink("/etc/passwd", p / "passwd_link")
    os.symlink("/nonexistent", p / "dangling")
    _write_zip_with_traversal(folder("zip_traversal"), _StorageInfo)


def _write_zip_with_traversal(p: Path, storage_info: type) -> None:
    """A one-tensor checkpoint whose item zip also holds members named ``../../..`` and ``/abs``."""
    import warnings
    import zipfile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(p), no_dist=True)
    buf = io.BytesIO()
    with zipfile.ZipFile(p / "__0_0.distcp") as src, zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info.filename))
        z.writestr("../../../../../tmp/shardscope-evil", b"evil")
        z.writestr("/tmp/shardscope-evil-abs", b"evil")
    (p / "__0_0.distcp").write_bytes(buf.getvalue())
    md = pickle.loads((p / ".metadata").read_bytes())  # we wrote it: safe
    for k, v in md.storage_data.items():
        md.storage_data[k] = storage_info(v.relative_path, 0, len(buf.getvalue()))
    (p / ".metadata").write_bytes(pickle.dumps(md))


if __name__ == "__main__":
    write_all(Path(sys.argv[1]))
    sys.exit(0)


# ------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def unseen(tmp_path_factory) -> Path:
    for attempt in (1, 2, 3):  # a busy machine can fail a gloo run; each try starts from an empty folder
        root = tmp_path_factory.mktemp("unseen")
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(root)], capture_output=True,
                              text=True, timeout=900)
        if proc.returncode == 0:
            break
        if attempt == 3:
            pytest.fail(f"writing the checkpoints failed 3 times:\n{proc.stderr[-6000:]}", pytrace=False)
    hostile = root / "hostile"
    hostile.mkdir()
    write_hostile(hostile, root / "extra_state")
    return root


def cli(capsys, *args) -> tuple[int, str, str]:
    """One ``shardscope`` command line through the real entry point (in this process: fast)."""
    from shardscope.app.cli.main import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _bits(t: torch.Tensor) -> list[int]:
    return t.reshape(-1).contiguous().view(torch.uint8).tolist()


def _same(a, b) -> bool:
    """Equal bit for bit (NaN-safe; float8 has no comparison kernels), BytesIO by content."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)
    if isinstance(a, io.BytesIO):
        return isinstance(b, io.BytesIO) and a.getvalue() == b.getvalue()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _reference(path: Path, tmp: Path):
    """What torch's own dcp_to_torch_save writes for ``path`` (trusted: we wrote it)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(tmp / "reference.pt"))
    return torch.load(tmp / "reference.pt", weights_only=False)


@pytest.mark.parametrize("name", SPAWNED + SINGLE)
def test_every_command_on_an_unseen_kind(unseen, name, capsys, tmp_path):
    import json

    from shardscope.backend.checkpoint.chunks import allow_safe_globals

    path = unseen / name
    rc, out, err = cli(capsys, "inspect", "--json", path)
    assert rc == 0, err
    listing = json.loads(out)
    assert not listing["problems"]
    rc, out, err = cli(capsys, "verify", "--deep", path)
    assert (rc, err) == (0, ""), out
    for t in listing["tensors"]:
        rc, out, err = cli(capsys, "show", path, t["fqn"])
        assert rc == 0 and "values" in out, (t["fqn"], err)
    for o in listing["objects"]:
        rc, out, err = cli(capsys, "show", path, o["fqn"])
        assert rc == 0, (o["fqn"], err)
        if o["fqn"] == "bio":  # by its bytes, not its address
            assert "value  io.BytesIO of 11 bytes: b'hello bytes'" in out, out
    if name == "dtypes":  # columns stay aligned past float8_e4m3fn and complex128
        rc, out, err = cli(capsys, "inspect", "--tensors", path)
        rows = [ln for ln in out.splitlines() if " B  1 chunk" in ln]
        assert len(rows) == len(listing["tensors"]) and len({ln.index("[") for ln in rows}) == 1, out
    rc, out, err = cli(capsys, "export", path, tmp_path / "all.pt")
    assert rc == 0, err
    allow_safe_globals()  # an io.BytesIO entry, as dcp_to_torch_save keeps it
    assert _same(_reference(path, tmp_path), torch.load(tmp_path / "all.pt", weights_only=True))
    if name == "dtypes":  # safetensors has no complex128: a clear refusal, nothing written
        rc, out, err = cli(capsys, "export", path, tmp_path / "c128.safetensors", "--only", "c128")
        assert rc == 2 and "c128: dtype complex128 has no safetensors equivalent" in err, err
        assert not (tmp_path / "c128.safetensors").exists()
    skip = ("--exclude", "c128") if name == "dtypes" else ()
    for dst in ("one.safetensors", "sharded"):
        extra = ("--max-shard-size", "200B") if dst == "sharded" else ()
        rc, out, err = cli(capsys, "export", path, tmp_path / dst, "--strip-prefix", "", *skip, *extra)
        assert rc == 0, err
    for other in (path, tmp_path / "all.pt", tmp_path / "one.safetensors", tmp_path / "sharded"):
        rc, out, err = cli(capsys, "diff", "--json", path, other)
        assert rc in (0, 1), err
        found = json.loads(out)
        assert not found["changed"] and not found["only_b"], (other, found)
        assert rc == 0 or (other.suffix != ".pt" and found["only_a"]), (other, found)  # safetensors holds tensors only


def test_layouts_match_torchs_own_metadata(unseen, capsys):
    """Shard(1), 2-D meshes, FSDP+TP's strided shards, a zero-row shard, thread_count=3: every chunk where torch
    says it is."""
    import json

    from torch_reference import torch_flat_tensors

    for name in ("dtensor", "threads"):
        rc, out, err = cli(capsys, "inspect", "--json", unseen / name)
        assert rc == 0, err
        ours = {t["fqn"]: (t["dtype"], tuple(t["shape"]), sorted(
            (tuple(c["offsets"]), tuple(c["sizes"]), c["file"], c["offset"], c["length"]) for c in t["chunks"]))
            for t in json.loads(out)["tensors"]}
        assert ours == torch_flat_tensors(unseen / name)
    assert ((3, 0), (0, 5)) in [c[:2] for c in ours_of(unseen / "dtensor", "tiny_rows")]


def ours_of(path: Path, fqn: str) -> list:
    from shardscope.backend.checkpoint import open_checkpoint

    return [(c.offsets, c.sizes) for c in open_checkpoint(path, use_cache=False).tensor(fqn).chunks]


# folder -> (exit code of `inspect`, of `verify --deep`, words the output must hold)
HOSTILE = {
    "top_dict": (2, 2, "does not hold DCP Metadata"), "top_list": (2, 2, "does not hold DCP Metadata"),
    "top_none": (2, 2, "does not hold DCP Metadata"), "top_str": (2, 2, "does not hold DCP Metadata"),
    "top_tsm": (2, 2, "does not hold DCP Metadata"), "top_bytes": (2, 2, "does not hold DCP Metadata"),
    "top_index": (2, 2, "does not hold DCP Metadata"),
    "entry_is_chunk": (0, 1, "a: unknown metadata entry ChunkStorageMetadata"),
    "files_100k": (0, 1, "__99999_0.distcp is missing"),
    "empty": (2, 2, "not a distributed checkpoint"),
    "is_a_file": (2, 2, "not a checkpoint file (.pt, .pth, .bin, .ckpt, .safetensors) or folder"),
    "metadata_is_dir": (2, 2, ".metadata: not a regular file (a folder); refused"),
    "metadata_fifo": (2, 2, ".metadata: not a regular file (a FIFO); refused"),
    "metadata_link_out": (2, 2, "a symbolic link to /etc/hostname, outside the checkpoint folder"),
    "shard_link_out": (0, 1, "__0_0.distcp is a symbolic link to"),
    "shard_link_in": (0, 0, "healthy"),
    "stray": (0, 0, "healthy"),
    "zip_traversal": (0, 1, "is not in the archive folder 'archive/'"),  # torch's loader refuses it too
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_and_odd_folders(unseen, name, capsys):
    import json

    path = unseen / "hostile" / name
    want_inspect, want_verify, words = HOSTILE[name]
    rc, out, err = cli(capsys, "inspect", path)
    assert rc == want_inspect, err
    rc, out, err = cli(capsys, "verify", "--deep", "--json", path)
    assert rc == want_verify, err
    text = out + err
    assert words in text, text[-2000:]
    assert "Traceback" not in text
    if rc == 1:  # found problems are listed once each; none twice (a cached read adds the listing's anew)
        messages = [p["message"] for p in json.loads(out)["problems"]]
        assert len(messages) == len(set(messages))
    if name == "files_100k":
        assert len(json.loads(out)["problems"]) == 100_000
    if name == "zip_traversal":
        assert not Path("/tmp/shardscope-evil").exists() and not Path("/tmp/shardscope-evil-abs").exists()
        rc, out, err = cli(capsys, "show", path, "w")
        assert rc == 2 and "max 5" not in out and len(err.splitlines()) == 1 and "tensor w" in err, err


def test_stray_files_twice_reported_once(unseen, capsys, tmp_path):
    """Leftovers of an interrupted save are named once, also when the metadata comes from the cache."""
    path = tmp_path / "leftover"
    shutil.copytree(unseen / "extra_state", path)
    (path / ".metadata.tmp").write_bytes(b"x")
    (path / "__9_0.distcp").write_bytes(b"PK\x03\x04junk")
    for _ in range(2):
        rc, out, _ = cli(capsys, "verify", path)
        assert rc == 1 and out.count(".metadata.tmp is left") == 1 and out.count("__9_0.distcp is not") == 1, out


@pytest.mark.parametrize("name", SPAWNED + SINGLE)
def test_window_shows_every_entry(unseen, name, qtbot):
    """The real window: every tensor selected shows its statistics (equal to torch's) and one map item per
    chunk; every non-tensor entry shows its value; "Verify contents" finds nothing."""
    from gui_support import open_view
    from PySide6.QtCore import QThreadPool
    from torch_reference import flatten

    path = unseen / name
    ref = flatten(_reference(path, Path(tempfile.mkdtemp(dir=unseen))))
    view = open_view(qtbot, path)
    try:
        for e in view.data.ckpt.tensors:
            got = []
            view.statsReady.connect(got.append)
            with qtbot.waitSignal(view.valuesDone, timeout=120000):
                assert view.select_path(e.fqn), e.fqn
            view.statsReady.disconnect(got.append)
            assert len(view.map.chunk_items) == e.chunk_count, e.fqn
            assert got, (e.fqn, view.inspector.title.text())
            t = ref[e.fqn]
            if t.numel() and t.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
                assert got[0].min == pytest.approx(t.min().item()) and got[0].max == pytest.approx(t.max().item())
        for o in view.data.ckpt.objects:
            assert view.select_path(o.fqn), o.fqn
            qtbot.waitUntil(lambda: "=" in view.inspector.title.text(), timeout=60000)
        with qtbot.waitSignal(view.contentsVerified, timeout=120000) as blocker:
            view.verify_contents()
        assert blocker.args[0] == []
    finally:
        view.shutdown()
        assert QThreadPool.globalInstance().waitForDone(10000)


def test_window_shows_hostile_names_as_text(unseen, qtbot, tmp_path):
    """A tensor named like HTML is shown as its text: Qt neither renders it nor opens the file an ``<img>``
    names (outside the checkpoint folder); a U+202E cannot reverse the labels around it."""
    import warnings

    from gui_support import open_view
    from PySide6.QtCore import Qt, QThreadPool
    from PySide6.QtGui import QImage

    outside = tmp_path / "outside.png"
    image = QImage(600, 400, QImage.Format.Format_RGB32)
    image.fill(0xFF0000)
    image.save(str(outside))
    img_name = f'<img src="{outside}" width=600>'
    path = tmp_path / "html_names"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({img_name: torch.ones(2), RTL_NAME: torch.ones(1)}, checkpoint_id=str(path), no_dist=True)
    view = open_view(qtbot, path)
    try:
        for fqn in (img_name, RTL_NAME):
            with qtbot.waitSignal(view.valuesDone, timeout=120000):
                assert view.select_path(fqn)
            for label in (view.map_caption, view.inspector.title):
                assert "<img" not in label.text() and "\u202e" not in label.text(), label.text()
                assert label.sizeHint().height() < 100  # no 400-pixel picture inside
            row, shown = view.model.index_for_path(fqn), ""
            while row.isValid():  # the tree's rows from the leaf up (RTL_NAME's U+202E is in a module's row)
                shown, row = row.data(Qt.ItemDataRole.DisplayRole) + "." + shown, row.parent()
            assert "\u202e" not in shown and (fqn != RTL_NAME or "\\u202e" in shown), shown  # the tree row too
            tip = view.model.index_for_path(fqn).data(Qt.ItemDataRole.ToolTipRole)
            assert "<img" not in tip and "&lt;img" in tip if fqn == img_name else tip.startswith(RTL_NAME)
    finally:
        view.shutdown()
        assert QThreadPool.globalInstance().waitForDone(10000)
