"""Every command and the window on the checkpoint kinds the fixtures lack, written by torch itself: DTensors
sharded on dim 1 and over 2-D meshes (FSDP+TP), uneven and zero-size shards, every dtype including float8 and
uint16/32, 0-dim and empty tensors, non-tensor objects of many kinds (io.BytesIO too), long and unicode
names, ``_extra_state``, ``dcp.async_save``, optimizer states, ``thread_count > 1``; and hostile folders.
Every command runs on each; values are compared with torch's own ``dcp_to_torch_save``.

The checkpoints are written by tests/kinds_writer.py (the module fixture runs it).
"""

from __future__ import annotations

import io
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import cli_in_process as cli
from gloo_retry import ATTEMPTS, RunFailed, retry_gloo, run_ok
from kinds_writer import RTL_NAME, SINGLE, SPAWNED, write_hostile

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def unseen(tmp_path_factory) -> Path:
    def write(root: Path) -> Path:
        run_ok([sys.executable, str(HERE / "kinds_writer.py"), str(root)], timeout=900)
        return root

    try:  # a busy machine can fail a gloo run; each try starts from an empty folder
        root = retry_gloo(lambda: tmp_path_factory.mktemp("unseen"), write)
    except RunFailed as e:
        pytest.fail(f"writing the checkpoints failed {ATTEMPTS} times:\n{e.proc.stderr[-6000:]}", pytrace=False)
    hostile = root / "hostile"
    hostile.mkdir()
    write_hostile(hostile, root / "extra_state")
    return root


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

    from shardscope.backend.checkpoint.unpickler import allow_torch_safe_globals as allow_safe_globals

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
    from shardscope.backend.formats import open_checkpoint

    return [(c.offsets, c.sizes) for c in open_checkpoint(path, use_cache=False).tensor(fqn).chunks]


# folder -> (exit code of `inspect`, of `verify --deep`, words the output must hold)
HOSTILE = {
    "top_dict": (2, 2, "does not hold DCP Metadata"), "top_list": (2, 2, "does not hold DCP Metadata"),
    "top_none": (2, 2, "does not hold DCP Metadata"), "top_str": (2, 2, "does not hold DCP Metadata"),
    "top_tsm": (2, 2, "does not hold DCP Metadata"), "top_bytes": (2, 2, "does not hold DCP Metadata"),
    "top_index": (2, 2, "does not hold DCP Metadata"),
    "entry_is_chunk": (2, 2, "it has no storage_data (torch's loader refuses it"),  # and a chunk as an entry
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
