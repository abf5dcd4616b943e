"""Coverage and rank balance (backend/checkpoint/layout.py): gaps, overlaps and half-missing huge shapes found
from the metadata alone, every chunk counted."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from conftest import run_cli
from damaged_metadata import FQN, clean, index_of, save_metadata
from shardscope.backend.checkpoint.layout import coverage, rank_balance
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.formats import open_checkpoint
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch_reference import torch_metadata


def test_rank_balance_counts_every_chunk(fixtures):
    ckpt = open_checkpoint(fixtures["fsdp2_r4"])
    bal = rank_balance(ckpt)
    assert [b.rank for b in bal] == [0, 1, 2, 3]
    assert sum(b.chunks for b in bal) == len(ckpt.chunk_table)
    assert sum(b.bytes for b in bal) == ckpt.total_bytes


def test_gap_and_overlap_are_found(copy_of):
    """Rewrite the metadata with torch's own classes so one tensor has a hole and another an overlap."""
    ckpt = copy_of("fsdp2_r2")
    script = textwrap.dedent(f"""
        import pickle, torch
        from torch.distributed.checkpoint import FileSystemReader
        md = FileSystemReader({str(ckpt)!r}).read_metadata()
        w = md.state_dict_metadata["model.emb.weight"]
        w.chunks = w.chunks[:1]                      # rows 19..37 now belong to no chunk
        b = md.state_dict_metadata["model.head.weight"]
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        c = b.chunks[1]
        b.chunks[1] = ChunkStorageMetadata(torch.Size([c.offsets[0] - 2, 0]), torch.Size([c.sizes[0] + 2, c.sizes[1]]))
        md.storage_meta = None
        pickle.dump(md, open({str(ckpt / '.metadata')!r}, "wb"))
    """)
    subprocess.run([sys.executable, "-c", script], check=True)
    problems = verify(open_checkpoint(ckpt, use_cache=False))
    gap = [p for p in problems if p.kind == "gap"]
    over = [p for p in problems if p.kind == "overlap"]
    assert gap and gap[0].fqn == "model.emb.weight" and "[19:37, 0:12]" in gap[0].message
    assert over and over[0].fqn == "model.head.weight" and "[17:19, 0:12]" in over[0].message


def test_huge_shape_with_half_missing_is_reported(copy_of):
    ckpt = copy_of("nopg")
    md = torch_metadata(ckpt)
    fqn = next(k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
               and len(v.size) == 2)
    tm = md.state_dict_metadata[fqn]
    old = tm.chunks[0]
    info = md.storage_data.pop(index_of(md, fqn, old.offsets))

    tm.size = torch.Size([2**40, 2**40])
    tm.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2**39, 2**40]))]
    md.storage_data[MetadataIndex(fqn, torch.Size([0, 0]))] = info
    save_metadata(ckpt, md)
    ck = open_checkpoint(ckpt, use_cache=False)
    cov = coverage(ck, ck.tensor(fqn))
    assert not cov.exact and cov.gap_elements == 2**79
    gaps = [p for p in verify(ck) if p.kind == "gap"]
    assert gaps and gaps[0].fqn == fqn
    clean(run_cli("show", ckpt, fqn, "--no-cache"))  # not 4 TiB of torch.empty: bad input


def test_partly_overlapping_ranges_are_found_without_reading(copy_of):
    ckpt = copy_of("fsdp2_r2")
    md = torch_metadata(ckpt)
    a = md.storage_data[index_of(md, FQN, md.state_dict_metadata[FQN].chunks[0].offsets)]
    a.length += 100  # runs into the next item
    save_metadata(ckpt, md)
    assert "storage_overlap" in [p.kind for p in verify(open_checkpoint(ckpt, use_cache=False))]


def _checkpoints_of_every_layout(fixtures, tmp_path):
    """DCP at 2 and 4 ranks (FSDP2, DDP), a DCP safetensors folder, an HF folder, and single safetensors and
    torch files (0-d, empty and multi-dim tensors), each written by its own library."""
    from safetensors.torch import save_file

    sd = {"scalar": torch.tensor(3.0), "empty": torch.zeros(0, 4), "w": torch.randn(5, 3, 2),
          "b": torch.arange(7, dtype=torch.int16), "h": torch.ones(2, 2, dtype=torch.bfloat16)}
    save_file(sd, str(tmp_path / "m.safetensors"))
    torch.save({"model": sd, "step": 4}, str(tmp_path / "m.pt"))
    names = ["fsdp2_r2", "fsdp2_r4", "ddp_r2", "fsdp_safetensors_r2", "hf_r2"]
    return [open_checkpoint(fixtures[n]) for n in names] + [
        open_checkpoint(str(tmp_path / "m.safetensors")), open_checkpoint(str(tmp_path / "m.pt"))]


def test_the_all_at_once_checks_agree_with_the_one_by_one_ones(fixtures, tmp_path):
    """whole_single_chunks and chunk_nbytes (numpy over every tensor at once) against coverage() and the
    product of each chunk's sizes, tensor by tensor, on every layout."""
    import math

    import numpy as np
    from shardscope.backend.checkpoint.layout import chunk_nbytes, whole_single_chunks
    from shardscope.backend.checkpoint.model import itemsize

    seen_whole = seen_sharded = 0
    for ckpt in _checkpoints_of_every_layout(fixtures, tmp_path):
        whole = whole_single_chunks(ckpt)
        nbytes = chunk_nbytes(ckpt)
        for i, e in enumerate(ckpt.tensors):
            one = e.chunk_count == 1 and all(o == 0 for o in e.chunks[0].offsets) and \
                tuple(e.chunks[0].sizes) == tuple(e.shape)
            assert bool(whole[i]) == one, (ckpt.path, e.fqn)
            if one:
                assert coverage(ckpt, e).exact
            seen_whole += one
            seen_sharded += e.chunk_count > 1
            for j, c in enumerate(e.chunks):
                assert nbytes[e.first_chunk + j] == math.prod(c.sizes) * itemsize(e.dtype), (ckpt.path, e.fqn)
        assert int(np.sum(nbytes)) == ckpt.total_bytes
    assert seen_whole > 10 and seen_sharded > 10


def test_a_lone_chunk_that_does_not_cover_its_tensor_is_still_a_gap(copy_of):
    """A single chunk at offset 0 that is one row short is not taken for the whole tensor."""
    ckpt = copy_of("ddp_r2")
    script = textwrap.dedent(f"""
        import pickle, torch
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        md = FileSystemReader({str(ckpt)!r}).read_metadata()
        w = md.state_dict_metadata["model.emb.weight"]
        assert len(w.chunks) == 1
        c = w.chunks[0]
        w.chunks[0] = ChunkStorageMetadata(c.offsets, torch.Size([c.sizes[0] - 1, *c.sizes[1:]]))
        pickle.dump(md, open({str(ckpt / ".metadata")!r}, "wb"))
    """)
    subprocess.run([sys.executable, "-c", script], check=True)
    kinds = {(p.kind, p.fqn) for p in verify(open_checkpoint(str(ckpt), use_cache=False))}
    assert ("gap", "model.emb.weight") in kinds
