"""libc calls the ``os`` and ``mmap`` modules do not offer: ``mincore``, ``sync_file_range``
and a ``madvise`` that lets other threads run.

All serve as hints or queries for speed only: where libc or the call is missing (not Linux, a
libc without it), the name is None and callers do without.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Callable
from typing import Any, Final

__all__ = ["SYNC_FILE_RANGE_WRITE", "madvise", "mincore", "sync_file_range"]

#: ``sync_file_range`` flag: start writeback of the range's dirty pages, do not wait.
SYNC_FILE_RANGE_WRITE: Final = 2


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """libc, loaded once: ``find_library`` runs ``ldconfig`` (~2 ms) on every call."""
    if os.name != "posix":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except (OSError, TypeError):  # pragma: no cover - depends on the libc
        return None


def _libc_function(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    libc = _libc()
    if libc is None:
        return None
    try:
        fn = getattr(libc, name)
    except AttributeError:  # pragma: no cover - depends on the libc
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


#: ``mincore(addr, length, vec)``: which pages of a mapping are in memory (bit 0 of each byte).
mincore: Final = _libc_function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])

#: ``sync_file_range(fd, offset, nbytes, flags)`` (Linux only).
sync_file_range: Final = (
    _libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
    if sys.platform.startswith("linux")
    else None
)

#: ``madvise(addr, length, advice)``. ``mmap.mmap.madvise`` holds the GIL for the whole call,
#: and the advice used here does the work of the call inside it (``MADV_POPULATE_WRITE`` zeroes
#: the memory it faults in, ``MADV_POPULATE_READ`` waits for the disk), so threads asking for
#: it took turns: two threads populating 512 MiB of huge pages ran at ~10 GB/s through
#: ``mmap.madvise`` and at ~16.6 GB/s through this call, which releases the GIL (ctypes does for
#: every foreign call).
madvise: Final = _libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])


def _libc_mmap() -> Callable[..., int | None] | None:
    """libc's ``mmap`` (64-bit POSIX only: ``off_t`` as an int64)."""
    libc = _libc()
    if libc is None or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        fn = libc.mmap
    except AttributeError:  # pragma: no cover - every POSIX libc has it
        return None
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int64,
    ]
    fn.restype = ctypes.c_void_p
    return fn


#: ``mmap(addr, length, prot, flags, fd, offset)`` from libc, or None.
libc_mmap: Final = _libc_mmap()
#: ``mmap`` flags the ``mmap`` module does not name before Python 3.13 (Linux and macOS share
#: MAP_FIXED; MAP_NORESERVE is Linux's, a hint, left out elsewhere).
MAP_FIXED: Final = 0x10
MAP_NORESERVE: Final = 0x4000 if sys.platform.startswith("linux") else 0
