"""``report(step=..., loss=...)``: append one JSON line per call to RUN/metrics/rank_N.jsonl.

The launcher sets ``SHARDSCOPE_RUN_DIR``; without it every call is a no-op, so scripts can keep
their ``report`` calls when run by hand. Memory is sampled on each call (process RSS; CUDA
allocated/reserved/peak from ``torch.cuda.memory_stats`` when a CUDA device is in use).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

ENV_RUN_DIR = "SHARDSCOPE_RUN_DIR"
_state: dict[str, Any] = {}


def _rank() -> int:
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if var in os.environ:
            try:
                return int(os.environ[var])
            except ValueError:
                pass
    return 0


def _open() -> Any:
    run_dir = os.environ.get(ENV_RUN_DIR)
    if not run_dir:
        return None
    key = (run_dir, os.getpid())
    if _state.get("key") != key:
        rank = _rank()
        os.makedirs(os.path.join(run_dir, "metrics"), exist_ok=True)
        _state["file"] = open(os.path.join(run_dir, "metrics", f"rank_{rank}.jsonl"), "a", buffering=1)
        _state["key"] = key
        _state["rank"] = rank
        try:
            import psutil

            _state["proc"] = psutil.Process()
        except ImportError:
            _state["proc"] = None
    return _state["file"]


def _memory() -> dict[str, int]:
    """Process RSS; with a CUDA device in use, this device's allocated / reserved / peak allocated bytes
    from ``torch.cuda.memory_stats`` (the caching allocator's own counters)."""
    out: dict[str, int] = {}
    proc = _state.get("proc")
    if proc is not None:
        out["rss"] = proc.memory_info().rss
    torch = sys.modules.get("torch")  # never import torch here: a script without torch stays without it
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        for key, stat in (("cuda_allocated", "allocated_bytes.all.current"),
                          ("cuda_reserved", "reserved_bytes.all.current"),
                          ("cuda_peak", "allocated_bytes.all.peak")):
            if stat in stats:
                out[key] = int(stats[stat])
    return out


def report(**values: Any) -> bool:
    """Record this step's values; returns False (and does nothing) outside a Shardscope run."""
    f = _open()
    if f is None:
        return False
    rec = {"time": time.time(), "rank": _state["rank"]}
    for k, v in values.items():
        rec[k] = v.item() if hasattr(v, "item") else v
    rec.update(_memory())
    f.write(json.dumps(rec) + "\n")
    return True
