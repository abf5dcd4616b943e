"""The one place that decides what a pickle from a checkpoint may build: every global it may name (the allow-lists
of every reader), and what the opcodes that act on objects (REDUCE, NEWOBJ, BUILD, SETITEM(S), APPEND(S)) may do,
exactly as ``torch.load(weights_only=True)``'s unpickler (``torch/_weights_only_unpickler.py``) permits them:

- REDUCE and NEWOBJ call only a :class:`Builder` this module made for an allowed global;
- BUILD acts only on an ``OrderedDict``/``Counter`` (its attributes) and on the inert :class:`StandIn` of a class a
  reader allows (numpy dtypes and arrays among them: only numbers, their sizes checked and charged); BUILD on a
  tensor (torch's legacy ``set_``) is left to torch; on anything else (a function, a record of ours, a set, a
  torch dtype) it is refused as torch refuses it;
- APPEND(S) only on a ``list``, SETITEM(S) only on a ``dict``/``OrderedDict``/``Counter``;
- only the opcodes torch's unpickler runs (protocol 2, what ``torch.save`` writes), read by a Python interpreter
  here, so no C code sizes anything from a number in the file (memo indexes are dict keys).

Nothing of Shardscope's is reachable from a pickle: globals resolve to immutable :class:`Builder` objects, numpy
and other allowed classes to :class:`StandIn` records that only keep what they were given, tensors to frozen
:class:`TensorRef` views checked as torch checks them. Copying constructors are charged against a budget set by
the pickle's size (a memo reference costs 2 bytes, so a small pickle could otherwise build big things many times).

Readers choose a :class:`Rules` set here (torch files, DCP items, DeepSpeed/Megatron/Lightning archives) and get
``RefusedPickleError`` (one line naming the file and what it asked for) for what torch refuses, :class:`NotBuilt`
for what torch would build and this module does not (a torch file's reader then lets ``torch.load(weights_only=
True)`` read it). The DCP ``.metadata`` unpickler (:mod:`.metadata`) takes its globals from here too, and
``torch.load``'s extra safe globals are :func:`torch_safe_globals`.

Its parts: :mod:`.objects` (what a global becomes: builders, inert stand-ins, numpy numbers, the budget),
:mod:`.tensors` (the one tensor rebuild), :mod:`.rules` (the allow-lists of every reader and of ``torch.load``),
:mod:`.machine` (the opcode interpreter, and stand-ins made real after a load) and :mod:`.metadata` (DCP
``.metadata`` and the metadata helper's replies)."""

from .machine import Unpickler, realize, unpickle
from .metadata import METADATA_GLOBALS, MetadataUnpickler, ShippedUnpickler, shippable_globals, unpickle_metadata
from .objects import (
                      _HIDDEN,
                      ELEMENT_ALLOWANCE,
                      STORAGE_DTYPES,
                      Budget,
                      Builder,
                      NotBuilt,
                      NumpyArray,
                      NumpyDType,
                      StandIn,
                      describe,
                      stand_in,
)
from .rules import (
                      DEEPSPEED_CLASSES,
                      MEGATRON_CLASSES,
                      PLAIN_CLASSES,
                      SAFE_NUMPY_GLOBALS,
                      TORCH_FILE,
                      TORCH_ITEM,
                      Rules,
                      allow_torch_safe_globals,
                      archive_rules,
                      torch_safe_globals,
)
from .tensors import DTypeName, StorageRef, TensorRef, row_major

__all__ = [
    "DEEPSPEED_CLASSES", "ELEMENT_ALLOWANCE", "MEGATRON_CLASSES", "METADATA_GLOBALS", "PLAIN_CLASSES",
    "SAFE_NUMPY_GLOBALS", "STORAGE_DTYPES", "TORCH_FILE", "TORCH_ITEM", "_HIDDEN", "Budget", "Builder", "DTypeName",
    "MetadataUnpickler", "NotBuilt", "NumpyArray", "NumpyDType", "Rules", "ShippedUnpickler", "StandIn", "StorageRef",
    "TensorRef", "Unpickler", "allow_torch_safe_globals", "archive_rules", "describe", "realize", "row_major",
    "shippable_globals", "stand_in", "torch_safe_globals", "unpickle", "unpickle_metadata",
]
