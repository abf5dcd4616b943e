"""Mutated ``.safetensors`` files, with the safetensors library itself as the oracle: what ``safe_open`` refuses,
Shardscope must not call healthy nor read values from; what it reads, Shardscope reads the same (issue 29,
item 8). Seeds are ``save_file`` outputs; :func:`fuzz.mutators.safetensors_layout` changes their layout (holes,
names twice, tails, overlaps) and the byte mutators the rest."""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass
from pathlib import Path

from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.errors import ShardscopeError
from shardscope.backend.formats import open_checkpoint

from fuzz.mutators import delete_bytes, flip_bits, insert_bytes, mutate, overwrite_int

NAME = "model.safetensors"


def _safetensors_parts(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _safetensors_file(header: dict | bytes, body: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def safetensors_layout(data: bytes, rng: random.Random) -> bytes:
    """A ``save_file`` output with its layout changed as the library may refuse it: a hole between tensors or at
    the start, an entry's bytes moved over another's, a name given twice (JSON keeps the last), bytes after the
    data or the data cut short, a field or ``__metadata__`` given twice, an empty tensor moved."""
    try:
        header, body = _safetensors_parts(data)
    except (ValueError, struct.error, RecursionError):
        return flip_bits(data, rng)
    names = [k for k in header if k != "__metadata__"] if isinstance(header, dict) else []
    if not all(isinstance(header[k], dict) and isinstance(header[k].get("data_offsets"), list) and
               len(header[k]["data_offsets"]) == 2 and all(type(x) is int for x in header[k]["data_offsets"])
               for k in names):
        return flip_bits(data, rng)  # an earlier mutation broke the header
    if not names:
        return data + b"\0" * rng.randint(1, 8)
    name = rng.choice(names)
    a, b = header[name]["data_offsets"]
    pick = rng.randrange(9)
    if pick == 0:  # a hole: every entry from this one on moves up
        gap = rng.choice([1, 2, 4, 8])
        for k in names:
            if header[k]["data_offsets"][0] >= a:
                header[k]["data_offsets"] = [x + gap for x in header[k]["data_offsets"]]
        body = body[:a] + b"\0" * gap + body[a:]
    elif pick == 1:  # moved over another entry's bytes
        other = rng.choice(names)
        o = header[other]["data_offsets"][0] + rng.choice([0, 1, 2])
        header[name]["data_offsets"] = [o, o + b - a]
    elif pick == 2:  # a name given twice: the text of another entry under this name, after it
        raw = json.dumps(header, separators=(",", ":")).encode()
        other = rng.choice(names)
        return _safetensors_file(raw[:-1] + b"," + json.dumps(name).encode() + b":" +
                                 json.dumps(header[other], separators=(",", ":")).encode() + b"}", body)
    elif pick == 3:
        body += bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
    elif pick == 4:
        body = body[:max(0, len(body) - rng.randint(1, 9))]
    elif pick == 5:  # a field twice
        raw = json.dumps(header, separators=(",", ":")).encode()
        field = rng.choice([b'"dtype":', b'"shape":', b'"data_offsets":'])
        i = raw.find(field)
        value = {b'"dtype":': b'"F16",', b'"shape":': b'[1],', b'"data_offsets":': b'[0,0],'}[field]
        return _safetensors_file(raw[:i] + field + value + raw[i:], body)
    elif pick == 6:  # __metadata__ twice
        raw = json.dumps(header, separators=(",", ":")).encode()
        return _safetensors_file(raw[:-1] + b',"__metadata__":{"x":"y"}}', body)
    elif pick == 7:  # an empty tensor somewhere
        at = rng.choice([0, a, b, len(body), len(body) + 4])
        header[f"{name}.empty"] = {"dtype": "F32", "shape": [0], "data_offsets": [at, at]}
    else:  # the whole data moved by a few bytes
        shift = rng.choice([1, 4, 8])
        for k in names:
            header[k]["data_offsets"] = [x + shift for x in header[k]["data_offsets"]]
        body = rng.choice([b"\0" * shift + body, body])
    return _safetensors_file(header, body)


SAFETENSORS_MUTATORS = [safetensors_layout, safetensors_layout, safetensors_layout, flip_bits, overwrite_int,
                        insert_bytes, delete_bytes]


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
