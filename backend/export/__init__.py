"""Writers over the one chunk reader: safetensors (single or sharded) and torch ``.pt``."""

from .plan import ExportError, ExportPlan, format_for, plan_export
from .writers import ExportResult, export

__all__ = ["ExportError", "ExportPlan", "ExportResult", "export", "format_for", "plan_export"]
