"""Mutated Megatron-Core files for the Megatron format: a real ``iter_N/`` folder with ``common.pt`` changed (as
bytes, the zip structure, or through its data.pkl with right CRC32s, so the change reaches the allow-list
unpickler) or ``metadata.json`` changed (as bytes, or as JSON: the backend, odd types, deep nesting). The contract
is :mod:`fuzz.harness`'s, and one more: ``common.pt`` is the checkpoint's state beside its tensors, so whatever it
holds, the checkpoint still opens (a problem, never a refusal) and its tensors still read."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from deepspeed_damage import archive_records, rezip
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.formats import open_checkpoint

from fuzz.mutators import BYTE_MUTATORS, DISTCP_MUTATORS, mutate, pickle_arg, pickle_int, pickle_splice

PICKLE_MUTATORS = [*BYTE_MUTATORS, pickle_arg, pickle_arg, pickle_arg, pickle_splice, *[pickle_int] * 4]
ODD_VALUES = [None, 1, -1, 2**70, 1.5, "", "zarr", "torch_dist\n", "\u202etorch_dist", "x" * 500, [], {}, True,
              ["torch_dist"], {"a": [1] * 50}]


@dataclass(frozen=True)
class MegatronSeed:
    """One file of a real iter folder; ``part`` says how it is mutated: ``archive``/``pickle`` (common.pt),
    ``bytes``/``json`` (metadata.json)."""

    folder: Path
    target: str
    part: str
    data: bytes


def megatron_corpus(folders: list[Path]) -> list[MegatronSeed]:
    seeds = []
    for folder in folders:
        common, config = (folder / "common.pt").read_bytes(), (folder / "metadata.json").read_bytes()
        seeds += [MegatronSeed(folder, "common.pt", part, common) for part in ("archive", "pickle", "pickle")]
        seeds += [MegatronSeed(folder, "metadata.json", part, config) for part in ("bytes", "json")]
    return seeds


def _json_mutation(data: bytes, rng: random.Random) -> bytes:
    config = json.loads(data)
    for _ in range(rng.choice([1, 1, 2])):
        key = rng.choice([*config, "sharded_backend", "other"]) if isinstance(config, dict) else None
        choice = rng.random()
        if choice < 0.1:
            config = rng.choice(ODD_VALUES)
        elif choice < 0.15:  # nesting deeper than json's recursion goes
            return b'{"sharded_backend": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        elif isinstance(config, dict) and choice < 0.3:
            config.pop(key, None)
        elif isinstance(config, dict):
            config[key] = rng.choice(ODD_VALUES)
    text = json.dumps(config)
    return text.encode() if rng.random() < 0.9 else text.encode("utf-16")


def mutated_file(seed: MegatronSeed, case: int) -> bytes:
    """The mutation number ``case`` of a seed (reproducible): the whole file's bytes."""
    rng = random.Random(f"{seed.folder.name}/{seed.target}/{seed.part}/{case}")
    if seed.part == "archive":
        return mutate(seed.data, rng, DISTCP_MUTATORS)
    if seed.part == "pickle":
        pkl = next(body for name, body in archive_records(seed.data) if name.endswith("/data.pkl"))
        return rezip(seed.data, {"data.pkl": mutate(pkl, rng, PICKLE_MUTATORS)})
    if seed.part == "json":
        return _json_mutation(seed.data, rng)
    return mutate(seed.data, rng, BYTE_MUTATORS)


def exercise_megatron(folder: Path, oracle: bool = False) -> str:
    """Open the iter folder, verify it deep, show every common.* and config.* entry as ``show`` does, read the
    tensors: "ok" or "problems"; raises what escapes (a CheckpointError: the checkpoint refused)."""
    from shardscope.backend.checkpoint.values import small_value_repr

    ckpt = open_checkpoint(folder, use_cache=False)
    problems = verify(ckpt, deep=True)
    with ChunkReader(ckpt) as reader:
        for o in ckpt.objects:
            if o.inline:
                small_value_repr(reader.read_object(o), 2000)
        for t in ckpt.tensors:
            reader.read_tensor(t)
    return "problems" if problems else "ok"


__all__ = ["MegatronSeed", "exercise_megatron", "megatron_corpus", "mutated_file"]
