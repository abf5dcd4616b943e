"""Every file-name rule in one place: what torch's, Hugging Face's, Lightning's and Megatron's writers name their
files, what a URL is, how a checkpoint's name states its step, and the names Shardscope's own temporaries take.

Names only: this module imports nothing beyond the standard library (``ls`` decides from names before it reads a
byte, and must not pay for numpy or torch). Readers, listings and writers all ask here; no other module spells a
checkpoint file name or pattern.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

# ------------------------------------------------------------------ torch DCP (FileSystemWriter)
METADATA = ".metadata"  # the coordinator's pickled Metadata, written last
METADATA_TMP = ".metadata.tmp"  # left by a save that did not finish
DATA_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")  # __<rank>_<n>.distcp
DATA_SUFFIX = ".distcp"
RANK_METADATA_RE = re.compile(r"^__(\d+)\.metadata$")  # use_collectives=False: one per rank
LIGHTNING_META = "meta.pt"  # Lightning/Fabric's sharded save: the trainer state beside the DCP files

# ------------------------------------------------------------------ safetensors and Hugging Face
SAFETENSORS_SUFFIX = ".safetensors"
HF_SHARD_RE = re.compile(r"^shard-(\d+)-.*\.safetensors$")  # torch's HuggingFaceStorageWriter: shard-0000K-model-…
SAFETENSORS_INDEX = "model.safetensors.index.json"  # save_pretrained's map of tensor -> shard file
BIN_INDEX = "pytorch_model.bin.index.json"  # the same for torch .bin shards
HF_WEIGHTS = "model.safetensors"  # save_pretrained's weights, unsharded
HF_CONFIG = "config.json"  # an HF model's (and a Trainer checkpoint's) config
HF_INDEXES = (SAFETENSORS_INDEX, BIN_INDEX)
HF_TRAINER_RE = re.compile(r"^(tmp-)?checkpoint-\d+$")  # transformers Trainer's checkpoint-500 (tmp- while saving)
HF_TRAINER_STATE = "trainer_state.json"
# the model's DCP folder in an HF Trainer / accelerate FSDP checkpoint (next to optimizer_N/)
ACCELERATE_MODEL_DIR = re.compile(r"pytorch_model_fsdp_(\d+)$")
MAX_INDEX_BYTES = 64 << 20  # an index names files and keys; far larger is not one

# ------------------------------------------------------------------ torch.save files
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")  # .ckpt: Lightning's consolidated checkpoint
HF_MODEL_FILES = ("model.safetensors", "pytorch_model.bin")  # save_pretrained's unsharded weights
FILE_SUFFIXES = (*TORCH_SUFFIXES, SAFETENSORS_SUFFIX)  # every single-file checkpoint

# ------------------------------------------------------------------ other frameworks
# DeepSpeed (engine.save_checkpoint): a save folder with ``latest`` naming a tag folder (``global_step2/``) of rank
# files; the functions at the end of this module read these names
# ZeRO-0/1/2: one model file per model-parallel rank; ZeRO-3: one per data-parallel rank too
DS_MODEL_FILE_RE = re.compile(r"(?:zero_pp_rank_([0-9]+)_)?mp_rank_([0-9]+)_model_states\.pt\Z")
# the optimizer partitions, one per data-parallel rank (bf16_ while bf16 is enabled, fp16_ from old releases)
DS_OPTIM_FILE_RE = re.compile(r"(bf16_|fp16_)?zero_pp_rank_([0-9]+)_mp_rank_([0-9]+)_optim_states\.pt\Z")
DS_LATEST = "latest"  # the save folder's file that names the newest tag
DS_RECOVERY_SCRIPT = "zero_to_fp32.py"  # rank 0 copies it into the save folder
DS_STEP_TAG_RE = re.compile(r"global_step[0-9]+\Z")  # the tag DeepSpeed gives a save by default
DS_MAX_TAG = 255

# ------------------------------------------------------------------ Megatron-Core (dist_checkpointing)
MEGATRON_CONFIG = "metadata.json"  # CheckpointingConfig: sharded_backend (torch_dist, zarr), versions; written last
MEGATRON_COMMON = "common.pt"  # rank 0's torch.save of the non-sharded state (args, iteration, ...); written first
MEGATRON_LATEST = "latest_checkpointed_iteration.txt"  # in the save dir: the iteration a resume loads
MEGATRON_ITER_RE = re.compile(r"^iter_(\d{1,18})$")  # the save dir's iter_0000100/
MP_RANK_RE = re.compile(r"^mp_rank_(\d+)")  # Megatron-LM's legacy per-model-parallel-rank folders (torch format)

# ------------------------------------------------------------------ URLs
URL_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")

# ------------------------------------------------------------------ folders that hold checkpoints
CHECKPOINT_HOLDERS = {"checkpoints", "checkpoint", "ckpt", "ckpts"}  # a run's checkpoints live in one of these


def within(path: str, root: str) -> bool:
    """True when ``path`` is ``root`` itself or lies inside it (whole path parts, not a string prefix)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


# ------------------------------------------------------------------ Shardscope's own temporaries
TMP_PREFIX = ".shardscope-tmp-"  # every temporary's name: <prefix><pid>-... (downloads, uploads, export outputs)
LEFTOVER_RE = re.compile(r"^\.shardscope-tmp-(\d+)-([0-9a-f]{6})-(.+)$")  # an export's temporary: pid, tag, name
DOWNLOAD_RE = re.compile(r"^\.shardscope-tmp-(\d+)-dl-")  # a download's temporary copy
SMALL_TMP_SUFFIX = ".tmp"  # a small file written atomically: ``.<name>.<random>.tmp``
SMALL_TMP_RE = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")  # (mkstemp's 8 random characters; not ``.metadata.tmp``)
WATCH_STATE = ".shardscope-watch.json"  # watch's record of a run's exports, in the folder that holds them
# an export's lineage sidecar (what it was made from; see backend/lineage.py): beside the export, file or folder,
# ``<export>.shardscope.json`` (never inside a folder export: it names local paths). A ``.json`` is never a
# checkpoint (not a FILE_SUFFIXES name, not an ``.index.json``), so ``ls`` never lists one
LINEAGE_FILE_SUFFIX = ".shardscope.json"
# a checkpoint's content manifest (``shardscope seal``, see backend/checkpoint/manifest.py): inside a folder
# checkpoint ``<folder>/shardscope-manifest.json``, beside a single file ``<file>.shardscope-manifest.json``; its
# model-signing bundle is ``shardscope-manifest.sig`` beside it the same way. Never a checkpoint file (a ``.json``
# and a ``.sig``), never a file of the checkpoint it describes (it is left out of the files it lists)
MANIFEST_NAME = "shardscope-manifest.json"
MANIFEST_FILE_SUFFIX = "." + MANIFEST_NAME
SIGNATURE_NAME = "shardscope-manifest.sig"
SIGNATURE_FILE_SUFFIX = "." + SIGNATURE_NAME
MEGATRON_INTEGRITY = "integrity.json"  # Megatron-Core's manifest: {"algorithm": "sha256", "files": {name: hex}}
# the small files that describe a checkpoint folder (its identity for lineage: their sizes, times and CRC32)
DESCRIBING_NAMES = (LIGHTNING_META, MEGATRON_CONFIG, MEGATRON_COMMON, HF_TRAINER_STATE, DS_LATEST, HF_CONFIG)

# ------------------------------------------------------------------ steps in names
STEP_RES = (
    re.compile(r"(?:^|[^a-z])(?:global_)?step[_=\-]?(\d+)", re.IGNORECASE),  # step_000100 step-100 step=12000
    re.compile(r"(?:^|[^a-z])checkpoint[_\-](\d+)", re.IGNORECASE),  # checkpoint-500
    re.compile(r"(?:^|[^a-z])iter(?:ation)?[_\-]?(\d+)", re.IGNORECASE),  # iter_0000100
    re.compile(r"^(\d+)$"),  # Orbax-style checkpoints/100
)


def is_url(path: str | os.PathLike) -> bool:
    """True for ``scheme://...`` other than ``file://``."""
    m = URL_RE.match(str(path))
    return m is not None and m.group(1) != "file"


def basename(path: str) -> str:
    """The last part of a local path or a URL (a trailing separator ignored)."""
    text = str(path).rstrip("/")
    return text.rsplit("/", 1)[-1] if is_url(text) else os.path.basename(text.rstrip(os.sep))


def rank_of_file(name: str) -> int | None:
    """The writer rank in a ``__R_N.distcp`` name (None for other names)."""
    m = DATA_FILE_RE.match(os.path.basename(name))
    return int(m.group(1)) if m else None


def dcp_data_file(rank: int, n: int = 0) -> str:
    """The name ``FileSystemWriter`` gives rank ``rank``'s ``n``-th data file: ``__<rank>_<n>.distcp``."""
    return f"__{rank}_{n}{DATA_SUFFIX}"


def hf_shard_file(i: int, n: int) -> str:
    """``save_pretrained``'s name of shard ``i`` of ``n`` (from 1): ``model-0000i-of-0000n.safetensors``."""
    return f"model-{i:05d}-of-{n:05d}{SAFETENSORS_SUFFIX}"


def hf_shard_rank(name: str) -> int | None:
    """The writer rank of a ``shard-0000K-…safetensors`` name (K-1), or None."""
    m = HF_SHARD_RE.match(name)
    return int(m.group(1)) - 1 if m else None


def is_metadata_name(name: str) -> bool:
    """A DCP metadata file's name (``.metadata`` or a per-rank ``__R.metadata``)."""
    return name == METADATA or bool(RANK_METADATA_RE.match(name))


def is_index_name(name: str) -> bool:
    """A file that only maps tensors to the shard files beside it (``model.safetensors.index.json``, a
    diffusers ``diffusion_pytorch_model.safetensors.index.json``): it stands for its folder."""
    return name.endswith(".index.json")


def is_torch_file(name: str) -> bool:
    """A torch.save file's name (``.pt``, ``.pth``, ``.bin``, Lightning's ``.ckpt``)."""
    return name.endswith(TORCH_SUFFIXES)


def is_safetensors_file(name: str) -> bool:
    return name.endswith(SAFETENSORS_SUFFIX)


def is_checkpoint_file(name: str) -> bool:
    """A single-file checkpoint's name (hidden names are temporaries of a writer)."""
    return not name.startswith(".") and name.endswith(FILE_SUFFIXES)


def step_from_name(name: str) -> int | None:
    """The training step a checkpoint's name states (``epoch=3-step=12000.ckpt`` -> 12000), or None."""
    stem = name
    for suffix in FILE_SUFFIXES:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    for pattern in STEP_RES:
        m = pattern.search(stem)
        if m:
            return int(m.group(1))
    return None


def lineage_sidecar(path: str, is_folder: bool) -> str:
    """Where the lineage sidecar of an export at ``path`` lies: beside it, file or folder (never inside a folder
    export: a folder is uploaded whole, and the sidecar names local paths)."""
    return path.rstrip(os.sep) + LINEAGE_FILE_SUFFIX


def manifest_path(path: str, is_folder: bool) -> str:
    """Where the content manifest of the checkpoint at ``path`` lies: inside a folder, beside a file."""
    return os.path.join(path, MANIFEST_NAME) if is_folder else path.rstrip(os.sep) + MANIFEST_FILE_SUFFIX


def signature_path(path: str, is_folder: bool) -> str:
    """Where the model-signing bundle of the checkpoint at ``path`` lies (beside its manifest)."""
    return os.path.join(path, SIGNATURE_NAME) if is_folder else path.rstrip(os.sep) + SIGNATURE_FILE_SUFFIX


def is_seal_file(name: str) -> bool:
    """A file ``seal`` writes inside a folder checkpoint (its manifest and signature bundle): never one of the
    checkpoint's own files."""
    return name in (MANIFEST_NAME, SIGNATURE_NAME)


def is_own_temporary(name: str) -> bool:
    """A temporary of Shardscope's (an export's, a download's, a small file's): never a file of a checkpoint."""
    return name.startswith(TMP_PREFIX) or bool(SMALL_TMP_RE.match(name))


def describes_checkpoint(name: str) -> bool:
    """A small file that describes a checkpoint folder (DCP ``.metadata``, an HF index, Lightning's
    ``meta.pt``, Megatron's ``metadata.json``, ...): what a lineage identity checksums."""
    return is_metadata_name(name) or is_index_name(name) or name in DESCRIBING_NAMES


def ds_model_file(name: str) -> tuple[int | None, int] | None:
    """(data-parallel rank or None below ZeRO-3, model-parallel rank) of a model-states file name, else None."""
    m = DS_MODEL_FILE_RE.match(name)
    return None if m is None else (None if m.group(1) is None else int(m.group(1)), int(m.group(2)))


def ds_optim_file(name: str) -> tuple[str, int, int] | None:
    """(prefix: '', 'bf16_' or 'fp16_', data-parallel rank, model-parallel rank) of an optimizer-states file name."""
    m = DS_OPTIM_FILE_RE.match(name)
    return None if m is None else (m.group(1) or "", int(m.group(2)), int(m.group(3)))


def is_deepspeed_step_folder(file_names: Iterable[str]) -> bool:
    """A tag folder (``global_step2/``): it holds a model-states file (every DeepSpeed save writes one)."""
    return any(DS_MODEL_FILE_RE.match(n) for n in file_names)


def is_deepspeed_save_dir(file_names: Iterable[str], dir_names: Iterable[str]) -> bool:
    """The folder ``save_checkpoint`` was given: a ``latest`` file or the recovery script beside tag folders
    (``global_stepN`` by default; a ``latest`` file with any folder counts too, as tags may be named freely)."""
    files, dirs = set(file_names), list(dir_names)
    if DS_LATEST in files and dirs:
        return True
    return DS_RECOVERY_SCRIPT in files and any(DS_STEP_TAG_RE.match(d) for d in dirs)


def parse_ds_latest(text: bytes) -> str | None:
    """The tag a ``latest`` file names, or None when it is not one plain folder name (no separator, not ``.``
    or ``..``, printable, at most 255 characters): a tag never leads outside the save folder."""
    try:
        tag = text.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    if not tag or len(tag) > DS_MAX_TAG or tag in (".", "..") or not tag.isprintable() or \
            any(c in tag for c in "/\\\x00"):
        return None
    return tag


# ------------------------------------------------------------------ Shardscope's own caches (never in a checkpoint)
def cache_folder() -> str:
    """Where Shardscope caches what it parsed (metadata, a listing's probes): ``$SHARDSCOPE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/shardscope/metadata``."""
    base = os.environ.get("SHARDSCOPE_CACHE_DIR")
    if base:
        return base
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "shardscope", "metadata")


def cache_enabled() -> bool:
    """False under ``--no-cache`` (``SHARDSCOPE_NO_CACHE``): no cache is read or written."""
    return not os.environ.get("SHARDSCOPE_NO_CACHE")
