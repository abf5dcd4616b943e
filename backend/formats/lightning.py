"""Lightning/Fabric sharded checkpoints: a DCP folder plus ``meta.pt`` (the trainer state: epoch, loops,
callbacks). The DCP part is read as any DCP folder; ``meta.pt`` is a file of the checkpoint, and this module is
the only one that knows it is there (:func:`has_trainer_state`) or reads it (:func:`trainer_state`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..filenames import LIGHTNING_META
from .base import RESUMABLE, Facts, FileNames, Format, StorageOptions, Target
from .dcp import dcp_folder_facts, has_dcp_files

if TYPE_CHECKING:
    from ..checkpoint.chunks import ChunkReader
    from ..checkpoint.model import Checkpoint, Problem
    from ..progress import Progress


class LightningFormat(Format):
    name = "lightning"
    label = "Lightning/Fabric (DCP + meta.pt)"
    probe_reads_own_files = True

    def detect_folder(self, name: str, files: FileNames, dirs: list[str]) -> bool:
        return LIGHTNING_META in files and has_dcp_files(files)

    def probe_folder(self, path: str, names: set[str], dirs: list[str], local: bool = True) -> Facts:
        facts = dcp_folder_facts(self.name, path, names, local, RESUMABLE)  # meta.pt: trainer state
        return Facts(facts.format, facts.state, facts.reason, facts.ranks, RESUMABLE)

    def open(self, path: Target, storage_options: StorageOptions | None = None, use_cache: bool = True,
             progress: Progress | None = None) -> Checkpoint:
        from ..checkpoint.model import FileInfo
        from ..checkpoint.reader import open_checkpoint
        from ..checkpoint.storage import open_folder

        folder = open_folder(path, storage_options)
        ckpt = open_checkpoint(folder, progress, use_cache)
        ckpt.format = self.name
        listing = folder.listing()
        if LIGHTNING_META in listing and LIGHTNING_META not in ckpt.extra_files:  # (a cache may hold it already)
            ckpt.extra_files[LIGHTNING_META] = LIGHTNING_META
            ckpt.files.append(FileInfo(LIGHTNING_META, None, listing[LIGHTNING_META], LIGHTNING_META))
            ckpt.reindex()
        return ckpt

    def deep_checks(self, ckpt: Checkpoint, progress: Progress | None = None) -> list[Problem]:
        """``meta.pt`` loads (``weights_only=True``) and holds a dict."""
        from ..checkpoint.model import Problem
        from ..errors import CheckpointError

        try:
            trainer_state(ckpt)
        except CheckpointError as exc:
            return [Problem("unreadable", str(exc), file=LIGHTNING_META)]
        return []


def has_trainer_state(ckpt: Checkpoint) -> bool:
    """True when an opened checkpoint is a Lightning/Fabric folder with its ``meta.pt``."""
    return bool(ckpt.extra_files.get(LIGHTNING_META))


def trainer_state(ckpt: Checkpoint, reader: ChunkReader | None = None) -> dict[str, Any]:
    """The ``meta.pt`` of a Lightning/Fabric folder (epoch, global_step, hparams, ...), loaded with
    ``weights_only=True``; {} when it has none. ``reader``: a ChunkReader of ``ckpt`` already open. Bad input
    (not loadable, not a dict) is a CheckpointError naming the file."""
    from ..checkpoint.chunks import ChunkReader, load_weights_only
    from ..errors import CheckpointError

    name = ckpt.extra_files.get(LIGHTNING_META)
    if not name:
        return {}
    if reader is None:
        with ChunkReader(ckpt) as own:
            return trainer_state(ckpt, own)
    path = reader.handles.where(name)
    meta = load_weights_only(reader.read_file(name), path, path=path)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: does not hold a dict.", path=path)
    return meta


FORMAT = LightningFormat()

__all__ = ["FORMAT", "LightningFormat", "has_trainer_state", "trainer_state"]
