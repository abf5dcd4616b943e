"""Safetensors headers read as columns (backend/checkpoint/safetensors_items.py ``parse_safetensors_table``): the
layout safetensors' own writer produces is read without a JSON dict per entry, every other spelling goes through
the JSON parser, and both give the same entries, the same model and the same error messages. Files are written by
``safetensors.torch.save_file``; other spellings and damage are that file's header rewritten."""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest
import torch
from conftest import run_cli
from safetensors.torch import save_file
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.checkpoint.dtypes import MAX_INDEX
from shardscope.backend.checkpoint.items import ItemFormatError
from shardscope.backend.checkpoint.safetensors_items import (
    _canonical_table,
    parse_safetensors_header,
    parse_safetensors_table,
)
from shardscope.backend.checkpoint.sources import _may_overlap
from shardscope.backend.checkpoint.storage import open_folder
from shardscope.backend.checkpoint.verify import overlap_problems
from shardscope.backend.errors import CheckpointError
from shardscope.backend.formats import open_checkpoint

NAMES = ["plain.weight", 'a"quoted"', "back\\slash", "ñame.层.😀", "tab\tnew\nline", "slash/and\u0001ctl", "z"]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {f"{n}.{i}": torch.randn(3, 2, generator=g) for i, n in enumerate(NAMES)}
    sd.update({"scalar": torch.tensor(2.5), "empty": torch.zeros(0), "empty.3d": torch.zeros(2, 0, 3),
               "bf16": torch.randn(5, generator=g).to(torch.bfloat16), "f16": torch.randn(2, 3, generator=g).half(),
               "f64": torch.randn(4, generator=g).double(), "i8": torch.arange(-3, 3, dtype=torch.int8),
               "u8": torch.arange(7, dtype=torch.uint8), "i16": torch.arange(3, dtype=torch.int16),
               "i32": torch.arange(9, dtype=torch.int32).reshape(3, 3), "i64": torch.arange(2, dtype=torch.int64),
               "bool": torch.tensor([True, False, True]), "4d": torch.randn(1, 2, 1, 3, generator=g)})
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            sd[name] = torch.randn(6, generator=g).to(getattr(torch, name))
    return sd


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    save_file(_state(), path, metadata={"format": "pt", 'key"q': "v\\é", "shardscope_objects": '{"step": 7}'})
    return path


def _header(path) -> tuple[bytes, bytes, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[:8], raw[8:8 + n], raw[8 + n:]


def _write(path, header: bytes, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _compact(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _table(path, data_limit=MAX_INDEX):
    size = path.stat().st_size
    with open_folder(str(path.parent)).handles() as h:
        table = parse_safetensors_table(h, path.name, 0, size, data_limit)
        reference = parse_safetensors_header(h, path.name, 0, size, data_limit)  # the JSON parser
    return table, reference


def _same_entries(table, reference) -> None:
    """The columns hold, entry by entry and in order, what the JSON parser's StoredTensors say."""
    assert table.names == list(reference.tensors)
    assert table.metadata == reference.metadata and table.end == reference.end
    starts = table.dim_start()
    for i, (name, st) in enumerate(reference.tensors.items()):
        shape = tuple(table.dims[starts[i]:starts[i] + table.ndim[i]].tolist())
        assert (table.dtypes[i], shape, int(table.data_offset[i]), int(table.nbytes[i])) == \
            (st.dtype, st.shape, st.data_offset, st.nbytes), name


def _fast(path, data_limit=MAX_INDEX):
    _, header, _ = _header(path)
    return _canonical_table(header, 8 + len(header), data_limit)


def _respelled(path, dst) -> None:
    """The same header with each entry's keys reordered: the same length, so the same data offsets, but not the
    canonical layout (read by the JSON parser)."""
    _, header, data = _header(path)
    obj = json.loads(header)
    out = {k: v if k == "__metadata__" else {"shape": v["shape"], "dtype": v["dtype"],
                                               "data_offsets": v["data_offsets"]} for k, v in obj.items()}
    text = _compact(out)
    _write(dst, text + b" " * (len(header) - len(text)), data)


def _model(ckpt) -> list:
    return [(t.fqn, t.dtype, t.shape, [c.to_json() for c in t.chunks]) for t in ckpt.tensors]


def test_safetensors_writer_headers_are_read_as_columns_matching_the_json_parser(written, tmp_path):
    assert _fast(written) is not None  # the layout safetensors writes takes the columnar path
    table, reference = _table(written)
    _same_entries(table, reference)
    assert {"scalar", "empty", "empty.3d", "bf16", *[f"{n}.{i}" for i, n in enumerate(NAMES)]} <= set(table.names)
    # the whole open: the same model as the JSON parser gives for the same header spelled otherwise
    other = tmp_path / written.name
    _respelled(written, other)
    assert _fast(other) is None
    fast, slow = open_checkpoint(written, use_cache=False), open_checkpoint(other, use_cache=False)
    assert _model(fast) == _model(slow) and fast.problems == slow.problems == []
    assert [(o.fqn, o.value) for o in fast.objects] == [(o.fqn, o.value) for o in slow.objects] == [("step", 7)]
    for col in ("tensor", "file", "byte_offset", "length", "dim_start", "dims"):
        a, b = getattr(fast.chunk_table, col), getattr(slow.chunk_table, col)
        assert a.dtype == b.dtype and np.array_equal(a, b), col
    state = _state()
    with ChunkReader(fast) as reader:
        for t in fast.tensors:
            got, want = reader.read_tensor(t), state[t.fqn]
            assert got.dtype == want.dtype and got.shape == want.shape, t.fqn
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), t.fqn


def _edit_entries(change):
    def edit(header: bytes) -> bytes:
        obj = json.loads(header)
        change(obj)
        return _compact(obj)
    return edit


@pytest.mark.parametrize("spelling, canonical", [
    pytest.param(lambda h: json.dumps(json.loads(h)).encode(), False, id="spaces"),
    pytest.param(lambda h: json.dumps(json.loads(h), indent=1).encode(), False, id="indented"),
    pytest.param(lambda h: b" " + h, False, id="leading space"),
    pytest.param(lambda h: _compact({k: dict(reversed(v.items())) if k != "__metadata__" else v
                                     for k, v in json.loads(h).items()}), False, id="keys reordered"),
    pytest.param(lambda h: _compact({**{k: v for k, v in json.loads(h).items() if k != "__metadata__"},
                                     "__metadata__": json.loads(h)["__metadata__"]}), False, id="metadata last"),
    pytest.param(lambda h: _compact({**json.loads(h), "__metadata__": None}), False, id="metadata null"),
    pytest.param(_edit_entries(lambda o: o["z.6"].update(extra=1)), False, id="extra key"),
    pytest.param(lambda h: h.replace(b'"dtype":"F64"', b'"dtype":"\\u0046\\u0036\\u0034"'), False,
                 id="escaped dtype"),
    pytest.param(lambda h: h.replace(b'"shape":[3,2]', b'"shape":[3, 2]', 1), False, id="one space"),
    pytest.param(lambda h: h + b"\n\t", True, id="trailing whitespace"),
    pytest.param(lambda h: _compact({k: v for k, v in json.loads(h).items() if k != "__metadata__"}), True,
                 id="no metadata"),
    pytest.param(lambda h: _compact({**json.loads(h), "__metadata__": {}}), True, id="empty metadata"),
    pytest.param(lambda h: json.dumps(json.loads(h), separators=(",", ":")).encode(), True, id="ascii escapes"),
    pytest.param(lambda h: h.replace(b'"scalar":', b'"\\u0073c\\/a\\ud83d\\ude00":'), True, id="escaped name"),
])
def test_other_spellings_give_the_json_parsers_entries(written, tmp_path, spelling, canonical):
    """Spellings outside safetensors' own layout go through the JSON parser; escapes and whitespace the layout
    allows are read as columns, names decoded as JSON decodes them."""
    _, header, data = _header(written)
    path = tmp_path / "spelled.safetensors"
    _write(path, spelling(header.rstrip(b" ")), data)
    assert (_fast(path) is not None) == canonical
    table, reference = _table(path)
    _same_entries(table, reference)
    assert table.names, "the spelling keeps the entries"


def _damaged(written, tmp_path, change) -> object:
    """``written`` with its header edited as a dict, written back in the canonical layout; the data offsets
    shift by the header's change of length, which the edits below allow for."""
    _, header, data = _header(written)
    obj = json.loads(header)
    change(obj)
    path = tmp_path / "damaged.safetensors"
    _write(path, _compact(obj), data)
    return path


def _shift(obj, name, a, b):
    obj[name]["data_offsets"] = [a, b]


DAMAGE = {  # what is changed, then the message parse_safetensors_file gives (the JSON parser's)
    "unknown dtype": (lambda o: o["f64"].update(dtype="F33"), "header entry 'f64' has unknown dtype 'F33'"),
    "offsets reversed": (lambda o: o["f64"].update(data_offsets=o["f64"]["data_offsets"][::-1]),
                         "header entry 'f64': bytes {a}..{b} lie outside the {limit}-byte data"),
    "negative dim": (lambda o: o["f64"].update(shape=[-4]), "header entry 'f64' is malformed"),
    "dim of 2**62": (lambda o: o["f64"].update(shape=[2**62]), "header entry 'f64' is malformed"),
    "65 dims": (lambda o: o["f64"].update(shape=[1] * 65), "header entry 'f64' is malformed"),
    "float offset": (lambda o: o["f64"].update(data_offsets=[0.0, 8]),
                     "header entry 'f64': bytes 0.0..8 lie outside the {limit}-byte data"),
    "offsets of 19 digits": (lambda o: o["f64"].update(data_offsets=[5 * 10**18, 5 * 10**18 + 32]),
                             "header entry 'f64': bytes {a}..{b} lie outside the {limit}-byte data"),
    "three offsets": (lambda o: o["f64"].update(data_offsets=[0, 8, 16]), "header entry 'f64' is malformed"),
    "no shape": (lambda o: o["f64"].pop("shape"), "header entry 'f64' is malformed"),
    "leading zero": (lambda o: None, "header is not JSON (JSONDecodeError)"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_headers_keep_the_json_parsers_messages(written, tmp_path, damage):
    change, message = DAMAGE[damage]
    path = _damaged(written, tmp_path, change)
    a, b, *_ = json.loads(_header(path)[1])["f64"]["data_offsets"]
    if damage == "leading zero":
        _, header, data = _header(path)
        _write(path, header.replace(b'"shape":[3,2]', b'"shape":[03,2]', 1), data)
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path, use_cache=False)
    expected = message.format(a=a, b=b, limit=MAX_INDEX - 8 - len(_header(path)[1]))
    assert str(err.value) == f"{path}: not a readable safetensors file ({expected}).", str(err.value)
    with pytest.raises(ItemFormatError) as direct:
        _table(path)
    assert str(direct.value) == expected


def test_an_entry_named_metadata_is_the_json_parsers_error(written, tmp_path):
    """JSON keeps the last of duplicate keys: a tensor entry named ``__metadata__`` after the metadata replaces it,
    and the JSON parser refuses it; the columnar reader must not take it for a tensor."""
    _, header, data = _header(written)
    path = tmp_path / "metadata.safetensors"
    _write(path, header.replace(b'"scalar":', b'"__metadata__":'), data)
    assert _fast(path) is None
    with pytest.raises(CheckpointError, match=r"\(header names __metadata__ twice\)\.$"):  # the library's refusal
        open_checkpoint(path, use_cache=False)


def test_entries_past_the_data_are_refused_with_a_limit_and_kept_without(written, tmp_path):
    last = _last_entry(json.loads(_header(written)[1]))
    path = _damaged(written, tmp_path, lambda o: o[last].update(
        data_offsets=[o[last]["data_offsets"][0], 10**17 + 24]))  # where a file cut short would end
    size = path.stat().st_size
    base = 8 + len(_header(path)[1])
    a = json.loads(_header(path)[1])[last]["data_offsets"][0]
    with pytest.raises(ItemFormatError, match=fr"^header entry '{last}': bytes {a}..{10**17 + 24} lie outside "
                       fr"the {size - base}-byte data$"):
        _table(path, data_limit=size)
    assert _fast(path, size) is None and _fast(path) is not None  # a file's entries are kept: verify says short
    table, reference = _table(path)
    _same_entries(table, reference)
    assert table.end == base + 10**17 + 24


def _last_entry(obj) -> str:
    """The entry whose bytes end the data section."""
    return max((k for k in obj if k != "__metadata__"), key=lambda k: obj[k]["data_offsets"])


def _wrong_length(o):
    o["f64"]["shape"] = [5]  # 32 bytes stored, 40 described


def _huge_shape(o):
    o["f64"]["shape"] = [2**40, 2**40, 2**40]  # the element count overflows int64


def _past_float_precision(o):
    last = _last_entry(o)
    a, _ = o[last]["data_offsets"]
    o[last].update(dtype="F32", shape=[2**53], data_offsets=[a, a + 2**55 + 4])  # one element more than the shape
    # says, which float64 arithmetic cannot tell apart


@pytest.mark.parametrize("change, fqn, words", [
    (_wrong_length, "f64", "f64: 32 bytes in damaged.safetensors for shape [5] of float64."),
    (_huge_shape, "f64", f"f64: 32 bytes in damaged.safetensors for shape {[2**40] * 3} of float64."),
    (_past_float_precision, "LAST", f"LAST: {2**55 + 4} bytes in damaged.safetensors for shape [{2**53}] of float32."),
])
def test_headers_the_library_refuses_are_refused_by_open_with_the_same_words(written, tmp_path, change, fqn,
                                                                                words):
    if fqn == "LAST":
        fqn = _last_entry(json.loads(_header(written)[1]))
        words = words.replace("LAST", fqn)
    path = _damaged(written, tmp_path, change)
    assert _fast(path) is not None  # the damage is past the parser: the model's checks find it
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path, use_cache=False)
    text = str(err.value)
    assert text.startswith(f"{path} (tensor ") and ": not a valid safetensors header: " in text, text
    assert text.endswith(words), text
    assert err.value.fqn == fqn


def test_overlap_check_in_numpy_finds_what_the_sweep_finds():
    """``header_problem``'s numpy pre-check says "overlap" exactly when :func:`overlap_problems` (``same_start``
    False) reports one: random ranges over a few files, with shared starts, equal ranges and empty ones."""
    rng = random.Random(23)
    found = 0
    for _ in range(3000):
        n = rng.randint(0, 12)
        rows = [(rng.randint(0, 2), rng.choice([0, 4, 8, rng.randint(0, 40)]), rng.choice([0, 4, 8, rng.randint(0, 9)]))
                for _ in range(n)]
        file = np.array([r[0] for r in rows], np.int32)
        start = np.array([r[1] for r in rows], np.int64)
        length = np.array([r[2] for r in rows], np.int64)
        ranges = [(f"f{f}", s, s + ln, f"t{i}") for i, (f, s, ln) in enumerate(rows) if ln > 0]
        want = bool(overlap_problems(ranges, same_start=False))
        assert _may_overlap(file, start, length) == want, rows
        found += want
    assert 300 < found < 2700  # both answers were tried often


def test_sharded_folder_is_read_from_every_files_columns(tmp_path):
    """An HF folder of shards (each tensor whole in one file): every tensor's one chunk is where the JSON parser
    says, in its own file, tensors in file then header order; a wrong length names the shard it is in."""
    g = torch.Generator().manual_seed(1)
    folder = tmp_path / "hf"
    folder.mkdir()
    shards = {"model-00001-of-00002.safetensors": {"a.weight": torch.randn(3, 4, generator=g),
                                                   "a.bias": torch.zeros(3)},
              "model-00002-of-00002.safetensors": {"b.weight": torch.randn(2, 2, generator=g).half(),
                                                   "b.scale": torch.tensor(1.5)}}
    for name, sd in shards.items():
        save_file(sd, folder / name)
    weight_map = {k: name for name, sd in shards.items() for k in sd}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ckpt = open_checkpoint(folder, use_cache=False)
    assert ckpt.problems == []
    expected = []
    for name in shards:
        with open_folder(str(folder)).handles() as h:
            header = parse_safetensors_header(h, name, 0, (folder / name).stat().st_size)
        expected += [(k, st.dtype, st.shape, [{"offsets": [0] * len(st.shape), "sizes": list(st.shape), "rank": None,
                                                "file": name, "offset": st.data_offset, "length": st.nbytes}])
                     for k, st in header.tensors.items()]
    assert _model(ckpt) == expected
    with ChunkReader(ckpt) as reader:
        for sd in shards.values():
            for k, v in sd.items():
                assert torch.equal(reader.read_tensor(ckpt.tensor(k)), v), k
    second = folder / "model-00002-of-00002.safetensors"
    _, header, data = _header(second)
    _write(second, header.replace(b'"shape":[2,2]', b'"shape":[2,1]'), data)
    problems = open_checkpoint(folder, use_cache=False).problems
    assert [(p.kind, p.message, p.file) for p in problems] == [
        ("unreadable", f"b.weight: 8 bytes in {second.name} for shape [2, 1] of float16.", second.name)]


def test_mutated_headers_read_as_the_json_parser_reads_them(written, tmp_path):
    """Fixed-seed byte mutations of safetensors' own header (a byte replaced by one JSON cares about, deleted or
    duplicated): whatever the columnar reader accepts, it reads as the JSON parser does, and it refuses with the
    JSON parser's message."""
    _, header, data = _header(written)
    header = header.rstrip(b" ")
    rng = random.Random(2323)
    path = tmp_path / "mutated.safetensors"
    fast = 0
    for _ in range(1500):
        h = bytearray(header)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(h))
            what = rng.random()
            if what < 0.6:
                h[i] = ord(rng.choice('0123456789,:"{}[]\\ -.eu'))
            elif what < 0.8:
                del h[i]
            else:
                h.insert(i, h[i])
        _write(path, bytes(h), data)
        size = path.stat().st_size
        with open_folder(str(tmp_path)).handles() as handles:
            try:
                want = parse_safetensors_header(handles, path.name, 0, size, MAX_INDEX)
            except ItemFormatError as exc:
                want = str(exc)
            try:
                got = parse_safetensors_table(handles, path.name, 0, size, MAX_INDEX)
            except ItemFormatError as exc:
                got = str(exc)
        if isinstance(want, str):
            assert got == want, bytes(h)
        else:
            _same_entries(got, want)
        fast += _canonical_table(bytes(h), 8 + len(h), MAX_INDEX) is not None
    assert fast > 50  # many mutants stay in the canonical layout (other names, dims; offsets that still tile)


def test_shardscope_exports_are_read_as_columns(written, tmp_path, capsys):
    """Shardscope's own safetensors writer spells headers compactly (non-ASCII names as JSON escapes): its exports
    open through the columnar reader too, with the same entries as the JSON parser's."""
    from shardscope.app.cli.main import main

    out = tmp_path / "exported.safetensors"
    assert main(["export", str(written), str(out)]) == 0, capsys.readouterr()
    assert b"\\u" in _header(out)[1]  # the escapes are there to decode
    assert _fast(out) is not None
    table, reference = _table(out)
    _same_entries(table, reference)
    assert set(table.names) == set(_state())


def _two(tmp_path) -> tuple[bytes, bytes]:
    """A header (its padding removed) and data that ``save_file`` writes for two 4-float tensors."""
    path = tmp_path / "two.safetensors"
    save_file({"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0)}, path)
    _, header, data = _header(path)
    return header.rstrip(b" "), data


def _entries(header: bytes, **offsets) -> bytes:
    obj = json.loads(header)
    for name, (a, b) in offsets.items():
        obj[name]["data_offsets"] = [a, b]
    return _compact(obj)


LAYOUTS = {  # (header, data) of two.safetensors -> the file's header and data; the library refuses each
    "hole between tensors": lambda h, d: (_entries(h, b=(20, 36)), d[:16] + b"\0" * 4 + d[16:]),
    "hole at the start": lambda h, d: (_entries(h, a=(4, 20), b=(20, 36)), b"\0" * 4 + d),
    "a key twice": lambda h, d: (h[:-1] + b',"a":' + _compact(json.loads(h)["b"]) + b"}", d),
    "a key twice, both tiling": lambda h, d: (h[:-1] + b',"a":{"dtype":"F32","shape":[1],"data_offsets":[32,36]}}',
                                              d + b"\0" * 4),
    "bytes after the data": lambda h, d: (h, d + b"x"),
    "bytes after no tensors": lambda h, d: (b"{}", b"\0"),
    "overlap": lambda h, d: (_entries(h, b=(8, 24)), d[:24]),
    "the same bytes twice": lambda h, d: (_entries(h, b=(0, 16)), d[:16]),
    "an empty tensor past the end": lambda h, d: (
        h[:-1] + b',"z":{"dtype":"F32","shape":[0],"data_offsets":[40,40]}}', d),
    "a field twice": lambda h, d: (h.replace(b'"dtype":"F32"', b'"dtype":"F32","dtype":"I32"', 1), d),
    "__metadata__ twice": lambda h, d: (b'{"__metadata__":{"x":"1"},' + h[1:-1] + b',"__metadata__":{"x":"2"}}', d),
    "a lone surrogate": lambda h, d: (h.replace(b'"a":', b'"a\\ud800":'), d),
    "a UTF-8 BOM": lambda h, d: (b"\xef\xbb\xbf" + h, d),
    "a UTF-16 header": lambda h, d: (h.decode().encode("utf-16-le"), d),
}
ACCEPTED = {  # ... and reads each of these
    "an empty tensor between": lambda h, d: (h[:-1] + b',"z":{"dtype":"F32","shape":[0],"data_offsets":[16,16]}}', d),
    "an empty key twice (the last kept)": lambda h, d: (
        h[:-1] + b',"z":{"dtype":"F32","shape":[0],"data_offsets":[32,32]},"z":{"dtype":"F32","shape":[0,2],'
        b'"data_offsets":[32,32]}}', d),
    "keys in another order": lambda h, d: (_compact(dict(reversed(json.loads(h).items()))), d),
    "a leading space": lambda h, d: (b" " + h, d),
    "a metadata key twice (the last kept)": lambda h, d: (b'{"__metadata__":{"x":"1","x":"2"},' + h[1:], d),
}


def _library_reads(path) -> dict | None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k).tolist() for k in f.keys()}
    except SafetensorError:
        return None


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_files_the_library_refuses_are_refused(tmp_path, layout):
    """Issue 29, item 8: a hole, a key twice (JSON's last, leaving a hole), bytes after the data, an overlap, JSON
    the library's parser refuses: never healthy or exported "verified"; one line naming the file, exit 2."""
    header, data = LAYOUTS[layout](*_two(tmp_path))
    path = tmp_path / "bad.safetensors"
    _write(path, header, data)
    assert _library_reads(path) is None, "the library reads it: not a refusal case"
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        open_checkpoint(path, use_cache=False)
    proc = run_cli("inspect", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1 and str(path) in proc.stderr, proc.stderr
    from shardscope.backend.formats.safetensors_file import _state

    assert _state(str(path), path.stat().st_size)[0] != "complete"  # the listing's probe agrees


@pytest.mark.parametrize("layout", list(ACCEPTED))
def test_files_the_library_reads_read_the_same(tmp_path, layout):
    header, data = ACCEPTED[layout](*_two(tmp_path))
    path = tmp_path / "good.safetensors"
    _write(path, header, data)
    want = _library_reads(path)
    assert want is not None
    ckpt = open_checkpoint(path, use_cache=False)
    from shardscope.backend.checkpoint.verify import verify

    assert verify(ckpt, deep=True) == []
    with ChunkReader(ckpt) as reader:
        assert {t.fqn: reader.read_tensor(t).tolist() for t in ckpt.tensors} == want


def test_a_big_non_canonical_header_is_read_whole(tmp_path):
    """Issue 29, item 10: a header of 100,000 entries spelled otherwise than safetensors writes it (indented) is read
    column by column after json.loads, not entry by entry (a 95 MB one took 86 s, the library 26 s): every entry, to
    the file's end. Its time against json.loads alone (about 1.45x) is a benchmark's to measure, not a test's."""
    n = 100_000
    header = {f"model.layers.{i // 10}.experts.{i % 10}.w": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i,
                                                                                                           4 * i + 4]}
              for i in range(n)}
    text = json.dumps(header, indent=1).encode()
    path = tmp_path / "indented.safetensors"
    _write(path, text, b"\0" * (4 * n))
    assert _fast(path) is None
    size = path.stat().st_size
    with open_folder(str(tmp_path)).handles() as h:
        table = parse_safetensors_table(h, path.name, 0, size, MAX_INDEX)
    assert len(table) == n and table.end == size
