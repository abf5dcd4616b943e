"""Hostile and damaged checkpoints built from real dcp.save output: every one gives a clean exit code and
one line, never a traceback, a hang, or memory driven by a number inside the file; and damaged bytes are
never reported as good values."""

from __future__ import annotations

import json
import math
import os
import pickle
import struct
import subprocess
import sys
import time

import pytest
from conftest import run_cli, run_cli_peak
from shardscope.backend.checkpoint import open_checkpoint
from shardscope.backend.checkpoint.chunks import ChunkReader, CorruptChunkError
from shardscope.backend.checkpoint.layout import coverage
from shardscope.backend.checkpoint.verify import verify, verify_contents
from shardscope.backend.errors import CheckpointError
from shardscope.backend.progress import Progress
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch_reference import torch_metadata

FQN = "model.blocks.0.fc1.weight"


def run_measured(*args: object, timeout: float = 300) -> tuple[subprocess.CompletedProcess, int]:
    """Run the CLI in a subprocess; the exit code, output and its peak RSS in MiB."""
    return run_cli_peak(*args, timeout=timeout)


def clean(proc: subprocess.CompletedProcess, codes: tuple[int, ...] = (2,)) -> None:
    assert proc.returncode in codes, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr


def save_metadata(folder, md, protocol: int = 2) -> bytes:
    data = pickle.dumps(md, protocol=protocol)
    (folder / ".metadata").write_bytes(data)
    return data


def index_of(md, fqn: str, offsets) -> MetadataIndex:
    return next(k for k in md.storage_data if k.fqn == fqn and tuple(k.offset) == tuple(offsets))


# ---------------------------------------------------------------- allocation bombs and nesting
def test_bytearray_bomb_is_refused_without_allocating(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    bomb = b"\x80\x02cbuiltins\nbytearray\n\x8a\x05" + (5_000_000_000).to_bytes(5, "little") + b"\x85R."
    (tmp_path / ".metadata").write_bytes(bomb)
    assert len(bomb) < 40
    proc, mb = run_measured("inspect", tmp_path)
    clean(proc)
    assert "allocation bomb" in proc.stderr and mb < 1500, mb


class _Bytes:
    def __reduce__(self):
        return bytearray, (20_000_000,)


class _ListOfBytes:
    def __reduce__(self):
        return list, (_Bytes(),)


def test_shape_built_from_a_huge_bytearray_is_refused(copy_of):
    ckpt = copy_of("fsdp2_r2")
    md = torch_metadata(ckpt)
    md.state_dict_metadata[FQN].size = _ListOfBytes()
    assert len(save_metadata(ckpt, md)) < 100_000
    proc, mb = run_measured("inspect", ckpt, "--no-cache")
    clean(proc)
    assert mb < 1500, mb


def test_deeply_nested_version_and_dict_key(copy_of):
    ckpt = copy_of("fsdp2_r2")
    md = torch_metadata(ckpt)
    md.version = "VERSIONMARK"
    data = pickle.dumps(md, protocol=2)
    marker = b"X\x0b\x00\x00\x00VERSIONMARK"
    assert data.count(marker) == 1
    # a dict whose key is a tuple nested 200,000 deep: hashing it recurses in C
    nested = b"}" + b")" + b"\x85" * 200_000 + b"K\x01s"
    (ckpt / ".metadata").write_bytes(data.replace(marker, nested))
    for cmd in ("inspect", "verify"):
        clean(run_cli(cmd, ckpt, "--no-cache"))


def test_nested_version_string_is_bad_input_not_a_cache_crash(copy_of):
    ckpt = copy_of("nopg")
    md = torch_metadata(ckpt)
    md.version = "VERSIONMARK"
    data = pickle.dumps(md, protocol=2)
    nested = b")" + b"\x85" * 200_000  # a tuple nested 200,000 deep where the version string belongs
    (ckpt / ".metadata").write_bytes(data.replace(b"X\x0b\x00\x00\x00VERSIONMARK", nested))
    proc = run_cli("inspect", ckpt)  # with the metadata cache on
    clean(proc)
    assert "version" in proc.stderr


# ---------------------------------------------------------------- record fields checked after unpickling
def _bad_records():
    def chunk_is_int(md):
        md.state_dict_metadata[FQN].chunks[0] = 7

    def none_in_sizes(md):
        md.state_dict_metadata[FQN].chunks[0].sizes = [None, 12]

    def string_offsets(md):
        md.state_dict_metadata[FQN].chunks[0].offsets = "ab"

    def huge_offset(md):
        info = md.storage_data[index_of(md, FQN, (0, 0))]
        info.offset = 2**63

    def ragged(md):
        md.state_dict_metadata[FQN].chunks[0].offsets = (0,)

    def path_none(md):
        md.storage_data[index_of(md, FQN, (0, 0))].relative_path = None

    def path_absolute(md):
        md.storage_data[index_of(md, FQN, (0, 0))].relative_path = "/dev/zero"

    def path_escapes(md):
        md.storage_data[index_of(md, FQN, (0, 0))].relative_path = "../../../../../../dev/zero"

    def dtype_junk(md):
        md.state_dict_metadata[FQN].properties.dtype = [1, 2]

    def shape_huge(md):
        md.state_dict_metadata[FQN].size = (2**63, 1)

    def fqn_not_str(md):
        md.state_dict_metadata[(1, 2)] = md.state_dict_metadata.pop(FQN)

    return [chunk_is_int, none_in_sizes, string_offsets, huge_offset, ragged, path_none, path_absolute,
            path_escapes, dtype_junk, shape_huge, fqn_not_str]


@pytest.mark.parametrize("damage", _bad_records(), ids=lambda f: f.__name__)
def test_bad_record_fields_are_bad_input(copy_of, damage):
    ckpt = copy_of("fsdp2_r2")
    md = torch_metadata(ckpt)
    damage(md)
    save_metadata(ckpt, md)
    with pytest.raises(CheckpointError):
        open_checkpoint(ckpt, use_cache=False)
    proc = run_cli("show", ckpt, FQN, "--no-cache", timeout=120)
    clean(proc)


def test_unhashable_storage_key_is_bad_input(copy_of):
    ckpt = copy_of("nopg")
    md = torch_metadata(ckpt)
    # a list where the MetadataIndex's offset belongs makes the storage_data key unhashable
    first = next(k for k in md.storage_data if k.offset is not None)
    info = md.storage_data.pop(first)
    key = MetadataIndex(first.fqn)
    object.__setattr__(key, "offset", "OFFSETMARK__")
    md.storage_data[key] = info
    data = pickle.dumps(md, protocol=2).replace(b"X\x0c\x00\x00\x00OFFSETMARK__", b"]")
    (ckpt / ".metadata").write_bytes(data)
    clean(run_cli("inspect", ckpt, "--no-cache"), (0, 2))
    proc = run_cli("verify", ckpt, "--no-cache")
    clean(proc, (1, 2))
    assert first.fqn in proc.stdout + proc.stderr


# ---------------------------------------------------------------- analysis cost and integer width
def test_fifty_thousand_repeated_chunks_are_fast(copy_of):
    ckpt = copy_of("fsdp2_r2")
    md = torch_metadata(ckpt)
    tm = md.state_dict_metadata[FQN]
    tm.chunks = tm.chunks + [tm.chunks[0]] * 50_000  # pickle memo references: a few bytes each
    assert len(save_metadata(ckpt, md)) < 2_000_000
    t0 = time.monotonic()
    problems = verify(open_checkpoint(ckpt, use_cache=False))
    assert time.monotonic() - t0 < 60  # was 119 s with a per-chunk slice update
    over = [p for p in problems if p.kind == "overlap" and p.fqn == FQN]
    extra = 50_000 * math.prod(tm.chunks[0].sizes)
    assert over and f"overlap on {extra} elements" in over[0].message


def test_huge_shape_with_half_missing_is_reported(copy_of):
    ckpt = copy_of("nopg")
    md = torch_metadata(ckpt)
    fqn = next(k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
               and len(v.size) == 2)
    tm = md.state_dict_metadata[fqn]
    old = tm.chunks[0]
    info = md.storage_data.pop(index_of(md, fqn, old.offsets))
    import torch

    tm.size = torch.Size([2**40, 2**40])
    tm.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2**39, 2**40]))]
    md.storage_data[MetadataIndex(fqn, torch.Size([0, 0]))] = info
    save_metadata(ckpt, md)
    ck = open_checkpoint(ckpt, use_cache=False)
    cov = coverage(ck, ck.tensor(fqn))
    assert not cov.exact and cov.gap_elements == 2**79
    gaps = [p for p in verify(ck) if p.kind == "gap"]
    assert gaps and gaps[0].fqn == fqn
    clean(run_cli("show", ckpt, fqn, "--no-cache"))  # not 4 TiB of torch.empty: bad input


# ---------------------------------------------------------------- untrusted lengths inside .distcp items
def _item(ckpt_path, fqn=FQN):
    ck = open_checkpoint(ckpt_path, use_cache=False)
    chunk = ck.tensor(fqn).chunks[0]
    return ck, chunk


def test_zip64_central_directory_claim(copy_of, tmp_path):
    ckpt = copy_of("fsdp2_r2")
    _ck, chunk = _item(ckpt)
    path = ckpt / chunk.file
    data = bytearray(path.read_bytes())
    item = data[chunk.offset:chunk.offset + chunk.length]
    eocd, z64 = item.rfind(b"PK\x05\x06"), item.rfind(b"PK\x06\x06")
    assert eocd > 0 and z64 > 0
    struct.pack_into("<I", data, chunk.offset + eocd + 16, 0xFFFFFFFF)  # "see the zip64 record"
    struct.pack_into("<Q", data, chunk.offset + z64 + 40, 2**50)  # a 1 PiB central directory
    path.write_bytes(bytes(data))
    proc, mb = run_measured("verify", "--deep", ckpt)
    clean(proc, (1,))
    assert FQN in proc.stdout and mb < 1500
    for args in (("show", ckpt, FQN), ("export", ckpt, tmp_path / "out.safetensors"),
                 ("diff", ckpt, ckpt)):
        clean(run_cli(*args))
    assert not (tmp_path / "out.safetensors").exists()


def test_data_pkl_size_is_bounded_by_the_item(copy_of):
    ckpt = copy_of("fsdp2_r2")
    _ck, chunk = _item(ckpt)
    path = ckpt / chunk.file
    data = bytearray(path.read_bytes())
    item = bytes(data[chunk.offset:chunk.offset + chunk.length])
    cd = item.find(b"PK\x01\x02")
    while cd >= 0:  # every central-directory size of data.pkl claims 3 GB
        nlen = struct.unpack_from("<H", item, cd + 28)[0]
        if item[cd + 46:cd + 46 + nlen].endswith(b"data.pkl"):
            struct.pack_into("<I", data, chunk.offset + cd + 20, 3_000_000_000)
        cd = item.find(b"PK\x01\x02", cd + 4)
    path.write_bytes(bytes(data))
    problems = verify(open_checkpoint(ckpt, use_cache=False), deep=True)
    assert [p.kind for p in problems] == ["unreadable"] and problems[0].fqn == FQN
    clean(run_cli("show", ckpt, FQN))


def test_hf_shard_claiming_more_than_exists(copy_of):
    ckpt = copy_of("hf_r2")
    name = sorted(p.name for p in ckpt.iterdir() if p.suffix == ".safetensors")[0]
    path = ckpt / name
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + n])
    key = next(k for k in header if k != "__metadata__")
    a = header[key]["data_offsets"][0]
    header[key]["data_offsets"][1] = a + 5_000_000_000
    raw = json.dumps(header).encode()
    raw += b" " * (n - len(raw)) if len(raw) <= n else b""
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    proc, mb = run_measured("verify", "--deep", ckpt)
    clean(proc, (1,))
    assert "short_file" in proc.stdout and name in proc.stdout and key in proc.stdout and mb < 1500
    clean(run_cli("show", ckpt, key))


# ---------------------------------------------------------------- paths
def test_relative_path_to_a_fifo_in_the_folder_does_not_hang(copy_of):
    ckpt = copy_of("fsdp2_r2")
    os.mkfifo(ckpt / "fifo.distcp")
    md = torch_metadata(ckpt)
    md.storage_data[index_of(md, FQN, (0, 0))].relative_path = "fifo.distcp"
    save_metadata(ckpt, md)
    problems = verify(open_checkpoint(ckpt, use_cache=False), deep=True)
    assert any(p.kind == "missing_file" and p.file == "fifo.distcp" for p in problems)
    clean(run_cli("show", ckpt, FQN, timeout=120))
    with ChunkReader(open_checkpoint(ckpt, use_cache=False)) as reader, pytest.raises(CheckpointError) as exc:
        reader.handles.read("fifo.distcp", 0, 10)
    assert "not a regular file" in str(exc.value)


def test_symlinked_item_to_a_device_is_refused(copy_of):
    ckpt = copy_of("fsdp2_r2")
    _ck, chunk = _item(ckpt)
    os.unlink(ckpt / chunk.file)
    os.symlink("/dev/zero", ckpt / chunk.file)
    proc, mb = run_measured("show", ckpt, FQN, "--no-cache")
    clean(proc)
    assert mb < 1500


def test_symlink_leading_out_of_the_folder_is_never_opened(copy_of, tmp_path):
    """An item or .metadata that is a link to a regular file elsewhere (a secret, another checkpoint) is
    refused by every reading command; a link to a file inside the folder is fine."""
    ckpt = copy_of("fsdp2_r2")
    _ck, chunk = _item(ckpt)
    outside = tmp_path / "outside.distcp"
    os.rename(ckpt / chunk.file, outside)
    os.symlink(outside, ckpt / chunk.file)
    for args in (("show", ckpt, FQN), ("verify", ckpt), ("verify", "--deep", ckpt), ("inspect", ckpt),
                 ("export", ckpt, tmp_path / "o.safetensors")):
        proc = run_cli(*args, timeout=120)
        assert "Traceback" not in proc.stderr and "healthy" not in proc.stdout, (args, proc.stdout, proc.stderr)
        assert proc.returncode in (0, 1, 2) if args[0] == "inspect" else proc.returncode in (1, 2), args
        out = proc.stdout + proc.stderr
        assert "outside the checkpoint folder" in out and "refused" in out, (args, out)
        assert out.count("outside the checkpoint folder") == 1, (args, out)  # said once, not per item
    assert not (tmp_path / "o.safetensors").exists()
    os.unlink(ckpt / chunk.file)
    os.rename(outside, ckpt / "real.bin")
    os.symlink("real.bin", ckpt / chunk.file)  # relative, inside
    assert run_cli("show", ckpt, FQN, timeout=120).returncode == 0
    # a file the user names is not a checkpoint folder: the Hugging Face cache links every file into blobs/
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    assert run_cli("export", ckpt, blobs / "f00d.safetensors", timeout=120).returncode == 0
    os.symlink(os.path.relpath(blobs / "f00d.safetensors", snap), snap / "model.safetensors")
    proc = run_cli("diff", snap / "model.safetensors", blobs / "f00d.safetensors", timeout=120)
    assert proc.returncode == 0 and "15 unchanged" in proc.stdout, proc.stdout + proc.stderr
    meta = tmp_path / "meta"
    os.rename(ckpt / ".metadata", meta)
    os.symlink(meta, ckpt / ".metadata")
    clean(run_cli("inspect", ckpt, "--no-cache", timeout=120))


# ---------------------------------------------------------------- wrong answers that look right
def _flip_a_value_bit(ckpt):
    ck = open_checkpoint(ckpt, use_cache=False)
    chunk = ck.tensor(FQN).chunks[0]
    with ChunkReader(ck) as reader:
        st = reader.locate(FQN, chunk)
    f = ckpt / chunk.file
    data = bytearray(f.read_bytes())
    data[st.data_offset + 10] ^= 0x40
    f.write_bytes(bytes(data))
    return chunk


def test_flipped_bit_is_an_error_on_every_read(copy_of, tmp_path):
    ckpt = copy_of("fsdp2_r2")
    chunk = _flip_a_value_bit(ckpt)
    ck = open_checkpoint(ckpt, use_cache=False)
    with ChunkReader(ck) as reader, pytest.raises(CorruptChunkError) as exc:
        reader.read_tensor(ck.tensor(FQN))
    assert exc.value.fqn == FQN and chunk.file in str(exc.value)
    proc = run_cli("show", ckpt, FQN)
    clean(proc)
    assert "CRC32" in proc.stderr and FQN in proc.stderr and chunk.file in proc.stderr
    for dst in ("out.safetensors", "out.pt"):
        proc = run_cli("export", ckpt, tmp_path / dst, "--strip-prefix=")
        assert proc.returncode != 0 and "verified" not in proc.stdout, proc.stdout
        assert "Traceback" not in proc.stderr and not (tmp_path / dst).exists()
    kinds = [p.kind for p in verify_contents(ck, Progress())]
    assert kinds == ["corrupt"]


def test_two_chunks_reading_the_same_bytes_are_reported(copy_of, tmp_path):
    ckpt = copy_of("fsdp2_r2")
    md = torch_metadata(ckpt)
    other = "optimizer.state.blocks.0.fc1.weight.exp_avg"  # same chunk shapes, same file
    a = md.storage_data[index_of(md, FQN, md.state_dict_metadata[FQN].chunks[0].offsets)]
    b = md.storage_data[index_of(md, other, md.state_dict_metadata[other].chunks[0].offsets)]
    assert a.relative_path == b.relative_path
    a.offset, a.length = b.offset, b.length  # FQN's first chunk now reads the exp_avg item
    save_metadata(ckpt, md)
    deep = verify(open_checkpoint(ckpt, use_cache=False), deep=True)
    assert "storage_overlap" in [p.kind for p in deep]
    proc = run_cli("verify", "--deep", ckpt)
    clean(proc, (1,))
    assert "overlap" in proc.stdout
    proc = run_cli("export", ckpt, tmp_path / "out.pt")  # reads both: refused, never "verified"
    clean(proc)
    assert "verified" not in proc.stdout and "one item" in proc.stderr and not (tmp_path / "out.pt").exists()


def test_partly_overlapping_ranges_are_found_without_reading(copy_of):
    ckpt = copy_of("fsdp2_r2")
    md = torch_metadata(ckpt)
    a = md.storage_data[index_of(md, FQN, md.state_dict_metadata[FQN].chunks[0].offsets)]
    a.length += 100  # runs into the next item
    save_metadata(ckpt, md)
    assert "storage_overlap" in [p.kind for p in verify(open_checkpoint(ckpt, use_cache=False))]


# ---------------------------------------------------------------- the unpickler's address-space limit and threads
def _memo_bomb(folder) -> bytes:
    """A 9-byte .metadata whose LONG_BINPUT index makes CPython's C unpickler zero-fill an 11 GB memo table
    (found by fuzzing: 0.5-1.5 GB from a 30 KB file before the address-space limit)."""
    data = b"\x80\x02]r" + (0x2A05F200).to_bytes(4, "little") + b"."
    (folder / ".metadata").write_bytes(data)
    (folder / "__0_0.distcp").write_bytes(b"x")
    return data


def test_memo_table_bomb_is_refused(tmp_path):
    assert len(_memo_bomb(tmp_path)) < 10
    proc, mb = run_measured("inspect", tmp_path, "--no-cache")
    clean(proc)
    assert "allocation bomb" in proc.stderr and mb < 1500, (proc.stderr, mb)


def test_metadata_loads_on_threads_leave_other_threads_alone(copy_of, tmp_path):
    """Loads on worker threads, two at a time (as the window and its Compare view do), while another thread
    keeps reserving 1 GiB: that thread never sees a failed allocation or a changed RLIMIT_AS, the bomb is
    still a clean error, and the good checkpoint opens."""
    import mmap
    import resource
    import threading

    from shardscope.backend.errors import RefusedPickleError

    good, bomb = copy_of("fsdp2_r4"), tmp_path / "bomb"
    bomb.mkdir()
    _memo_bomb(bomb)
    before = resource.getrlimit(resource.RLIMIT_AS)
    stop, loading = threading.Event(), threading.Event()
    seen = {"during": 0, "failures": [], "limits": set()}

    def allocate() -> None:
        while not stop.is_set():
            seen["limits"].add(resource.getrlimit(resource.RLIMIT_AS))
            try:
                mmap.mmap(-1, 1 << 30).close()  # reserves address space (counted by RLIMIT_AS), touches nothing
            except (OSError, MemoryError) as exc:
                seen["failures"].append(repr(exc))
            if loading.is_set():
                seen["during"] += 1

    results: dict[str, list] = {"good": [], "bomb": []}

    def load(path, key) -> None:
        for _ in range(3):
            try:
                results[key].append(len(open_checkpoint(path, use_cache=False).tensors))
            except RefusedPickleError as exc:
                results[key].append(str(exc))

    allocator = threading.Thread(target=allocate)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # hand the GIL over often, so the allocator runs while a load is under way
    allocator.start()
    try:
        loading.set()
        loaders = [threading.Thread(target=load, args=a) for a in ((good, "good"), (bomb, "bomb"))]
        for t in loaders:
            t.start()
        for t in loaders:
            t.join(300)
        loading.clear()
    finally:
        stop.set()
        allocator.join(60)
        sys.setswitchinterval(switch)
    assert not seen["failures"] and seen["limits"] == {before} and seen["during"] > 0, seen
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    assert results["good"] == [results["good"][0]] * 3 and results["good"][0] > 0, results
    assert len(results["bomb"]) == 3 and all("allocation bomb" in r for r in results["bomb"]), results


def test_huge_bytearray8_leaves_no_stray_line(monkeypatch):
    """Found by fuzzing: a BYTEARRAY8 opcode with a huge length makes CPython 3.11 free a half-made bytearray
    whose export count was never set, which may print "SystemError: deallocated bytearray object has exported
    buffers". The load is refused and nothing else reaches stderr (in this process, as the CLI loads)."""
    import io

    from shardscope.backend.checkpoint import reader_process, safe_pickle
    from shardscope.backend.errors import RefusedPickleError

    monkeypatch.setattr(reader_process, "ISOLATE", False)
    bomb = b"\x80\x05\x96" + (2**62).to_bytes(8, "little") + b"."
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    for _ in range(5):
        garbage = [(object(), object()) for _ in range(50_000)]  # freed 56-byte blocks whose last word is set
        del garbage
        with pytest.raises(RefusedPickleError, match="allocation bomb"):
            safe_pickle.load_metadata_pickle(bomb, "bomb")
    assert err.getvalue() == ""


def _versioned(ckpt, piece: bytes) -> None:
    """The checkpoint's .metadata with ``piece`` (pickle opcodes) where its version string was."""
    md = torch_metadata(ckpt)
    md.version = "VERSIONMARK"
    data = pickle.dumps(md, protocol=2)
    (ckpt / ".metadata").write_bytes(data.replace(b"X\x0b\x00\x00\x00VERSIONMARK", piece))


@pytest.mark.parametrize("case", ["memo bomb", "nested 200,000 deep", "a function as a value", "good"])
def test_metadata_helper_process_answers_like_this_process(copy_of, tmp_path, monkeypatch, case):
    """Loads on a thread run in the helper process (reader_process.py); hostile input gives the same kind of
    clean error there, and a good checkpoint the same model, by both readers (streaming and object graph)."""
    from shardscope.backend.checkpoint import reader, reader_process

    ckpt = copy_of("fsdp2_r2")
    if case == "memo bomb":
        _memo_bomb(ckpt)
    elif case == "nested 200,000 deep":
        _versioned(ckpt, b")" + b"\x85" * 200_000)
    elif case == "a function as a value":
        _versioned(ckpt, b"ctorch.serialization\n_get_layout\n")

    def model(isolate: bool, streaming: bool):
        monkeypatch.setattr(reader_process, "ISOLATE", isolate)
        monkeypatch.setattr(reader, "STREAMING", streaming)
        try:
            c = open_checkpoint(ckpt, use_cache=False)
        except CheckpointError as exc:
            return type(exc).__name__
        t = c.chunk_table
        return ([(e.fqn, e.dtype, e.shape, e.first_chunk, e.chunk_count) for e in c.tensors],
                [(o.fqn, o.file, o.offset, o.length) for o in c.objects], c.version, c.save_id,
                [getattr(t, a).tolist() for a in ("tensor", "file", "byte_offset", "length", "dim_start", "dims")])

    for streaming in (True, False):
        here, there = model(False, streaming), model(True, streaming)
        assert type(here) is type(there), (here, there)
        assert (here == there) if case == "good" else isinstance(here, str), (here, there)


def test_a_data_file_deleted_after_opening_is_one_problem_not_one_per_entry(copy_of):
    """The window keeps a checkpoint open; its folder may lose files before "Verify contents" runs."""
    path = copy_of("fsdp2_r4")
    ckpt = open_checkpoint(path, use_cache=False)
    entries = sum(1 for t in ckpt.tensors for c in t.chunks if c.file == "__1_0.distcp")
    entries += sum(1 for o in ckpt.objects if o.file == "__1_0.distcp")
    assert entries > 10
    os.remove(path / "__1_0.distcp")
    found = [p for p in verify_contents(ckpt) if p.file == "__1_0.distcp"]
    assert len(found) == 1, [p.message for p in found]
    assert "__1_0.distcp" in found[0].message and f"{entries:,} entries stored in it not checked" in found[0].message
