"""How a format's stored items decode: the item codec a format's ``open`` attaches to its checkpoint model.

A codec says where a chunk's values lie (:meth:`ItemCodec.stored`: a ``StoredTensor`` with its stored checksum),
whether they may be copied byte for byte (``StoredTensor.encoded`` is False), and which stream transforms an item
passed through when it was written (torch DCP's ``_StorageInfo.transform_descriptors``, applied in the order the
metadata lists them, as torch's ``_StorageReaderTransforms`` does). The shared :class:`.chunks.ChunkReader` keeps
ranges, handles, caching, CRC32 and remote plans; it asks the checkpoint's codec for the rest.

A transformed item is decoded whole into memory (as torch's own reader does), bounded by what the item can hold:
the chunk's values plus a torch.save archive's overhead, or :data:`MAX_OBJECT_BYTES` for a non-tensor entry. The
bound is ours, never a number in the file: a zstd frame declaring more is refused before anything is allocated,
and one that produces more is cut off there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .dtypes import ITEMSIZE, contiguous_strides
from .items import ZIP_LOCAL, InMemory, ItemFormatError, RecordCrcError, StoredTensor, parse_torch_item

if TYPE_CHECKING:
    from .model import Chunk
    from .safetensors_items import SafetensorsHeader

MAX_OBJECT_BYTES = 1 << 30  # a non-tensor entry (an optimizer step, an lr) is small; refuse a 1 GiB pickle
ITEM_OVERHEAD = 1 << 20  # a one-tensor torch.save archive's records beside its values are ~1 KiB
ZSTD = "stream.zstd"  # torch.distributed.checkpoint._extension.ZStandard.registry_name()
MAX_WINDOW = 1 << 27  # libzstd's own default limit: a frame may not ask for a larger window
_BLOCK = 1 << 20


class ItemReader(Protocol):
    """What a codec reads through: the chunk reader's handles, its safetensors header cache and its decoded items."""

    handles: Any

    def safetensors_blob(self, name: str, offset: int) -> SafetensorsHeader:
        """The header of the safetensors blob at ``offset`` of file ``name``."""
        ...

    def decoded_item(self, name: str, offset: int, length: int, transforms: tuple[str, ...], limit: int
                     ) -> bytes | bytearray:
        """The item's bytes with its transforms undone, at most ``limit`` bytes."""
        ...


class UnknownTransform(ItemFormatError):
    """An item was written through a stream transform this codec cannot undo (say which one)."""


def check_descriptors(descriptors: Sequence[str]) -> str | None:
    """The first descriptor Shardscope cannot decode, or None. torch's rule: ``name/version``, ``stream.zstd``
    with major version 1 (``ZStandard.from_descriptor``)."""
    for desc in descriptors:
        name, _, version = desc.partition("/")
        if name != ZSTD or version.partition(".")[0] != "1":
            return desc
    return None


def decode(data: bytes | bytearray, descriptors: Sequence[str], limit: int) -> bytes | bytearray:
    """The item's bytes with its stream transforms undone, at most ``limit`` bytes; ItemFormatError otherwise."""
    unknown = check_descriptors(descriptors)
    if unknown is not None:
        raise UnknownTransform(f"stored through stream transform {unknown!r}, which Shardscope cannot decode "
                               f"(it decodes {ZSTD}/1, torch's ZStandard)")
    for _ in descriptors:
        data = _zstd(data, limit)
    return data


def _zstd(data: bytes | bytearray, limit: int) -> bytearray:
    """One zstd frame decompressed, refused past ``limit`` bytes (declared or produced); the frame's content
    checksum, when it has one, is checked by libzstd."""
    try:
        import zstandard
    except ImportError:
        raise ItemFormatError("compressed with zstd; install the zstandard package to read it "
                              "(pip install 'shardscope[zstd]')") from None
    try:
        params = zstandard.get_frame_parameters(data)
        if params.content_size not in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR) and \
                params.content_size > limit:
            raise ItemFormatError(f"its zstd frame declares {params.content_size} bytes, more than the {limit} "
                                  "the item can hold")
        out = bytearray()
        with zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).stream_reader(data) as stream:
            while block := stream.read(_BLOCK):
                out += block
                if len(out) > limit:
                    raise ItemFormatError(f"its zstd stream holds more than the {limit} bytes the item can hold")
    except zstandard.ZstdError as exc:
        if "checksum" in str(exc):  # the frame stores a checksum of its content (torch's writer stores none)
            raise RecordCrcError("its zstd frame fails its content checksum") from None
        raise ItemFormatError(f"its zstd stream cannot be decoded ({str(exc)[:120]})") from None
    return out  # NOTE: not bytes(out): a copy would double the peak of a large item


def compressed_bound(limit: int) -> int:
    """The most bytes zstd can store ``limit`` bytes in (ZSTD_COMPRESSBOUND, generously)."""
    return limit + limit // 128 + (128 << 10)


class ItemCodec:
    """DCP's items: at each chunk's byte range a ``torch.save`` zip archive of one tensor, or (torch's
    ``SerializationFormat.SAFETENSORS``) where the file's safetensors blob starts; ``transforms`` names the
    stream transforms of the items that have any, by (file, item offset)."""

    raw_values = False  # True: each chunk's byte range is its raw values (the reader's columnar fast path)

    def __init__(self, transforms: dict[tuple[str, int], tuple[str, ...]] | None = None) -> None:
        self.transforms = transforms or {}

    def transforms_of(self, file: str, offset: int) -> tuple[str, ...]:
        """The stream transforms the item at ``offset`` of ``file`` was written through (none: ``()``)."""
        return self.transforms.get((file, offset), ()) if self.transforms else ()

    def stored(self, reader: ItemReader, fqn: str, chunk: Chunk, dtype: str) -> StoredTensor:
        """Where the chunk's values are (its item range already checked against the file)."""
        descs = self.transforms_of(chunk.file, chunk.offset)
        if descs:
            return self._decoded(reader, fqn, chunk, dtype, descs)
        handles = reader.handles
        magic = handles.read(chunk.file, chunk.offset, 4) if chunk.length >= 4 else b""
        if magic == ZIP_LOCAL:
            return parse_torch_item(handles, chunk.file, chunk.offset, chunk.length)
        blob = reader.safetensors_blob(chunk.file, chunk.offset)
        st = blob.tensors.get(fqn)
        if st is None:
            raise ItemFormatError(f"tensor {fqn} is not in the safetensors header")
        return st

    def _decoded(self, reader: ItemReader, fqn: str, chunk: Chunk, dtype: str, descs: tuple[str, ...]
                 ) -> StoredTensor:
        data = reader.decoded_item(chunk.file, chunk.offset, chunk.length, descs, self.item_limit(chunk, dtype))
        if data[:4] != ZIP_LOCAL:  # torch writes a safetensors blob untransformed (only its framing is)
            raise ItemFormatError("the decoded item is not a torch.save archive")
        st = parse_torch_item(InMemory(bytes(data)), chunk.file, 0, len(data))
        return StoredTensor(st.dtype, st.shape, st.stride, st.storage_offset, st.data_offset, st.nbytes, st.crc32,
                            encoded=True)

    @staticmethod
    def item_limit(chunk: Chunk, dtype: str) -> int:
        """The most bytes a decoded item of this chunk may have: its values and an archive's records."""
        return math.prod(chunk.sizes) * max(1, ITEMSIZE.get(dtype, 1)) + ITEM_OVERHEAD

    def to_json(self) -> list[list[Any]]:
        """The transforms as JSON (the metadata cache keeps them with the model)."""
        return [[f, o, list(d)] for (f, o), d in sorted(self.transforms.items())]

    @classmethod
    def from_json(cls, rows: list[list[Any]]) -> ItemCodec:
        """The codec :meth:`to_json` wrote (a damaged cache raises ValueError/TypeError: a miss)."""
        out: dict[tuple[str, int], tuple[str, ...]] = {}
        for f, o, d in rows:
            if not (isinstance(f, str) and type(o) is int and all(isinstance(x, str) for x in d)):
                raise ValueError("transforms")
            out[(f, o)] = tuple(d)
        return cls(out)


class RawValues(ItemCodec):
    """Each chunk's byte range is the raw values themselves (a safetensors file's data, an HF storage folder)."""

    raw_values = True

    def stored(self, reader: ItemReader, fqn: str, chunk: Chunk, dtype: str) -> StoredTensor:
        need = math.prod(chunk.sizes) * max(1, ITEMSIZE.get(dtype, 1))
        if chunk.length != need:  # the safetensors library refuses such a header: never read a prefix
            raise ItemFormatError(f"{chunk.length} bytes stored for shape {list(chunk.sizes)} of {dtype}, "
                                  f"which needs {need}")
        return StoredTensor(dtype, tuple(chunk.sizes), contiguous_strides(chunk.sizes), 0, chunk.offset,
                            chunk.length, None)


STORED_ITEMS = ItemCodec()
RAW_VALUES = RawValues()

__all__ = ["ITEM_OVERHEAD", "MAX_OBJECT_BYTES", "RAW_VALUES", "STORED_ITEMS", "ItemCodec", "RawValues",
           "UnknownTransform", "check_descriptors", "compressed_bound", "decode"]
