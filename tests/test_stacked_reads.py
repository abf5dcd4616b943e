"""One index of a stacked tensor (an expert of torchtitan's ``[E, ...]`` experts, a layer of Megatron's stacked
layers) made by the export's tensor source from only the chunks that hold it, each chunk read once for all the
outputs it feeds: real DCP checkpoints (one chunk per tensor from ``dcp.save`` in one process; four row chunks from
FSDP2 on four ranks), the values against the whole tensor read the ordinary way."""

from __future__ import annotations

from collections import Counter

from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.export.hf_transforms import Step, Transform
from shardscope.backend.export.plan import ExportItem
from shardscope.backend.export.source import TensorSource
from shardscope.backend.formats import open_checkpoint


class CountingReader(ChunkReader):
    """The real chunk reader, counting how often each chunk is read."""

    def __init__(self, ckpt) -> None:
        super().__init__(ckpt)
        self.reads: Counter = Counter()

    def read_chunk(self, fqn, chunk, dtype):
        self.reads[(fqn, chunk.offsets)] += 1
        return super().read_chunk(fqn, chunk, dtype)


def _rows(reader: ChunkReader, entry) -> list[ExportItem]:
    n = entry.shape[0]
    return [ExportItem(f"{entry.fqn}.{i}", entry, entry.dtype, Transform((Step("index", (i, n)),))) for i in range(n)]


def test_one_chunk_of_stacked_experts_is_read_once_for_every_expert(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    experts = torch.randn(6, 8, 4)
    dcp.save({"layers.0.moe.experts.w1": experts}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    ckpt = open_checkpoint(tmp_path / "ckpt", use_cache=False)
    entry = ckpt.tensor("layers.0.moe.experts.w1")
    with CountingReader(ckpt) as reader:
        items = _rows(reader, entry)
        source = TensorSource(reader, items)
        for i, item in enumerate(items):
            assert torch.equal(source.tensor(item), experts[i])
        assert list(reader.reads.values()) == [1]  # one chunk, read once for six outputs
        assert not source.stacked._values  # dropped after its last output


def test_row_chunks_are_read_only_for_the_rows_they_hold(fixtures):
    import torch

    ckpt = open_checkpoint(fixtures["fsdp2_r4"], use_cache=False)
    entries = [e for e in ckpt.tensors if len(e.shape) >= 2 and len({c.offsets[0] for c in e.chunks}) > 1]
    assert entries
    with CountingReader(ckpt) as reader:
        for entry in entries:
            whole = reader.read_tensor(entry)
            reader.reads.clear()
            items = _rows(reader, entry)
            source = TensorSource(reader, items)
            for i, item in enumerate(items):
                assert torch.equal(source.tensor(item), whole[i]), (entry.fqn, i)
            assert set(reader.reads.values()) == {1} and len(reader.reads) == len(entry.chunks), entry.fqn
            assert not source.stacked._values
