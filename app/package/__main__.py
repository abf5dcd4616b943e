"""``python -m shardscope``: the same as the ``shardscope`` command."""

import sys

from shardscope.app.cli import main

sys.exit(main())
