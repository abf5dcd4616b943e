"""Run one measured step in a fresh process; prints JSON {seconds, peak_rss}. Used by the benchmarks."""

from __future__ import annotations

import json
import resource
import sys
import time


def peak_rss() -> int:
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec from the parent.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def drop_caches() -> bool:
    """Sync and drop the page cache (a cold read); False when not allowed (not root)."""
    import subprocess

    subprocess.run(["sync"], check=True)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def emit(seconds: float, **extra) -> None:
    print(json.dumps({"seconds": seconds, "peak_rss": peak_rss(), **extra}))


if __name__ == "__main__":
    what, path = sys.argv[1], sys.argv[2]
    if what == "baseline":
        import torch

        emit(0.0)
    elif what == "torch":
        import torch
        from torch.distributed.checkpoint import FileSystemReader

        t0 = time.perf_counter()
        md = FileSystemReader(path).read_metadata()
        seconds = time.perf_counter() - t0
        emit(seconds, chunks=sum(len(getattr(v, "chunks", ())) for v in md.state_dict_metadata.values()))
    elif what in ("shardscope", "shardscope-cached"):
        import torch  # noqa: F401
        from shardscope.backend.formats import open_checkpoint

        t0 = time.perf_counter()
        ck = open_checkpoint(path, use_cache=(what == "shardscope-cached"))
        emit(time.perf_counter() - t0, chunks=len(ck.chunk_table))
    elif what == "inspect-json":  # the whole command, first open without the cache, its JSON to /dev/null
        import os

        from shardscope.app.cli.main import main

        t0 = time.perf_counter()
        out, sys.stdout = sys.stdout, open(os.devnull, "w")
        rc = main(["--no-cache", "inspect", "--json", path])
        sys.stdout.close()
        sys.stdout = out
        emit(time.perf_counter() - t0, rc=rc)
