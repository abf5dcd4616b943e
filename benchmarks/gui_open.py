"""Browser speed on the million-chunk metadata: launch to populated tree vs. the core parse alone,
and the time to draw a 512-chunk shard map. Each side runs in a fresh process, timed from the
process's own start (imports included).

    QT_QPA_PLATFORM=offscreen python benchmarks/gui_open.py [--dir DIR]   (reuses metadata_open's folder)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent


def since_start() -> float:
    import psutil

    return time.time() - psutil.Process().create_time()


def core(path: str) -> None:
    from shardscope.backend.formats import open_checkpoint

    ck = open_checkpoint(path)
    print(json.dumps({"seconds": since_start(), "chunks": len(ck.chunk_table)}))


def gui(path: str) -> None:
    from PySide6.QtWidgets import QApplication
    from shardscope.app.bootstrap import make_app
    from shardscope.app.main_window import MainWindow

    app = make_app()
    win = MainWindow()
    win.resize(1400, 900)
    win.show()
    view = win.open_path(path)
    out: dict = {}

    def tree_ready(_data) -> None:
        QApplication.processEvents()
        view.tree.viewport().repaint()
        out["tree_seconds"] = since_start()
        out["rows"] = view.proxy.rowCount()

    def loaded(data) -> None:
        out["analysis_seconds"] = since_start()
        times = []
        big = [t for t in data.ckpt.tensors if t.chunk_count >= 512][:6]
        for t in big:
            t0 = time.perf_counter()
            view.map.show_tensors(data.ckpt, [t])
            view.map.viewport().repaint()
            times.append(time.perf_counter() - t0)
        times.sort()
        out["map_ms_median"] = 1000 * times[len(times) // 2] if times else None
        out["map_ms_max"] = 1000 * times[-1] if times else None
        out["map_chunks"] = big[0].chunk_count if big else 0
        app.quit()

    view.treeReady.connect(tree_ready)
    view.loaded.connect(loaded)
    app.exec()
    print(json.dumps(out), flush=True)
    os._exit(0)  # see app/bootstrap.run: skip interpreter teardown


def run(what: str, path: Path, cache: Path, no_cache: bool) -> dict:
    env = {**os.environ, "SHARDSCOPE_CACHE_DIR": str(cache), "QT_QPA_PLATFORM": "offscreen"}
    if no_cache:
        env["SHARDSCOPE_NO_CACHE"] = "1"
    proc = subprocess.run([sys.executable, __file__, f"--{what}", str(path)], capture_output=True, text=True,
                          env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--core", metavar="PATH")
    ap.add_argument("--gui", metavar="PATH")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.core:
        return core(args.core)
    if args.gui:
        return gui(args.gui)
    root = args.dir or Path(tempfile.mkdtemp(prefix="shardscope-bench-"))
    ckpt = root / "ckpt"
    if not (ckpt / ".metadata").exists():
        sys.path.insert(0, str(HERE))
        from metadata_open import write_metadata

        write_metadata(ckpt, 2000, 512)
    cache = root / "gui-cache"
    rows = []
    for label, no_cache in (("first open (no cache)", True), ("cached open", False)):
        if not no_cache:
            run("core", ckpt, cache, False)  # fill the cache
        c = min((run("core", ckpt, cache, no_cache) for _ in range(args.repeat)), key=lambda r: r["seconds"])
        g = min((run("gui", ckpt, cache, no_cache) for _ in range(args.repeat)), key=lambda r: r["tree_seconds"])
        rows.append((label, c, g))
    print(f"\n{rows[0][1]['chunks']} chunks; seconds from process start; best of {args.repeat}\n")
    print("| | core parse (CLI) | tree visible (GUI) | added | health/ranks done | 512-chunk map, median / max |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, c, g in rows:
        print(f"| {label} | {c['seconds']:.2f} s | {g['tree_seconds']:.2f} s | "
              f"{100 * (g['tree_seconds'] / c['seconds'] - 1):+.0f}% | {g['analysis_seconds']:.2f} s | "
              f"{g['map_ms_median']:.0f} / {g['map_ms_max']:.0f} ms |")


if __name__ == "__main__":
    main()
