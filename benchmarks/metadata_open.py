"""Open a synthetic million-chunk DCP .metadata: Shardscope vs torch's FileSystemReader.read_metadata.

Writes the metadata with torch's own classes (2,000 tensors x 512 ranks by default), then times
each reader in a fresh process (wall time, peak RSS above a process that only imported torch).

    python benchmarks/metadata_open.py [--tensors 2000] [--ranks 512] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def write_metadata(folder: Path, tensors: int, ranks: int) -> None:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    folder.mkdir(parents=True, exist_ok=True)
    sdm, storage = {}, {}
    file_pos = [0] * ranks
    for t in range(tensors):
        rows, cols = 4096 + 8 * (t % 7), 1024 if t % 3 else 4096
        fqn = f"model.layers.{t // 8}.{['q', 'k', 'v', 'o', 'up', 'down', 'gate', 'norm'][t % 8]}.weight"
        per = -(-rows // ranks)
        chunks = []
        for r in range(ranks):
            start = r * per
            n = max(0, min(per, rows - start))
            c = ChunkStorageMetadata(torch.Size([start, 0]), torch.Size([n, cols]))
            chunks.append(c)
            length = n * cols * 4 + 1100
            storage[MetadataIndex(fqn, c.offsets)] = _StorageInfo(f"__{r}_0.distcp", file_pos[r], length)
            file_pos[r] += length
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([rows, cols]), chunks)
    md = Metadata(sdm, planner_data={k: tuple(k.split(".", 1)) for k in sdm}, storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id=str(folder), save_id="bench"), version="1.0.0")
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)


def measure(what: str, path: Path) -> dict:
    env = {**os.environ, "SHARDSCOPE_CACHE_DIR": str(path.parent / "cache")}
    out = subprocess.run([sys.executable, str(HERE / "_measure.py"), what, str(path)], capture_output=True,
                         text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="shardscope-bench-"))
    ckpt = root / "ckpt"
    if not (ckpt / ".metadata").exists():
        print(f"writing {args.tensors} tensors x {args.ranks} ranks to {ckpt} ...", flush=True)
        write_metadata(ckpt, args.tensors, args.ranks)
    size = (ckpt / ".metadata").stat().st_size
    base = measure("baseline", ckpt)["peak_rss"]
    steps = ["torch", "shardscope", "inspect-json"]
    runs: dict[str, list[dict]] = {s: [] for s in steps}
    for i in range(args.repeat):  # alternating, the order reversed every other round
        for what in steps if i % 2 == 0 else steps[::-1]:
            runs[what].append(measure(what, ckpt))
    measure("shardscope-cached", ckpt)  # fills the cache
    runs["shardscope (cached)"] = [measure("shardscope-cached", ckpt) for _ in range(args.repeat)]
    rows = {name: sorted(r, key=lambda x: x["seconds"])[len(r) // 2] for name, r in runs.items()}  # medians
    t_ref, m_ref = rows["torch"]["seconds"], rows["torch"]["peak_rss"] - base
    print(f"\n.metadata: {size / 2**20:.1f} MiB, {rows['torch']['chunks']} chunks; median of {args.repeat} "
          f"alternating runs; load average {os.getloadavg()[0]:.1f} at the end; peak RSS above a process that "
          f"imported torch ({base / 2**20:.0f} MiB)\n")
    print("| reader | wall time | vs torch | peak RSS added | vs torch | runs (s) |\n|---|---:|---:|---:|---:|---|")
    names = {"inspect-json": "shardscope inspect --json (whole command, no cache)"}
    for name, r in rows.items():
        mem = r["peak_rss"] - base
        every = " ".join(f"{x['seconds']:.1f}" for x in runs[name])
        print(f"| {names.get(name, name)} | {r['seconds']:.2f} s | {r['seconds'] / t_ref:.2f}x | "
              f"{mem / 2**20:.0f} MiB | {mem / m_ref:.2f}x | {every} |")


if __name__ == "__main__":
    main()
