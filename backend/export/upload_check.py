"""What an upload to a URL sent and what its commit proved (the export summary's ``uploaded:`` line)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sent:
    """One uploaded object: its size and, when sent with checksums, the CRC32 of the whole staged file
    and (multipart) S3's composite checksum (the CRC32 of the parts' CRC32s, ``-N``)."""

    size: int
    requests: int = 1
    crc32: str | None = None
    composite: str | None = None

    def matches(self, stored: str) -> bool:
        """True when a stored ``ChecksumCRC32`` (full-object, or composite with or without ``-N``) is ours."""
        value = stored.split("-", 1)[0]
        return value in (self.crc32, (self.composite or "").split("-", 1)[0])


@dataclass
class UploadCheck:
    """What a commit proved about the uploaded objects (the summary's ``uploaded:`` line)."""

    objects: int = 0
    requests: int = 0  # PUTs and parts
    by_crc32: int = 0  # final objects that report the staged file's CRC32 (sent with every PUT/part)
    checksummed: bool = False  # every PUT and part carried a CRC32 the server checks on receipt
    unreadable: int = 0  # final objects these credentials may write but not read back

    def add(self, sent: Sent, crc_confirmed: bool, readable: bool = True) -> None:
        """Count one final object."""
        self.objects += 1
        self.requests += sent.requests
        self.by_crc32 += crc_confirmed
        self.unreadable += not readable

    def describe(self) -> str:
        """Exactly what was checked, in one sentence."""
        n = f"{self.objects} object{'s' if self.objects != 1 else ''}"
        readable = self.objects - self.unreadable
        denied = (f"{self.unreadable} of {self.objects} final objects could not be read back with these credentials "
                  "(access denied), so nothing was checked after their upload") if self.unreadable else ""
        if not self.checksummed:
            sizes = (f"{n}; each final object's size equals the staged file's (the uploaded bytes themselves were "
                     "not checked)") if readable else n
            return "; ".join(p for p in (sizes, denied) if p)
        text = (f"{n} in {self.requests} PUT{'s' if self.requests != 1 else ''}/parts, each sent with the CRC32 of "
                "its bytes as read from the staged file, which the server checks on receipt (S3 refuses a mismatch)")
        if self.by_crc32 == readable:
            tail = "every final object reports the staged file's CRC32" if readable else ""
        else:
            tail = (f"{self.by_crc32} of {readable} final objects report the staged file's CRC32, the others were "
                    "checked by size only")
        return "; ".join(p for p in (text, tail, denied) if p)


__all__ = ["Sent", "UploadCheck"]
