"""What the page cache holds of a file (``mincore``, sampled), and a read-ahead thread.

Strategies differ for warm and cold files: a cold range is worth reading ahead, or reading
with direct I/O, where a warm one is copied from as it is. The answers are samples and hints:
where the kernel cannot say, callers take the warm path.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Iterator
from typing import Final

import numpy as np

from ._syscalls import mincore

__all__ = [
    "READ_AHEAD_MIN",
    "mapped_mostly_uncached",
    "mostly_uncached",
    "read_ahead",
    "resident_fraction",
]

#: A range with at least this fraction of its pages cached counts as cached: it is copied from
#: as it is, with no read-in (mapped slices) and no read-ahead thread (large preads).
_MOSTLY_RESIDENT: Final = 0.5

#: ``resident_fraction`` looks at this many windows of a long range...
_RESIDENCY_WINDOWS: Final = 8

#: ... of this many pages each (mincore walks the page cache page by page: asking about all of
#: a 2 GiB mapping took 30-40 ms, as long as a fifth of a warm column split).
_RESIDENCY_WINDOW_PAGES: Final = 8


def mapped_mostly_uncached(address: int, length: int) -> bool:
    """Whether most (sampled) pages of mapped memory are not in memory; False if unknown."""
    fraction = resident_fraction(address, length)
    return fraction is not None and fraction < _MOSTLY_RESIDENT


def resident_fraction(address: int, length: int) -> float | None:
    """Estimated fraction of the pages of ``[address, address + length)`` (mapped memory) that
    are in memory, or None where the kernel cannot say.

    Long ranges are sampled: 8 windows of 8 pages, evenly spread.
    """
    if mincore is None or length <= 0:
        return None
    page = mmap.PAGESIZE
    start = address - address % page
    pages = -(-(address + length - start) // page)
    window = _RESIDENCY_WINDOW_PAGES
    if pages <= _RESIDENCY_WINDOWS * window * 4:
        firsts = [0]
        window = pages
    else:
        stride = (pages - window) // (_RESIDENCY_WINDOWS - 1)
        firsts = [i * stride for i in range(_RESIDENCY_WINDOWS)]
    vec = np.empty(window, np.uint8)
    resident = 0
    for first in firsts:
        if mincore(start + first * page, window * page, vec.ctypes.data) != 0:
            return None
        resident += int(np.count_nonzero(vec & 1))
    return resident / (len(firsts) * window)


#: Reads at least this large get a read-ahead thread when most of their range is uncached.
READ_AHEAD_MIN: Final = 256 << 20

#: Window of each ``POSIX_FADV_WILLNEED`` the read-ahead thread issues.
_READ_AHEAD_STEP: Final = 2 << 20


def mostly_uncached(fd: int, offset: int, nbytes: int) -> bool:
    """Whether most of ``[offset, offset + nbytes)`` of a file is not in the page cache.

    Sampled with ``mincore`` over a temporary mapping, which reads nothing; False where that
    cannot be done.
    """
    if mincore is None or nbytes <= 0:
        return False
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        with mmap.mmap(fd, offset + nbytes - start, offset=start, access=mmap.ACCESS_READ) as m:
            view = np.frombuffer(m, np.uint8)
            try:
                return mapped_mostly_uncached(view.ctypes.data + offset - start, nbytes)
            finally:
                del view  # the mapping cannot close while exported
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def read_ahead(fd: int, offset: int, nbytes: int) -> Iterator[None]:
    """Keep the disk busy ahead of a large read of a cold file while the body runs.

    The reader threads each wait for their own piece, and the kernel's readahead reads only a
    window ahead of each, so between windows the disk idles. A separate thread asks for the
    whole range in 2 MiB windows (``POSIX_FADV_WILLNEED``, which queues the reads and returns
    once they are submitted), front to back at the disk's pace, and stops when the body ends.
    A cold 2 GiB load took 1.14-1.41 s this way against 1.26-1.57 s without (six interleaved
    pairs, five of them faster; 8 MiB windows were bimodal, up to 2.2 s). Warm or small reads
    are left alone.
    """
    if (
        nbytes < READ_AHEAD_MIN
        or not hasattr(os, "posix_fadvise")
        or not mostly_uncached(fd, offset, nbytes)
    ):
        yield
        return
    done = threading.Event()
    end = offset + nbytes

    def ask() -> None:
        for at in range(offset, end, _READ_AHEAD_STEP):
            if done.is_set():
                return
            try:
                os.posix_fadvise(fd, at, min(_READ_AHEAD_STEP, end - at), os.POSIX_FADV_WILLNEED)
            except OSError:
                return

    thread = threading.Thread(target=ask, name="pysafetensors-read-ahead", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
