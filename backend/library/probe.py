"""What a local checkpoint's first bytes say: whether a folder's save finished, whether a consolidated file is
whole, a torch file's kind, a DCP folder's serialisation. A few header bytes only, never a whole file."""

from __future__ import annotations

import json
import os
import struct

from ..checkpoint.items import ItemFormatError, zip_records
from ..checkpoint.model import MAX_INDEX
from ..checkpoint.safetensors_items import MAX_SAFETENSORS_HEADER, parse_safetensors_header
from ..checkpoint.storage import LocalHandles
from ..errors import ShardscopeError
from .names import DATA_FILE_RE, HF_INDEXES, HF_SHARD_RE, RANK_METADATA_RE
from .records import RESUMABLE, WEIGHTS

OPTIMIZER_MARKS = (b"param_groups", b"optimizer_states")  # any torch optimizer's state_dict; Lightning's key
MAX_KIND_PROBE = 16 << 20  # bytes of a torch file's pickle read to tell its kind


def disk_bytes(st: os.stat_result) -> int:
    """Bytes a file takes on disk (``st_blocks``); the size where a file system reports no blocks."""
    blocks = getattr(st, "st_blocks", None)
    if blocks is None or (blocks == 0 and st.st_size > 0):
        return st.st_size
    return blocks * 512



def folder_state(path: str, fmt: str, names: set[str], dirs: list[str], probe: bool = True
                 ) -> tuple[str, str, list[int]]:
    """(state, reason, writer ranks) of a checkpoint folder, from names and (``probe``: a local folder) a few
    header bytes."""
    ranks = sorted({int(m.group(1)) for n in names if (m := DATA_FILE_RE.match(n))})
    if fmt == "empty":
        return "incomplete", "an empty folder: a save that never wrote a file", []
    if fmt == "hf-safetensors":
        ranks = sorted({int(m.group(1)) - 1 for n in names if (m := HF_SHARD_RE.match(n))})
        return "complete", "", ranks
    if fmt == "hf-sharded":
        return (*_hf_index_state(path, names), []) if probe else ("complete", "", [])
    if fmt == "hf-trainer":
        ranks = _nested_ranks(path, dirs) if probe else []
        if os.path.basename(path).startswith("tmp-"):
            return "incomplete", "a tmp-checkpoint folder: the Trainer did not finish this save", ranks
        if "trainer_state.json" not in names:
            return "incomplete", "no trainer_state.json: the Trainer did not finish this save", ranks
        return "complete", "", ranks
    meta_ranks = {int(m.group(1)) for n in names if (m := RANK_METADATA_RE.match(n))}
    if ".metadata.tmp" in names:
        return "incomplete", "a .metadata.tmp is left: the save did not finish", ranks
    if ".metadata" in names and not probe:
        return "complete", "", ranks
    if ".metadata" in names:
        head = _head(os.path.join(path, ".metadata"), 1)
        if head is None:
            return "unreadable", ".metadata cannot be read", ranks
        if head not in (b"\x80", b"{"):
            return "unreadable", ".metadata is empty or not DCP metadata", ranks
        return "complete", "", ranks
    if meta_ranks:
        missing = sorted(set(ranks) - meta_ranks)
        if missing:
            return "incomplete", f"rank(s) {missing} wrote data but no __R.metadata", sorted(set(ranks) | meta_ranks)
        return "complete", "", sorted(set(ranks) | meta_ranks)
    return "incomplete", "no .metadata: the save did not finish (the coordinator writes it last)", ranks


def _nested_ranks(path: str, dirs: list[str]) -> list[int]:
    """Writer ranks of DCP folders one level down (HF Trainer's ``pytorch_model_fsdp_0/``)."""
    ranks: set[int] = set()
    for d in dirs:
        try:
            names = os.listdir(os.path.join(path, d))
        except OSError:
            continue
        ranks.update(int(m.group(1)) for n in names if (m := DATA_FILE_RE.match(n)))
    return sorted(ranks)


def _hf_index_state(path: str, names: set[str]) -> tuple[str, str]:
    index = next(n for n in HF_INDEXES if n in names)
    try:
        with open(os.path.join(path, index), "rb") as f:
            data = json.loads(f.read(64 << 20))
        wanted = set((data.get("weight_map") or {}).values())
    except (OSError, ValueError, AttributeError):
        return "unreadable", f"{index} is not readable JSON"
    missing = sorted(n for n in wanted if not isinstance(n, str) or n not in names)
    if missing:
        return "incomplete", f"{len(missing)} shard file(s) named in {index} are missing (e.g. {missing[0]})"
    return "complete", ""


def _head(path: str, n: int, offset: int = 0) -> bytes | None:
    try:
        with open(path, "rb") as f:
            if offset < 0:
                f.seek(offset, os.SEEK_END)
            elif offset:
                f.seek(offset)
            return f.read(n)
    except OSError:
        return None


def dcp_serialisation(path: str, names: set[str]) -> str:
    """``dcp-safetensors`` when the data files are safetensors (torch's SerializationFormat.SAFETENSORS)."""
    data = sorted(n for n in names if n.endswith(".distcp"))
    if not data:
        return "dcp"
    head = _head(os.path.join(path, data[0]), 9)
    if head and len(head) == 9 and head[:2] != b"PK" and head[8:9] == b"{":
        return "dcp-safetensors"
    return "dcp"


def file_state(path: str, size: int) -> tuple[str, str, str | None]:
    """(state, reason, format) of a consolidated file; format None when it is not a checkpoint at all."""
    if path.endswith(".safetensors"):
        return (*_safetensors_state(path, size), "safetensors")
    head = _head(path, 4)
    if head is None:
        return "unreadable", "the file cannot be read", "torch"
    if size == 0:
        return "incomplete", "an empty file", "torch"
    if head[:1] == b"\x80":
        return "complete", "", "torch"  # torch's legacy (pre-zip) format
    if head != b"PK\x03\x04":
        return ("unreadable", "not a torch.save file", "torch") if not path.endswith(".bin") else ("", "", None)
    # torch.save writes no zip comment, so a whole archive ends with its end-of-central-directory record
    tail = _head(path, 4, -22) if size >= 22 else None
    if tail != b"PK\x05\x06":
        return "incomplete", "truncated: the zip archive has no end record (torch.save did not finish)", "torch"
    return "complete", "", "torch"


def torch_file_kind(path: str, size: int) -> str:
    """``resumable`` when a torch file's pickle names an optimizer's state (``param_groups``, Lightning's
    ``optimizer_states``), else ``weights``: read from the archive's ``data.pkl`` record (at most 16 MiB), or
    the head of a legacy (pre-zip) file. Nothing is unpickled."""
    data = b""
    head = _head(path, 4)
    if head == b"PK\x03\x04":
        handles = LocalHandles(os.path.dirname(path) or ".")
        base = os.path.basename(path)
        try:
            pkl = zip_records(handles, base, size).get("data.pkl")
            if pkl and pkl[1] <= MAX_KIND_PROBE:
                data = handles.read(base, pkl[0], pkl[1])
        except (ItemFormatError, ShardscopeError):
            data = b""  # not an archive torch maps: its tensors are not readable, so it resumes nothing either
        finally:
            handles.close()
    elif head and head[:1] == b"\x80":
        data = _head(path, MAX_KIND_PROBE) or b""
    return RESUMABLE if any(mark in data for mark in OPTIMIZER_MARKS) else WEIGHTS


def _safetensors_state(path: str, size: int) -> tuple[str, str]:
    """Whether a safetensors file is whole: its header parsed by the one parser (headers over 1 MiB only
    length-checked, to keep a scan quick), and its data ending within the file."""
    head = _head(path, 8)
    if head is None:
        return "unreadable", "the file cannot be read"
    if len(head) < 8:
        return "incomplete", "shorter than a safetensors header"
    (n,) = struct.unpack("<Q", head)
    if 8 + n > size:
        return ("incomplete", "truncated inside its header") if n <= MAX_SAFETENSORS_HEADER else \
            ("unreadable", f"header length {n} is implausible")
    if n > 1 << 20:
        return "complete", ""
    try:
        with LocalHandles(os.path.dirname(path) or ".") as handles:
            end = parse_safetensors_header(handles, os.path.basename(path), 0, size, MAX_INDEX).end
    except ItemFormatError as exc:
        return "unreadable", f"the safetensors header does not parse ({exc})"
    except ShardscopeError:
        return "unreadable", "the file cannot be read"
    if end > size:
        return "incomplete", f"truncated: the header needs {end} bytes, the file has {size}"
    return "complete", ""


def trainer_state_step(path: str) -> int | None:
    try:
        if os.path.getsize(path) > 64 << 20:
            return None
        with open(path, "rb") as f:
            step = json.load(f).get("global_step")
        return int(step) if isinstance(step, int) else None
    except (OSError, ValueError, AttributeError):
        return None
