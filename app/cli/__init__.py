"""The ``shardscope`` command: one module per subcommand, all following one exit-code contract.

``main`` is the entry point; the contract (codes and the one-line error) is in :mod:`.main` and
:mod:`shardscope.backend.errors`.
"""

from .main import main

__all__ = ["main"]
