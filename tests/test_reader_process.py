"""Metadata loads in a helper process (backend/checkpoint/reader_process.py): other threads are left alone,
and the helper answers like this process does."""

from __future__ import annotations

import pickle
import sys

import pytest
from damaged_metadata import memo_bomb
from shardscope.backend.errors import CheckpointError
from shardscope.backend.formats import open_checkpoint
from torch_reference import torch_metadata


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
    memo_bomb(bomb)
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
        memo_bomb(ckpt)
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
