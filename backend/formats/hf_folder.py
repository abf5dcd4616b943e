"""Folders of safetensors files: torch's ``HuggingFaceStorageWriter`` (``shard-0000K-model-…safetensors`` with a
JSON ``.metadata``; ``DCP_SHARDING_INFO`` places each piece in the full tensor) and plain folders of safetensors
files. Only JSON headers are read (:mod:`..checkpoint.hf_reader`); safetensors stores no checksums."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..filenames import HF_SHARD_RE, METADATA, hf_shard_rank, is_safetensors_file
from .base import CHECKSUMS_NONE, WEIGHTS, Facts, FileNames, Format, StorageOptions, Target

if TYPE_CHECKING:
    from ..checkpoint.model import Checkpoint
    from ..progress import Progress


class HfSafetensorsFolderFormat(Format):
    name = "hf-safetensors"
    label = "safetensors files (HF layout)"
    kind = WEIGHTS
    checksums = CHECKSUMS_NONE

    def detect_folder(self, name: str, files: FileNames, dirs: list[str]) -> bool:
        return any(HF_SHARD_RE.match(n) for n in files)

    def opens_folder(self, name: str, files: FileNames, dirs: list[str]) -> bool:
        """A folder opened by name (not found by a listing): any folder of safetensors files without a pickled
        ``.metadata`` (the storage writer's is JSON; the reader checks)."""
        return self.detect_folder("", files, []) or (METADATA not in files and any(map(is_safetensors_file, files)))

    def probe_folder(self, path: str, names: set[str], dirs: list[str], local: bool = True) -> Facts:
        ranks = sorted({r for n in names if (r := hf_shard_rank(n)) is not None})
        return Facts(self.name, "complete", "", ranks, WEIGHTS)

    def open(self, path: Target, storage_options: StorageOptions | None = None, use_cache: bool = True,
             progress: Progress | None = None) -> Checkpoint:
        from ..checkpoint.hf_reader import open_hf_folder
        from ..checkpoint.storage import open_folder

        folder = open_folder(path, storage_options)
        ckpt = open_hf_folder(folder, folder.listing())
        ckpt.format, ckpt.folder = self.name, folder  # the chunk reader reads through it (no second listing)
        return ckpt


FORMAT = HfSafetensorsFolderFormat()
