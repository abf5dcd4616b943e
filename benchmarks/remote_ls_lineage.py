"""``ls`` of an S3 prefix whose exports have lineage sidecars: the listing alone (the reference: what ``ls`` did
before it read sidecars on URLs) side by side with the listing plus every sidecar, read in one batch.

A local S3 API server (moto, its own process, counting the requests it answers) holds N runs, each with one DCP
checkpoint's names and one export with its sidecar. Each measure is a fresh ``scan`` in this process, the two kinds
alternating, ``--repeat`` times each (the third: the same scan again, its sidecars remembered, as the Library
polls); medians of wall time, and the requests of one scan.

    python benchmarks/remote_ls_lineage.py [--exports 50] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--exports", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    import s3fs
    from s3_server import S3Server
    from shardscope.backend.library import remote_scan, scan
    from shardscope.backend.library.remote_scan import RemoteTree
    from shardscope.backend.lineage import SCHEMA

    server = S3Server()
    try:
        import os

        os.environ.update(server.env())
        fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": server.endpoint})
        fs.mkdir("bench")
        files = {}
        for i in range(args.exports):
            run = f"bench/runs/run{i:03d}"
            files[f"{run}/checkpoints/step_000010/.metadata"] = b"x" * 100
            files[f"{run}/checkpoints/step_000010/__0_0.distcp"] = b"x" * 100
            files[f"{run}/exports/step_000010.safetensors"] = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"
            doc = {"schema": SCHEMA, "written": 0, "export_format": "safetensors",
                   "source": {"path": f"/data/runs/run{i:03d}/checkpoints/step_000010", "step": 10,
                              "run": f"/data/runs/run{i:03d}", "format": "dcp", "identity": None}}
            files[f"{run}/exports/step_000010.safetensors.shardscope.json"] = json.dumps(doc).encode()
        fs.pipe(files)
        time.sleep(6)  # past the listing's "being written" window
        reader = RemoteTree.lineage

        def listing_only(self, sidecar):  # the reference: no sidecar read on a URL
            return None

        kinds = (("listing only (reference)", listing_only, True), ("listing + sidecars", reader, True),
                 ("again (a Library poll)", reader, False))
        times: dict[str, list[float]] = {name: [] for name, _, _ in kinds}
        requests: dict[str, dict[str, int]] = {}
        for _ in range(args.repeat):
            for name, fn, fresh in kinds:
                RemoteTree.lineage = fn
                if fresh:
                    remote_scan._sidecar_memo.clear()
                server.reset()
                t = time.perf_counter()
                found = scan(["s3://bench/runs"])
                times[name].append(time.perf_counter() - t)
                requests[name] = server.requests()
                sources = sum(1 for c in found.checkpoints if c.lineage is not None)
                assert sources == (args.exports if fn is reader else 0), sources
        RemoteTree.lineage = reader
    finally:
        server.stop()
    print(f"ls s3://bench/runs: {args.exports} runs, {args.exports} exports with sidecars; median of "
          f"{args.repeat}, alternating")
    print(f"{'':28}{'wall s':>10}{'GET requests':>14}{'sources shown':>15}")
    for name, ts in times.items():
        shown = 0 if "reference" in name else args.exports
        print(f"{name:28}{statistics.median(ts):>10.3f}{requests[name].get('GET', 0):>14}{shown:>15}")


if __name__ == "__main__":
    main()
