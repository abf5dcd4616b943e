"""The one result type of every writer (export, import, reshard)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..text import count, human_bytes


@dataclass
class ExportResult:
    """What a writer did; ``verified`` is True only when every written byte range was re-read and
    matched the source bytes (None: not verified; False: a mismatch, nothing was committed)."""

    dst: str
    files: list[str]
    tensors: int
    bytes: int
    seconds: float
    format: str = ""
    ranks: int | None = None  # DCP outputs: written as this many ranks
    left_out: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. the layout recognised
    verified: bool | None = None
    verified_what: str = ""  # what exactly was proven, printed after "verified:"
    mismatches: list[str] = field(default_factory=list)
    uploaded: str = ""  # URL destinations: how the upload of the verified staged copy was checked
    kept: list[str] = field(default_factory=list)  # --force over a folder: its entries that are not an export's

    def summary(self) -> str:
        """The lines the CLI prints and the dialog shows."""
        if self.verified is False:
            return (f"VERIFICATION FAILED: {count(len(self.mismatches), 'tensor differs', 'tensors differ')} "
                    f"from the source ({', '.join(self.mismatches[:5])}); nothing was written to {self.dst}.")
        how = f" as {count(self.ranks, 'rank')}" if self.ranks else ""
        lines = [*self.notes,
                 f"wrote {self.dst}: {count(self.tensors, 'tensor')}, {human_bytes(self.bytes)}{how} "
                 f"in {self.seconds:.1f} s"
                 + (f" ({len(self.files)} files)" if len(self.files) > 1 else "")]
        if self.verified and not self.tensors:
            lines.append("verified: nothing (no tensor was written; the file was read back only as a structure)")
        elif self.verified:
            staged = " (the local staged copy, before its upload)" if self.uploaded else ""
            lines.append(f"verified{staged}: {self.verified_what}")
        if self.uploaded:
            lines.append(f"uploaded: {self.uploaded}")
        if self.kept:
            lines.append(f"kept in the folder (not written by an export): {', '.join(self.kept[:8])}"
                         + (f" and {len(self.kept) - 8} more" if len(self.kept) > 8 else ""))
        lines += [f"left out: {note}" for note in self.left_out]
        return "\n".join(lines)


WriteResult = ExportResult

__all__ = ["ExportResult", "WriteResult"]
