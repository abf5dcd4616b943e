"""A torch.save file loaded safely: ``torch.load(weights_only=True, mmap=True)`` after the checks torch's own
loader lacks (a ``bytearray`` larger than the file, leaves that cannot be flattened or are not dense), flattened
to dotted names with their nested key paths. The torch-file format (:mod:`..formats.torch_file`) turns the
loaded leaves into the checkpoint model; values are then read from the file's records by the chunk reader."""

from __future__ import annotations

import os
import pickletools
import warnings
from typing import Any

from ..errors import CheckpointError
from .chunks import allow_safe_globals
from .flatten import FlattenError, dotted, flatten
from .items import ItemFormatError, zip_records
from .storage import LocalHandles


class TorchFileLoad:
    """A torch ``.pt`` file, loaded with ``weights_only=True`` and memory-mapped: its leaves by dotted name."""

    def __init__(self, path: str, name: str | None = None) -> None:
        import torch

        self.name = name or path  # a URL's name: the copy it was loaded from is temporary
        allow_safe_globals()  # what an export of a DCP checkpoint may hold (io.BytesIO)
        budget, self.records = _check_pickle(path, self.name)
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

    def tensors(self) -> dict[str, Any]:
        """The tensor leaves by dotted name, in the file's order."""
        import torch

        return {k: v for k, v in self._leaves.items() if isinstance(v, torch.Tensor)}

    def objects(self) -> dict[str, Any]:
        """The non-tensor leaves by dotted name."""
        import torch

        return {k: v for k, v in self._leaves.items() if not isinstance(v, torch.Tensor)}

    def paths(self) -> dict[str, tuple]:
        """Each leaf's nested key path (what a ``.pt`` export nests it back into)."""
        return dict(self._paths)


def _dense(t: Any) -> bool:
    """A tensor whose values exist as a strided CPU buffer (not sparse, quantized or on the meta device)."""
    import torch

    return t.layout == torch.strided and not t.is_quantized and t.device.type != "meta"


def _check_pickle(path: str, name: str) -> tuple[int, dict[str, tuple[int, int, int]] | None]:
    """Refuse a torch file whose ``data.pkl`` builds a ``bytearray`` from a number larger than the file
    (``weights_only`` allows ``bytearray(5_000_000_000)``: a 100-byte pickle that allocates 5 GB). Returns
    the budget of entries :func:`flatten` may visit (a pickle of N bytes holds fewer than N objects, so only
    shared references reach more) and the file's zip records (:func:`zip_records`; None when they cannot be
    read), which the format reuses to locate the tensors (a file of 100,000 tensors has 100,000 records)."""
    size = os.path.getsize(path)
    handles = LocalHandles(os.path.dirname(os.path.abspath(path)), confined=False)
    base = os.path.basename(path)
    records: dict[str, tuple[int, int, int]] | None = None
    try:
        records = zip_records(handles, base, size)
        pkl = records.get("data.pkl")
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
    return (len(data) or size) + 10_000, records
