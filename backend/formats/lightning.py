"""Lightning/Fabric sharded checkpoints: a DCP folder plus ``meta.pt`` (the trainer state: epoch, loops,
callbacks). The DCP part is read as any DCP folder; ``meta.pt`` is kept as a file of the checkpoint."""

from __future__ import annotations

from typing import Any

from ..filenames import LIGHTNING_META
from .base import RESUMABLE, Facts, Format
from .dcp import dcp_folder_facts, has_dcp_files


class LightningFolder(Format):
    name = "lightning"
    label = "Lightning/Fabric (DCP + meta.pt)"
    probe_reads_own_files = True

    def detect_folder(self, name: str, files: dict[str, Any] | set[str], dirs: list[str]) -> bool:
        return LIGHTNING_META in files and has_dcp_files(files)

    def probe_folder(self, path: str, names: set[str], dirs: list[str], local: bool = True) -> Facts:
        facts = dcp_folder_facts(self.name, path, names, local, RESUMABLE)  # meta.pt: trainer state
        return Facts(facts.format, facts.state, facts.reason, facts.ranks, RESUMABLE)

    def open(self, path: Any, storage_options: dict[str, Any] | None = None, use_cache: bool = True,
             progress: Any = None) -> Any:
        from ..checkpoint.reader import open_checkpoint
        from ..checkpoint.storage import open_folder

        ckpt = open_checkpoint(open_folder(path, storage_options), progress, use_cache)
        ckpt.format = self.name
        return ckpt


FORMAT = LightningFolder()
