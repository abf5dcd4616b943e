"""The one chunk reader: bytes of a stored item, by file and byte range, for every storage variant.

A DCP ``.distcp`` item is either a complete ``torch.save`` zip archive of one tensor (the default,
starts with ``PK\\x03\\x04``) or, for ``SerializationFormat.SAFETENSORS``, a safetensors blob that
holds all of a file's tensors and starts at the item's offset. The zip is parsed here, its
``data.pkl`` read with an allow-list unpickler, so the raw storage bytes can be read straight into
a destination buffer (and their CRC32 checked, which ``torch.load`` never does).
"""

from __future__ import annotations

import io
import json
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from .storage import FileHandles, LocalHandles, RemoteHandles

ZIP_LOCAL = b"PK\x03\x04"
_EOCD = b"PK\x05\x06"
_EOCD64_LOC = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"

STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128",
    "QInt8Storage": "qint8", "QUInt8Storage": "quint8", "QInt32Storage": "qint32",
}
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
    "U64": "uint64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "C64": "complex64", "C128": "complex128", "F8_E8M0": "float8_e8m0fnu",
}


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where one item's tensor values are: ``nbytes`` raw bytes at ``data_offset`` in the file,
    viewed with ``shape``/``stride``/``storage_offset`` (in elements)."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    data_offset: int  # absolute, in the file
    nbytes: int  # bytes of the whole storage record
    crc32: int | None  # from the zip directory; None for safetensors

    @property
    def contiguous(self) -> bool:
        expect = 1
        for size, st in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and st != expect:
                return False
            expect *= size
        return True


class _StorageRef:
    __slots__ = ("dtype", "key", "numel")

    def __init__(self, dtype: str, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


class _TensorRef:
    __slots__ = ("shape", "storage", "storage_offset", "stride")

    def __init__(self, storage: _StorageRef, storage_offset: int, shape: tuple, stride: tuple) -> None:
        self.storage, self.storage_offset, self.shape, self.stride = storage, storage_offset, shape, stride


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> _TensorRef:
    if not isinstance(storage, _StorageRef):
        raise pickle.UnpicklingError("tensor without storage")
    return _TensorRef(storage, int(storage_offset), tuple(size), tuple(stride))


class _StorageType:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class _ItemUnpickler(pickle.Unpickler):
    """Reads a torch.save ``data.pkl`` of one plain tensor and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return _rebuild_tensor_v2
        if module == "collections" and name == "OrderedDict":
            return dict
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        raise pickle.UnpicklingError(f"unsupported global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise pickle.UnpicklingError("unsupported persistent id")
        return _StorageRef(pid[1].dtype, str(pid[2]), int(pid[4]))


def _zip_directory(blob_tail: bytes, tail_start: int, item_offset: int, item_length: int,
                   handles: LocalHandles | RemoteHandles, name: str) -> list[tuple[str, int, int, int, int]]:
    """(name, local header offset, compressed size, method, crc) for each record of an item zip."""
    pos = blob_tail.rfind(_EOCD)
    if pos < 0:
        raise ValueError("no end-of-central-directory record")
    (_, _, _, _, count, cd_size, cd_offset, _) = struct.unpack_from("<4sHHHHIIH", blob_tail, pos)
    if cd_offset == 0xFFFFFFFF or count == 0xFFFF:
        loc = blob_tail.rfind(_EOCD64_LOC, 0, pos)
        if loc < 0:
            raise ValueError("zip64 locator missing")
        (eocd64_off,) = struct.unpack_from("<Q", blob_tail, loc + 8)
        rec = handles.read(name, item_offset + eocd64_off, 56)
        if rec[:4] != _EOCD64:
            raise ValueError("bad zip64 end record")
        count, cd_size, cd_offset = struct.unpack_from("<QQQ", rec, 32)
    cd = handles.read(name, item_offset + cd_offset, cd_size)
    out = []
    p = 0
    for _ in range(count):
        if cd[p:p + 4] != _CENTRAL:
            raise ValueError("bad central directory entry")
        (method, _, _, crc, csize, usize, nlen, xlen, clen, _, _, _, lho) = struct.unpack_from(
            "<HHHIIIHHHHHII", cd, p + 10)
        fname = cd[p + 46:p + 46 + nlen].decode("utf-8", "replace")
        extra = cd[p + 46 + nlen:p + 46 + nlen + xlen]
        if 0xFFFFFFFF in (csize, usize, lho):
            q = 0
            while q + 4 <= len(extra):
                hid, hlen = struct.unpack_from("<HH", extra, q)
                if hid == 1:
                    vals = list(struct.unpack_from("<" + "Q" * (hlen // 8), extra, q + 4))
                    if usize == 0xFFFFFFFF:
                        usize = vals.pop(0)
                    if csize == 0xFFFFFFFF:
                        csize = vals.pop(0)
                    if lho == 0xFFFFFFFF:
                        lho = vals.pop(0)
                q += 4 + hlen
        out.append((fname, lho, csize, method, crc))
        p += 46 + nlen + xlen + clen
    return out


def parse_torch_item(handles: LocalHandles | RemoteHandles, name: str, offset: int, length: int) -> StoredTensor:
    """Locate the tensor inside a torch.save zip item without loading its values."""
    tail_len = min(length, 65536 + 22)
    tail_start = offset + length - tail_len
    tail = handles.read(name, tail_start, tail_len)
    records = _zip_directory(tail, tail_start, offset, length, handles, name)
    by_suffix = {}
    for rec in records:
        fname = rec[0]
        slash = fname.find("/")
        by_suffix[fname[slash + 1:] if slash >= 0 else fname] = rec
    pkl = by_suffix.get("data.pkl")
    if pkl is None:
        raise ValueError("no data.pkl record")

    def record_data(rec: tuple) -> tuple[int, int]:
        _, lho, csize, method, _ = rec
        if method != 0:
            raise ValueError("compressed zip record")
        head = handles.read(name, offset + lho, 30)
        if head[:4] != ZIP_LOCAL:
            raise ValueError("bad local header")
        nlen, xlen = struct.unpack_from("<HH", head, 26)
        return offset + lho + 30 + nlen + xlen, csize

    start, size = record_data(pkl)
    ref = _ItemUnpickler(io.BytesIO(handles.read(name, start, size))).load()
    if not isinstance(ref, _TensorRef):
        raise ValueError("item is not a single tensor")
    rec = by_suffix.get(f"data/{ref.storage.key}")
    if rec is None:
        raise ValueError(f"storage record data/{ref.storage.key} missing")
    data_start, data_size = record_data(rec)
    if data_start + data_size > offset + length:
        raise ValueError("storage record runs past the item")
    return StoredTensor(ref.storage.dtype, ref.shape, ref.stride, ref.storage_offset, data_start,
                        data_size, rec[4])


def parse_safetensors_blob(handles: LocalHandles | RemoteHandles, name: str, start: int) -> dict[str, dict]:
    head = handles.read(name, start, 8)
    (n,) = struct.unpack("<Q", head)
    if n > 100 * 2**20:
        raise ValueError("safetensors header too large")
    header = json.loads(handles.read(name, start + 8, n))
    base = start + 8 + n
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[key] = {"dtype": SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"].lower()),
                    "shape": tuple(info["shape"]), "offset": base + a, "nbytes": b - a}
    return out


def stored_tensor(handles: LocalHandles | RemoteHandles, name: str, offset: int, length: int, fqn: str,
                  blob_cache: dict | None = None) -> StoredTensor:
    """Where the values of the item at ``offset`` in ``name`` are, whatever the storage variant."""
    magic = handles.read(name, offset, 4) if length >= 4 else b""
    if magic == ZIP_LOCAL:
        return parse_torch_item(handles, name, offset, length)
    # SerializationFormat.SAFETENSORS: the item offset is where the file's safetensors blob starts.
    key = (name, offset)
    blob = blob_cache.get(key) if blob_cache is not None else None
    if blob is None:
        blob = parse_safetensors_blob(handles, name, offset)
        if blob_cache is not None:
            blob_cache[key] = blob
    info = blob.get(fqn)
    if info is None:
        raise ValueError(f"tensor {fqn} not in the safetensors header")
    shape = info["shape"]
    stride = []
    acc = 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return StoredTensor(info["dtype"], shape, tuple(reversed(stride)), 0, info["offset"], info["nbytes"], None)


__all__ = ["FileHandles", "StoredTensor", "parse_safetensors_blob", "parse_torch_item", "stored_tensor"]
