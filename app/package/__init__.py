"""Shardscope: browse, train and export PyTorch distributed checkpoints.

``from shardscope import report`` is the metrics API for training scripts; it needs no Qt.
"""

from shardscope.backend.version import __version__


def report(**values):
    """Record metrics of the current step (``report(step=s, loss=l, lr=...)``); no-op outside a run."""
    from shardscope.backend.runs.report import report as _report

    return _report(**values)


__all__ = ["__version__", "report"]
