"""Letting go of the pages of a read-only file mapping that have been read.

A mapping keeps every page it has touched in the process's resident set (file-backed: page
cache, reclaimable, but counted), so reading a whole mapped file once leaves all of it
resident. ``madvise(MADV_DONTNEED)`` on a range of a file mapping that was never written
unmaps its pages from this process only: they stay in the page cache, and a later read of
the range maps them again (the same bytes). On anonymous memory, or on private file pages
that were written, it would throw the contents away, so ranges are dropped only inside the
mappings of a named file, found in ``/proc/self/maps``.
"""

from __future__ import annotations

import mmap
import os
from typing import Final

from ._syscalls import madvise

__all__ = ["drop_mapped_pages", "file_mappings"]

_PAGE: Final = mmap.PAGESIZE
_DONTNEED: Final = getattr(mmap, "MADV_DONTNEED", None)


def file_mappings(path: str) -> list[tuple[int, int]]:
    """The address ranges ``[start, end)`` at which this process maps the file at ``path``
    (matched by device and inode); empty where that cannot be told (no ``/proc``) or pages
    cannot be dropped (no ``madvise``)."""
    if madvise is None or _DONTNEED is None:
        return []
    try:
        st = os.stat(path)
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            lines = maps.readlines()
    except OSError:
        return []
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    found: list[tuple[int, int]] = []
    for line in lines:
        # start-end perms offset dev inode [path]
        fields = line.split(None, 5)
        if len(fields) < 5 or fields[3] != dev or fields[4] != str(st.st_ino):
            continue
        start, _, end = fields[0].partition("-")
        found.append((int(start, 16), int(end, 16)))
    return found


def drop_mapped_pages(address: int, length: int, maps: list[tuple[int, int]]) -> None:
    """Unmap from this process the whole pages of ``[address, address + length)``, where the
    range lies inside one of ``maps`` (see :func:`file_mappings`; never written to); a hint,
    nothing happens where it cannot be given."""
    if madvise is None or _DONTNEED is None or length <= 0:
        return
    low = -(-address // _PAGE) * _PAGE  # whole pages only: neighbours keep theirs
    high = (address + length) // _PAGE * _PAGE
    if high <= low or not any(start <= low and high <= end for start, end in maps):
        return
    madvise(low, high - low, _DONTNEED)
