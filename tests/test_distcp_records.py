"""The zip records of ``.distcp`` items that torch's loader reads and never checks: a non-tensor entry's
``data.pkl`` (its CRC32), the central directory and member names, ``.format_version``/``byteorder``/
``version``, a tensor item's ``data.pkl``. torch's own DCP loader is the oracle: whatever it cannot load,
``verify --deep`` does not call healthy, and any value Shardscope gives equals the one saved."""

from __future__ import annotations

import io
import shutil
import struct
import warnings
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.errors import ShardscopeError
from shardscope.backend.formats import open_checkpoint

DATA = "__0_0.distcp"
SAVED_W = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7


def _saved() -> dict:
    return {"w": SAVED_W.clone(), "f": 1.5, "step": 2, "b": io.BytesIO(b"hello bytes"), "note": "text"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A small checkpoint straight from dcp.save: one tensor and four non-tensor entries (a float, an int,
    a BytesIO and a string), each stored as its own torch.save archive."""
    import torch.distributed.checkpoint as dcp

    out = tmp_path_factory.mktemp("records") / "ckpt"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # no_dist=True says so on purpose
        dcp.save(_saved(), checkpoint_id=str(out), no_dist=True)
    return out


def _items(folder: Path) -> dict[str, tuple[int, int]]:
    """(offset, length) of every entry's archive in the data file, by name."""
    ckpt = open_checkpoint(folder, use_cache=False)
    out = {o.fqn: (o.offset, o.length) for o in ckpt.objects}
    out.update({t.fqn: (t.chunks[0].offset, t.chunks[0].length) for t in ckpt.tensors})
    return out


def _records(data: bytes, item: tuple[int, int]) -> dict[str, tuple[int, int, int]]:
    """Per record of one item's archive, by its name without the folder: (absolute offset of its bytes, its
    length, absolute offset of its central directory entry). Read with Python's zipfile (test side only)."""
    start, length = item
    blob = data[start:start + length]
    out = {}
    cd = blob.find(b"PK\x01\x02")
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        for info in z.infolist():
            nlen, xlen = struct.unpack_from("<HH", blob, info.header_offset + 26)
            entry = blob.index(info.filename.encode(), cd) - 46  # its central directory entry
            out[info.filename.split("/", 1)[1]] = (start + info.header_offset + 30 + nlen + xlen, info.file_size,
                                                  start + entry)
    return out


def _with(folder: Path, dst: Path, changes: list[tuple[int, bytes]]) -> Path:
    """A copy of ``folder`` whose data file has ``changes`` (offset, new bytes) applied."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(folder, dst)
    data = bytearray((dst / DATA).read_bytes())
    for at, new in changes:
        data[at:at + len(new)] = new
    (dst / DATA).write_bytes(bytes(data))
    return dst


def _fresh_crc(data: bytes, rec: tuple[int, int, int], new: bytes) -> list[tuple[int, bytes]]:
    """The changes that replace a record's bytes by ``new`` (same length) with its CRC32 updated in the
    central directory as well: only the structure, not the checksum, then says the record is wrong."""
    return [(rec[0], new), (rec[2] + 16, struct.pack("<I", zlib.crc32(new)))]


def _torch_loads(folder: Path) -> bool:
    """torch's DCP loader reads the checkpoint and gives back exactly what was saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    state = {"w": torch.zeros(3, 4), "f": 0.0, "step": 0, "b": io.BytesIO(), "note": ""}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    except (Exception, CheckpointException):  # the oracle: any failure of torch's loader counts (a BaseException)
        return False
    want = _saved()
    return (torch.equal(state["w"], want["w"]) and state["f"] == want["f"] and state["step"] == want["step"]
            and state["note"] == want["note"] and isinstance(state["b"], io.BytesIO)
            and state["b"].getvalue() == want["b"].getvalue())


def _shardscope(folder: Path) -> tuple[bool, list[str]]:
    """(verify --deep says healthy, the entries whose value was read but differs from the saved one)."""
    ckpt = open_checkpoint(folder, use_cache=False)
    healthy = not verify(ckpt, deep=True)
    wrong = []
    want = _saved()
    with ChunkReader(ckpt) as reader:
        for t in ckpt.tensors:
            try:
                if not torch.equal(reader.read_tensor(t), want[t.fqn]):
                    wrong.append(t.fqn)
            except ShardscopeError:
                pass
        for o in ckpt.objects:
            try:
                value = reader.read_object(o)
            except ShardscopeError:
                continue
            same = value.getvalue() == want["b"].getvalue() if o.fqn == "b" else value == want[o.fqn]
            if not same:
                wrong.append(o.fqn)
    return healthy, wrong


def _cases(data: bytes, items: dict[str, tuple[int, int]]) -> dict[str, list[list[tuple[int, bytes]]]]:
    """The fixed mutations, by class."""
    w, f = _records(data, items["w"]), _records(data, items["f"])
    cases: dict[str, list[list[tuple[int, bytes]]]] = {k: [] for k in (
        "central directory", "member names", "small records", "tensor data.pkl", "object data.pkl")}
    for item in ("w", "f"):
        start, length = items[item]
        blob = data[start:start + length]
        cd = blob.find(b"PK\x01\x02")
        for i in range(cd, length, 3):  # every third byte of the central directory and the end record
            cases["central directory"].append([(start + i, bytes([blob[i] ^ 0x5A]))])
    for recs in (w, f):
        for key, (at, _, entry) in recs.items():
            name = ("archive/" + key).encode()
            for i in (0, 4, 7, 8, len(name) - 1):
                for new in (b"\xff", b"X"):
                    cases["member names"].append([(entry + 46 + i, new)])
            cases["member names"].append([(at - len(name) - 64, b"\xff")])  # the local header's copy (padded)
    for key in (".format_version", "byteorder", "version", ".storage_alignment", ".data/serialization_id"):
        at, size, _ = w[key]
        for new in (b"0", b"2", b"x", b"\xff"):
            cases["small records"].append([(at, new)])
            cases["small records"].append(_fresh_crc(data, w[key], new + data[at + 1:at + size]))
    at, size, _ = w["data.pkl"]
    for i in range(0, size, 2):
        cases["tensor data.pkl"].append([(at + i, bytes([data[at + i] ^ 0x21]))])
    at, size, _ = f["data.pkl"]
    for i in range(size):
        cases["object data.pkl"].append([(at + i, bytes([data[at + i] ^ 0x40]))])
    return cases


def test_what_torch_cannot_load_is_never_healthy(saved, tmp_path):
    """Item 6 (and 5): each class of mutation; where torch's DCP loader fails (or loads other values),
    deep verify finds a problem; a value Shardscope reads is always the saved one."""
    data = (saved / DATA).read_bytes()
    cases = _cases(data, _items(saved))
    failures, refused = [], {}
    for kind, changes_list in cases.items():
        refused[kind] = 0
        for n, changes in enumerate(changes_list):
            folder = _with(saved, tmp_path / "case", changes)
            torch_ok = _torch_loads(folder)
            healthy, wrong = _shardscope(folder)
            refused[kind] += not torch_ok
            if (healthy and not torch_ok) or wrong:
                failures.append(f"{kind} #{n} {changes}: healthy={healthy} torch loads={torch_ok} wrong={wrong}")
    assert not failures, f"{len(failures)} cases:\n" + "\n".join(failures[:20])
    assert all(refused.values()), refused  # every class has cases torch refuses: the oracle is exercised


def test_corrupt_object_pickle_gives_no_value(saved, tmp_path):
    """Item 5: the saved 1.5 with its data.pkl record changed (the CRC32 stored with it now differs) is
    refused with one line naming the file and the entry by show, export and diff, and is a problem for verify."""
    data = (saved / DATA).read_bytes()
    at = _records(data, _items(saved)["f"])["data.pkl"][0]
    assert data[at + 3:at + 5] == b"?\xf8"  # BINFLOAT 1.5
    folder = _with(saved, tmp_path / "bad", [(at + 3, b"\xbf\x80")])
    show = run_cli("show", folder, "f", "--no-cache")
    assert show.returncode == 2, show
    assert "value" not in show.stdout and "0.0078" not in show.stdout + show.stderr
    assert len(show.stderr.splitlines()) == 1 and DATA in show.stderr and "entry f" in show.stderr, show.stderr
    assert "CRC32" in show.stderr
    ver = run_cli("verify", "--deep", folder, "--no-cache")
    assert ver.returncode == 1 and "healthy" not in ver.stdout.replace("1 problem", ""), ver.stdout
    assert "entry f" in ver.stdout and "CRC32" in ver.stdout and not ver.stderr, ver
    export = run_cli("export", folder, tmp_path / "out.pt")
    assert export.returncode == 2, export
    assert DATA in export.stderr and "entry f" in export.stderr and "Traceback" not in export.stderr
    assert not (tmp_path / "out.pt").exists()
    diff = run_cli("diff", folder, saved)
    assert diff.returncode == 2, diff
    assert "unreadable in A" in diff.stdout and "f" in diff.stdout and len(diff.stderr.splitlines()) == 1, diff


@pytest.mark.parametrize("crc", ["stale", "fresh"])
def test_bytearray_bomb_in_a_tensor_pickle_is_one_line(saved, tmp_path, crc):
    """Item 7: a tensor item's data.pkl that asks the C unpickler for a huge bytearray (CPython 3.11 then
    printed "SystemError: deallocated bytearray object has exported buffers" by itself): one line on
    stderr for show and diff, a problem and nothing on stderr for verify. With its CRC32 updated too,
    only the check of the pickle's opcodes stands between the file and the unpickler."""
    data = (saved / DATA).read_bytes()
    rec = _records(data, _items(saved)["w"])["data.pkl"]
    at, size, _ = rec
    bomb = b"\x80\x02\x96" + (2**62).to_bytes(8, "little")
    new = bomb + data[at + len(bomb):at + size]
    changes = [(at, bomb)] if crc == "stale" else _fresh_crc(data, rec, new)
    folder = _with(saved, tmp_path / "bomb", changes)
    for args, code in [(("show", folder, "w", "--no-cache"), 2), (("diff", folder, saved), 2)]:
        proc = run_cli(*args)
        assert proc.returncode == code, proc
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
        assert "SystemError" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
        assert DATA in proc.stderr or "failed" in proc.stderr, proc.stderr
    ver = run_cli("verify", "--deep", folder, "--no-cache")
    assert ver.returncode == 1 and "tensor w" in ver.stdout and not ver.stderr, ver


def test_object_pickle_cut_short_is_one_line(saved, tmp_path):
    """A non-tensor entry whose data.pkl (CRC32 updated to match) ends inside a BINFLOAT's argument: torch's
    weights-only unpickler raises struct.error, which is one line naming the file and entry (found by the
    fuzzer's torch oracle), not a traceback."""
    data = (saved / DATA).read_bytes()
    rec = _records(data, _items(saved)["f"])["data.pkl"]
    assert rec[1] == 12
    folder = _with(saved, tmp_path / "short", _fresh_crc(data, rec, b"\x80\x02K\x01K\x01K\x01K\x01G."))
    show = run_cli("show", folder, "f", "--no-cache")
    assert show.returncode == 2 and len(show.stderr.splitlines()) == 1, show
    assert "entry f" in show.stderr and "Traceback" not in show.stderr and "internal error" not in show.stderr
    ver = run_cli("verify", "--deep", folder, "--no-cache")
    assert ver.returncode == 1 and "entry f" in ver.stdout and not ver.stderr, ver


def test_object_pickle_of_an_unknown_protocol_is_not_healthy(saved, tmp_path):
    """A non-tensor entry whose data.pkl (CRC32 updated to match) names pickle protocol 130: torch's DCP loader
    (Python's pickle) refuses it while the weights-only unpickler would not; found by the fuzzer's torch oracle."""
    data = (saved / DATA).read_bytes()
    rec = _records(data, _items(saved)["f"])["data.pkl"]
    pkl = data[rec[0]:rec[0] + rec[1]]
    assert pkl[:2] == b"\x80\x02"
    folder = _with(saved, tmp_path / "proto", _fresh_crc(data, rec, b"\x80\x82" + pkl[2:]))
    assert not _torch_loads(folder)
    ver = run_cli("verify", "--deep", folder, "--no-cache")
    assert ver.returncode == 1 and "entry f" in ver.stdout and "protocol 130" in ver.stdout and not ver.stderr, ver
    show = run_cli("show", folder, "f", "--no-cache")
    assert show.returncode == 2 and len(show.stderr.splitlines()) == 1 and "entry f" in show.stderr, show


@pytest.mark.parametrize("entry, record", [("w", "version"), ("w", "data.pkl"), ("f", "data.pkl")])
def test_a_record_marked_as_a_folder_is_not_healthy(saved, tmp_path, entry, record):
    """The DOS folder bit in a central directory entry's external attributes: miniz (torch's zip reader) takes
    the record for a folder and torch's loader fails; verify --deep once said healthy (found by fuzz_long)."""
    data = (saved / DATA).read_bytes()
    rec = _records(data, _items(saved)[entry])[record]
    case = _with(saved, tmp_path / "case", [(rec[2] + 38, struct.pack("<I", 0x10))])
    assert not _torch_loads(case)
    healthy, wrong = _shardscope(case)
    assert not healthy and not wrong


def test_a_tensor_rebuilt_with_arguments_torch_refuses_is_not_healthy(saved, tmp_path):
    """A tensor item's data.pkl without its requires_grad argument (the NEWFALSE opcode dropped, the length kept,
    the CRC32 updated): torch's _rebuild_tensor_v2 refuses the call; verify --deep once said healthy (found by
    fuzz_long)."""
    data = (saved / DATA).read_bytes()
    rec = _records(data, _items(saved)["w"])["data.pkl"]
    pkl = data[rec[0]:rec[0] + rec[1]]
    at = pkl.index(b"\x89ccollections")
    new = pkl[:at] + pkl[at + 1:] + b"."
    case = _with(saved, tmp_path / "case", _fresh_crc(data, rec, new))
    assert not _torch_loads(case)
    healthy, wrong = _shardscope(case)
    assert not healthy and not wrong
