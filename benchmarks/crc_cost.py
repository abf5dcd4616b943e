"""What checking the stored CRC32 on every read costs: a 512 MiB checkpoint written by ``dcp.save``, every
chunk read through the chunk reader (CRC32 checked in the same pass) against the same byte ranges read
into the same buffers without the check; warm page cache, best of 3.

    python benchmarks/crc_cost.py [--mib 512]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import zlib


def main() -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from shardscope.backend.checkpoint.chunks import ChunkReader
    from shardscope.backend.formats import open_checkpoint

    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    args = ap.parse_args()
    n = args.mib // 64
    with tempfile.TemporaryDirectory() as tmp:
        dcp.save({f"w{i}": torch.randn(4096, 4096) for i in range(n)}, checkpoint_id=tmp, no_dist=True)
        ckpt = open_checkpoint(tmp, use_cache=False)
        chunks = [(t, c) for t in ckpt.tensors for c in t.chunks]
        total = sum(c.length for _, c in chunks)
        with ChunkReader(ckpt) as reader:
            located = [(t, c, reader.locate(t.fqn, c)) for t, c in chunks]

            def checked() -> None:
                for t, c, _ in located:
                    reader.read_chunk(t.fqn, c, t.dtype)

            def plain() -> None:
                for _, c, st in located:
                    reader.handles.readinto(c.file, st.data_offset, memoryview(bytearray(st.nbytes)))

            def crc_only() -> None:
                for _, c, st in located:
                    buf = bytearray(st.nbytes)
                    reader.handles.readinto(c.file, st.data_offset, memoryview(buf))
                    zlib.crc32(buf)

            plain()  # warm the page cache
            times = {}
            for name, fn in (("read, no check", plain), ("read + CRC32 (chunk reader)", checked),
                             ("read + zlib.crc32 alone", crc_only)):
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    fn()
                    best = min(best, time.perf_counter() - t0)
                times[name] = best
    base = times["read, no check"]
    print(f"{total / 2**20:.0f} MiB in {len(chunks)} chunks, warm page cache, best of 3\n")
    print("| read | time | throughput | vs no check |")
    print("|---|---:|---:|---:|")
    for name, t in times.items():
        print(f"| {name} | {t:.3f} s | {total / t / 2**30:.2f} GiB/s | {t / base:.2f}x |")


if __name__ == "__main__":
    main()
