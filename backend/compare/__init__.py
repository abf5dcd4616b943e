"""Comparing checkpoints (DCP folders, consolidated .pt and safetensors files) tensor by tensor."""

from .diff import DiffResult, diff

__all__ = ["DiffResult", "diff"]
