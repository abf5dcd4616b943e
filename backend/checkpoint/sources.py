"""One reading interface over everything diff and import accept, local or on an fsspec URL: a DCP folder
(also HF safetensors folders), a torch ``.pt`` file (``weights_only=True``, memory-mapped) or a
``.safetensors`` file (or a folder with ``model.safetensors.index.json``). Tensors are read one at a time.

On a URL a safetensors file is read by ranges through the planned reader (header, then each tensor's
bytes, checked against the object's size), a ``.pt`` is copied to the temp folder first (see
:meth:`TorchFileSource.from_url`)."""

from __future__ import annotations

import json
import os
import pickletools
import warnings
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError
from .chunks import ChunkReader, allow_safe_globals
from .download import Download
from .flatten import FlattenError, dotted, flatten
from .hf_reader import INDEX, index_weight_map, open_hf_folder
from .items import ItemFormatError, zip_records
from .model import Checkpoint, Problem
from .reader import open_checkpoint
from .safetensors_items import parse_safetensors_file
from .storage import Folder, LocalHandles, is_url, open_folder, open_remote_file
from .verify import overlap_problems

TORCH_EXT = (".pt", ".pth", ".bin", ".ckpt")
NOT_A_CHECKPOINT = "not a checkpoint file (.pt, .pth, .bin, .ckpt, .safetensors) or folder."


@dataclass(frozen=True)
class EntryInfo:
    """What a source says about one entry without reading its values."""

    kind: str  # "tensor" or "object"
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    layout: tuple | None = None  # DCP only: (offsets, sizes, writer rank) of every chunk


class Source:
    """Something diff and import read entries from, one tensor at a time."""
    name: str
    kind: str

    def entries(self) -> dict[str, EntryInfo]:
        """Every entry by name, with its kind, dtype, shape (and chunk layout for DCP), without reading values."""
        raise NotImplementedError

    def tensor(self, fqn: str) -> Any:
        """The values of tensor ``fqn``, read in full."""
        raise NotImplementedError

    def object(self, fqn: str) -> Any:
        """The value of non-tensor entry ``fqn``."""
        raise NotImplementedError

    def nested_path(self, fqn: str) -> tuple | None:
        """The nested key path entry ``fqn`` was flattened from, or None when not known."""
        return None

    def close(self) -> None:
        """Release open files and readers; the source is not used afterwards."""
        pass

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DcpSource(Source):
    """A DCP folder (local or URL, also HF storage-writer folders) through the chunk reader."""
    kind = "dcp"

    def __init__(self, path: str | Folder) -> None:
        self.ckpt = open_checkpoint(path)
        self.name = self.ckpt.path
        self.reader = ChunkReader(self.ckpt)

    def entries(self) -> dict[str, EntryInfo]:
        """Every tensor (with its chunk layout) and object entry of the DCP folder."""
        out = {t.fqn: EntryInfo("tensor", t.dtype, t.shape,
                                tuple((c.offsets, c.sizes, c.rank) for c in t.chunks)) for t in self.ckpt.tensors}
        out.update({o.fqn: EntryInfo("object") for o in self.ckpt.objects})
        return out

    def tensor(self, fqn: str) -> Any:
        """Tensor ``fqn`` assembled from its chunks by the DCP reader."""
        return self.reader.read_tensor(self.ckpt.tensor(fqn))

    def object(self, fqn: str) -> Any:
        """Object entry ``fqn`` unpickled by the DCP reader."""
        return self.reader.read_object(self.ckpt.object(fqn))

    def nested_path(self, fqn: str) -> tuple | None:
        """The nested key path from the checkpoint's planner data, or None."""
        return self.ckpt.planner_data.get(fqn)

    def close(self) -> None:
        """Close the DCP reader's files."""
        self.reader.close()


class TorchFileSource(Source):
    """A torch ``.pt`` file, loaded with ``weights_only=True`` and memory-mapped."""
    kind = "torch"

    def __init__(self, path: str, name: str | None = None) -> None:
        import torch

        self.name = name or path  # a URL's name: the copy it was loaded from is temporary
        allow_safe_globals()  # what an export of a DCP checkpoint may hold (io.BytesIO)
        budget = _check_pickle(path, self.name)
        try:
            with warnings.catch_warnings():  # torch warns on stderr about what a file holds (TypedStorage, CSR)
                warnings.simplefilter("ignore")
                data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise CheckpointError(f"{self.name}: cannot be loaded safely with weights_only=True "
                                  f"({str(exc).splitlines()[0][:200]}).", path=self.name) from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{self.name}: does not hold a dict of tensors.", path=self.name)
        try:
            flat = flatten(data, limit=budget)
        except FlattenError as exc:
            raise CheckpointError(f"{self.name}: its pickled data {exc}.", path=self.name) from None
        self._leaves = {dotted(k): v for k, v in flat.items()}
        self._paths = {dotted(k): k for k in flat}
        if len(self._leaves) != len(flat):  # torch's flatten_state_dict refuses these too
            seen: set[str] = set()  # NOTE: one pass; a scan of the names before each one was quadratic
            twice = next(n for n in map(dotted, flat) if n in seen or seen.add(n))
            raise CheckpointError(f"{self.name}: two entries are both named {twice!r} once flattened "
                                  "(a key with a dot next to a nested one).", path=self.name, fqn=twice)
        odd = next((k for k, v in self._leaves.items() if isinstance(v, torch.Tensor) and not _dense(v)), None)
        if odd is not None:
            v = self._leaves[odd]
            what = ("a quantized tensor" if v.is_quantized else "a tensor on the meta device (no values)"
                    if v.device.type == "meta" else f"a {str(v.layout).removeprefix('torch.')} tensor")
            raise CheckpointError(f"{self.name} (tensor {odd}): {what}; only dense tensors are read.",
                                  path=self.name, fqn=odd)

    @classmethod
    def from_url(cls, url: str, storage_options: dict[str, Any] | None = None) -> TorchFileSource:
        """A ``.pt`` on an fsspec URL: copied whole to the system temp folder (torch's zip reader needs a
        local file to memory-map, and without a map ``weights_only`` loading holds every tensor in
        memory), loaded, and the copy removed at once (the mapped pages stay readable)."""
        with Download(url, storage_options) as copy:
            return cls(copy.path or "", name=url)

    def entries(self) -> dict[str, EntryInfo]:
        """Every leaf of the loaded file: tensors with dtype and shape, anything else as an object."""
        import torch

        out = {}
        for k, v in self._leaves.items():
            if isinstance(v, torch.Tensor):
                out[k] = EntryInfo("tensor", str(v.dtype).removeprefix("torch."), tuple(v.shape))
            else:
                out[k] = EntryInfo("object")
        return out

    def tensor(self, fqn: str) -> Any:
        """The loaded tensor leaf ``fqn``."""
        return self._leaves[fqn]

    def object(self, fqn: str) -> Any:
        """The loaded non-tensor leaf ``fqn``."""
        return self._leaves[fqn]

    def nested_path(self, fqn: str) -> tuple | None:
        """The nested key path leaf ``fqn`` was flattened from, or None."""
        return self._paths.get(fqn)


def _dense(t: Any) -> bool:
    """A tensor whose values exist as a strided CPU buffer (not sparse, quantized or on the meta device)."""
    import torch

    return t.layout == torch.strided and not t.is_quantized and t.device.type != "meta"


def _check_pickle(path: str, name: str) -> int:
    """Refuse a torch file whose ``data.pkl`` builds a ``bytearray`` from a number larger than the file
    (``weights_only`` allows ``bytearray(5_000_000_000)``: a 100-byte pickle that allocates 5 GB). Returns
    the budget of entries :func:`flatten` may visit: a pickle of N bytes holds fewer than N objects, so only
    shared references reach more."""
    size = os.path.getsize(path)
    handles = LocalHandles(os.path.dirname(os.path.abspath(path)), confined=False)
    base = os.path.basename(path)
    try:
        records = zip_records(handles, base, size)
        pkl = next((r for k, r in records.items() if k == "data.pkl"), None)
        data = handles.read(base, pkl[0], pkl[1]) if pkl and pkl[1] <= size else b""
    except (ItemFormatError, CheckpointError):
        data = b""  # not a zip archive torch maps: torch.load says why
    finally:
        handles.close()
    if b"bytearray" in data:
        largest = 0
        try:
            for _, arg, _ in pickletools.genops(data):
                if type(arg) is int:
                    largest = max(largest, arg)
        except Exception:  # a malformed tail: judge what comes before it (torch.load fails there)
            pass
        if largest > size:
            raise CheckpointError(f"{name}: its pickled data asks for a {largest:,}-byte bytearray, more than the "
                                  f"{size:,}-byte file holds; refused.", path=name)
    return (len(data) or size) + 10_000


class SafetensorsSource(Source):
    """A ``.safetensors`` file, or a folder with ``model.safetensors.index.json``: read through the same
    header parser and chunk reader as every checkpoint (bounds and dtype checks included)."""

    kind = "safetensors"

    def __init__(self, where: Folder, names: list[str], name: str) -> None:
        self.name = name
        where.confined = False  # files the user named (or their index names): HF's cache links them to blobs/
        listing = where.listing()
        missing = [n for n in names if n not in listing]
        if missing:
            raise CheckpointError(f"{where.join(missing[0])}: no such file.", path=where.join(missing[0]))
        listing = {n: listing[n] for n in names}
        # NOTE: the headers are parsed here first, through the folder's handles left open: on a URL those are
        # the folder's one shared planner, so open_hf_folder finds the header bytes cached (one GET per file).
        handles = where.handles()
        metas = [parse_safetensors_file(handles, n, listing[n]).metadata for n in names]
        if handles.local:
            handles.close()  # local handles are this call's own descriptors
        self.ckpt = open_hf_folder(where, listing)
        self.ckpt.folder = where
        bad = _header_problem(self.ckpt)
        if bad is not None:  # a header the safetensors library refuses: sizes that do not fit, entries overlapping
            raise CheckpointError(f"{where.join(bad.file or '')} (tensor {bad.fqn}): not a valid safetensors "
                                  f"header: {bad.message}", path=where.join(bad.file or ""), fqn=bad.fqn)
        self.reader = ChunkReader(self.ckpt)
        self._objects: dict[str, Any] = {}
        for meta in metas:
            try:
                objects = json.loads(meta.get("shardscope_objects") or "{}")
            except (ValueError, RecursionError):
                objects = None
            if isinstance(objects, dict):
                self._objects.update(objects)

    @classmethod
    def open(cls, path: str, storage_options: dict[str, Any] | None = None) -> SafetensorsSource:
        """A ``.safetensors`` file or an index folder, local or on a URL."""
        if is_url(path) and path.rstrip("/").endswith(".safetensors"):
            where, name = open_remote_file(path, storage_options)
            return cls(where, [name], path)
        if not is_url(path) and not os.path.isdir(path):
            folder = os.path.dirname(os.path.abspath(path))
            return cls(open_folder(folder), [os.path.basename(path)], path)
        where = open_folder(path, storage_options)
        return cls(where, _index_files(where), path)

    def entries(self) -> dict[str, EntryInfo]:
        """Every tensor of the file(s), plus the non-tensor entries shardscope kept in their header metadata."""
        out = {t.fqn: EntryInfo("tensor", t.dtype, t.shape) for t in self.ckpt.tensors}
        out.update({k: EntryInfo("object") for k in self._objects})
        return out

    def tensor(self, fqn: str) -> Any:
        """Tensor ``fqn`` read through the checked chunk reader."""
        return self.reader.read_tensor(self.ckpt.tensor(fqn))

    def object(self, fqn: str) -> Any:
        """Non-tensor entry ``fqn``, from the JSON shardscope keeps in the files' header metadata."""
        return self._objects[fqn]

    def close(self) -> None:
        """Close the chunk reader's files."""
        self.reader.close()


def _header_problem(ckpt: Checkpoint) -> Problem | None:
    """The first entry of safetensors headers that the safetensors library would refuse: a byte length
    that does not fit its shape and dtype (found by the reader), or bytes overlapping another entry's.
    O(n log n): a header of 300,000 entries must not cost a full :func:`verify`."""
    bad = next((p for p in ckpt.problems if p.kind == "unreadable" and p.fqn), None)
    if bad is not None:
        return bad
    t, names, fqns = ckpt.chunk_table, [f.name for f in ckpt.files], [e.fqn for e in ckpt.tensors]
    ranges = [(names[f], o, o + n, fqns[ti]) for f, o, n, ti in zip(
        t.file.tolist(), t.byte_offset.tolist(), t.length.tolist(), t.tensor.tolist(), strict=True) if n > 0]
    return next(iter(overlap_problems(ranges, same_start=False)), None)


def _index_files(where: Folder) -> list[str]:
    """The shard files an HF ``model.safetensors.index.json`` names (plain names inside the folder)."""
    return sorted(set(index_weight_map(where).values()))


def open_source(path: str | os.PathLike | Folder, storage_options: dict[str, Any] | None = None) -> Source:
    """The Source for a path or URL: a DCP folder, a ``.pt`` or a safetensors file or folder. URLs take
    the same kinds as local paths (``storage_options`` go to fsspec)."""
    if isinstance(path, Folder):  # a URL already opened with storage options
        return DcpSource(path)
    text = str(path)
    if is_url(text):
        return _open_url(text, storage_options)
    if not os.path.exists(text):
        raise CheckpointError(f"{text}: no such file or folder.", path=text)
    if os.path.isfile(text):
        if text.endswith(".safetensors"):
            return SafetensorsSource.open(text)
        if text.endswith(TORCH_EXT):
            return TorchFileSource(text)
        if os.path.basename(text) == ".metadata":
            return DcpSource(text)
        raise CheckpointError(f"{text}: {NOT_A_CHECKPOINT}", path=text)
    if os.path.exists(os.path.join(text, INDEX)) and not os.path.exists(os.path.join(text, ".metadata")):
        return SafetensorsSource.open(text)
    return DcpSource(text)


def _open_url(url: str, storage_options: dict[str, Any] | None) -> Source:
    """A URL: a file by its name (one request for its size), else a folder (one listing)."""
    base = url.rstrip("/").rsplit("/", 1)[-1]
    if base.endswith(".safetensors"):
        return SafetensorsSource.open(url, storage_options)
    if base.endswith(TORCH_EXT):
        return TorchFileSource.from_url(url, storage_options)
    where = open_folder(url, storage_options)  # a .metadata URL gives its folder
    listing = where.listing()
    if not listing:
        raise CheckpointError(f"{url}: no such file or folder, or an empty one.", path=url)
    if INDEX in listing and ".metadata" not in listing:
        return SafetensorsSource(where, _index_files(where), url)
    return DcpSource(where)
