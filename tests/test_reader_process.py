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


def helper_pids() -> set[int]:
    """The metadata helper processes this process started (found in /proc, whatever started them)."""
    import os

    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"helper_main" in cmd:
            found.add(int(entry))
    return found


def gone(pid: int) -> bool:
    """The process has ended and was reaped (no zombie left either)."""
    import os

    return not os.path.exists(f"/proc/{pid}")


def wait_for(condition, seconds: float):
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    return condition()


@pytest.fixture(scope="module")
def big_metadata(tmp_path_factory):
    """A 512-rank checkpoint whose .metadata (88,000 chunks, about 48 MB) takes the helper seconds to load."""
    from scale_checkpoint import write_scale_checkpoint

    return write_scale_checkpoint(tmp_path_factory.mktemp("big") / "r512", ranks=512, layers=250, dim=32)


def test_a_cancelled_load_ends_its_helper_process_at_once(big_metadata, monkeypatch):
    """A metadata load waits on its helper process and could not be cancelled: the helper kept loading (and
    holding its memory) for seconds after the window gave up on it. Cancelling the operation kills it."""
    import threading
    import time

    from shardscope.backend.checkpoint import reader_process
    from shardscope.backend.errors import Cancelled
    from shardscope.backend.progress import Progress

    monkeypatch.setattr(reader_process, "ISOLATE", True)
    reader_process._close_idle()  # no waiting helper: the load starts its own
    before = helper_pids()
    operation = Progress()
    outcome: list[str] = []

    def load() -> None:
        with operation.current():
            try:
                open_checkpoint(big_metadata, progress=operation, use_cache=False)
                outcome.append("loaded")
            except Cancelled:
                outcome.append("cancelled")

    thread = threading.Thread(target=load)
    thread.start()
    (pid,) = wait_for(lambda: helper_pids() - before, 30)
    # NOTE: cancelled as soon as the helper is there: on a quiet machine its whole load takes under half a
    # second (a sleep of 0.5 s here let it finish first); the helper starting or loading is killed alike
    assert not outcome
    cancelled_at = time.monotonic()
    operation.cancel()
    thread.join(30)
    assert outcome == ["cancelled"]
    assert wait_for(lambda: gone(pid), 5), "the helper process outlived the cancel"
    assert time.monotonic() - cancelled_at < 5
    monkeypatch.setattr(reader_process, "ISOLATE", None)
    assert open_checkpoint(big_metadata, use_cache=False).chunk_table is not None  # a later load is whole


def test_cancel_and_closing_the_tab_end_the_helper_of_an_opening_checkpoint(qtbot, big_metadata, tmp_path):
    """In the window: Cancel under the tree while the metadata is read, and closing the tab, each end the helper
    process at once; the header says the opening was cancelled."""
    import shutil

    from PySide6.QtCore import QThreadPool
    from shardscope.app.main_window import MainWindow
    from shardscope.backend.checkpoint import reader_process
    from shardscope.widgets.checkpoint_view import CheckpointView

    win = MainWindow()
    qtbot.addWidget(win)
    win.quiet = True
    win.show()
    for how in ("cancel", "close"):
        copy = tmp_path / how  # not in the metadata cache: read from the file
        shutil.copytree(big_metadata, copy)
        reader_process._close_idle()  # no waiting helper: the load starts its own
        before = helper_pids()
        view = win.open_path(str(copy))
        (pid,) = wait_for(lambda b=before: (qtbot.wait(20), helper_pids() - b)[1], 30)
        assert view.opening() and view.progress.cancel_button.isVisible()
        if how == "cancel":
            with qtbot.waitSignal(view.openCancelled, timeout=10000):
                view.progress.cancel_button.click()
            assert "cancelled" in view.header.text() and not view.progress.isVisible()
        else:
            win.close_tab(win.tabs.indexOf(view))
            assert not any(isinstance(win.tabs.widget(i), CheckpointView) and win.tabs.widget(i).path == str(copy)
                           for i in range(win.tabs.count()))
        assert wait_for(lambda p=pid: gone(p), 5), f"the helper outlived {how}"
    assert QThreadPool.globalInstance().waitForDone(30000)
