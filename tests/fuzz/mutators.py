"""Mutations of real checkpoint files: byte flips, truncations, insertions, pickle-opcode-aware argument
changes (ints, strings, memo references) and zip-header field changes. Every mutator is a pure function of
(bytes, random.Random), so a seed reproduces a case exactly."""

from __future__ import annotations

import functools
import pickletools
import random
import struct
import warnings
from collections.abc import Callable

INTERESTING = [0, 1, 2, 7, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0xFFFF, 0x10000, 2**31 - 1, 2**31, 2**32 - 1,
               2**32, 2**40, 2**50, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 5_000_000_000]
STRINGS = ["", "/dev/zero", "../../../../dev/zero", "..", "__0_0.distcp", "a\nb", "\u202eevil", "x" * 300,
           "model.emb.weight", "float32", "torch", "builtins"]


def flip_bits(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(out))
        out[i] ^= 1 << rng.randrange(8)
    return bytes(out)


def truncate(data: bytes, rng: random.Random) -> bytes:
    return data[:rng.randrange(len(data))]


def insert_bytes(data: bytes, rng: random.Random) -> bytes:
    i = rng.randrange(len(data) + 1)
    if rng.random() < 0.5:
        chunk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    else:  # a copy of another part of the file
        a = rng.randrange(len(data))
        chunk = data[a:a + rng.randint(1, 64)]
    return data[:i] + chunk + data[i:]


def delete_bytes(data: bytes, rng: random.Random) -> bytes:
    a = rng.randrange(len(data))
    return data[:a] + data[a + rng.randint(1, 32):]


def overwrite_int(data: bytes, rng: random.Random) -> bytes:
    width = rng.choice([1, 2, 4, 8])
    if len(data) <= width:
        return flip_bits(data, rng)
    i = rng.randrange(len(data) - width)
    value = rng.choice(INTERESTING) & ((1 << (8 * width)) - 1)
    return data[:i] + value.to_bytes(width, "little") + data[i + width:]


# ---------------------------------------------------------------- pickle-aware
@functools.lru_cache(maxsize=64)
def _ops(data: bytes) -> tuple[tuple[str, object, int, int], ...]:
    """(opcode name, argument, start, end) of every opcode pickletools can decode before it fails. Cached:
    decoding a seed's 40,000 opcodes was most of a case's time, and every case of a seed starts from it."""
    out = []
    prev = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # genops decoding a damaged STRING argument warns
        try:
            for op, arg, pos in pickletools.genops(data):
                if prev is not None:
                    out.append((prev[0], prev[1], prev[2], pos))
                prev = (op.name, arg, pos)
        except (ValueError, struct.error, IndexError, UnicodeDecodeError):
            return tuple(out)
    if prev is not None:
        out.append((prev[0], prev[1], prev[2], prev[2] + 1))
    return tuple(out)


def _encode_int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if 0 <= value < 65536:
        return b"M" + value.to_bytes(2, "little")
    if -(2**31) <= value < 2**31:
        return b"J" + value.to_bytes(4, "little", signed=True)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _encode_str(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(raw)) + raw


def pickle_arg(data: bytes, rng: random.Random) -> bytes:
    """Change one opcode's argument: an int to an interesting value, a string to a hostile one, a memo
    reference to another memo slot; or drop or repeat one opcode."""
    ops = _ops(data)
    if not ops:
        return flip_bits(data, rng)
    name, arg, start, end = rng.choice(ops)
    choice = rng.random()
    if name in ("BININT", "BININT1", "BININT2", "LONG1", "INT", "LONG") and choice < 0.8:
        value = rng.choice([*INTERESTING, -1, -(2**63), -(2**31)])
        return data[:start] + _encode_int(value) + data[end:]
    if name in ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE") and choice < 0.8:
        return data[:start] + _encode_str(rng.choice([*STRINGS, str(arg)[::-1]])) + data[end:]
    if name in ("BINGET", "LONG_BINGET") and choice < 0.8:
        return data[:start] + b"h" + bytes([rng.randrange(256)]) + data[end:]
    if choice < 0.9:
        return data[:start] + data[end:]  # drop the opcode
    return data[:end] + data[start:end] + data[end:]  # repeat it


def pickle_splice(data: bytes, rng: random.Random) -> bytes:
    """Replace an opcode by a whole sub-pickle: a deep nest, a big constructor call, or another opcode run."""
    ops = _ops(data)
    if not ops:
        return insert_bytes(data, rng)
    _, _, start, end = rng.choice(ops)
    pick = rng.randrange(4)
    if pick == 0:
        piece = b")" + b"\x85" * rng.choice([10, 1000, 100_000])  # nested tuples
    elif pick == 1:
        piece = b"cbuiltins\nbytearray\n" + _encode_int(rng.choice(INTERESTING)) + b"\x85R"
    elif pick == 2:
        piece = b"cbuiltins\nlist\n" + b"cbuiltins\nbytearray\n" + _encode_int(rng.choice([10**6, 10**8])) + \
            b"\x85R\x85R"
    else:
        a, b = sorted(rng.sample(range(len(ops)), 2)) if len(ops) > 1 else (0, 0)
        piece = data[ops[a][2]:ops[b][3]]
    return data[:start] + piece + data[end:]


# ---------------------------------------------------------------- zip-aware (.distcp items)
_ZIP_FIELDS = {  # signature -> (offset, width) of its numeric fields
    b"PK\x03\x04": [(6, 2), (8, 2), (14, 4), (18, 4), (22, 4), (26, 2), (28, 2)],
    b"PK\x01\x02": [(10, 2), (16, 4), (20, 4), (24, 4), (28, 2), (30, 2), (32, 2), (42, 4)],
    b"PK\x05\x06": [(8, 2), (10, 2), (12, 4), (16, 4), (20, 2)],
    b"PK\x06\x06": [(4, 8), (24, 8), (32, 8), (40, 8), (48, 8)],
    b"PK\x06\x07": [(4, 4), (8, 8), (16, 4)],
}


def zip_field(data: bytes, rng: random.Random) -> bytes:
    """Set one field of one zip header (local, central, end, zip64 end, zip64 locator) to an interesting value."""
    sig = rng.choice(list(_ZIP_FIELDS))
    spots = []
    i = data.find(sig)
    while i >= 0 and len(spots) < 4096:
        spots.append(i)
        i = data.find(sig, i + 4)
    if not spots:
        return overwrite_int(data, rng)
    at = rng.choice(spots)
    off, width = rng.choice(_ZIP_FIELDS[sig])
    if at + off + width > len(data):
        return truncate(data, rng)
    value = rng.choice(INTERESTING) & ((1 << (8 * width)) - 1)
    return data[:at + off] + value.to_bytes(width, "little") + data[at + off + width:]


BYTE_MUTATORS: list[Callable[[bytes, random.Random], bytes]] = [flip_bits, truncate, insert_bytes, delete_bytes,
                                                                overwrite_int]
METADATA_MUTATORS = [*BYTE_MUTATORS, pickle_arg, pickle_arg, pickle_arg, pickle_splice]
DISTCP_MUTATORS = [*BYTE_MUTATORS, zip_field, zip_field, zip_field]


def mutate(data: bytes, rng: random.Random, mutators: list[Callable[[bytes, random.Random], bytes]],
           rounds: int | None = None) -> bytes:
    """Apply 1-3 random mutators in a row (never returning the input unchanged if it can be helped)."""
    for _ in range(rounds or rng.choice([1, 1, 1, 2, 3])):
        if not data:
            break
        data = rng.choice(mutators)(data, rng)
    return data
