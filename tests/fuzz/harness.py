"""Run Shardscope's read side on one mutated checkpoint and classify what happened.

The contract: opening, verifying (deep), reading values and nesting the entries as a ``.pt`` export does
either works or raises a ShardscopeError; anything else escaping is a bug (``crash``), as is taking longer
than the per-case limit (``hang``) or a peak RSS above twice the checkpoint's size plus 300 MB (``memory``).
With torch's own DCP loader as the oracle (``.distcp`` cases of a checkpoint it reads: the ``.metadata`` is
then the trusted one it unpickles), a "healthy" verdict on a folder torch cannot load, or a value that differs
from the one torch loads, is a bug too (``unsound``)."""

from __future__ import annotations

import contextlib
import functools
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

from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.errors import ShardscopeError
from shardscope.backend.export.planner import plan_export
from shardscope.backend.export.torch_writer import nested_state, pickle_state
from shardscope.backend.formats import open_checkpoint

from fuzz.mutators import DISTCP_MUTATORS, METADATA_MUTATORS, mutate

MAX_VALUES_READ = 6
MEMORY_SLACK = 300 << 20


class Hang(BaseException):
    """The per-case time limit passed (BaseException: no ``except Exception`` in the code swallows it)."""


@dataclass
class Outcome:
    kind: str  # ok, problems, error (a ShardscopeError), crash, hang, memory, unsound
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


def torch_state(folder: Path) -> dict | str:
    """What torch's own DCP loader reads from a folder, flattened to DCP's names; or why it cannot (the
    exception's type). Unpickles the folder's ``.metadata``: only for a trusted one."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    try:  # torch's own messages (a rank-local metadata fallback logs a traceback) are not Shardscope's output
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            _load_state_dict(state, storage_reader=FileSystemReader(str(folder)),
                             planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        return type(exc).__name__
    return flatten_state_dict(state)[0]


@functools.cache
def torch_reads(checkpoint: Path) -> bool:
    """torch's loader reads this (unmutated) checkpoint, so it can be the oracle for its mutations (it cannot
    read a safetensors-serialised ``.distcp`` folder). Only with one ``.metadata``: without it, torch in one
    process falls back to rank 0's ``__0.metadata`` and reads its own copies of replicated entries, which
    are not the ones Shardscope (merging every rank's file) reads."""
    return (checkpoint / ".metadata").is_file() and isinstance(torch_state(checkpoint), dict)


def same_value(a: object, b: object) -> bool:
    """Equal as torch's loader gives them: tensors by dtype, shape and bits; tuples and lists item by item (a
    non-tensor entry may hold tensors)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            a.shape == b.shape and bool(torch.equal(a, b) or (a.is_floating_point() and
                                        torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)))
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, io.BytesIO) and isinstance(b, io.BytesIO):
        return a.getvalue() == b.getvalue()
    return type(a) is type(b) and a == b


def exercise(folder: Path, oracle: bool = False) -> str:
    """Open, verify deep and read values of one folder: "ok" or "problems" (with ``oracle``: "unsound ..."
    when torch's loader disagrees with a healthy verdict or a value); raises what escapes."""
    ckpt = open_checkpoint(folder, use_cache=False)
    problems = verify(ckpt, deep=True)
    reference = torch_state(folder) if oracle and not problems else None
    if isinstance(reference, str):
        return f"unsound: verify --deep says healthy; torch's loader fails ({reference})"
    with ChunkReader(ckpt) as reader:
        entries = [(t.fqn, functools.partial(reader.read_tensor, t)) for t in ckpt.tensors[:MAX_VALUES_READ]]
        entries += [(o.fqn, functools.partial(reader.read_object, o)) for o in ckpt.objects[:MAX_VALUES_READ]]
        for fqn, read in entries:
            try:
                value = read()
            except ShardscopeError:
                continue
            if reference is not None and not same_value(value, reference.get(fqn)):
                return f"unsound: {fqn} reads {str(value)[:80]}; torch's loader gives {str(reference.get(fqn))[:80]}"
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


def run_case(folder: Path, timeout: float = 30.0, oracle: bool = False,
             check: Callable[[Path, bool], str] | None = None) -> Outcome:
    """Exercise one checkpoint folder with a time limit (main thread only) and peak-memory accounting.
    A traceback or error that C code prints on its way (an unraisable exception) counts as a crash too:
    the user would see it. ``oracle``: check the verdict and values against torch's loader. ``check``: what
    exercises the folder (:func:`exercise` by default; another format's reader)."""
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    base = _status("VmRSS")
    _reset_peak()
    old = signal.signal(signal.SIGALRM, _on_alarm)
    printed, real_stderr = io.StringIO(), sys.stderr
    sys.stderr = printed
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        kind, detail = (check or exercise)(folder, oracle), ""
        if kind.startswith("unsound"):
            kind, detail = "unsound", kind
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


def run_same_metadata_case(folder: Path, timeout: float = 30.0) -> Outcome:
    """:func:`run_case` with torch's loader as the oracle, for a ``.metadata`` holding the same Metadata as a healthy
    checkpoint's, pickled in another order (:func:`fuzz.mutators.metadata_attribute_order`): a problem or a refusal
    where torch's loader reads the folder is unsound too."""
    out = run_case(folder, timeout, oracle=True)
    if out.kind in ("problems", "error") and not isinstance(torch_state(folder), str):
        return Outcome("unsound", f"{out.kind} where torch's loader reads the folder: {out.detail}"[:1500], out.peak)
    return out


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
