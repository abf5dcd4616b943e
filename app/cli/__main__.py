"""``python -m shardscope.app.cli``: the same as the ``shardscope`` command."""

import sys

from .main import main

sys.exit(main())
