"""Tensor statistics (backend/checkpoint/values.py) against torch's."""

from __future__ import annotations

import pytest
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.checkpoint.values import tensor_stats
from shardscope.backend.formats import open_checkpoint
from torch_reference import flatten, torch_consolidated


def test_stats_match_torch(fixtures):
    ckpt = open_checkpoint(fixtures["fsdp2_r4"])
    ref = flatten(torch_consolidated(fixtures["fsdp2_r4"]))["model.head.weight"]
    with ChunkReader(ckpt) as reader:
        t = reader.read_tensor(ckpt.tensor("model.head.weight"))
    st = tensor_stats(t)
    assert st.min == pytest.approx(ref.min().item())
    assert st.max == pytest.approx(ref.max().item())
    assert st.mean == pytest.approx(ref.double().mean().item())
    assert st.std == pytest.approx(ref.double().std().item())
    assert sum(st.hist_counts) == ref.numel() and st.nan == 0
