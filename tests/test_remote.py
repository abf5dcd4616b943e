"""Checkpoints on S3, against a real S3 API server (moto's server mode in its own process) that counts
every request it answers: reads are planned (few requests), exports go to and come from s3:// URLs,
endpoints come from the environment or --storage-option, failures are one line and leave nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import s3fs
from s3_server import S3Server

pytestmark = pytest.mark.s3  # every test here talks to the local S3 API server

BUCKET = "ckpts"
REMOTE_FIXTURES = ("fsdp2_r4", "fsdp_safetensors_r2", "hf_r2")


def big_checkpoint(out: Path) -> Path:
    """A checkpoint with large items (above the whole-file and coalescing sizes), written by dcp.save."""
    script = (
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        "g = torch.Generator().manual_seed(0)\n"
        "sd = {f'layers.{i}.weight': torch.randn(1536, 1024, generator=g) for i in range(3)}\n"
        "sd['norm.weight'] = torch.ones(1024)\n"
        "dcp.save({'model': sd}, checkpoint_id=sys.argv[1], no_dist=True)\n")
    subprocess.run([sys.executable, "-c", script, str(out)], check=True, capture_output=True, timeout=600)
    return out


@pytest.fixture(scope="session")
def s3(fixtures, tmp_path_factory):
    """The server, an s3fs client of it, and the fixture checkpoints uploaded to s3://ckpts/<name>."""
    server = S3Server()
    try:
        fs = s3fs.S3FileSystem(key="testing", secret="testing", use_listings_cache=False,
                               client_kwargs={"endpoint_url": server.endpoint})
        fs.mkdir(BUCKET)
        local = {name: fixtures[name] for name in REMOTE_FIXTURES}
        local["big"] = big_checkpoint(tmp_path_factory.mktemp("big") / "big")
        for name, path in local.items():
            fs.put(f"{path}/", f"{BUCKET}/{name}/", recursive=True)
        yield server, fs, local
    finally:
        server.stop()


def shardscope(server: S3Server | None, *args: str, timeout: float = 600,
               extra_env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, int]:
    """Run the CLI in a fresh process (endpoint from AWS_* variables when ``server``); also return the
    number of requests the server answered meanwhile."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(extra_env or {})
    if server is not None:
        env.update(server.env())
        server.reset()
    proc = subprocess.run([sys.executable, "-m", "shardscope.app.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    return proc, (server.total() if server is not None else 0)


def data_files(path: Path) -> int:
    return sum(1 for p in path.iterdir() if p.is_file())


def test_inspect_verify_show_read_few_requests(s3):
    server, _, local = s3
    files = data_files(local["fsdp2_r4"])
    url = f"s3://{BUCKET}/fsdp2_r4"
    proc, requests = shardscope(server, "inspect", url, "--no-cache")
    assert proc.returncode == 0, proc.stderr
    assert "healthy" in proc.stdout and requests <= 6, (requests, proc.stdout)
    proc, requests = shardscope(server, "verify", "--deep", url, "--no-cache")
    assert proc.returncode == 0, proc.stderr
    assert requests <= files + 4, requests  # every small file read whole, once (was 2,747 requests)
    fqn = "model.blocks.0.fc1.weight"
    proc, requests = shardscope(server, "show", url, fqn, "--json", "--no-cache")
    local_proc, _ = shardscope(None, "show", str(local["fsdp2_r4"]), fqn, "--json", "--no-cache")
    assert proc.returncode == 0 and local_proc.returncode == 0, proc.stderr + local_proc.stderr
    assert requests <= files + 4, requests
    assert proc.stdout.replace(url, "X") == local_proc.stdout.replace(str(local["fsdp2_r4"]), "X")


def model_and_adam_checkpoint(out: Path) -> Path:
    """Model weights and Adam-like state (exp_avg, exp_avg_sq, step per parameter: large and tiny items side by
    side), about 100 MiB written by dcp.save into 4 files (FileSystemWriter's threads), each larger than one
    planned segment."""
    script = (
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        "g = torch.Generator().manual_seed(0)\n"
        "model = {}\n"
        "for i in range(8):\n"
        "    model[f'layers.{i}.weight'] = torch.randn(1024, 1024, generator=g)\n"
        "    model[f'layers.{i}.bias'] = torch.randn(1024, generator=g)\n"
        "opt = {k: {'exp_avg': torch.randn_like(v), 'exp_avg_sq': torch.rand_like(v), 'step': torch.tensor(3.0)}\n"
        "       for k, v in model.items()}\n"
        "dcp.save({'model': model, 'optimizer': {'state': opt, 'param_groups': [{'lr': 0.001}]}},\n"
        "         storage_writer=dcp.FileSystemWriter(sys.argv[1], thread_count=4), no_dist=True)\n")
    subprocess.run([sys.executable, "-c", script, str(out)], check=True, capture_output=True, timeout=600)
    return out


def test_export_from_s3_makes_the_same_planned_requests_every_time(s3, tmp_path):
    """Two identical exports of a model + optimizer checkpoint make the same requests, kind by kind (the reads
    are planned into fixed segments before the first read, whichever thread reads first), and no more than one
    listing, one GET of the .metadata and one GET per planned segment of each data file: its size over the
    segment size, rounded up. Before the planned segments, the count changed from run to run (threads raced
    to coalesce, the cache dropped and fetched items again) and exceeded this bound."""
    from shardscope.backend.checkpoint.remote_plans import SEGMENT

    server, fs, _ = s3
    ckpt = model_and_adam_checkpoint(tmp_path / "adam")
    fs.put(f"{ckpt}/", f"{BUCKET}/adam/", recursive=True)
    sizes = {p.name: p.stat().st_size for p in ckpt.iterdir() if p.suffix == ".distcp"}
    assert len(sizes) == 4 and min(sizes.values()) > SEGMENT, sizes
    bound = 1 + 1 + sum(-(-size // SEGMENT) for size in sizes.values())
    seen = []
    for i in range(2):
        out = tmp_path / f"out{i}.safetensors"
        proc, total = shardscope(server, "--no-cache", "export", f"s3://{BUCKET}/adam", str(out), "--only", "model",
                                 "--only", "optimizer")
        assert proc.returncode == 0, proc.stderr
        kinds = server.kinds()
        assert sum(kinds.values()) == total
        seen.append(kinds)
    assert seen[0] == seen[1], seen
    assert seen[0].get("LIST") == 1 and not seen[0].get("HEAD"), seen[0]
    assert sum(seen[0].values()) <= bound, (seen[0], bound)
    assert (tmp_path / "out0.safetensors").read_bytes() == (tmp_path / "out1.safetensors").read_bytes()


@pytest.mark.parametrize("name", ["fsdp2_r4", "fsdp_safetensors_r2", "hf_r2", "big"])
def test_export_from_s3_equals_local_export(s3, tmp_path, name):
    server, _, local = s3
    remote_out, local_out = tmp_path / "remote.safetensors", tmp_path / "local.safetensors"
    proc, requests = shardscope(server, "export", f"s3://{BUCKET}/{name}", str(remote_out))
    assert proc.returncode == 0, proc.stderr
    ref, _ = shardscope(None, "export", str(local[name]), str(local_out))
    assert ref.returncode == 0, ref.stderr
    assert remote_out.read_bytes() == local_out.read_bytes()
    large_items = 3 if name == "big" else 0  # three 6 MiB tensors: one request each (was ~56 per tensor)
    assert requests <= data_files(local[name]) + large_items + 3, requests


def test_export_to_s3_file_and_sharded_folder(s3, tmp_path):
    server, fs, local = s3
    src = f"s3://{BUCKET}/fsdp2_r4"
    ref, _ = shardscope(None, "export", str(local["fsdp2_r4"]), str(tmp_path / "ref.safetensors"))
    assert ref.returncode == 0, ref.stderr
    proc, _ = shardscope(server, "export", src, f"s3://{BUCKET}/out/model.safetensors")
    assert proc.returncode == 0, proc.stderr
    assert fs.cat(f"{BUCKET}/out/model.safetensors") == (tmp_path / "ref.safetensors").read_bytes()
    # its manifest: one more PUT beside it, the same files and digests as the local export's
    sent = json.loads(fs.cat(f"{BUCKET}/out/model.safetensors.shardscope-manifest.json"))
    made = json.loads((tmp_path / "ref.safetensors.shardscope-manifest.json").read_text())
    assert list(sent["files"].values()) == list(made["files"].values()) and list(sent["files"]) == ["model.safetensors"]
    assert {k: t["sha256"] for k, t in sent["tensors"].items()} == {k: t["sha256"] for k, t in made["tensors"].items()}
    again, _ = shardscope(server, "export", src, f"s3://{BUCKET}/out/model.safetensors")
    assert again.returncode == 2 and "already exists" in again.stderr and again.stderr.count("\n") == 1

    ref_dir = tmp_path / "ref_sharded"
    ref, _ = shardscope(None, "export", str(local["fsdp2_r4"]), str(ref_dir), "--max-shard-size", "4KB")
    assert ref.returncode == 0, ref.stderr
    dst = f"{BUCKET}/out/sharded"
    proc, _ = shardscope(server, "export", src, f"s3://{dst}", "--max-shard-size", "4KB")
    assert proc.returncode == 0, proc.stderr
    local_names = sorted(os.listdir(ref_dir))  # the lineage sidecar lies beside the folder, not in it
    assert sorted(os.path.basename(p) for p in fs.find(dst)) == local_names
    for name in local_names:  # the manifests alike but for the time each was written
        strip = (lambda b: json.loads(b) | {"written": ""}) if name == "shardscope-manifest.json" else bytes
        assert strip(fs.cat(f"{dst}/{name}")) == strip((ref_dir / name).read_bytes()), name
    # --force replaces the folder: fewer, larger shards and none of the old ones left behind
    proc, _ = shardscope(server, "export", src, f"s3://{dst}", "--max-shard-size", "1MB", "--force")
    assert proc.returncode == 0, proc.stderr
    index = json.loads(fs.cat(f"{dst}/model.safetensors.index.json"))
    assert sorted(os.path.basename(p) for p in fs.find(dst)) == sorted(
        {*index["weight_map"].values(), "model.safetensors.index.json", "shardscope-manifest.json"})
    assert not [p for p in fs.find(BUCKET) if ".shardscope-tmp" in p]


def test_failed_upload_leaves_no_final_key(s3):
    server, fs, _ = s3
    src = f"s3://{BUCKET}/fsdp2_r4"
    try:
        server.fail_puts("fail1/model.safetensors")
        proc, _ = shardscope(server, "export", src, f"s3://{BUCKET}/fail1/model.safetensors")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"s3://{BUCKET}/fail1/model.safetensors" in proc.stderr
        assert not fs.exists(f"{BUCKET}/fail1/model.safetensors")
        # a folder: the shards are staged and moved into place; the index (moved last) fails, so the
        # shards already moved are taken back
        server.fail_puts("fail2/sharded/model.safetensors.index.json")
        proc, _ = shardscope(server, "export", src, f"s3://{BUCKET}/fail2/sharded", "--max-shard-size", "4KB")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert server.requests().get("failed", 0) >= 1
        assert fs.find(f"{BUCKET}/fail2") == []
    finally:
        server.fail_puts("")
    assert not [p for p in fs.find(BUCKET) if ".shardscope-tmp" in p]


def test_failed_force_export_over_a_folder_leaves_the_old_folder_as_it_was(s3):
    """--force over a sharded folder: the shards are moved into place first (replacing the old ones of the
    same names), the index last; when the index's move fails the old shards are put back."""
    server, fs, _ = s3
    src, dst = f"s3://{BUCKET}/fsdp2_r4", f"{BUCKET}/force/sharded"
    proc, _ = shardscope(server, "export", src, f"s3://{dst}", "--max-shard-size", "4KB")
    assert proc.returncode == 0, proc.stderr
    fs.pipe(f"{dst}/config.json", b"{}")  # a model folder's own file, which no export writes
    before = {p: fs.cat(p) for p in fs.find(dst)}
    assert len(before) == 6  # three shards, the index, the manifest and config.json
    try:
        # the new index's move into place fails (not the old one's put back)
        server.fail_puts(f"{dst}/model.safetensors.index.json<-{BUCKET}/force/.shardscope-tmp-")
        # the same shard names with other bytes (the keys renamed)
        proc, _ = shardscope(server, "export", src, f"s3://{dst}", "--max-shard-size", "4KB",
                             "--rename", r"\.weight$=.w", "--force")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert server.requests().get("failed", 0) >= 1
    finally:
        server.fail_puts("")
    assert {p: fs.cat(p) for p in fs.find(dst)} == before
    assert not [p for p in fs.find(BUCKET) if ".shardscope-tmp" in p or ".shardscope-old" in p]
    # and when nothing fails, the new folder replaces it
    proc, _ = shardscope(server, "export", src, f"s3://{dst}", "--max-shard-size", "4KB",
                         "--rename", r"\.weight$=.w", "--force")
    assert proc.returncode == 0, proc.stderr
    assert "kept in the folder (not written by an export): config.json" in proc.stdout
    after = {p: fs.cat(p) for p in fs.find(dst)}
    assert after.keys() == before.keys()
    assert [p for p in before if after[p] == before[p]] == [f"{dst}/config.json"]
    assert not [p for p in fs.find(BUCKET) if ".shardscope-tmp" in p or ".shardscope-old" in p]


def test_storage_option_gives_endpoint_and_credentials_without_env(s3):
    server, _, _ = s3
    opts = ["--storage-option", f"client_kwargs.endpoint_url={server.endpoint}",
            "--storage-option", "key=testing", "--storage-option", "secret=testing"]
    server.reset()
    proc, _ = shardscope(None, "verify", f"s3://{BUCKET}/fsdp2_r4", *opts)
    assert proc.returncode == 0, proc.stderr
    assert server.total() > 0  # it really went to this server
    proc, _ = shardscope(None, "verify", f"s3://{BUCKET}/fsdp2_r4", "--storage-option", "nokey")
    assert proc.returncode == 2 and "KEY=VALUE" in proc.stderr


def test_unreachable_endpoint_is_one_line_and_exit_2():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    proc, _ = shardscope(None, "inspect", f"s3://{BUCKET}/fsdp2_r4",
                         "--storage-option", f"client_kwargs.endpoint_url=http://127.0.0.1:{port}",
                         "--storage-option", "key=k", "--storage-option", "secret=s", timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "cannot reach the storage endpoint" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert elapsed < 60, elapsed  # about a second of retries plus start-up (was six seconds of retries)


def test_planned_reads_return_exact_bytes_under_threads_and_small_budgets():
    """The planner (item bounds, read-ahead, coalescing, LRU, served-drop) against fsspec's real
    in-memory filesystem: every read returns exactly the file's bytes, whatever the order."""
    import itertools
    import random
    from concurrent.futures import ThreadPoolExecutor

    import fsspec
    from shardscope.backend.checkpoint.remote_reads import RemoteHandles
    from shardscope.backend.errors import CheckpointError

    fs = fsspec.filesystem("memory")
    rng = random.Random(7)
    files = {"small": rng.randbytes(300_000), "big": rng.randbytes(24 << 20)}
    for name, data in files.items():
        fs.pipe(f"/planner/{name}", data)
    bounds = [0, 1000, 5000, 3 << 20, (3 << 20) + 10, 9 << 20, 20 << 20, 24 << 20]
    items = [(a, b - a) for a, b in itertools.pairwise(bounds)]
    for budget, plan, sizes in ((64 << 20, True, True), (4 << 20, True, False), (1 << 20, False, True)):
        handles = RemoteHandles(fs, "/planner", "memory://planner",
                                sizes={n: len(d) for n, d in files.items()} if sizes else None, budget=budget)
        if plan:
            handles.plan_items("big", items)
        reads = []
        for _ in range(150):
            name = rng.choice(list(files))
            size = len(files[name])
            start = rng.randrange(size)
            reads.append((name, start, min(size, start + rng.choice([1, 4, 30, 70_000, 2 << 20, 9 << 20]))))

        def check(r: tuple[str, int, int], handles: RemoteHandles = handles) -> None:
            name, a, b = r
            assert handles.read(name, a, b - a) == files[name][a:b]

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(check, reads))
        batch = reads[:20]
        assert handles.read_ranges(batch) == [files[n][a:b] for n, a, b in batch]
        handles.prefetch([("big", 0, 1 << 20)])
        buf = bytearray(5000)
        handles.readinto("big", 100, memoryview(buf))
        assert bytes(buf) == files["big"][100:5100]
        with pytest.raises(CheckpointError, match="truncated"):
            handles.read("small", 299_000, 2000)
        handles.close()
        assert handles.stats.requests < len(reads)  # planned: fewer requests than reads


def test_planned_segments_are_fetched_once_whatever_the_thread_order():
    """plan_reads against fsspec's real in-memory filesystem: items read by 4 threads in a different random order
    each time, each item in a few reads, then released: the requests are exactly the planned segments (each
    fetched once, none dropped before its items were released), every read returns the file's bytes, and
    nothing stays held. The segments depend on the ranges alone."""
    import itertools
    import random
    from concurrent.futures import ThreadPoolExecutor

    import fsspec
    from shardscope.backend.checkpoint.remote_plans import SEGMENT, plan_segments
    from shardscope.backend.checkpoint.remote_reads import RemoteHandles

    fs = fsspec.filesystem("memory")
    rng = random.Random(11)
    files = {f"__{r}_0.distcp": rng.randbytes(20 << 20) for r in range(3)}
    for name, data in files.items():
        fs.pipe(f"/planned/{name}", data)
    items = []
    for name in files:  # items of many sizes, back to back, a few bytes left between some
        bounds = sorted({0, 20 << 20, *(rng.randrange(20 << 20) for _ in range(40))})
        items += [(name, a + (i % 3), b) for i, (a, b) in enumerate(itertools.pairwise(bounds)) if b > a + 3]
    shuffled = items[:]
    rng.shuffle(shuffled)
    for name in files:
        mine = [(a, b) for n, a, b in items if n == name]
        assert plan_segments(mine) == plan_segments([(a, b) for n, a, b in shuffled if n == name])
        assert all(e - s <= SEGMENT for s, e, _ in plan_segments(mine))
    counts = set()
    for trial in range(3):
        handles = RemoteHandles(fs, "/planned", "memory://planned", sizes={n: len(d) for n, d in files.items()})
        planned = handles.plan_reads(items)
        order = items[:]
        random.Random(trial).shuffle(order)

        def read_item(item: tuple[str, int, int], handles: RemoteHandles = handles) -> None:
            name, a, b = item
            head = min(b, a + 64)
            assert handles.read(name, a, head - a) == files[name][a:head]  # a header, then the rest
            if b > head:
                buf = bytearray(b - head)
                handles.readinto(name, head, memoryview(buf))
                assert bytes(buf) == files[name][head:b]
            handles.release(name, a, b)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(read_item, order))
        assert handles.stats.requests == planned, (handles.stats, planned)
        assert handles._planned_used == 0 and not handles._dropped_early
        counts.add(handles.stats.requests)
        handles.close()
    assert len(counts) == 1
    # many files read at once (an export reads each tensor from every rank's file): smaller segments, so the held
    # ones stay bounded; files read one after the other (a deep verify) keep whole segments
    many = RemoteHandles(fs, "/planned", "memory://planned")
    ranges = [(f"__{r}_0.distcp", 0, 3 << 20) for r in range(64)]
    assert many.plan_reads(ranges) == 64 * 2  # 128 MiB / 64 files: 2 MiB segments
    assert many.plan_reads(ranges, files_at_once=1) == 64


def test_window_opens_s3_with_storage_options(s3, tmp_path):
    server, _, _ = s3
    shot = tmp_path / "window.png"
    server.reset()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.run([sys.executable, "-m", "shardscope.app.cli", "gui", f"s3://{BUCKET}/fsdp2_r4",
                           "--screenshot", str(shot), "--size", "1280x720", "--select", "model.blocks.0.fc1.weight",
                           "--storage-option", f"client_kwargs.endpoint_url={server.endpoint}",
                           "--storage-option", "key=testing", "--storage-option", "secret=testing"],
                          capture_output=True, text=True, timeout=600, env={**env, "QT_QPA_PLATFORM": "offscreen"})
    assert proc.returncode == 0, proc.stderr
    assert shot.stat().st_size > 10_000 and 0 < server.total() <= 12


def test_leftover_uploads_of_a_killed_export_are_cleaned_next_time(s3):
    """A kill -9 during an upload leaves a temporary key; the next export into that folder removes it
    when it was this machine's and its process is gone (never another machine's or a live one's)."""
    from shardscope.backend.export.remote_target import _host

    server, fs, _ = s3
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    names = {"dead": f".shardscope-tmp-{dead}-abcdef-{_host()}-model.safetensors",
             "live": f".shardscope-tmp-{os.getpid()}-abcdef-{_host()}-model.safetensors",
             "other_host": f".shardscope-tmp-{dead}-abcdef-elsewhere.example-model.safetensors"}
    for name in names.values():
        fs.pipe(f"{BUCKET}/killed/{name}", b"partial upload")
    proc, _ = shardscope(server, "export", f"s3://{BUCKET}/fsdp2_r4", f"s3://{BUCKET}/killed/model.safetensors")
    assert proc.returncode == 0, proc.stderr
    assert not fs.exists(f"{BUCKET}/killed/{names['dead']}")
    assert fs.exists(f"{BUCKET}/killed/{names['live']}") and fs.exists(f"{BUCKET}/killed/{names['other_host']}")
    fs.rm(f"{BUCKET}/killed", recursive=True)


def test_another_machines_stale_leftovers_and_dead_multipart_uploads_are_cleaned(s3, tmp_path):
    """Another machine's temporary upload is removed once untouched for the stale age (a day; shortened here
    with the documented variable), and so is an incomplete multipart upload: this machine's at once when
    its process is gone (a local record), anyone's after the stale age. This machine's live one is kept."""
    from shardscope.backend.export.remote_target import _uploads_dir

    server, fs, _ = s3
    other = ".shardscope-tmp-4242-abcdef-elsewhere.example-model.safetensors"
    fs.pipe(f"{BUCKET}/stale/{other}", b"partial upload")
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    ids = {}
    for who, key in (("dead", "stale/model.safetensors"), ("live", "stale/other.safetensors")):
        ids[who] = fs.call_s3("create_multipart_upload", Bucket=BUCKET, Key=key)["UploadId"]
    os.makedirs(_uploads_dir(), exist_ok=True)
    for who, pid in (("dead", dead), ("live", os.getpid())):
        Path(_uploads_dir(), f"{pid}-test{who}").write_text(ids[who])

    def uploads():
        out = fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix="stale/")
        return {u["UploadId"] for u in out.get("Uploads") or []}

    assert uploads() == set(ids.values())
    proc, _ = shardscope(server, "export", f"s3://{BUCKET}/fsdp2_r4", f"s3://{BUCKET}/stale/a.safetensors")
    assert proc.returncode == 0, proc.stderr
    fs.invalidate_cache()
    assert fs.exists(f"{BUCKET}/stale/{other}")  # another machine's, fresh: kept
    assert uploads() == {ids["live"]}  # this machine's dead process's upload: aborted at once
    assert not Path(_uploads_dir(), f"{dead}-testdead").exists()
    proc, _ = shardscope(server, "export", f"s3://{BUCKET}/fsdp2_r4", f"s3://{BUCKET}/stale/b.safetensors",
                         extra_env={"SHARDSCOPE_STALE_UPLOAD_SECONDS": "0"})
    assert proc.returncode == 0, proc.stderr
    fs.invalidate_cache()
    # moto reports every upload as started in 2010, so only the live local record keeps one here
    assert not fs.exists(f"{BUCKET}/stale/{other}") and uploads() == {ids["live"]}
    Path(_uploads_dir(), f"{os.getpid()}-testlive").unlink()
    fs.call_s3("abort_multipart_upload", Bucket=BUCKET, Key="stale/other.safetensors", UploadId=ids["live"])
    fs.rm(f"{BUCKET}/stale", recursive=True)


# ------------------------------------------------------------------ single files and index folders on a URL
def write_safetensors(path: Path, tensors: dict) -> None:
    """A safetensors file written byte by byte from the format's definition (no safetensors package)."""
    header, blobs, pos = {}, [], 0
    codes = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.int64": "I64"}
    for key, t in tensors.items():
        data = t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
        header[key] = {"dtype": codes[str(t.dtype)], "shape": list(t.shape), "data_offsets": [pos, pos + len(data)]}
        blobs.append(data)
        pos += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


@pytest.fixture(scope="module")
def files(s3, tmp_path_factory):
    """One state dict as a .safetensors file (18 MiB: read by ranges, not whole), a .pt, an HF index folder
    of two shards, and objects that are not checkpoints, locally and under s3://ckpts/files/."""
    import torch

    _, fs, _ = s3
    g = torch.Generator().manual_seed(1)
    sd = {f"layers.{i}.weight": torch.randn(1536, 1024, generator=g) for i in range(3)}
    sd["norm.weight"] = torch.randn(1024, generator=g).to(torch.bfloat16)
    sd["step"] = torch.tensor([7], dtype=torch.int64)
    root = tmp_path_factory.mktemp("files")
    write_safetensors(root / "model.safetensors", sd)
    torch.save(sd, root / "model.pt")
    shards = root / "sharded"
    shards.mkdir()
    names = {"model-00001-of-00002.safetensors": ["layers.0.weight", "layers.1.weight"],
             "model-00002-of-00002.safetensors": ["layers.2.weight", "norm.weight", "step"]}
    for name, keys in names.items():
        write_safetensors(shards / name, {k: sd[k] for k in keys})
    index = {"metadata": {}, "weight_map": {k: n for n, keys in names.items() for k in keys}}
    (shards / "model.safetensors.index.json").write_text(json.dumps(index))
    whole = (root / "model.safetensors").read_bytes()
    (root / "truncated.safetensors").write_bytes(whole[:-1000])
    (root / "garbage.safetensors").write_bytes(b"\xff" * 64)
    (root / "garbage.pt").write_bytes(b"PK\x03\x04 not a zip")
    (root / "notes.txt").write_text("not a checkpoint")
    fs.put(f"{root}/", f"{BUCKET}/files/", recursive=True)
    return root, f"s3://{BUCKET}/files"


def test_diff_reads_remote_safetensors_pt_and_index_folder_with_few_requests(s3, files):
    server, _, _ = s3
    local, url = files
    size = (local / "model.safetensors").stat().st_size
    proc, requests = shardscope(server, "diff", f"{url}/model.safetensors", str(local / "model.pt"))
    assert proc.returncode == 0, proc.stderr
    assert "0 changed, 5 unchanged" in proc.stdout, proc.stdout
    # its size (HEAD), the header (GET) and one GET per 6 MiB tensor, the small ones merged: not one per read
    assert requests <= 5, requests
    pt_size = (local / "model.pt").stat().st_size
    proc, requests = shardscope(server, "diff", f"{url}/model.pt", f"{url}/sharded")
    assert proc.returncode == 0, proc.stderr
    assert "0 changed, 5 unchanged" in proc.stdout, proc.stdout
    pt_gets = -(-pt_size // (16 << 20))  # the .pt: its size, then copied in 16 MiB ranged GETs
    # the folder: its listing, the index, a 12 MiB shard (header, two tensors), a 6 MiB one (read whole)
    assert requests <= 1 + pt_gets + 1 + 1 + 3 + 1, requests
    assert size < pt_size + 4096


def test_import_reads_a_remote_pt_and_leaves_no_temporary(s3, files, tmp_path):
    server, _, _ = s3
    local, url = files
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env_tmp = {"TMPDIR": str(tmp)}
    out = tmp_path / "imported"
    proc, _ = shardscope(server, "import", f"{url}/model.pt", str(out), extra_env=env_tmp)
    assert proc.returncode == 0, proc.stderr
    proc, _ = shardscope(None, "diff", str(out), str(local / "model.pt"))
    assert proc.returncode == 0 and "0 changed, 5 unchanged" in proc.stdout, proc.stdout + proc.stderr
    proc, _ = shardscope(server, "import", f"{url}/sharded", str(tmp_path / "imported2"), extra_env=env_tmp)
    assert proc.returncode == 0, proc.stderr
    assert list(tmp.iterdir()) == []


@pytest.mark.parametrize(("name", "expect"), [
    ("missing.safetensors", "no such file"),
    ("missing.pt", "no such file"),
    ("missing-folder", "no such file"),
    ("notes.txt", "is a file, not a checkpoint folder"),
    ("garbage.safetensors", "not a readable safetensors file"),
    ("garbage.pt", "cannot be loaded safely with weights_only=True"),
    ("truncated.safetensors", "truncated"),
])
def test_remote_file_errors_are_one_line_naming_the_url(s3, files, name, expect):
    server, _, _ = s3
    local, url = files
    proc, _ = shardscope(server, "diff", f"{url}/{name}", str(local / "model.pt"))
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1 and f"{url}/{name}" in proc.stderr and expect in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_remote_file_on_an_unreachable_endpoint_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name in ("model.pt", "model.safetensors"):
        proc, _ = shardscope(None, "diff", f"s3://{BUCKET}/files/{name}", f"s3://{BUCKET}/files/{name}",
                             "--storage-option", f"client_kwargs.endpoint_url=http://127.0.0.1:{port}",
                             "--storage-option", "key=k", "--storage-option", "secret=s", timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "cannot reach the storage endpoint" in proc.stderr and f"s3://{BUCKET}/files/{name}" in proc.stderr


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_interrupted_download_leaves_no_temporary(s3, files, tmp_path, how):
    """A .pt being copied is interrupted while the server holds its GET (so the copy cannot finish first): SIGINT
    and SIGTERM remove the copy at once; after a kill -9 the next download removes it."""
    import signal

    server, _, _ = s3
    local, url = files
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(server.env(), TMPDIR=str(tmp))
    server.hold(f"GET /{BUCKET}/files/model.pt?")
    try:
        proc = subprocess.Popen([sys.executable, "-m", "shardscope.app.cli", "diff", f"{url}/model.pt",
                                 str(local / "model.pt")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        server.wait_until_held(proc)
        assert list(tmp.glob(".shardscope-tmp-*-dl-*")), "the copy starts before its first GET"
        proc.send_signal(getattr(signal, how))
        _, stderr = proc.communicate(timeout=120)
    finally:
        server.hold("")
    if how == "SIGKILL":
        assert proc.returncode == -9 and list(tmp.iterdir())
        again, _ = shardscope(server, "diff", f"{url}/model.pt", str(local / "model.pt"),
                              extra_env={"TMPDIR": str(tmp)})
        assert again.returncode == 0, again.stderr
    else:
        assert proc.returncode == 130 and stderr.count("\n") == 1, (proc.returncode, stderr)
    assert list(tmp.iterdir()) == []


def test_window_compares_a_remote_safetensors_file(s3, files, tmp_path):
    """The window's Compare view opens URLs through the same sources as diff."""
    server, _, _ = s3
    local, url = files
    shot = tmp_path / "compare.png"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.run([sys.executable, "-m", "shardscope.app.cli", "gui", "--compare", f"{url}/model.safetensors",
                           str(local / "model.pt"), "--screenshot", str(shot), "--size", "1280x720",
                           "--storage-option", f"client_kwargs.endpoint_url={server.endpoint}",
                           "--storage-option", "key=testing", "--storage-option", "secret=testing"],
                          capture_output=True, text=True, timeout=600, env={**env, "QT_QPA_PLATFORM": "offscreen"})
    assert proc.returncode == 0, proc.stderr
    assert shot.stat().st_size > 10_000


# ------------------------------------------------------------------ uploads checked by the server
def stored_crc32(fs: s3fs.S3FileSystem, key: str) -> str | None:
    bucket, _, name = key.partition("/")
    return fs.call_s3("head_object", Bucket=bucket, Key=name, ChecksumMode="ENABLED").get("ChecksumCRC32")


def test_export_to_s3_sends_crc32_with_every_put_and_part(s3, tmp_path):
    import zlib

    server, fs, local = s3
    before = server.checks()
    # 18 MiB: a multipart upload of two 16 MiB parts
    proc, _ = shardscope(server, "export", str(local["big"]), f"s3://{BUCKET}/sums/big.safetensors")
    assert proc.returncode == 0, proc.stderr
    assert "verified (the local staged copy, before its upload):" in proc.stdout, proc.stdout
    assert "uploaded: 2 objects in 3 PUTs/parts" in proc.stdout, proc.stdout  # the file and its manifest
    assert "every final object reports the staged file's CRC32" in proc.stdout, proc.stdout
    data = fs.cat(f"{BUCKET}/sums/big.safetensors")
    parts = [zlib.crc32(data[i:i + (16 << 20)]).to_bytes(4, "big") for i in range(0, len(data), 16 << 20)]
    composite = __import__("base64").b64encode(zlib.crc32(b"".join(parts)).to_bytes(4, "big")).decode()
    # S3's composite checksum, computed by the server from the parts it received (moto leaves out the "-2")
    assert stored_crc32(fs, f"{BUCKET}/sums/big.safetensors") in (composite, f"{composite}-2")
    proc, _ = shardscope(server, "export", str(local["fsdp2_r4"]), f"s3://{BUCKET}/sums/sharded",
                         "--max-shard-size", "4KB")
    assert proc.returncode == 0, proc.stderr
    assert "every final object reports the staged file's CRC32" in proc.stdout, proc.stdout
    after = server.checks()
    assert after.get("none", 0) == before.get("none", 0), (before, after)  # no PUT body went unchecked
    assert after.get("crc32", 0) >= before.get("crc32", 0) + 3


@pytest.mark.parametrize(("src", "name"), [("fsdp2_r4", "model.safetensors"), ("big", "big.safetensors")])
def test_upload_damaged_in_transit_is_refused_and_leaves_nothing(s3, src, name):
    """One byte of the PUT (or of every part) flipped on the way: the server refuses the body against its
    CRC32, the export fails with one line, and neither the object nor a multipart upload is left."""
    server, fs, local = s3
    dst = f"{BUCKET}/damaged/{name}"
    before = server.checks().get("bad_digest", 0)
    try:
        server.corrupt_puts(f"damaged/{name}")
        proc, _ = shardscope(server, "export", str(local[src]), f"s3://{dst}")
    finally:
        server.corrupt_puts("")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "CRC32 you specified did not match" in proc.stderr and f"s3://{dst}" in proc.stderr, proc.stderr
    assert server.checks().get("bad_digest", 0) > before
    assert not fs.exists(dst)
    assert not fs.call_s3("list_multipart_uploads", Bucket=BUCKET).get("Uploads")



def test_upload_to_storage_without_checksums_says_it_checked_sizes_only(tmp_path):
    """Other storage (fsspec's real in-memory filesystem here) gets no checksum: the summary line says the
    objects were checked by size only, never more."""
    import fsspec
    from shardscope.backend.export.remote_target import RemoteTarget

    staged = tmp_path / "staged"
    staged.mkdir()
    for name, data in (("a.safetensors", b"x" * 5000), ("model.safetensors.index.json", b"{}")):
        (staged / name).write_bytes(data)
    target = RemoteTarget("memory://upload-check/out")
    target.check(force=False)
    target.commit(str(staged), "dir")
    fs = fsspec.filesystem("memory")
    assert fs.cat("/upload-check/out/a.safetensors") == b"x" * 5000
    assert target.report.describe() == ("2 objects; each final object's size equals the staged file's (the uploaded "
                                        "bytes themselves were not checked)")
    fs.rm("/upload-check", recursive=True)


def test_verify_on_s3_checks_the_manifest_beside_the_export(s3, tmp_path):
    """An export to a URL puts its manifest beside it; ``verify URL`` checks every file against it (sealed, exit
    0), and one flipped byte or a file the manifest lacks is exit 1 naming the file (fail closed)."""
    server, fs, _ = s3
    url = f"s3://{BUCKET}/sealed/model.safetensors"
    proc, _ = shardscope(server, "export", f"s3://{BUCKET}/fsdp2_r4", url)
    assert proc.returncode == 0, proc.stderr
    ok, _ = shardscope(server, "verify", url)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "sealed: 1 file SHA-256 checked against model.safetensors.shardscope-manifest.json" in ok.stdout, ok.stdout
    data = bytearray(fs.cat(f"{BUCKET}/sealed/model.safetensors"))
    data[-1] ^= 0x01  # the last tensor's last byte: no stored checksum in a safetensors file sees it
    fs.pipe(f"{BUCKET}/sealed/model.safetensors", bytes(data))
    bad, _ = shardscope(server, "verify", url)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "model.safetensors: its SHA-256 differs from the manifest's; it holds" in bad.stdout, bad.stdout

    folder = f"s3://{BUCKET}/sealed/sharded"
    proc, _ = shardscope(server, "export", f"s3://{BUCKET}/fsdp2_r4", folder, "--max-shard-size", "4KB")
    assert proc.returncode == 0, proc.stderr
    ok, _ = shardscope(server, "verify", folder, "--json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    seal = json.loads(ok.stdout)["seal"]
    assert seal["state"] == "sealed" and seal["files_checked"] == len(fs.ls(f"{BUCKET}/sealed/sharded")) - 1
    fs.pipe(f"{BUCKET}/sealed/sharded/notes.txt", b"written after the seal")
    bad, _ = shardscope(server, "verify", folder)
    assert bad.returncode == 1 and "notes.txt is not in the manifest: unverified" in bad.stdout, bad.stdout
