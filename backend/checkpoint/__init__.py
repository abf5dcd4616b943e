"""The checkpoint model, its safe reader, layout and health analysis, and the chunk reader."""

from .model import Checkpoint, Chunk, FileInfo, ObjectEntry, Problem, TensorEntry
from .reader import open_checkpoint

__all__ = ["Checkpoint", "Chunk", "FileInfo", "ObjectEntry", "Problem", "TensorEntry", "open_checkpoint"]
