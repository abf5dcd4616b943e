"""Comparing checkpoints (DCP folders, consolidated .pt and safetensors files) tensor by tensor."""

from .diff import DiffResult, diff
from .sources import Source, open_source

__all__ = ["DiffResult", "Source", "diff", "open_source"]
