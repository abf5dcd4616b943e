"""torch's own compressed DCP checkpoints (issue 32, item 1): ``FileSystemWriter(path, _extensions=[ZStandard()])``
records ``transform_descriptors=['stream.zstd/1']`` in each item's ``_StorageInfo``; the DCP format's codec decodes
them, bounded by what the item can hold. They open, verify deep, show, export, diff and reshard like any DCP
folder, with the values torch's own ``dcp.load`` reads (the oracle); no fast path copies their stored bytes; a
transform Shardscope does not know is named in one line."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli, run_cli_peak
from fuzz.harness import same_value as same
from fuzz.harness import torch_state
from fuzz.zstd_files import compress, declaring, decompress, items, read_metadata, rebuild, write_zstd_checkpoint
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.checkpoint.items import InMemory, parse_torch_item
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.errors import CheckpointError
from shardscope.backend.formats import open_checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(compressed, uncompressed): the same state saved by torch in this process, with and without ZStandard."""
    root = tmp_path_factory.mktemp("zstd")
    return write_zstd_checkpoint(root / "zstd"), write_zstd_checkpoint(root / "plain", compressed=False)


@pytest.fixture(scope="module")
def oracle(saved):
    """What torch's own dcp.load reads from the compressed folder (flattened names)."""
    state = torch_state(saved[0])
    assert isinstance(state, dict), state
    return state


def cli(capsys, *args) -> tuple[int, str, str]:
    from shardscope.app.cli.main import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_every_item_decodes_to_what_dcp_load_reads(saved, oracle):
    md = read_metadata(saved[0])
    assert {tuple(i.transform_descriptors) for i in md.storage_data.values()} == {("stream.zstd/1",)}
    ckpt = open_checkpoint(saved[0], use_cache=False)
    assert ckpt.problems == [] and len(ckpt.codec.transforms) == len(md.storage_data)
    assert verify(ckpt, deep=True) == []
    with ChunkReader(ckpt) as reader:
        values = {t.fqn: reader.read_tensor(t) for t in ckpt.tensors}
        values |= {o.fqn: reader.read_object(o) for o in ckpt.objects}
    assert values.keys() == oracle.keys() and all(same(values[k], oracle[k]) for k in oracle), values
    assert isinstance(values["pair"][0], torch.Tensor)  # a tensor inside a torch.save'd (BYTE_IO) entry


def test_compressed_items_are_never_copied_byte_for_byte(saved):
    ckpt = open_checkpoint(saved[0], use_cache=False)
    w = ckpt.tensor("model.w")
    with ChunkReader(ckpt) as reader, open(saved[0] / "copy.bin", "wb") as out:
        chunk = w.chunks[0]
        assert reader.locate(w.fqn, chunk).encoded
        assert reader.direct_copy(w.fqn, chunk, w.dtype) is None and reader.flat_runs(w) is None
        assert [raw for _, raw in reader.whole_values([w], 1 << 20)] == [None]
        with pytest.raises(CheckpointError, match=r"model\.w.*cannot be copied as they are"):
            reader.copy_range(w.fqn, chunk, out.fileno(), 0)
    (saved[0] / "copy.bin").unlink()


def test_commands_take_it_like_any_dcp_folder(saved, oracle, capsys, tmp_path):
    from safetensors.torch import load_file

    src, plain = saved
    assert cli(capsys, "verify", "--deep", src)[0] == 0
    rc, out, _ = cli(capsys, "show", src, "model.w")
    assert rc == 0 and "values" in out and "NaN 0" in out
    assert cli(capsys, "show", src, "step")[1].split()[-1] == "11"
    assert cli(capsys, "export", src, tmp_path / "m.safetensors")[0] == 0
    got = load_file(tmp_path / "m.safetensors")
    assert got and all(same(v, oracle[f"model.{k}"] if f"model.{k}" in oracle else oracle[k]) for k, v in got.items())
    # NOTE: without "pair": a .pt export of an entry holding a tensor fails its own read-back (compressed or not)
    assert cli(capsys, "export", "--exclude", "pair", src, tmp_path / "all.pt")[0] == 0
    state = torch.load(tmp_path / "all.pt", weights_only=True)
    assert same(state["model"]["h"], oracle["model.h"]) and state["step"] == 11 and "pair" not in state
    rc, out, _ = cli(capsys, "diff", src, plain)
    assert rc == 0 and " 0 changed" in out, out
    for command in (["reshard", "--ranks", "2"], ["import"]):  # written uncompressed, read back by dcp.load
        assert cli(capsys, *command, src, tmp_path / command[0])[0] == 0
        written = torch_state(tmp_path / command[0])
        assert isinstance(written, dict) and written.keys() == oracle.keys(), written
        assert all(same(written[k], oracle[k]) for k in oracle), command


def test_deep_verify_checks_the_decoded_bytes(saved, tmp_path):
    """A value byte changed inside the compressed archive (compressed again, so zstd cannot notice): the CRC32
    the archive stores for the decoded record finds it."""
    _, pairs = items(saved[0])
    i = next(n for n, (key, _) in enumerate(pairs) if key.fqn == "model.w")
    archive = bytearray(decompress(pairs[i][1]))
    archive[parse_torch_item(InMemory(bytes(archive)), "item", 0, len(archive)).data_offset + 5] ^= 0x40
    folder = rebuild(saved[0], tmp_path / "bad", {i: compress(bytes(archive))})
    problems = verify(open_checkpoint(folder, use_cache=False), deep=True)
    assert [(p.kind, p.fqn) for p in problems] == [("corrupt", "model.w")], problems
    assert "CRC32" in problems[0].message
    assert isinstance(torch_state(saved[0]), dict)


def test_a_zstd_frames_content_checksum_is_checked(saved, tmp_path):
    """torch's writer stores no content checksum; a frame that has one (another zstd writer) is checked: a byte
    changed in the compressed bytes of a tensor and of a non-tensor entry is corrupt, naming each."""
    import zstandard

    _, pairs = items(saved[0])
    new = {}
    for i, (key, raw) in enumerate(pairs):
        if key.fqn in ("model.w", "step"):
            frame = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(decompress(raw)))
            frame[-1] ^= 1  # the checksum's last byte
            new[i] = bytes(frame)
    problems = verify(open_checkpoint(rebuild(saved[0], tmp_path / "sum", new), use_cache=False), deep=True)
    assert sorted((p.kind, p.fqn) for p in problems) == [("corrupt", "model.w"), ("corrupt", "step")], problems
    assert all("content checksum" in p.message for p in problems)


def test_a_transform_shardscope_does_not_know_is_named_in_one_line(saved, tmp_path):
    folder = rebuild(saved[0], tmp_path / "lz4", {}, ["stream.lz4/1"])
    ckpt = open_checkpoint(folder, use_cache=False)
    assert [p.kind for p in ckpt.problems] == ["unreadable"] and "'stream.lz4/1'" in ckpt.problems[0].message
    proc = run_cli("show", str(folder), "model.w")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "__0_0.distcp" in lines[0] and "model.w" in lines[0] and "stream.lz4/1" in lines[0], lines


def test_a_size_inside_the_file_never_drives_memory(saved, tmp_path):
    """Every item replaced by a zstd frame declaring 2**62 bytes: refused before anything is allocated, each named."""
    _, pairs = items(saved[0])
    folder = rebuild(saved[0], tmp_path / "huge", {i: declaring(1 << 62) for i in range(len(pairs))})
    problems = verify(open_checkpoint(folder, use_cache=False), deep=True)
    assert len(problems) == len(pairs) and all("declares 4611686018427387904 bytes" in p.message for p in problems)
    proc, peak = run_cli_peak("verify", "--deep", folder)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and 0 < peak < 1024, (proc.stderr, peak)


def test_the_metadata_cache_keeps_each_items_transforms(saved):
    first = open_checkpoint(saved[0], use_cache=True)
    again = open_checkpoint(saved[0], use_cache=True)  # a cache hit: the codec from the cache's record
    assert again.codec.transforms == first.codec.transforms and again.codec.transforms
    with ChunkReader(again) as reader:
        assert same(reader.read_tensor(again.tensor("model.b")), torch.arange(7))
