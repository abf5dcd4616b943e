"""The ``.metadata`` the DCP writer pickles from columns (backend/export/dcp_metadata.py): read by torch's own
``pickle.load`` it must equal the ``Metadata`` torch's objects make from the same entries, torch's
``FileSystemReader`` must read it, and the read-back check must find any difference."""

from __future__ import annotations

import pickle

import pytest
import torch
from shardscope.backend.checkpoint.model import DTYPE_NAMES
from shardscope.backend.export import dcp_metadata
from shardscope.backend.export.dcp_metadata import MetadataColumns, check_metadata, write_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

FILES = ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
DTYPES = [d for d in DTYPE_NAMES if isinstance(getattr(torch, d, None), torch.dtype)]


def _columns() -> tuple[MetadataColumns, dict[str, tuple]]:
    """Entries of every kind the writer meets: objects, every dtype torch has, 0-d, empty, sharded over ranks,
    names past 255 bytes of UTF-8 and with quotes, offsets past 2**31 and 2**63 / 4, nested key paths."""
    cols = MetadataColumns(FILES)
    planner: dict[str, tuple] = {}
    cols.add_object("step", 0, 0, 811)
    cols.add_object("extra.rng", 1, 0, 300)
    planner.update({"step": ("step",), "extra.rng": ("extra", "rng")})
    for i, dtype in enumerate(DTYPES):
        name = f"layers.{i}.w"
        cols.add_tensor(name, dtype, (7, 3))
        cols.add_chunk((0, 0), (3, 3), 0, 1000 + i, 900)
        cols.add_chunk((3, 0), (3, 3), 1, 5_000_000_000 + i, 900)  # past 2**32: LONG1
        cols.add_chunk((6, 0), (1, 3), 2, 2**62 + i, 700)
        planner[name] = ("layers", i, "w")
    cols.add_tensor("scalar", "float32", ())
    cols.add_chunk((), (), 0, 70_000, 640)
    cols.add_tensor("empty", "int64", (0, 5))
    cols.add_chunk((0, 0), (0, 5), 0, 80_000, 650)
    long = "ü\"'\\ naïve " * 40  # 480 characters, over 255 bytes: BINUNICODE
    cols.add_tensor(long, "bfloat16", (2,))
    cols.add_chunk((0,), (2,), 0, 90_000, 660)
    for name in ("scalar", "empty", long):
        planner[name] = (name,)
    return cols, planner


def _tensors(cols: MetadataColumns):
    """(fqn, dtype code, shape, [(offsets, sizes, file, offset, length) per chunk]) per tensor of ``cols``."""
    shape, dims = cols.shape.tolist(), cols.chunk_dims.tolist()
    files, offs, lens = cols.item_file.tolist(), cols.item_offset.tolist(), cols.item_length.tolist()
    s = d = c = 0
    for fqn, code, nd, n in zip(cols.fqns, cols.dtype.tolist(), cols.ndim.tolist(), cols.nchunks.tolist(), strict=True):
        chunks = []
        for j in range(c, c + n):
            chunks.append((tuple(dims[d:d + nd]), tuple(dims[d + nd:d + 2 * nd]), files[j], offs[j], lens[j]))
            d += 2 * nd
        c += n
        yield fqn, code, tuple(shape[s:s + nd]), chunks
        s += nd


def _torch_metadata(cols: MetadataColumns) -> tuple[dict, dict]:
    """The state_dict_metadata and storage_data torch's own objects make of the same entries."""
    sdm: dict = {o[0]: BytesStorageMetadata() for o in cols.objects}
    storage: dict = {MetadataIndex(o[0]): _StorageInfo(FILES[o[1]], o[2], o[3]) for o in cols.objects}
    for fqn, code, shape, chunks in _tensors(cols):
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=getattr(torch, DTYPE_NAMES[code])),
                                         torch.Size(shape), [ChunkStorageMetadata(torch.Size(o), torch.Size(s))
                                                             for o, s, *_ in chunks])
        for o, _s, f, off, length in chunks:
            storage[MetadataIndex(fqn, torch.Size(o))] = _StorageInfo(FILES[f], off, length)
    return sdm, storage


@pytest.mark.parametrize("shared_sizes", [1 << 16, 2], ids=["shapes shared", "shapes inline past 2"])
def test_torch_unpickles_the_same_metadata_its_own_objects_make(tmp_path, monkeypatch, shared_sizes):
    monkeypatch.setattr(dcp_metadata, "SHARED_SIZES", shared_sizes)
    cols, planner = _columns()
    write_metadata(str(tmp_path), cols, planner, "ckpt", "save-1", "1.0.0")
    md = pickle.loads((tmp_path / ".metadata").read_bytes())  # torch's classes, as dcp.load reads it
    sdm, storage = _torch_metadata(cols)
    assert list(md.state_dict_metadata) == list(sdm)
    assert md.state_dict_metadata == sdm
    assert list(md.storage_data.items()) == list(storage.items())
    assert md.planner_data == planner
    assert (md.storage_meta.checkpoint_id, md.storage_meta.save_id, md.version) == ("ckpt", "save-1", "1.0.0")
    assert FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata == sdm
    assert check_metadata(str(tmp_path), cols, planner, "1.0.0") is None


def test_flat_key_paths_are_written_without_a_dict(tmp_path):
    cols, _ = _columns()
    write_metadata(str(tmp_path), cols, None, "ckpt", "s", "1.0.0")
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    assert md.planner_data == {k: (k,) for k in md.state_dict_metadata}
    assert check_metadata(str(tmp_path), cols, None, "1.0.0") is None


def test_the_read_back_check_names_what_differs(tmp_path):
    cols, planner = _columns()
    write_metadata(str(tmp_path), cols, planner, "ckpt", "s", "1.0.0")
    other, _ = _columns()
    other.item_offset[3] += 1
    assert "where the items are" in check_metadata(str(tmp_path), other, planner, "1.0.0")
    other, _ = _columns()
    other.chunk_dims[-1] = 3
    assert "chunks' offsets or sizes" in check_metadata(str(tmp_path), other, planner, "1.0.0")
    other, _ = _columns()
    other.dtype[0] = (other.dtype[0] + 1) % len(DTYPES)
    assert "does not read back as written" in check_metadata(str(tmp_path), other, planner, "1.0.0")
    assert "key paths" in check_metadata(str(tmp_path), cols, {**planner, "step": ("other",)}, "1.0.0")
    data = bytearray((tmp_path / ".metadata").read_bytes())
    (tmp_path / ".metadata").write_bytes(bytes(data[:len(data) // 2]))
    assert "does not read back" in check_metadata(str(tmp_path), cols, planner, "1.0.0")


def test_an_unknown_dtype_is_refused_with_its_name():
    from shardscope.backend.export.plan import ExportError

    with pytest.raises(ExportError, match="w: dtype 'float128'"):
        MetadataColumns(FILES).add_tensor("w", "float128", (1,))


def test_the_read_back_check_runs_in_the_metadata_helper_process_too(tmp_path, monkeypatch):
    """Where a load must not run in this process (another thread runs: the window's import), the compact
    streaming load runs in the helper process and gives the same answers."""
    from shardscope.backend.checkpoint import reader_process

    monkeypatch.setattr(reader_process, "ISOLATE", True)
    cols, planner = _columns()
    write_metadata(str(tmp_path), cols, planner, "ckpt", "s", "1.0.0")
    assert check_metadata(str(tmp_path), cols, planner, "1.0.0") is None
    other, _ = _columns()
    other.item_length[0] += 1
    assert "where the items are" in check_metadata(str(tmp_path), other, planner, "1.0.0")
