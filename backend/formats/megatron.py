"""Megatron-Core ``dist_checkpointing`` saves with the ``torch_dist`` backend (``--ckpt-format torch_dist``): an
``iter_0000100/`` folder of torch DCP files (the sharded tensors; a tensor-parallel shard is a DCP chunk, so the
shard map shows it), ``common.pt`` (rank 0's torch.save of what is not sharded: ``args``, ``iteration``,
``checkpoint_version``, the optimizer's param groups, ...; written first) and ``metadata.json`` (the backend;
written last). The save dir beside the iter folders holds ``latest_checkpointed_iteration.txt``, the iteration a
resume loads: a listing pins that one, so no prune removes it.

The DCP part is read by :mod:`..checkpoint.reader`; ``common.pt`` by the allow-list archive reader
(:mod:`..checkpoint.whole_archive`: nothing in it runs) into non-tensor entries under ``common.``, and
``metadata.json`` into entries under ``config.`` (Megatron's ``CheckpointingConfig``). A save with another sharded
backend (zarr) is listed, not opened. Detecting and probing read names and a few small files, no numpy or torch."""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..filenames import MEGATRON_COMMON, MEGATRON_CONFIG, MEGATRON_ITER_RE, MEGATRON_LATEST, basename, is_url
from .base import RESUMABLE, Facts, FileNames, Format, StorageOptions, Target
from .dcp import dcp_folder_facts, has_dcp_files

if TYPE_CHECKING:
    from ..checkpoint.items import ByteSource
    from ..checkpoint.model import Checkpoint, Problem
    from ..progress import Progress

TORCH_DIST = "torch_dist"  # the sharded backend whose tensors are a DCP checkpoint
MAX_CONFIG_BYTES = 64 << 10  # Megatron writes ~120 bytes
MAX_LATEST_BYTES = 4096  # an iteration number, or "release"
BACKEND_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")  # a backend name fit for a listing's format column
COMMON_PREFIX = "common."
CONFIG_PREFIX = "config."


class MegatronFormat(Format):
    name = "megatron"
    label = "Megatron-Core dist checkpoint (torch_dist)"
    kind = RESUMABLE  # common.pt holds the args, iteration and RNG a run resumes with
    integrity_manifest = True  # seal writes integrity.json (Megatron-Core's verify_integrity_manifest reads it)

    def detect_folder(self, name: str, files: FileNames, dirs: list[str]) -> bool:
        config, common = MEGATRON_CONFIG in files, MEGATRON_COMMON in files
        return (config and common) or ((config or common) and has_dcp_files(files))

    def probe_folder(self, path: str, names: set[str], dirs: list[str], local: bool = True) -> Facts:
        step = iteration_of(basename(path))
        pinned = _pinned(path, step) if local else ""
        facts = dcp_folder_facts(self.name, path, names, local, RESUMABLE)
        state, reason = facts.state, facts.reason
        if local and MEGATRON_CONFIG in names:
            backend, why = read_backend(os.path.join(path, MEGATRON_CONFIG))
            if why:
                state, reason = "unreadable", why
            elif backend != TORCH_DIST:  # listed by its backend (its tensors are no DCP files); open refuses it
                variant = backend if BACKEND_RE.fullmatch(backend) else "other"
                return Facts(f"{self.name}-{variant}", "complete", "", [], RESUMABLE, step, pinned)
        if state == "complete" and MEGATRON_CONFIG not in names:
            state, reason = "incomplete", "no metadata.json: Megatron writes it last, once every rank's data is saved"
        elif state == "complete" and MEGATRON_COMMON not in names:
            state, reason = "incomplete", "no common.pt (args, iteration, RNG): Megatron cannot resume from it"
        return Facts(self.name, state, reason, facts.ranks, RESUMABLE, step, pinned)

    def opens_folder(self, name: str, files: FileNames, dirs: list[str]) -> bool:
        """A save dir (``latest_checkpointed_iteration.txt`` beside its ``iter_*/`` folders): the iteration it names
        is opened, as a resume loads it."""
        return MEGATRON_LATEST in files and any(MEGATRON_ITER_RE.fullmatch(d) for d in dirs)

    def model_folder(self, path: str) -> tuple[str, str | None]:
        latest = latest_folder(path) if os.path.isdir(path) else None
        if latest is None:
            return path, None
        return latest, (f"Megatron save dir: exporting {os.path.basename(latest)}/ (the iteration {MEGATRON_LATEST} "
                        "names)")

    def open(self, path: Target, storage_options: StorageOptions | None = None, use_cache: bool = True,
             progress: Progress | None = None) -> Checkpoint:
        from ..checkpoint.model import FileInfo, ObjectEntry, Problem
        from ..checkpoint.reader import open_checkpoint
        from ..checkpoint.storage import open_folder, why_absent

        if isinstance(path, str) and not is_url(path):
            path = self.model_folder(path)[0]  # a save dir: the iteration a resume loads
        folder = open_folder(path, storage_options)
        listing = folder.listing()
        handles = folder.handles()
        problems: list[Problem] = []
        objects: dict[str, Any] = {}
        try:
            if MEGATRON_CONFIG in listing:
                config = _read_config(handles, listing[MEGATRON_CONFIG])
                if isinstance(config, str):
                    problems.append(Problem("unreadable", f"{MEGATRON_CONFIG}: {config}", file=MEGATRON_CONFIG))
                else:
                    _refuse_other_backend(folder.path, config)
                    objects.update((f"{CONFIG_PREFIX}{k}", v) for k, v in config.items())
            ckpt = open_checkpoint(folder, progress, use_cache)
            if MEGATRON_COMMON in listing:
                try:
                    objects.update(common_entries(handles, listing[MEGATRON_COMMON]))
                except CheckpointError as exc:  # the tensors still read: a problem of this checkpoint
                    problems.append(Problem("unreadable", f"{MEGATRON_COMMON}: cannot be read safely: {exc}",
                                            file=MEGATRON_COMMON))
        finally:
            if handles.local:
                handles.close()
        for name, what in ((MEGATRON_COMMON, "the state Megatron does not shard (args, iteration, RNG, the "
                            "optimizer's param groups) is not there: Megatron cannot resume from this checkpoint"),
                           (MEGATRON_CONFIG, "Megatron writes it last, once every rank's data is saved: the save "
                            "did not finish")):
            if name not in listing:
                problems.append(Problem("missing_file", f"{name} {why_absent(folder.path, name)}; {what}.",
                                        file=name))
            ckpt.files.append(FileInfo(name, None, listing.get(name), "other"))
        taken = {t.fqn for t in ckpt.tensors} | {o.fqn for o in ckpt.objects}
        ckpt.objects += [ObjectEntry(k, None, 0, 0, None, v, True) for k, v in objects.items() if k not in taken]
        ckpt.format = self.name
        ckpt.problems += problems
        ckpt.reindex()
        return ckpt


def iteration_of(name: str) -> int | None:
    """The iteration an ``iter_0000100`` folder name states, or None."""
    m = MEGATRON_ITER_RE.match(name)
    return int(m.group(1)) if m else None


def latest_iteration(save_dir: str) -> int | None:
    """The iteration ``latest_checkpointed_iteration.txt`` of a local save dir names (None: no file, ``release``,
    or not a number)."""
    try:
        with open(os.path.join(save_dir, MEGATRON_LATEST), "rb") as f:
            text = f.read(MAX_LATEST_BYTES + 1)
    except OSError:
        return None
    text = text.strip()
    if len(text) > 18 or not re.fullmatch(rb"[0-9]+", text):
        return None
    return int(text)


def latest_folder(save_dir: str) -> str | None:
    """The ``iter_0000100/`` folder of a local save dir that its ``latest_checkpointed_iteration.txt`` names (what a
    resume loads), or None (no such file, ``release``, or no such folder)."""
    step = latest_iteration(save_dir)
    if step is None:
        return None
    folder = os.path.join(save_dir, f"iter_{step:07d}")  # Megatron-LM's get_checkpoint_name
    return folder if os.path.isdir(folder) else None


def _pinned(path: str, step: int | None) -> str:
    """Why a prune must keep the iter folder at ``path``: the save dir's pointer names its iteration."""
    if step is None or latest_iteration(os.path.dirname(os.path.abspath(path))) != step:
        return ""
    return f"{MEGATRON_LATEST} names it (Megatron resumes from it)"


def read_backend(path: str) -> tuple[str, str]:
    """(sharded backend, "") of a local ``metadata.json``, or ("", why it cannot be read) for a listing."""
    from .base import FileBytes

    try:
        size = os.path.getsize(path)
        with FileBytes(path) as src:
            config = _read_config(src, size)
    except (OSError, CheckpointError):
        return "", "metadata.json cannot be read"
    if isinstance(config, str):
        return "", f"metadata.json {config}"
    return config["sharded_backend"], ""


def _read_config(src: ByteSource, size: int) -> dict[str, Any] | str:
    """``metadata.json`` (file ``MEGATRON_CONFIG`` of ``src``, ``size`` bytes): a JSON object naming its
    ``sharded_backend``, or why it is not one, in words."""
    if size > MAX_CONFIG_BYTES:
        return f"is {size} bytes: far more than Megatron's config ever is; not read"
    try:
        config = json.loads(src.read(MEGATRON_CONFIG, 0, size))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return "is not JSON"
    if not isinstance(config, dict) or not isinstance(config.get("sharded_backend"), str):
        return "does not name a sharded_backend: not Megatron-Core's checkpoint config"
    return config


def _refuse_other_backend(where: str, config: dict[str, Any]) -> None:
    backend = config["sharded_backend"]
    if backend != TORCH_DIST:
        from ..checkpoint.whole_archive import describe

        raise CheckpointError(f"{where}: a Megatron-Core checkpoint saved with the {describe(backend, 40)} sharded "
                              "backend; only torch_dist (PyTorch DCP) ones can be read.", path=where)


def common_entries(src: ByteSource, size: int) -> dict[str, Any]:
    """The entries of ``common.pt`` (file ``MEGATRON_COMMON`` of ``src``): its nested dicts flattened to dotted
    names under ``common.`` as DCP names entries, each leaf as plain data (``common.args``: the training
    arguments as a dict). Read by the allow-list archive reader; CheckpointError when it cannot be read safely."""
    from ..checkpoint.flatten import FlattenError, dotted, flatten
    from ..checkpoint.unpickler import MEGATRON_CLASSES
    from ..checkpoint.whole_archive import load_torch_archive, plain

    archive = load_torch_archive(src, MEGATRON_COMMON, size, MEGATRON_CLASSES)
    where = src.where(MEGATRON_COMMON)
    if not isinstance(archive.root, dict):
        raise CheckpointError(f"{where}: does not hold a dict (Megatron saves its common state as one).", path=where)
    try:  # a pickle of N bytes holds fewer than N objects: only shared references reach more
        flat = flatten(archive.root, limit=archive.records["data.pkl"].nbytes + 10_000)
    except FlattenError as exc:
        raise CheckpointError(f"{where}: its pickled data {exc}.", path=where) from None
    return {f"{COMMON_PREFIX}{dotted(k)}": plain(v) for k, v in flat.items()}


FORMAT = MegatronFormat()
