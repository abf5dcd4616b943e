"""Checkpoint formats as plug-ins: one module per format (:mod:`.dcp`, :mod:`.lightning`, :mod:`.hf_folder`,
:mod:`.hf_index`, :mod:`.hf_trainer`, :mod:`.megatron`, :mod:`.safetensors_file`, :mod:`.torch_file`), each a
:class:`~.base.Format` with a cheap ``detect``/``probe`` and an ``open``; :mod:`.registry` orders them and is the
one door every command, the window and the library go through. The door's own types: :data:`~.base.FileNames`,
:data:`~.base.Target`, :data:`~.base.StorageOptions` and :data:`~.registry.Openable`."""

from .base import RESUMABLE, WEIGHTS, Facts, FileNames, Format, StorageOptions, Target
from .registry import (
    FILE_FORMATS,
    FOLDER_FORMATS,
    FORMATS,
    Openable,
    deep_checks,
    detect_file,
    detect_folder,
    format_named,
    label_of,
    model_folder,
    open_checkpoint,
    open_source,
    probe,
    resolve,
    verify_contents,
)

__all__ = ["FILE_FORMATS", "FOLDER_FORMATS", "FORMATS", "RESUMABLE", "WEIGHTS", "Facts", "FileNames", "Format",
           "Openable", "StorageOptions", "Target", "deep_checks", "detect_file", "detect_folder", "format_named",
           "label_of", "model_folder", "open_checkpoint", "open_source", "probe", "resolve", "verify_contents"]
