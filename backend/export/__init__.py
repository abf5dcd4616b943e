"""Writers over the one chunk reader: a plan (what goes where), one atomic output, one verifier,
one result type, and a writer per format (safetensors, torch archive, DCP for import and reshard), each
registered once in ``registry.WRITERS``."""

from .plan import ExportError, ExportPlan
from .planner import plan_export
from .registry import WRITERS, Writer, check_request, export_formats, parse_shard_size, writer
from .result import ExportResult
from .writers import export

__all__ = ["WRITERS", "ExportError", "ExportPlan", "ExportResult", "Writer", "check_request", "export",
           "export_formats", "parse_shard_size", "plan_export", "writer"]
