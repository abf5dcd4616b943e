"""The allow-lists: what each reader's pickles may name (torch files, DCP items, archives), and the extra safe
globals of every ``torch.load(weights_only=True)``."""


from __future__ import annotations

import io
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ...errors import RefusedPickleError
from .objects import (
    _DENSE,
    _IMPORT_MAPPING,
    _NAME_MAPPING,
    NUMPY_NUMBER_CODES,
    STORAGE_DTYPES,
    Budget,
    Builder,
    NotBuilt,
    _charged,
    _codecs_encode,
    _numpy_dtype,
    _numpy_reconstruct,
    _numpy_scalar,
    describe,
    stand_in,
)
from .tensors import _TENSOR_REBUILDS, DTypeName, TensorRef, _empty, _rebuild_parameter


# ---------------------------------------------------------------- the allow-lists
class StorageKind(str):
    """A storage class (``torch.FloatStorage``; ``torch.storage.UntypedStorage`` holds ``uint8``) by its elements'
    dtype."""


class TensorType(str):
    """``torch.Tensor`` or ``torch.nn.Parameter`` named as the type a tensor is rebuilt as (never called)."""


# What torch.load(weights_only=True) accepts beyond its own list when Shardscope loads checkpoint data with it
# (torch.serialization.add_safe_globals): io.BytesIO (DCP pickles a Stateful's BytesIO: torchtitan's train_state) and
# numpy arrays of numbers (RNG states: Megatron's rng_state, a Trainer's rng_state.pth), as torch's refusal message
# advises and Megatron-Core itself does. An object array stays refused: its dtype's class is not allowed.
SAFE_NUMPY_GLOBALS = ("numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
                      "numpy._core.multiarray._reconstruct",
                      *(f"numpy.dtypes.{n}DType" for n in NUMPY_NUMBER_CODES.values()))
# Classes any archive's extra state may pickle (a training script's arguments, RNG states, a device), kept inert
PLAIN_CLASSES = frozenset({"numpy.dtype", "numpy.ndarray", "argparse.Namespace", "torch.device", "pathlib.Path",
                           "pathlib.PosixPath", "pathlib.WindowsPath", "pathlib.PurePosixPath",
                           "pathlib.PureWindowsPath"})
# What Megatron-Core's common.pt may hold besides plain data: the classes Megatron-Core registers for torch.load's
# weights_only (megatron/core/safe_globals.py) and the numpy RNG state's dtype class
MEGATRON_CLASSES = ("types.SimpleNamespace", "numpy.dtypes.UInt32DType", "_io.BytesIO", "signal.Signals",
                    "megatron.core.enums.ModelType", "megatron.core.transformer.enums.ModelType",
                    "megatron.core.transformer.enums.AttnBackend", "megatron.core.transformer.enums.CudaGraphScope",
                    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
                    "megatron.core.rerun_state_machine.RerunDiagnostic",
                    "megatron.core.rerun_state_machine.RerunMode", "megatron.core.rerun_state_machine.RerunState")
# The DeepSpeed classes a ZeRO checkpoint pickles (nothing of deepspeed is imported)
DEEPSPEED_CLASSES = ("deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.utils.tensor_fragment.fragment_address")


def _not_built(what: str) -> Callable[..., Any]:
    def refuse(*args: Any) -> Any:
        raise NotBuilt(what)
    return refuse


def _new_empty(cls: type) -> Callable[..., Any]:
    return lambda *args: cls()  # NEWOBJ: cls.__new__(cls, *args) of a container is an empty one


@dataclass(frozen=True)
class Rules:
    """What one kind of pickle may name. ``torch_values``: torch.Size/device/dtypes as torch's own objects (torch
    is imported) rather than plain stand-ins; ``classes``: globals kept as inert :class:`StandIn`s; ``lenient``:
    tensors saved with attributes (ZeRO-3's ``ds_id``) read as plain tensors, numpy scalars decoded; ``strict``:
    a global this module does not list is refused in a checkpoint's own words (else classified by torch's list)."""

    what: str
    torch_values: bool = False
    classes: frozenset[str] = frozenset()
    lenient: bool = False
    strict: bool = True
    containers: frozenset[str] = frozenset({"collections.OrderedDict", "collections.Counter", "builtins.set",
                                            "builtins.bytearray", "builtins.complex"})

    def resolve(self, module: str, name: str, budget: Budget) -> Builder:
        """The :class:`Builder` a pickle gets for global ``module.name`` (Python 2 names renamed as torch renames
        them); RefusedPickleError or NotBuilt for any other."""
        written = f"{module}.{name}"
        if (module, name) in _NAME_MAPPING:
            module, name = _NAME_MAPPING[(module, name)]
        elif module in _IMPORT_MAPPING:
            module = _IMPORT_MAPPING[module]
        full = f"{module}.{name}"
        made = self._builder(full, budget)
        if made is not None:
            return made
        what = written if written.isprintable() else describe(written)
        if not self.strict and _torch_accepts(full):
            raise NotBuilt(f"it names {what[:200]}, which torch's weights-only loader reads and this reader does not")
        if self.strict:
            raise RefusedPickleError(
                f"{budget.source}: refused to load the pickled global {what[:200]}: it is not one {self.what} holds, "
                "so the file is damaged or hostile. Nothing from it was run.", path=budget.source)
        raise budget.refused(f"names the global {what[:200]}")

    def _builder(self, full: str, budget: Budget) -> Builder | None:
        module, _, name = full.rpartition(".")
        if module == "torch._utils" and name in _TENSOR_REBUILDS:
            return Builder(full, _TENSOR_REBUILDS[name])
        if full == "torch._utils._rebuild_parameter_with_state":
            return Builder(full, self._parameter_with_state)
        if full == "torch._tensor._rebuild_from_type_v2":
            return Builder(full, self._from_type)
        if module == "torch" and name in STORAGE_DTYPES and STORAGE_DTYPES[name] in _DENSE:
            return Builder(full, None, kind=StorageKind(STORAGE_DTYPES[name]))
        if full == "torch.storage.UntypedStorage":
            return Builder(full, None, kind=StorageKind("uint8"))  # torch.load makes a uint8 storage of it
        if module == "torch" and name in _DENSE:
            return Builder(full, None, kind=DTypeName(name))
        if full in ("torch.Tensor", "torch.nn.parameter.Parameter"):
            return Builder(full, None, kind=TensorType(full))
        if full in self.containers:
            ctor = _CONTAINERS[full]
            return Builder(full, _charged(ctor)(budget) if ctor is not complex else complex,
                           new=_new_empty(ctor) if ctor is not complex else complex)
        if full == "_codecs.encode":
            return Builder(full, _charged(_codecs_encode)(budget))
        if full == "torch.Size":
            return Builder(full, _charged(self._size_type())(budget))
        if full == "torch.device" and self.torch_values:
            import torch

            return Builder(full, torch.device)
        if full in ("numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct"):
            return Builder(full, _numpy_reconstruct(budget))
        if full == "numpy.dtype":
            return Builder(full, _numpy_dtype, kind=stand_in("numpy.dtype"))
        if module == "numpy.dtypes" and name.removesuffix("DType") in NUMPY_NUMBER_CODES.values():
            code = next(c for c, n in NUMPY_NUMBER_CODES.items() if n == name.removesuffix("DType"))
            return Builder(full, lambda: _numpy_dtype(code), new=lambda: _numpy_dtype(code))
        if full in ("numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar") and self.lenient:
            return Builder(full, _numpy_scalar)
        if full == "numpy.ndarray":  # only the class _reconstruct is given; torch would allocate a called one
            cls = stand_in(full)
            return Builder(full, _not_built("an array made by calling numpy.ndarray"), kind=cls)
        if full in self.classes or (self.lenient and full in PLAIN_CLASSES) or full in _SAFE_CLASSES:
            cls = stand_in(full)
            return Builder(full, cls, new=cls, kind=cls)
        return None

    def _size_type(self) -> Callable[..., Any]:
        if self.torch_values:
            import torch

            return torch.Size
        return tuple

    def _parameter_with_state(self, data: Any, requires_grad: Any, hooks: Any, state: Any = None) -> TensorRef:
        if not (self.lenient or _empty(state)):
            raise NotBuilt("a parameter is saved with attributes")
        return _rebuild_parameter(data, requires_grad, hooks)

    def _from_type(self, func: Any, new_type: Any, args: Any, state: Any) -> TensorRef:
        """A tensor saved with attributes (ZeRO-3 gives its flat groups a ``ds_id``): ``func(*args)`` of a rebuild,
        as a plain tensor; the attributes are dropped where the rules are lenient."""
        if not (isinstance(func, Builder) and func.call is not None and func.call in _TENSOR_REBUILDS.values()) or \
                not (isinstance(new_type, Builder) and isinstance(new_type.kind, TensorType)) or \
                type(args) is not tuple or not (self.lenient or _empty(state) or new_type.kind != "torch.Tensor"):
            raise NotBuilt("a tensor is rebuilt from a type, with attributes")
        if not self.lenient and not _empty(state):
            raise NotBuilt("a tensor is saved with attributes")
        out = func.call(*args)
        if type(out) is not TensorRef:
            raise NotBuilt("a tensor is rebuilt from something else than a tensor")
        return out


_CONTAINERS: dict[str, type] = {"collections.OrderedDict": OrderedDict, "collections.Counter": Counter,
                                "builtins.set": set, "builtins.bytearray": bytearray, "builtins.complex": complex}
_SAFE_CLASSES = frozenset({"_io.BytesIO"})

TORCH_FILE = Rules("a torch file", torch_values=True, strict=False)
"""A whole torch.save file (``.pt``): what weights_only reads, with :data:`SAFE_NUMPY_GLOBALS` and BytesIO."""
TORCH_ITEM = Rules("a DCP tensor item")
"""The data.pkl of one tensor in a DCP item (torch.save of a tensor)."""


def archive_rules(what: str, classes: Iterable[str] = ()) -> Rules:
    """The rules for a torch.save archive of training state (DeepSpeed's files, Megatron's ``common.pt``,
    Lightning's ``meta.pt``): ``classes`` kept as inert stand-ins besides :data:`PLAIN_CLASSES`."""
    return Rules(what, classes=frozenset(classes), lenient=True,
                 containers=frozenset({"collections.OrderedDict", "builtins.set", "builtins.bytearray"}))


def _torch_accepts(full: str) -> bool:
    """Whether ``torch.load(weights_only=True)`` with :func:`torch_safe_globals` accepts global ``full`` (already
    renamed); True when torch's private list cannot be read (torch.load then decides)."""
    try:
        from torch import _weights_only_unpickler as wo

        if full.partition(".")[0] in wo._blocklisted_modules or full.rpartition(".")[0] in wo._blocklisted_modules:
            return False
        return full in wo._get_allowed_globals() or full in SAFE_NUMPY_GLOBALS or full == "_io.BytesIO"
    except (ImportError, AttributeError, TypeError, ValueError):
        return True


def allow_torch_safe_globals() -> None:
    """Let ``torch.load(weights_only=True)`` accept :func:`torch_safe_globals` (every weights-only load of checkpoint
    data calls this; add_safe_globals is a set: adding them again is free). NOTE: not torch's ``safe_globals``
    context manager, whose exit removes them for every other load too."""
    import torch

    torch.serialization.add_safe_globals(torch_safe_globals())


def torch_safe_globals() -> list[Any]:
    """What ``torch.load(weights_only=True)`` needs beyond its own list to read what this module reads in a torch
    file (``torch.serialization.safe_globals(...)`` takes it): a class, or a (function, name) pair."""
    import numpy as np

    reconstruct = getattr(np, "_core", np).multiarray._reconstruct
    return ([io.BytesIO, np.ndarray, np.dtype, (reconstruct, "numpy.core.multiarray._reconstruct"),
             (reconstruct, "numpy._core.multiarray._reconstruct")]
            + [c for n in NUMPY_NUMBER_CODES.values()
               if (c := getattr(getattr(np, "dtypes", None), f"{n}DType", None))])
