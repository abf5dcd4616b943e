"""The parser of DCP's default item format: a ``torch.save`` zip archive of one tensor (``.distcp`` items
start with ``PK\\x03\\x04``); safetensors blobs are :mod:`.safetensors_items`' job. Pure parsing: every
length, offset and count read from the bytes is checked against the bytes that exist before anything is
allocated or read. Reading values is :mod:`.chunks`' job.
"""

from __future__ import annotations

import functools
import math
import pickle
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import RefusedPickleError
from .dtypes import MAX_INDEX, MAX_NDIM
from .unpickler import STORAGE_DTYPES, TORCH_ITEM, NotBuilt, TensorRef, row_major, unpickle

ZIP_LOCAL = b"PK\x03\x04"
_EOCD = b"PK\x05\x06"
_EOCD64_LOC = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"
MAX_CENTRAL_DIRECTORY = 1 << 20  # a one-tensor torch.save archive has ~6 records (~500 bytes)
MAX_DATA_PKL = 1 << 20  # the data.pkl of one tensor is ~200 bytes
MAX_SMALL_RECORD = 4096  # .format_version, byteorder, version, ...: a few bytes each
# The records torch.save writes beside data.pkl and data/<key> (torch 2.13; older releases write fewer),
# and the range of file-format versions its zip reader accepts (caffe2/serialize/versions.h).
SMALL_RECORDS = (".format_version", ".storage_alignment", "byteorder", "version", ".data/version",
                 ".data/serialization_id")
FILE_FORMAT_VERSIONS = range(1, 11)
_STORAGE_RECORD = re.compile(r"data/[0-9]+")



class ByteSource(Protocol):
    """What the parsers read from: storage handles (``read`` raises CheckpointError past the end)."""

    def read(self, name: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes of file ``name`` from ``offset``; raises CheckpointError past the end."""
        ...

    def where(self, name: str) -> str:
        """The file's path or URL, for error messages."""
        ...


class ItemFormatError(ValueError):
    """An item's bytes do not parse; the chunk reader turns it into a CheckpointError naming file and tensor."""


class RecordCrcError(ItemFormatError):
    """A zip record's bytes do not match the CRC32 stored for them in the central directory."""


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where one item's tensor values are: ``nbytes`` raw bytes at ``data_offset`` in the file (in the decoded
    item when ``encoded``), viewed with ``shape``/``stride``/``storage_offset`` (in elements)."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    data_offset: int  # absolute, in the file
    nbytes: int  # bytes of the whole storage record
    crc32: int | None  # from the zip directory; None for safetensors
    # the values lie in the item's decoded bytes (a compressed item), not in the file: never copied byte for byte
    encoded: bool = False

    @property
    def contiguous(self) -> bool:
        """True when the stored strides are row-major for the shape, so the bytes can be read as one run."""
        return row_major(self.shape, self.stride)

    @property
    def numel(self) -> int:
        """Number of elements (product of the shape; 1 for a scalar)."""
        return math.prod(self.shape)

    def span(self) -> int:
        """Elements of storage the view reaches, from ``storage_offset`` on."""
        if any(s == 0 for s in self.shape):
            return 0
        return 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=True))


class StorageRef:
    """A torch storage in a ``data.pkl``: the archive record ``data/<key>`` holding ``numel`` elements.
    Used by the item parser here and by the torch-archive writer (persistent ids)."""

    __slots__ = ("dtype", "key", "numel")

    def __init__(self, key: str, numel: int, dtype: str | None) -> None:
        self.key, self.numel, self.dtype = key, numel, dtype


# ---------------------------------------------------------------- torch.save zip items
def checked_dims(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > MAX_NDIM or \
            not all(type(v) is int and 0 <= v < MAX_INDEX for v in value):
        raise ItemFormatError(f"data.pkl has an implausible {what}")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class _ZipRecord:
    name: str
    header: int  # local header offset, relative to the item
    size: int
    method: int
    crc: int
    flags: int
    raw: bytes  # the name as stored: the local header must repeat it


def _zip64_sizes(extra: bytes, usize: int, csize: int, lho: int) -> tuple[int, int, int]:
    q = 0
    while q + 4 <= len(extra):
        hid, hlen = struct.unpack_from("<HH", extra, q)
        if hid == 1:
            vals = list(struct.unpack_from("<" + "Q" * (min(hlen, len(extra) - q - 4) // 8), extra, q + 4))
            try:
                if usize == 0xFFFFFFFF:
                    usize = vals.pop(0)
                if csize == 0xFFFFFFFF:
                    csize = vals.pop(0)
                if lho == 0xFFFFFFFF:
                    lho = vals.pop(0)
            except IndexError:
                raise ItemFormatError("truncated zip64 extra field") from None
        q += 4 + hlen
    return usize, csize, lho


def _end_record(src: ByteSource, name: str, offset: int, length: int, max_directory: int = MAX_CENTRAL_DIRECTORY
                ) -> tuple[int, int, int]:
    """(record count, central directory size, its offset in the item), all checked against ``length``. As in
    torch's zip reader (miniz), a zip64 locator right before the end record makes the zip64 end record's
    values the ones that count: they must agree with the end record's (torch.save writes both)."""
    tail_len = min(length, 65536 + 22 + 20)
    tail = src.read(name, offset + length - tail_len, tail_len)
    pos = tail.rfind(_EOCD)
    if pos < 0 or pos + 22 > len(tail):
        raise ItemFormatError("no end-of-central-directory record")
    (_, disk, cd_disk, on_disk, count, cd_size, cd_offset, comment) = struct.unpack_from("<4sHHHHIIH", tail, pos)
    if pos + 22 + comment != len(tail):
        raise ItemFormatError("the end-of-central-directory record does not end the item")
    if pos >= 20 and tail[pos - 20:pos - 16] == _EOCD64_LOC:
        loc_disk, eocd64_off, disks = struct.unpack_from("<IQI", tail, pos - 16)
        if eocd64_off + 56 > length:
            raise ItemFormatError(f"zip64 end record at {eocd64_off} lies outside the {length}-byte item")
        rec = src.read(name, offset + eocd64_off, 56)
        size64, disk, cd_disk, on_disk, count64, cd_size64, cd_offset64 = struct.unpack_from("<Q4xIIQQQQ", rec, 4)
        if rec[:4] != _EOCD64 or size64 < 44 or loc_disk or disks != 1:
            raise ItemFormatError("bad zip64 end record")
        for short, full, sat in ((count, count64, 0xFFFF), (cd_size, cd_size64, 0xFFFFFFFF),
                                 (cd_offset, cd_offset64, 0xFFFFFFFF)):
            if short not in (sat, full):
                raise ItemFormatError("the zip64 end record disagrees with the end-of-central-directory record")
        count, cd_size, cd_offset = count64, cd_size64, cd_offset64
    elif cd_offset == 0xFFFFFFFF or count == 0xFFFF or cd_size == 0xFFFFFFFF:
        raise ItemFormatError("zip64 locator missing")
    if disk or cd_disk or on_disk != count:
        raise ItemFormatError("the end-of-central-directory record names other disks")
    if cd_size > max_directory or cd_offset + cd_size > length or count > cd_size // 46:
        raise ItemFormatError(f"zip central directory ({count} records, {cd_size} bytes at {cd_offset}) does not "
                              f"fit the {length}-byte item")
    return count, cd_size, cd_offset


def _zip_directory(src: ByteSource, name: str, offset: int, length: int,
                   max_directory: int = MAX_CENTRAL_DIRECTORY) -> dict[str, _ZipRecord]:
    """The records of an item zip by name without the archive folder (``data.pkl``, ``data/0``). As torch's
    zip reader needs them: every name valid UTF-8 and in the one archive folder the first names, stored
    (not compressed, not encrypted) on disk 0; and, beyond what torch checks, no name twice."""
    count, cd_size, cd_offset = _end_record(src, name, offset, length, max_directory)
    cd = src.read(name, offset + cd_offset, cd_size)
    out: dict[str, _ZipRecord] = {}
    folder = None
    p = 0
    for _ in range(count):
        if cd[p:p + 4] != _CENTRAL or p + 46 > len(cd):
            raise ItemFormatError("bad central directory entry")
        (flags, method, _, _, crc, csize, usize, nlen, xlen, clen, disk, _, eattr, lho) = struct.unpack_from(
            "<HHHHIIIHHHHHII", cd, p + 8)
        if p + 46 + nlen + xlen + clen > len(cd):
            raise ItemFormatError("central directory entry runs past the directory")
        raw = cd[p + 46:p + 46 + nlen]
        try:
            fname = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ItemFormatError(f"zip record name {raw[:80]!r} is not UTF-8") from None
        if 0xFFFFFFFF in (csize, usize, lho):
            usize, csize, lho = _zip64_sizes(cd[p + 46 + nlen:p + 46 + nlen + xlen], usize, csize, lho)
        if lho + 30 + csize > length:
            raise ItemFormatError(f"zip record {fname!r} ({csize} bytes at {lho}) lies outside the item")
        if method != 0 or csize != usize or flags & 0x41 or disk or eattr & 0x10:  # 0x10: miniz reads a folder
            raise ItemFormatError(f"zip record {fname!r} is compressed, encrypted, on another disk or a folder")
        top, slash, key = fname.partition("/")
        folder = top if folder is None else folder
        if not slash or top != folder:
            raise ItemFormatError(f"zip record {fname!r} is not in the archive folder {folder + '/'!r}")
        if key in out:
            raise ItemFormatError(f"zip record {fname!r} appears twice")
        out[key] = _ZipRecord(fname, lho, csize, method, crc, flags, raw)
        p += 46 + nlen + xlen + clen
    return out


def _record_start(src: ByteSource, name: str, offset: int, length: int, rec: _ZipRecord) -> int:
    """Absolute offset of a stored record's bytes (after its local header), checked to fit the item; the
    local header must agree with the central directory (name, flags, method; CRC32 and sizes unless a data
    descriptor carries them)."""
    if rec.header + 30 + len(rec.raw) > length:
        raise ItemFormatError(f"zip record {rec.name!r} runs past the item")
    head = src.read(name, offset + rec.header, 30 + len(rec.raw))
    if head[:4] != ZIP_LOCAL:
        raise ItemFormatError(f"bad local header for {rec.name!r}")
    flags, method, crc, csize, usize, nlen, xlen = struct.unpack_from("<HH4xIIIHH", head, 6)
    sizes = (crc, csize, usize) if 0xFFFFFFFF not in (csize, usize) else (crc,)
    if (flags, method, head[30:]) != (rec.flags, rec.method, rec.raw) or nlen != len(rec.raw) or \
            (not flags & 8 and sizes != (rec.crc, rec.size, rec.size)[:len(sizes)]):
        raise ItemFormatError(f"the local header of zip record {rec.name!r} disagrees with the central directory")
    start = rec.header + 30 + nlen + xlen
    if start + rec.size > length:
        raise ItemFormatError(f"zip record {rec.name!r} runs past the item")
    return offset + start


def _check_crc(rec: _ZipRecord, crc: int) -> None:
    if crc != rec.crc:
        raise RecordCrcError(f"zip record {rec.name!r} fails its CRC32 check (stored {rec.crc:08x}, read {crc:08x})")


def _record_bytes(src: ByteSource, name: str, offset: int, length: int, rec: _ZipRecord, limit: int) -> bytes:
    """A whole record of at most ``limit`` bytes, its CRC32 checked."""
    if rec.size > limit:
        raise ItemFormatError(f"zip record {rec.name!r} claims {rec.size} bytes; at most {limit} are plausible")
    data = src.read(name, _record_start(src, name, offset, length, rec), rec.size)
    _check_crc(rec, zlib.crc32(data))
    return data


def _check_records(src: ByteSource, name: str, offset: int, length: int, records: dict[str, _ZipRecord]) -> None:
    """The records torch's loader reads besides the pickle and the storages: only names torch.save writes,
    data.pkl and a version present, each small record's CRC32 checked and its value one torch accepts."""
    odd = next((r.name for k, r in records.items()
                if k != "data.pkl" and k not in SMALL_RECORDS and not _STORAGE_RECORD.fullmatch(k)), None)
    if odd is not None:
        raise ItemFormatError(f"unexpected zip record {odd!r}")
    if "data.pkl" not in records:
        raise ItemFormatError("no data.pkl record")
    if "version" not in records and ".data/version" not in records:
        raise ItemFormatError("no version record")
    values = {k: _record_bytes(src, name, offset, length, records[k], MAX_SMALL_RECORD)
              for k in SMALL_RECORDS if k in records}
    version = values.get(".data/version", values.get("version", b""))
    if not re.fullmatch(rb"[0-9]{1,6}\n?", version) or int(version) not in FILE_FORMAT_VERSIONS:
        raise ItemFormatError(f"archive version {version[:20]!r} is not one torch reads")
    order = values.get("byteorder", b"little")
    if order != b"little":  # torch would byte-swap a big-endian item; Shardscope reads values as stored
        raise ItemFormatError(f"byteorder record holds {order[:20]!r}; only little-endian items are read")
    if not re.fullmatch(rb"[1-9][0-9]{0,5}", values.get(".storage_alignment", b"64")):
        raise ItemFormatError("storage alignment record is not a number")
    try:
        values.get(".data/serialization_id", b"").decode("utf-8")  # torch logs it as a string
    except UnicodeDecodeError:
        raise ItemFormatError("serialization id record is not UTF-8") from None


@functools.lru_cache(maxsize=4096)
def _item_ref(data: bytes) -> TensorRef:
    """The tensor a ``data.pkl`` describes (read by :mod:`.unpickler` under its rules for a DCP tensor item);
    ItemFormatError when it is not one. Remembered by its bytes (errors are not): every rank's chunk of a tensor
    usually has the same ``data.pkl`` (same shape, dtype and storage key), so a 4-rank checkpoint's items are decoded
    a quarter as often, a 512-rank one's 1/512. The reference is immutable."""
    try:
        ref, _ = unpickle(data, "data.pkl", TORCH_ITEM)
    except (RefusedPickleError, NotBuilt) as exc:
        raise ItemFormatError(str(exc).removeprefix("data.pkl: ")) from None
    if type(ref) is not TensorRef:
        raise ItemFormatError("item is not a single tensor")
    return ref


def parse_torch_item(src: ByteSource, name: str, offset: int, length: int) -> StoredTensor:
    """Locate the tensor inside a torch.save zip item without loading its values."""
    records = _zip_directory(src, name, offset, length)
    _check_records(src, name, offset, length, records)
    data = _record_bytes(src, name, offset, length, records["data.pkl"], MAX_DATA_PKL)
    ref = _item_ref(data)
    rec = records.get(f"data/{ref.key}")
    if rec is None:
        raise ItemFormatError(f"storage record data/{ref.key} missing")
    if sum(1 for k in records if k.startswith("data/")) != 1:
        raise ItemFormatError("the archive holds storage records the tensor does not use")
    data_start = _record_start(src, name, offset, length, rec)
    return StoredTensor(ref.dtype, ref.shape, ref.stride, ref.storage_offset, data_start, rec.size,
                        rec.crc)


class InMemory:
    """A ByteSource over bytes already read (a non-tensor entry, an archive template); a read past them is an
    ItemFormatError. ``label`` is what errors call it (else the name asked for)."""

    def __init__(self, data: bytes, label: str | None = None) -> None:
        self.data = data
        self.label = label

    def read(self, name: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > len(self.data):
            raise ItemFormatError(f"the archive needs bytes {offset}..{offset + length} of {len(self.data)}")
        part = self.data[offset:offset + length] if isinstance(self.data, bytes) else \
            bytes(memoryview(self.data)[offset:offset + length])  # a decoded item (bytearray): bytes, hashable
        return part

    def where(self, name: str) -> str:
        return self.label or name


def check_object_archive(data: bytes) -> None:
    """A non-tensor entry stored as a ``torch.save`` archive, checked as :func:`parse_torch_item` checks a
    tensor item's, and every record's CRC32 too (``torch.load`` checks none): ItemFormatError (RecordCrcError
    for a CRC32 mismatch) when any record is damaged. ``torch.load`` then unpickles it."""
    src = InMemory(data)
    records = _zip_directory(src, "", 0, len(data))
    _check_records(src, "", 0, len(data), records)
    with memoryview(data) as view:
        for key, rec in records.items():
            if key not in SMALL_RECORDS:  # data.pkl and the storages; the small ones were checked above
                start = _record_start(src, "", 0, len(data), rec)
                _check_crc(rec, zlib.crc32(view[start:start + rec.size]))
    start = _record_start(src, "", 0, len(data), records["data.pkl"])
    if data[start:start + 1] == pickle.PROTO and records["data.pkl"].size >= 2 and \
            data[start + 1] > pickle.HIGHEST_PROTOCOL:  # torch's DCP loader unpickles it with Python's pickle
        raise ItemFormatError(f"data.pkl names pickle protocol {data[start + 1]}, which Python's pickle refuses")


def torch_archive_records(src: ByteSource, name: str, size: int) -> dict[str, tuple[int, int, int]]:
    """:func:`zip_records` of a whole ``torch.save`` archive, with the checks :func:`parse_torch_item` makes of an
    item's records: only names torch.save writes, data.pkl and a version present, each small record's CRC32 and
    value one torch accepts."""
    records = _zip_directory(src, name, 0, size, max(size, MAX_CENTRAL_DIRECTORY))  # a whole file: bounded by it
    _check_records(src, name, 0, size, records)
    return {key: (_record_start(src, name, 0, size, rec), rec.size, rec.crc) for key, rec in records.items()}


def zip_records(src: ByteSource, name: str, size: int) -> dict[str, tuple[int, int, int]]:
    """Every stored record of a whole zip file (a ``torch.save`` archive of ``size`` bytes) by its name without
    the archive folder (``data.pkl``, ``data/0``): (absolute offset of its bytes, byte length, stored CRC32).
    Read from the central directory and local headers only, each checked to lie inside the file."""
    records = _zip_directory(src, name, 0, size, max(size, MAX_CENTRAL_DIRECTORY))  # a whole file: bounded by it
    return {key: (_record_start(src, name, 0, size, rec), rec.size, rec.crc) for key, rec in records.items()}


__all__ = ["STORAGE_DTYPES", "ItemFormatError", "RecordCrcError", "StorageRef", "StoredTensor",
           "check_object_archive", "checked_dims", "parse_torch_item", "row_major",
           "torch_archive_records", "zip_records"]
