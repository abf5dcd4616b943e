"""Writers over the one chunk reader: a plan (what goes where), one atomic output, one verifier,
one result type, and a writer per format (safetensors, torch archive, DCP for import and reshard)."""

from .plan import ExportError, ExportPlan, format_for, plan_export
from .result import ExportResult
from .writers import export

__all__ = ["ExportError", "ExportPlan", "ExportResult", "export", "format_for", "plan_export"]
