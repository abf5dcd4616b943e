"""``storage_data`` pairs each MetadataIndex with its _StorageInfo as the dict is built (SETITEMS), not by the order
the pickle first builds the objects: a ``.metadata`` re-pickled with one extra attribute placed first, whose objects
are built there and only referenced from ``storage_data``, reads what torch's own loader reads (issue 29, item 7).
A Metadata without ``storage_data`` is refused, as torch's FileSystemReader refuses it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_cli
from damaged_metadata import clean, save_metadata
from fuzz.harness import torch_state
from shardscope.backend.checkpoint import reader
from shardscope.backend.checkpoint.chunks import ChunkReader
from shardscope.backend.checkpoint.verify import verify
from shardscope.backend.formats import open_checkpoint
from torch.distributed.checkpoint import FileSystemReader


def _saved(folder):
    dcp.save({"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0)}, checkpoint_id=str(folder), no_dist=True)
    return FileSystemReader(str(folder)).read_metadata()


def _extra_first(md, extra) -> None:
    """``extra`` as an unused attribute placed before the Metadata's own (torch keeps it and ignores it)."""
    state = dict(md.__dict__)
    md.__dict__.clear()
    md.__dict__.update({"aa_extra": extra, **state})


def _index(md, fqn):
    return next(k for k in md.storage_data if k.fqn == fqn)


def _values(folder) -> dict:
    ckpt = open_checkpoint(folder, use_cache=False)
    assert verify(ckpt, deep=True) == [], "verify --deep finds problems"
    with ChunkReader(ckpt) as chunks:
        return {t.fqn: chunks.read_tensor(t).tolist() for t in ckpt.tensors}


@pytest.fixture(params=[True, False], ids=["streaming", "graph"])
def both_readers(request, monkeypatch):
    monkeypatch.setattr(reader, "STREAMING", request.param)


@pytest.mark.parametrize("protocol", [2, 4])
@pytest.mark.parametrize("extra", ["a_to_b", "indices_reversed", "infos_reversed"])
def test_storage_data_pairs_as_the_dict_is_built(tmp_path, both_readers, protocol, extra):
    md = _saved(tmp_path)
    ia, ib = _index(md, "a"), _index(md, "b")
    sa, sb = md.storage_data[ia], md.storage_data[ib]
    _extra_first(md, {"a_to_b": {ia: sb}, "indices_reversed": [ib, ia], "infos_reversed": [sb, sa]}[extra])
    save_metadata(tmp_path, md, protocol)
    torch_reads = torch_state(tmp_path)
    assert torch_reads["a"].tolist() == [1.0] * 4 and torch_reads["b"].tolist() == [2.0] * 4
    assert _values(tmp_path) == {"a": [1.0] * 4, "b": [2.0] * 4}


@pytest.mark.parametrize("how", ["absent", "none"])
def test_metadata_without_storage_data_is_refused(tmp_path, both_readers, how):
    md = _saved(tmp_path)
    if how == "absent":
        del md.__dict__["storage_data"]
    else:
        md.storage_data = None
    save_metadata(tmp_path, md)
    assert isinstance(torch_state(tmp_path), str)  # torch: "storage_data must not be None in metadata"
    with pytest.raises(Exception, match="storage_data") as err:
        open_checkpoint(tmp_path, use_cache=False)
    assert type(err.value).__name__ == "CheckpointError"


def test_cli_refuses_metadata_without_storage_data(tmp_path):
    md = _saved(tmp_path)
    md.storage_data = None
    save_metadata(tmp_path, md)
    proc = run_cli("inspect", str(tmp_path))
    clean(proc, (2,))
    assert "storage_data" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
