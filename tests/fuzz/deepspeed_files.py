"""Mutated DeepSpeed ZeRO files for the DeepSpeed parser: a real tag folder with one file changed, either as bytes
(the zip structure, any byte) or through its data.pkl (opcode-aware changes of any length, the archive zipped
again with right CRC32s, so the change reaches the unpickler and the layout checks). The contract is the one of
:mod:`fuzz.harness`: parsing, reading every tensor and checking every record either works or raises one
ShardscopeError (a one-line message); no other exception, no hang, memory bounded by the files' size."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from deepspeed_damage import archive_records, rezip
from shardscope.backend.checkpoint.deepspeed_state import plain
from shardscope.backend.errors import CheckpointError

from fuzz.mutators import BYTE_MUTATORS, DISTCP_MUTATORS, mutate, pickle_arg, pickle_int, pickle_splice

PICKLE_MUTATORS = [*BYTE_MUTATORS, pickle_arg, pickle_arg, pickle_arg, pickle_splice, *[pickle_int] * 8]


@dataclass(frozen=True)
class DeepSpeedSeed:
    """One file of a real tag folder; ``part`` says what is mutated: the whole ``archive`` or its ``pickle``."""

    folder: Path
    target: str
    part: str
    data: bytes


def deepspeed_corpus(folders: list[Path]) -> list[DeepSpeedSeed]:
    """Every ``.pt`` file of each tag folder, once as an archive and once through its data.pkl."""
    seeds = []
    for folder in folders:
        for p in sorted(folder.glob("*.pt")):
            raw = p.read_bytes()
            seeds += [DeepSpeedSeed(folder, p.name, "archive", raw), DeepSpeedSeed(folder, p.name, "pickle", raw)]
    return seeds


def mutated_file(seed: DeepSpeedSeed, case: int) -> bytes:
    """The mutation number ``case`` of a seed (reproducible): the whole file's bytes."""
    rng = random.Random(f"{seed.folder.parent.parent.name}/{seed.target}/{seed.part}/{case}")
    if seed.part == "archive":
        return mutate(seed.data, rng, DISTCP_MUTATORS)
    pkl = next(body for name, body in archive_records(seed.data) if name.endswith("/data.pkl"))
    return rezip(seed.data, {"data.pkl": mutate(pkl, rng, PICKLE_MUTATORS)})


def exercise_deepspeed(folder: Path, oracle: bool = False) -> str:
    """Open the tag folder through the formats door (the parser, then the boxes and located records), read every
    tensor (master weights and optimizer states) and every value through the one chunk reader (an unreadable one
    is an answer), then Verify contents: "ok" or "problems"; raises what escapes. Every CheckpointError met says
    one line."""
    from shardscope.backend.checkpoint.chunks import ChunkReader
    from shardscope.backend.formats import open_checkpoint, verify_contents

    ckpt = open_checkpoint(folder)
    plain(ckpt.format_data["state"].ds_config)
    problems = list(ckpt.problems)
    with ChunkReader(ckpt) as reader:
        for t in ckpt.tensors:
            try:
                value = reader.read_tensor(t)
            except CheckpointError as exc:
                if "\n" in str(exc):
                    raise AssertionError(f"a message of several lines: {exc}") from None
                problems.append(exc)
                continue
            assert tuple(value.shape) == t.shape
        for o in ckpt.objects:
            reader.read_object(o)
    problems += verify_contents(ckpt)
    return "problems" if problems else "ok"


__all__ = ["DeepSpeedSeed", "deepspeed_corpus", "exercise_deepspeed", "mutated_file"]
