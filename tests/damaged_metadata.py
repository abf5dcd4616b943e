"""What the tests of hostile and damaged DCP metadata share: the entry they damage, the CLI run in a
subprocess with its peak memory, the check that a run ended cleanly (an expected exit code, no traceback),
writing a ``.metadata`` (also one that would run a command) and finding a chunk's index in it, and a memo-table
bomb."""

from __future__ import annotations

import pickle
import subprocess

from conftest import run_cli_peak
from torch.distributed.checkpoint.metadata import MetadataIndex

FQN = "model.blocks.0.fc1.weight"


def run_measured(*args: object, timeout: float = 300) -> tuple[subprocess.CompletedProcess, int]:
    """Run the CLI in a subprocess; the exit code, output and its peak RSS in MiB."""
    return run_cli_peak(*args, timeout=timeout)


def clean(proc: subprocess.CompletedProcess, codes: tuple[int, ...] = (2,)) -> None:
    assert proc.returncode in codes, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr


class _Touch:
    """A pickle that, if ever unpickled, runs ``touch <marker>``."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def write_evil_metadata(folder, marker) -> None:
    """A ``.metadata`` whose pickle calls ``os.system`` (creating ``marker``) when loaded with plain pickle."""
    (folder / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))


def save_metadata(folder, md, protocol: int = 2) -> bytes:
    data = pickle.dumps(md, protocol=protocol)
    (folder / ".metadata").write_bytes(data)
    return data


def index_of(md, fqn: str, offsets) -> MetadataIndex:
    return next(k for k in md.storage_data if k.fqn == fqn and tuple(k.offset) == tuple(offsets))


def memo_bomb(folder) -> bytes:
    """A 9-byte .metadata whose LONG_BINPUT index makes CPython's C unpickler zero-fill an 11 GB memo table
    (found by fuzzing: 0.5-1.5 GB from a 30 KB file before the address-space limit)."""
    data = b"\x80\x02]r" + (0x2A05F200).to_bytes(4, "little") + b"."
    (folder / ".metadata").write_bytes(data)
    (folder / "__0_0.distcp").write_bytes(b"x")
    return data
