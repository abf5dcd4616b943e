"""Mutated ``.safetensors`` files, with the safetensors library itself as the oracle: what ``safe_open`` refuses,
Shardscope must not call healthy nor read values from; what it reads, Shardscope reads the same (issue 29,
item 8). Seeds are ``save_file`` outputs; :func:`fuzz.mutators.safetensors_layout` changes their layout (holes,
names twice, tails, overlaps) and the byte mutators the rest."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.errors import ShardscopeError
from shardscope.backend.formats import open_checkpoint

from fuzz.mutators import SAFETENSORS_MUTATORS, mutate

NAME = "model.safetensors"


@dataclass(frozen=True)
class SafetensorsSeed:
    name: str
    data: bytes


def safetensors_corpus(tmp: Path) -> list[SafetensorsSeed]:
    """A few ``save_file`` outputs: dtypes, an empty tensor, a scalar, metadata, names needing escapes."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(29)
    states = {
        "plain": {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)},
        "mixed": {"w": torch.randn(2, 3, generator=g).half(), "e": torch.zeros(0), "s": torch.tensor(1.5),
                  "i": torch.arange(6, dtype=torch.int64), "bf": torch.randn(3, generator=g).bfloat16()},
        "names": {"ñame.😀": torch.ones(2), 'q"uote': torch.arange(3, dtype=torch.int32), "z": torch.ones(1, 1)},
    }
    seeds = []
    for key, state in states.items():
        path = tmp / f"{key}.safetensors"
        save_file(state, path, metadata={"format": "pt"} if key != "plain" else None)
        seeds.append(SafetensorsSeed(key, path.read_bytes()))
    return seeds


def mutated_file(seed: SafetensorsSeed, case: int) -> bytes:
    return mutate(seed.data, random.Random(f"safetensors/{seed.name}/{case}"), SAFETENSORS_MUTATORS)


def library_reads(path: Path) -> dict | None:
    """Every tensor as the safetensors library reads it, or None where it refuses the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, ValueError, TypeError, OSError):
        return None


def exercise_safetensors(folder: Path, oracle: bool = True) -> str:
    """Open, verify deep and read every value of ``folder/model.safetensors``; "unsound ..." where the library
    refuses the file and Shardscope says healthy, where both read and a value differs, or where Shardscope
    refuses a file the library reads."""
    import torch

    path = folder / NAME
    want = library_reads(path) if oracle else {}
    try:
        ckpt = open_checkpoint(path, use_cache=False)
    except ShardscopeError as exc:
        if want is not None and oracle:
            return f"unsound: refused ({str(exc)[:200]}); the safetensors library reads the file"
        raise
    problems = verify(ckpt, deep=True)
    if want is None and not problems:
        return "unsound: verify --deep says healthy; the safetensors library refuses the file"
    if want is None:
        return "problems"
    with ChunkReader(ckpt) as reader:
        for t in ckpt.tensors:
            try:
                got = reader.read_tensor(t)
            except ShardscopeError:
                if problems:
                    continue
                raise
            ref = want.get(t.fqn)
            if ref is None or got.dtype != ref.dtype or got.shape != ref.shape or \
                    not torch.equal(got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)):
                return f"unsound: {t.fqn} reads {str(got)[:80]}; the library gives {str(ref)[:80]}"
    if set(want) != {t.fqn for t in ckpt.tensors}:
        return f"unsound: tensors {sorted({t.fqn for t in ckpt.tensors} ^ set(want))[:5]} differ from the library's"
    return "problems" if problems else "ok"
