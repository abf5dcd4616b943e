"""Process helpers shared by the run launcher and the exporters' stale-temporary cleanup."""

from __future__ import annotations

import os
import signal
from typing import Any


def pid_alive(pid: Any, group: bool = False) -> bool:
    """True if a process with this pid (or, with ``group``, a process group with this id) exists,
    also when it is another user's."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        (os.killpg if group else os.kill)(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_started(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch, as the kernel says), None when it is gone: with
    the pid, it names one process for good (a pid alone is reused once its process has ended)."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def process_running(pid: Any, started: Any = None) -> bool:
    """True while process ``pid`` runs: it exists, is not a zombie (ended, not yet waited for) and, when
    ``started`` (see :func:`process_started`) is given, is the process that started then, not a later one
    that was given the same pid."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return not isinstance(started, (int, float)) or abs(proc.create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # another user's process: it exists
        return True


def send_signal(pid: int, sig: int, group: bool = False) -> None:
    """Signal a process (or a process group); one that is already gone is not an error."""
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate_tree(pid: int, grace: float = 10.0) -> int | None:
    """SIGTERM to ``pid``'s process group and every descendant, SIGKILL to whatever is left after
    ``grace`` seconds. Returns when none of them runs any more (zombies of our own children aside), with
    ``pid``'s exit code (negative: its signal) when it is our child: the wait here reaps it, and a later
    ``Popen.wait()`` would answer 0 for it.

    NOTE: torchrun starts its workers in sessions of their own, so signalling the group alone would
    orphan them if torchrun dies first: every descendant is collected up front."""
    import psutil

    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    send_signal(pid, signal.SIGTERM, group=True)
    for p in family:
        send_signal(p.pid, signal.SIGTERM)
    gone, alive = psutil.wait_procs(family, timeout=grace)
    for p in alive:
        send_signal(p.pid, signal.SIGKILL)
    send_signal(pid, signal.SIGKILL, group=True)
    gone += psutil.wait_procs(alive, timeout=grace)[0]
    code = next((getattr(p, "returncode", None) for p in gone if p.pid == pid), None)
    return int(code) if code is not None else None


def orphaned(folder: str, prefix: str) -> list[str]:
    """Names in ``folder`` of the form ``<prefix><pid>-...`` whose process is gone (not this one):
    temporaries a killed process (``kill -9``) could not remove."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    out = []
    for name in names:
        if not name.startswith(prefix):
            continue
        pid_text = name[len(prefix):].split("-", 1)[0]
        if pid_text.isdigit() and int(pid_text) != os.getpid() and not pid_alive(int(pid_text)):
            out.append(name)
    return out

