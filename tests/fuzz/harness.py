"""Run Shardscope's read side on one mutated checkpoint and classify what happened.

The contract: opening, verifying (deep), reading values and nesting the entries as a ``.pt`` export does
either works or raises a ShardscopeError; anything else escaping is a bug (``crash``), as is taking longer
than the per-case limit (``hang``) or a peak RSS above twice the checkpoint's size plus 300 MB (``memory``)."""

from __future__ import annotations

import io
import os
import random
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardscope.backend.checkpoint import open_checkpoint
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.errors import ShardscopeError
from shardscope.backend.export.plan import plan_export
from shardscope.backend.export.torch_writer import nested_state, pickle_state

from fuzz.mutators import DISTCP_MUTATORS, METADATA_MUTATORS, mutate

MAX_VALUES_READ = 6
MEMORY_SLACK = 300 << 20


class Hang(BaseException):
    """The per-case time limit passed (BaseException: no ``except Exception`` in the code swallows it)."""


@dataclass
class Outcome:
    kind: str  # ok, problems, error (a ShardscopeError), crash, hang, memory
    detail: str = ""
    peak: int = 0  # bytes above the RSS before the case


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


def exercise(folder: Path) -> str:
    """Open, verify deep and read values of one folder: "ok" or "problems"; raises what escapes."""
    ckpt = open_checkpoint(folder, use_cache=False)
    problems = verify(ckpt, deep=True)
    with ChunkReader(ckpt) as reader:
        for t in ckpt.tensors[:MAX_VALUES_READ]:
            try:
                reader.read_tensor(t)
            except ShardscopeError:
                pass
        for o in ckpt.objects[:MAX_VALUES_READ]:
            try:
                reader.read_object(o)
            except ShardscopeError:
                pass
        nest_for_torch_export(ckpt, reader)
    return "problems" if problems else "ok"


def nest_for_torch_export(ckpt: object, reader: ChunkReader) -> None:
    """What a ``.pt`` export does with ``planner_data`` before it writes a byte: the nested state dict
    (``set_element`` along every key path) and its pickle; refused plans and unreadable entries are answers."""
    try:
        plan = plan_export(ckpt, "torch")
        pickle_state(nested_state(plan, reader), plan.items)
    except ShardscopeError:
        pass


def _on_alarm(signum: int, frame: object) -> None:
    raise Hang()


STRAY = ("Traceback (most recent call last)", "Exception ignored", "SystemError")


def run_case(folder: Path, timeout: float = 30.0) -> Outcome:
    """Exercise one checkpoint folder with a time limit (main thread only) and peak-memory accounting.
    A traceback or error that C code prints on its way (an unraisable exception) counts as a crash too:
    the user would see it."""
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    base = _status("VmRSS")
    _reset_peak()
    old = signal.signal(signal.SIGALRM, _on_alarm)
    printed, real_stderr = io.StringIO(), sys.stderr
    sys.stderr = printed
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        kind, detail = exercise(folder), ""
    except ShardscopeError as exc:
        kind, detail = "error", str(exc)[:300]
    except Hang:
        kind, detail = "hang", f"over {timeout} s"
    except Exception:  # the harness records any other escape: that is the bug being looked for
        kind, detail = "crash", traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        sys.stderr = real_stderr
    if kind != "crash" and any(s in printed.getvalue() for s in STRAY):
        kind, detail = "crash", f"printed on stderr: {printed.getvalue()[-1500:]}"
    peak = max(0, _status("VmHWM") - base)
    if kind not in ("crash", "hang") and peak > 2 * size + MEMORY_SLACK:
        kind, detail = "memory", f"peak {peak >> 20} MB for {size >> 10} KB of checkpoint"
    return Outcome(kind, detail, peak)


def make_case(source: Path, target: str, data: bytes, dst: Path) -> Path:
    """A copy of the checkpoint ``source`` (hard links) whose file ``target`` holds ``data``."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for p in source.iterdir():
        if p.name == target or not p.is_file():
            continue
        try:
            os.link(p, dst / p.name)
        except OSError:
            shutil.copyfile(p, dst / p.name)
    (dst / target).write_bytes(data)
    return dst


@dataclass(frozen=True)
class Seed:
    """A corpus entry: one file of a real checkpoint to mutate."""

    checkpoint: Path
    target: str  # ".metadata" or a ``__R_N.distcp`` name
    data: bytes

    @property
    def mutators(self) -> list[Callable]:
        return METADATA_MUTATORS if self.target.endswith("metadata") else DISTCP_MUTATORS


def corpus(checkpoints: list[Path]) -> tuple[list[Seed], list[Seed]]:
    """(.metadata seeds, .distcp seeds) from real checkpoints; each .metadata also re-pickled with
    protocol 2 (no framing), so argument changes reach deeper than the first frame."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    meta, data = [], []
    for ck in checkpoints:
        for p in sorted(ck.iterdir()):
            if p.name.endswith(".metadata"):
                raw = p.read_bytes()
                meta.append(Seed(ck, p.name, raw))
                if p.name == ".metadata":  # a trusted fixture: torch's own reader may unpickle it
                    md = FileSystemReader(str(ck)).read_metadata()
                    meta.append(Seed(ck, p.name, pickle.dumps(md, protocol=2)))
            elif p.name.endswith(".distcp"):
                data.append(Seed(ck, p.name, p.read_bytes()))
    return meta, data


def mutated(seed: Seed, case: int, mutators: list[Callable] | None = None) -> bytes:
    """The mutation number ``case`` of a seed (reproducible), by the seed's mutators or those given."""
    rng = random.Random(f"{seed.checkpoint.name}/{seed.target}/{case}")
    return mutate(seed.data, rng, mutators or seed.mutators)
