"""Where a zip's central directory is, as torch's reader (miniz) and Python's ``zipfile`` find it.

Both start from the end-of-central-directory record and, when a zip64 locator stands right
before it, from a zip64 end record, but not the same one: miniz reads the zip64 record where
the locator points (newer versions try right before it first), ``zipfile`` the one right
before the locator. Each falls back on the plain
end record when its zip64 record has no signature. ``zipfile`` then assumes the directory ends
where the end records begin and shifts every offset by any difference ("data prepended to the
archive"); miniz reads the directory at the stated offset. The converter refuses an archive
that the two would read differently, the scanner grades it dangerous; both read the records
here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

__all__ = [
    "EOCD",
    "EOCD_SIG",
    "LOCAL_SIG",
    "ZIP64_EOCD",
    "ZIP64_EOCD_SIG",
    "ZIP64_LOCATOR",
    "ZIP64_LOCATOR_SIG",
    "Directory",
    "EndRecords",
    "end_records",
]

#: The signature of a local file header, the first bytes of any zip that ``torch.load`` and
#: this package's converter and scanner open as one.
LOCAL_SIG: Final = b"PK\x03\x04"
EOCD_SIG: Final = b"PK\x05\x06"
ZIP64_LOCATOR_SIG: Final = b"PK\x06\x07"
ZIP64_EOCD_SIG: Final = b"PK\x06\x06"
EOCD: Final = struct.Struct("<4sHHHHIIH")
ZIP64_LOCATOR: Final = struct.Struct("<4sIQI")
ZIP64_EOCD: Final = struct.Struct("<4sQHHIIQQQQ")


@dataclass(frozen=True, slots=True)
class Directory:
    """The central directory as one reader takes it from the end records."""

    offset: int
    """Where the end record used says the directory starts."""
    size: int
    """Its stated size in bytes."""
    entries: int
    """Entries in the whole archive."""
    records: int
    """Where the end records used begin (the zip64 record, or the plain end record)."""
    spans_disks: bool
    """The record names another disk, or counts entries on this disk and in all apart."""


@dataclass(frozen=True, slots=True)
class EndRecords:
    """A zip's end records, read as miniz and as ``zipfile`` read them."""

    eocd: int
    """Offset of the end-of-central-directory record."""
    locator: int | None
    """Offset of the zip64 locator right before it, if there is one."""
    located: int
    """Where the locator points (0 without one)."""
    locator_spans_disks: bool
    """The locator names another disk or several."""
    miniz: Directory
    zipfile: Directory


def end_records(read_at: Callable[[int, int], bytes], size: int, eocd: int) -> EndRecords:
    """Read the end records of a zip of ``size`` bytes whose end record is at ``eocd``.

    Args:
        read_at: ``read_at(offset, n)`` returns the ``n`` bytes at ``offset``; it is only asked
            for ranges inside ``0 .. size``.
        size: The archive's size.
        eocd: Offset of the end record, which must lie whole inside the archive.
    """
    plain = _directory(EOCD.unpack(read_at(eocd, EOCD.size))[1:7], eocd)
    locator, located, locator_spans_disks = None, 0, False
    miniz = zipfile = plain
    loc_at = eocd - ZIP64_LOCATOR.size
    if loc_at >= 0 and read_at(loc_at, 4) == ZIP64_LOCATOR_SIG:
        _, disk, located, disks = ZIP64_LOCATOR.unpack(read_at(loc_at, ZIP64_LOCATOR.size))
        locator, locator_spans_disks = loc_at, disk != 0 or disks > 1
        # miniz looks for a zip64 record only when it and the locator fit before the end
        # record; zipfile's, right before the locator, would start before the file otherwise.
        if loc_at >= ZIP64_EOCD.size:
            miniz = _zip64(read_at, size, located) or plain
            zipfile = _zip64(read_at, size, loc_at - ZIP64_EOCD.size) or plain
    return EndRecords(eocd, locator, located, locator_spans_disks, miniz, zipfile)


def _directory(fields: tuple[int, ...], at: int) -> Directory:
    """The directory that a record at ``at`` states with (disk, directory disk, entries on this
    disk, entries in all, directory size, directory offset)."""
    disk, cd_disk, n_here, n_total, cd_size, cd_offset = fields
    return Directory(cd_offset, cd_size, n_total, at, bool(disk or cd_disk or n_here != n_total))


def _zip64(read_at: Callable[[int, int], bytes], size: int, at: int) -> Directory | None:
    """The directory a zip64 end record at ``at`` states, if one is there."""
    if at < 0 or at + ZIP64_EOCD.size > size:
        return None
    rec = ZIP64_EOCD.unpack(read_at(at, ZIP64_EOCD.size))
    if rec[0] != ZIP64_EOCD_SIG:
        return None
    return _directory(rec[4:], at)
