"""Validation of unpickled metadata (backend/checkpoint/validate.py): every bad field is bad input (exit 2,
one line), never a crash, and a huge count of repeated chunks stays fast."""

from __future__ import annotations

import math
import pickle
import time

import pytest
from conftest import run_cli
from damaged_metadata import FQN, clean, index_of, save_metadata
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.errors import CheckpointError
from shardscope.backend.formats import open_checkpoint
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch_reference import torch_metadata


def test_nested_version_string_is_bad_input_not_a_cache_crash(copy_of):
    ckpt = copy_of("nopg")
    md = torch_metadata(ckpt)
    md.version = "VERSIONMARK"
    data = pickle.dumps(md, protocol=2)
    nested = b")" + b"\x85" * 200_000  # a tuple nested 200,000 deep where the version string belongs
    (ckpt / ".metadata").write_bytes(data.replace(b"X\x0b\x00\x00\x00VERSIONMARK", nested))
    proc = run_cli("inspect", ckpt)  # with the metadata cache on
    clean(proc)
    assert "version" in proc.stderr


def _bad_records():
    def chunk_is_int(md):
        md.state_dict_metadata[FQN].chunks[0] = 7

    def none_in_sizes(md):
        md.state_dict_metadata[FQN].chunks[0].sizes = [None, 12]

    def string_offsets(md):
        md.state_dict_metadata[FQN].chunks[0].offsets = "ab"

    def huge_offset(md):
        info = md.storage_data[index_of(md, FQN, (0, 0))]
        info.offset = 2**63

    def ragged(md):
        md.state_dict_metadata[FQN].chunks[0].offsets = (0,)

    def path_none(md):
        md.storage_data[index_of(md, FQN, (0, 0))].relative_path = None

    def path_absolute(md):
        md.storage_data[index_of(md, FQN, (0, 0))].relative_path = "/dev/zero"

    def path_escapes(md):
        md.storage_data[index_of(md, FQN, (0, 0))].relative_path = "../../../../../../dev/zero"

    def dtype_junk(md):
        md.state_dict_metadata[FQN].properties.dtype = [1, 2]

    def shape_huge(md):
        md.state_dict_metadata[FQN].size = (2**63, 1)

    def fqn_not_str(md):
        md.state_dict_metadata[(1, 2)] = md.state_dict_metadata.pop(FQN)

    return [chunk_is_int, none_in_sizes, string_offsets, huge_offset, ragged, path_none, path_absolute,
            path_escapes, dtype_junk, shape_huge, fqn_not_str]


@pytest.mark.parametrize("damage", _bad_records(), ids=lambda f: f.__name__)
def test_bad_record_fields_are_bad_input(copy_of, damage):
    ckpt = copy_of("fsdp2_r2")
    md = torch_metadata(ckpt)
    damage(md)
    save_metadata(ckpt, md)
    with pytest.raises(CheckpointError):
        open_checkpoint(ckpt, use_cache=False)
    proc = run_cli("show", ckpt, FQN, "--no-cache", timeout=120)
    clean(proc)


def test_unhashable_storage_key_is_bad_input(copy_of):
    ckpt = copy_of("nopg")
    md = torch_metadata(ckpt)
    # a list where the MetadataIndex's offset belongs makes the storage_data key unhashable
    first = next(k for k in md.storage_data if k.offset is not None)
    info = md.storage_data.pop(first)
    key = MetadataIndex(first.fqn)
    object.__setattr__(key, "offset", "OFFSETMARK__")
    md.storage_data[key] = info
    data = pickle.dumps(md, protocol=2).replace(b"X\x0c\x00\x00\x00OFFSETMARK__", b"]")
    (ckpt / ".metadata").write_bytes(data)
    clean(run_cli("inspect", ckpt, "--no-cache"), (0, 2))
    proc = run_cli("verify", ckpt, "--no-cache")
    clean(proc, (1, 2))
    assert first.fqn in proc.stdout + proc.stderr


def test_fifty_thousand_repeated_chunks_are_fast(copy_of):
    ckpt = copy_of("fsdp2_r2")
    md = torch_metadata(ckpt)
    tm = md.state_dict_metadata[FQN]
    tm.chunks = tm.chunks + [tm.chunks[0]] * 50_000  # pickle memo references: a few bytes each
    assert len(save_metadata(ckpt, md)) < 2_000_000
    t0 = time.monotonic()
    problems = verify(open_checkpoint(ckpt, use_cache=False))
    assert time.monotonic() - t0 < 60  # was 119 s with a per-chunk slice update
    over = [p for p in problems if p.kind == "overlap" and p.fqn == FQN]
    extra = 50_000 * math.prod(tm.chunks[0].sizes)
    assert over and f"overlap on {extra} elements" in over[0].message
