"""Tensors rebuilt from a pickle: one rebuild with torch's checks, frozen views over storages."""


from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..dtypes import ITEMSIZE, MAX_INDEX, MAX_NDIM
from .objects import _DENSE, _GRAD_DTYPES, _HIDDEN, Builder, NotBuilt


# ---------------------------------------------------------------- tensors: one rebuild, torch's checks
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class StorageRef:
    """A storage of a torch.save archive (its record ``data/<key>``), as a pickle names it: ``nbytes`` bytes of
    ``dtype`` elements (``uint8`` for an untyped storage)."""

    key: str
    dtype: str
    nbytes: int

    def __repr__(self) -> str:
        return _HIDDEN

    def __reduce__(self) -> Any:
        raise TypeError("a storage of a pickle being read is not pickled")


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class TensorRef:
    """A dense tensor of an archive, located, not read: ``shape``/``stride`` (elements) from element
    ``storage_offset`` of the storage ``storage`` (its record key; its address where torch.load read the file),
    which holds ``nbytes`` bytes. Checked as torch checks a rebuild, and to lie inside its storage."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage: Any
    nbytes: int

    @property
    def key(self) -> Any:
        """The storage's record key (``"0"`` for ``data/0``)."""
        return self.storage

    @property
    def storage_numel(self) -> int:
        """Elements of the tensor's dtype the storage holds."""
        return self.nbytes // ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        """Elements of the view (1 for a 0-dim tensor)."""
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        """True when the view is row-major, so its elements are one run of the storage."""
        return row_major(self.shape, self.stride)

    def __repr__(self) -> str:
        return _HIDDEN

    def __reduce__(self) -> Any:
        raise TypeError("a tensor of a pickle being read is not pickled")


def row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True when ``stride`` is the C-contiguous stride of ``shape`` (size-1 dimensions may have any stride)."""
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def _dims(value: Any) -> tuple[int, ...]:
    if type(value) is not tuple:
        if type(value) is not list:
            raise NotBuilt("a tensor has an implausible shape or stride")
        value = tuple(value)
    if len(value) > MAX_NDIM or not all(type(v) is int and 0 <= v < MAX_INDEX for v in value):
        raise NotBuilt("a tensor has an implausible shape or stride")
    return value


def _empty(value: Any) -> bool:
    return value is None or (type(value) in (dict, OrderedDict) and not value)


def _view(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, metadata: Any,
          dtype: str) -> TensorRef:
    """torch's ``t.set_(storage, offset, size, stride)`` and the attributes its rebuilds set, checked as torch
    checks them; NotBuilt where torch would fail or make something else than a plain dense tensor."""
    if type(storage) is not StorageRef or dtype not in _DENSE:
        raise NotBuilt("a tensor is rebuilt from something else than a storage of a dense dtype")
    if requires_grad is not False and (requires_grad is not True or dtype not in _GRAD_DTYPES):
        raise NotBuilt("a tensor is rebuilt with a requires_grad torch refuses")
    if not _empty(hooks) or not _empty(metadata):
        raise NotBuilt("a tensor is rebuilt with hooks or metadata (conj/neg bits)")
    if type(offset) is not int or not 0 <= offset < MAX_INDEX:
        raise NotBuilt("a tensor has an implausible storage offset")
    shape, strides = _dims(size), _dims(stride)
    if len(shape) != len(strides):
        raise NotBuilt("a tensor's shape and stride differ in length")
    if 0 not in shape:
        last = offset + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
        if (last + 1) * ITEMSIZE[dtype] > storage.nbytes:
            raise NotBuilt(f"a tensor of shape {shape} reaches past its storage data/{storage.key}")
    return TensorRef(dtype, shape, strides, offset, storage.key, storage.nbytes)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> TensorRef:
    return _view(storage, storage_offset, size, stride, False, None, None, getattr(storage, "dtype", ""))


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                       backward_hooks: Any = None, metadata: Any = None) -> TensorRef:
    return _view(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata,
                 getattr(storage, "dtype", ""))


def _rebuild_tensor_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                       backward_hooks: Any, dtype: Any, metadata: Any = None) -> TensorRef:
    if not isinstance(dtype, Builder) or not isinstance(dtype.kind, DTypeName):
        raise NotBuilt("a tensor is rebuilt with a dtype that is not a torch dtype")
    return _view(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata, str(dtype.kind))


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> TensorRef:
    """``nn.Parameter(data, requires_grad)``: the same view."""
    if type(data) is not TensorRef or type(requires_grad) is not bool or \
            (requires_grad and data.dtype not in _GRAD_DTYPES) or not _empty(backward_hooks):
        raise NotBuilt("a parameter is rebuilt with arguments torch refuses")
    return data


class DTypeName(str):
    """A torch dtype (``torch.float32``) by its short name."""


_TENSOR_REBUILDS: dict[str, Callable[..., TensorRef]] = {
    "_rebuild_tensor": _rebuild_tensor, "_rebuild_tensor_v2": _rebuild_tensor_v2,
    "_rebuild_tensor_v3": _rebuild_tensor_v3, "_rebuild_parameter": _rebuild_parameter}
