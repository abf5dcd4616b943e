"""A model folder with an HF index (``model.safetensors.index.json``, as ``save_pretrained`` writes it): the shard
files the index names, each tensor where the index places it; a shard that is missing or a tensor that is in
none is a problem of the checkpoint (not a refusal). ``pytorch_model.bin.index.json`` folders are listed; their
``.bin`` shards open one by one."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from ..errors import CheckpointError
from ..filenames import BIN_INDEX, HF_INDEXES, MAX_INDEX_BYTES, SAFETENSORS_INDEX
from .base import CHECKSUMS_NONE, WEIGHTS, Facts, FileNames, Format, StorageOptions, Target

if TYPE_CHECKING:
    from ..checkpoint.model import Checkpoint
    from ..checkpoint.storage import Folder
    from ..progress import Progress


class HfIndexFormat(Format):
    name = "hf-sharded"
    label = "safetensors shards with an HF index"
    kind = WEIGHTS
    checksums = CHECKSUMS_NONE

    def detect_folder(self, name: str, files: FileNames, dirs: list[str]) -> bool:
        return any(n in files for n in HF_INDEXES)

    def probe_folder(self, path: str, names: set[str], dirs: list[str], local: bool = True) -> Facts:
        if not local:
            return Facts(self.name, "complete", kind=WEIGHTS)
        index = next(n for n in HF_INDEXES if n in names)
        try:
            with open(os.path.join(path, index), "rb") as f:
                data = json.loads(f.read(MAX_INDEX_BYTES))
            wanted = set((data.get("weight_map") or {}).values())
        except (OSError, ValueError, AttributeError, TypeError, RecursionError):
            return Facts(self.name, "unreadable", f"{index} is not readable JSON", kind=WEIGHTS)
        missing = sorted(str(n) for n in wanted if not isinstance(n, str) or n not in names)
        if missing:
            return Facts(self.name, "incomplete", f"{len(missing)} shard file(s) named in {index} are missing "
                         f"(e.g. {missing[0]})", kind=WEIGHTS)
        return Facts(self.name, "complete", kind=WEIGHTS)

    def open(self, path: Target, storage_options: StorageOptions | None = None, use_cache: bool = True,
             progress: Progress | None = None) -> Checkpoint:
        from ..checkpoint.hf_reader import index_weight_map, open_hf_folder
        from ..checkpoint.storage import open_folder

        folder = open_folder(path, storage_options)
        listing = folder.listing()
        if SAFETENSORS_INDEX not in listing and BIN_INDEX in listing:
            raise CheckpointError(f"{folder.join(BIN_INDEX)}: the shards of a .bin index are torch files: open "
                                  "one of them, or its model's safetensors.", path=folder.join(BIN_INDEX))
        refused: CheckpointError | None = None
        try:
            found = index_weight_map(folder)
            weight_map: dict[str, str] | None = found
            named = set(found.values())
        except CheckpointError as exc:
            weight_map, refused = None, exc  # the reader reports the broken index
            named = {n for n in listing if n.endswith(".safetensors")}
        if SAFETENSORS_INDEX not in listing:  # a link leading out of the folder, or a FIFO: refused, and said why
            from ..checkpoint.storage import why_absent

            where = folder.join(SAFETENSORS_INDEX)
            raise CheckpointError(f"{where} {why_absent(folder.path, SAFETENSORS_INDEX)}.", path=where)
        present = {n: listing[n] for n in named if n in listing}
        if not present:  # nothing to open: say why, not that the shards hold no tensors
            raise refused or _no_shard(folder, weight_map or {})
        present[SAFETENSORS_INDEX] = listing[SAFETENSORS_INDEX]  # its problems: shards missing, tensors in none
        ckpt = open_hf_folder(folder, present, weight_map)
        ckpt.format, ckpt.folder = self.name, folder  # the chunk reader reads through it (no second listing)
        return ckpt


def _no_shard(folder: Folder, weight_map: dict[str, str]) -> CheckpointError:
    """The error for an index none of whose shards can be opened: the first one, why, and a tensor it holds."""
    from ..checkpoint.storage import why_absent

    if not weight_map:
        where = folder.join(SAFETENSORS_INDEX)
        return CheckpointError(f"{where}: its weight_map names no shard file.", path=where)
    key, name = min(weight_map.items(), key=lambda kv: (kv[1], kv[0]))
    return CheckpointError(f"{folder.join(name)} {why_absent(folder.path, name)}; {SAFETENSORS_INDEX} places "
                           f"{key!r} in it, and no shard it names is in the folder.", path=folder.join(name), fqn=key)


FORMAT = HfIndexFormat()
