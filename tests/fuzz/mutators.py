"""Mutations of real checkpoint files: byte flips, truncations, insertions, pickle-opcode-aware argument
changes (ints, strings, memo references) and zip-header field changes. Every mutator is a pure function of
(bytes, random.Random), so a seed reproduces a case exactly."""

from __future__ import annotations

import functools
import io
import pickle
import pickletools
import random
import struct
import warnings
import zlib
from collections.abc import Callable

from shardscope.backend.checkpoint.safe_pickle import _quiet_bytearray_noise

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


_INT_OPS = ("BININT", "BININT1", "BININT2", "LONG1", "INT", "LONG")


def pickle_int(data: bytes, rng: random.Random) -> bytes:
    """Change one integer of the pickle (a shape, a count, a padding, an offset) a little or to an interesting
    value: sizes that almost add up reach the checks between files, not only the parser's."""
    ints = [op for op in _ops(data) if op[0] in _INT_OPS and type(op[1]) is int]
    if not ints:
        return pickle_arg(data, rng)
    _, arg, start, end = rng.choice(ints)
    value = rng.choice([arg + 1, arg - 1, arg + rng.randint(2, 64), arg * 2, arg // 2, 0, -arg,
                        rng.choice(INTERESTING)])
    return data[:start] + _encode_int(value) + data[end:]


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


def _spots(data: bytes, sig: bytes) -> list[int]:
    """Where ``sig`` occurs (the first 4096 places)."""
    spots = []
    i = data.find(sig)
    while i >= 0 and len(spots) < 4096:
        spots.append(i)
        i = data.find(sig, i + 4)
    return spots


def zip_field(data: bytes, rng: random.Random) -> bytes:
    """Set one field of one zip header (local, central, end, zip64 end, zip64 locator) to an interesting value."""
    sig = rng.choice(list(_ZIP_FIELDS))
    spots = _spots(data, sig)
    if not spots:
        return overwrite_int(data, rng)
    at = rng.choice(spots)
    off, width = rng.choice(_ZIP_FIELDS[sig])
    if at + off + width > len(data):
        return truncate(data, rng)
    value = rng.choice(INTERESTING) & ((1 << (8 * width)) - 1)
    return data[:at + off] + value.to_bytes(width, "little") + data[at + off + width:]


# ---------------------------------------------------------------- zip records (.distcp items)
_SMALL_RECORDS = (b".format_version", b"byteorder", b"version", b".storage_alignment", b".data/serialization_id")


@functools.lru_cache(maxsize=64)
def _members(data: bytes) -> tuple[tuple[bytes, int, int, int], ...]:
    """(name, start of its bytes, length, its central directory entry) of every record of every torch.save
    archive in a ``.distcp``: each local header is paired with the first central directory entry of the same
    name after it (the archives lie one after another). Cached like :func:`_ops`."""
    out = []
    local = data.find(b"PK\x03\x04")
    while 0 <= local and local + 30 <= len(data):
        nlen, xlen = struct.unpack_from("<HH", data, local + 26)
        name = data[local + 30:local + 30 + nlen]
        entry = data.find(b"PK\x01\x02", local)
        while entry >= 0 and entry + 46 <= len(data) and data[entry + 46:entry + 46 + nlen] != name:
            entry = data.find(b"PK\x01\x02", entry + 4)
        if entry >= 0 and entry + 46 <= len(data) and name:
            (size,) = struct.unpack_from("<I", data, entry + 20)
            out.append((name, local + 30 + nlen + xlen, size, entry))
        local = data.find(b"PK\x03\x04", local + 4)
    return tuple(out)


def _replace(data: bytes, at: int, new: bytes, entry: int | None = None) -> bytes:
    """``data`` with ``new`` at ``at`` (same length); with ``entry``, that central directory entry's CRC32
    updated to the new record bytes too (so only the structure checks can tell)."""
    out = bytearray(data)
    out[at:at + len(new)] = new
    if entry is not None:
        (size,) = struct.unpack_from("<I", out, entry + 20)
        struct.pack_into("<I", out, entry + 16, zlib.crc32(out[at:at + size]))
    return bytes(out)


def zip_member_name(data: bytes, rng: random.Random) -> bytes:
    """Change one byte of a record's name in its central directory entry or local header: invalid UTF-8,
    another letter or case, a slash."""
    members = _members(data)
    if not members:
        return zip_field(data, rng)
    name, start, _, entry = rng.choice(members)
    where = entry + 46 if rng.random() < 0.7 else data.rfind(name, 0, start)
    i = where + rng.randrange(len(name))
    return _replace(data, i, bytes([rng.choice([0xFF, 0xC3, 0x80, ord("/"), ord("X"), data[i] ^ 0x20])]))


def zip_central_directory(data: bytes, rng: random.Random) -> bytes:
    """Change any byte of one central directory entry (name included) or end record, not only the
    numeric fields :func:`zip_field` knows."""
    members = _members(data)
    ends = [i for sig in (b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07") for i in _spots(data, sig)]
    if not members:
        return zip_field(data, rng)
    if ends and rng.random() < 0.3:
        at, span = rng.choice(ends), 22
    else:
        name, _, _, at = rng.choice(members)
        span = 46 + len(name)
    i = min(len(data) - 1, at + rng.randrange(span))
    return _replace(data, i, bytes([data[i] ^ (1 << rng.randrange(8)) if rng.random() < 0.5 else rng.randrange(256)]))


def zip_small_record(data: bytes, rng: random.Random) -> bytes:
    """Rewrite a ``.format_version``/``byteorder``/``version``/``.storage_alignment``/serialization id
    record (same length), its CRC32 left stale or updated."""
    members = [m for m in _members(data) if m[0].split(b"/", 1)[-1] in _SMALL_RECORDS and m[2]]
    if not members:
        return zip_member_name(data, rng)
    _, start, size, entry = rng.choice(members)
    value = rng.choice([b"0", b"2", b"9", b"11", b"x", b"\xff", b"big", b"-1", b" ", b"\n", b"99999999"])
    new = (value + data[start + len(value):start + size])[:size]
    return _replace(data, start, new, entry if rng.random() < 0.5 else None)


def zip_pickle_record(data: bytes, rng: random.Random) -> bytes:
    """Change a ``data.pkl`` record, a non-tensor entry's more often than a tensor's (same length: an
    opcode-aware change is cut or padded to fit), its CRC32 left stale or updated."""
    members = [m for m in _members(data) if m[0].endswith(b"/data.pkl") and m[2]]
    if not members:
        return zip_field(data, rng)
    objects = [m for m in members if b"_rebuild_tensor" not in data[m[1]:m[1] + m[2]]]
    _, start, size, entry = rng.choice(objects if objects and rng.random() < 0.7 else members)
    pkl = data[start:start + size]
    if not pkl:  # the record lies past the end (an earlier mutation cut the file)
        return zip_field(data, rng)
    new = rng.choice([flip_bits, overwrite_int, pickle_arg, pickle_arg])(pkl, rng)
    new = (new + pkl[len(new):])[:size]
    return _replace(data, start, new, entry if rng.random() < 0.5 else None)


BYTE_MUTATORS: list[Callable[[bytes, random.Random], bytes]] = [flip_bits, truncate, insert_bytes, delete_bytes,
                                                                overwrite_int]
METADATA_MUTATORS = [*BYTE_MUTATORS, pickle_arg, pickle_arg, pickle_arg, pickle_splice]
DISTCP_MUTATORS = [*BYTE_MUTATORS, zip_field, zip_field, zip_field]
DISTCP_MUTATORS += [zip_member_name, zip_central_directory, zip_small_record, zip_pickle_record]



# ---------------------------------------------------------------- planner_data-aware (.metadata)
# The nested key paths ``dcp_to_torch_save`` unflattens: mutated on the unpickled Metadata (torch's own classes,
# which only the tests unpickle) and pickled again, so each case is a file torch itself could have written.
BAD_KEYS = [10**12, 2**62, 2**63, 2**70, -1, True, False, 1.5, None, b"x", ("a",), ""]


class _MetadataUnpickler(pickle.Unpickler):
    """Only what a DCP ``.metadata`` names (a mutated file may name anything else)."""

    def find_class(self, module: str, name: str) -> object:
        import torch

        if module.startswith("torch.distributed.checkpoint") or (module, name) in {
                ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                ("collections", "OrderedDict")} or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                      torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not in a .metadata")


def rename_entry(md: object, old: str, new: str) -> None:
    """Entry ``old`` becomes ``new`` everywhere (records, storage keys, planner_data), order kept."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md.state_dict_metadata = {new if k == old else k: v for k, v in md.state_dict_metadata.items()}
    md.storage_data = {(MetadataIndex(new, k.offset, k.index) if k.fqn == old else k): v
                       for k, v in md.storage_data.items()}
    md.planner_data = {new if k == old else k: v for k, v in md.planner_data.items()}


def planner_paths(data: bytes, rng: random.Random) -> bytes:
    """Change ``planner_data``: a key to a huge, negative, bool or non-int/str value; a path cut to a prefix of
    others, lengthened, made another's, emptied or deepened; a dict key where a list index is (or the reverse);
    or the whole field replaced. Usually the entry is renamed to spell its new path, so the case gets past
    the name check to the tree and list-length checks."""
    try:
        # NOTE: an earlier mutation's huge BYTEARRAY8 trips CPython's bytearray dealloc noise (see
        # safe_pickle._quiet_bytearray_noise); the broken objects are freed here, under the same filter,
        # so the line is not printed while a later case runs (found by a long pass).
        with warnings.catch_warnings(), _quiet_bytearray_noise():
            warnings.simplefilter("ignore")
            unpickler = _MetadataUnpickler(io.BytesIO(data))
            try:
                md = unpickler.load()
            except Exception as exc:
                failure = exc.with_traceback(None)  # no frames keep the half-built objects alive
            else:
                failure = None
            del unpickler  # (a full gc.collect here cost a minute of the fixed-seed pass)
        if failure is not None:
            raise failure
        planner = md.planner_data
        if not isinstance(planner, dict) or not planner:
            raise ValueError("no planner_data to change")
        names = list(planner)
    except Exception:  # an earlier mutation broke the pickle: fall back to the opcode-level one
        return pickle_arg(data, rng)
    name = rng.choice(names)
    path, other = ([*p] if isinstance(p, tuple | list) else [name] for p in (planner[name], planner[rng.choice(names)]))
    pick = rng.randrange(8)
    if pick == 0:  # one key to something no list or dict holds
        path[rng.randrange(len(path))] = rng.choice(BAD_KEYS)
    elif pick == 1:  # a prefix of other paths (issue 19, item 4)
        path = path[:rng.randrange(1, len(path))] if len(path) > 1 else [*path, "x"]
    elif pick == 2:  # under another entry's path, which becomes a container
        path = other + rng.choice([["x"], [0], [10**12]])
    elif pick == 3:  # the same path as another entry
        path = other
    elif pick == 4:  # dict vs list at one level
        i = rng.randrange(len(path))
        path[i] = str(path[i]) if type(path[i]) is int else rng.choice([0, 1, 7])
    elif pick == 5:
        path = rng.choice([[], ["x"] * rng.choice([257, 10_000]), [0, *path], [*path, 2**31]])
    elif pick == 6:  # a list index past what the paths can fill (issue 19, item 3)
        path = [*path[:-1], rng.choice([10**12, 10**6, len(names) + 1, 2**40]), *path[-1:]]
    else:  # the field itself
        md.planner_data = rng.choice([None, [], "per-rank-data", {name: 5}, {5: (name,)}])
        return _pickled(md, data, rng)
    planner[name] = rng.choice([tuple(path), tuple(path), path, "x"])
    if rng.random() < 0.7:  # spell it, as a hostile writer would
        try:
            rename_entry(md, name, ".".join(map(str, path)))
        except (TypeError, ValueError):  # an unhashable or unprintable key: keep the name
            pass
    return _pickled(md, data, rng)


def _pickled(md: object, data: bytes, rng: random.Random) -> bytes:
    """``md`` pickled again; a Metadata an earlier mutation made unpicklable (a nest deeper than the
    recursion limit) falls back to the opcode-level mutation of ``data``."""
    try:
        return pickle.dumps(md, protocol=rng.choice([2, 4]))
    except (RecursionError, pickle.PicklingError, TypeError, ValueError, AttributeError):
        return pickle_arg(data, rng)


METADATA_MUTATORS.append(planner_paths)


# ---------------------------------------------------------------- attribute order (.metadata, issue 29 item 7)
def _load_metadata(data: bytes) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _MetadataUnpickler(io.BytesIO(data)).load()


def metadata_attribute_order(data: bytes, rng: random.Random) -> bytes:
    """The same Metadata pickled again (torch's own classes, so torch's loader may read it: the oracle) with an
    extra unused attribute placed first whose objects are the ones ``storage_data`` or a tensor's chunk list refer
    to: they are then built there, in another order, and only referenced later (a key mapped to another's value,
    keys or values reversed or shuffled, a tensor's chunks or another tensor's); or ``storage_data`` dropped."""
    try:
        md = _load_metadata(data)
        keys, infos = list(md.storage_data), list(md.storage_data.values())
        tensors = [v for v in md.state_dict_metadata.values() if hasattr(v, "chunks")]
    except Exception:  # not a Metadata torch's classes read (a seed is): the input, pickled as it was
        return data
    pick = rng.randrange(7)
    if pick == 0 and len(keys) > 1:  # one key built first with another key's value
        i, j = rng.sample(range(len(keys)), 2)
        extra: object = {keys[i]: infos[j]}
    elif pick == 1:
        extra = keys[::-1]
    elif pick == 2:
        extra = infos[::-1]
    elif pick == 3:
        extra = rng.sample(keys + infos, len(keys + infos))
    elif pick == 4 and len(tensors) > 1:  # chunks of tensors built first, in another order
        extra = [c for t in rng.sample(tensors, len(tensors)) for c in t.chunks]
    elif pick == 5 and tensors:  # inside a tensor's own state, before its chunk list
        t, chunks = rng.choice(tensors), rng.choice(tensors).chunks[::-1]
        state = dict(t.__dict__)
        t.__dict__.clear()
        t.__dict__.update({"aa_extra": chunks, **state})
        extra = None
    else:
        md.__dict__.pop("storage_data") if rng.random() < 0.5 else setattr(md, "storage_data", None)
        extra = None
    if extra is not None:
        state = dict(md.__dict__)
        md.__dict__.clear()
        md.__dict__.update({"aa_extra": extra, **state})
    return pickle.dumps(md, protocol=rng.choice([2, 4]))


def mutate(data: bytes, rng: random.Random, mutators: list[Callable[[bytes, random.Random], bytes]],
           rounds: int | None = None) -> bytes:
    """Apply 1-3 random mutators in a row (never returning the input unchanged if it can be helped)."""
    for _ in range(rounds or rng.choice([1, 1, 1, 2, 3])):
        if not data:
            break
        data = rng.choice(mutators)(data, rng)
    return data
