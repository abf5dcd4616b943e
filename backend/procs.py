"""Process helpers shared by the run launcher and the exporters' stale-temporary cleanup."""

from __future__ import annotations

import os
from typing import Any


def pid_alive(pid: Any) -> bool:
    """True if a process with this pid exists (also when it is another user's)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
