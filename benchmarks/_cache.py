"""Page-cache control for the benchmark: residency (``mincore``), warming and eviction."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import numpy as np

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def residency(path: str) -> float:
    """Fraction of the file's pages in the page cache (``mincore`` over a shared mapping)."""
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = np.zeros(pages, np.uint8)
            if _libc.mincore(addr, size, vec.ctypes.data) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return float(np.count_nonzero(vec & 1)) / pages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def warm(path: str, *, refresh: bool = False) -> float:
    """Read the whole file through the page cache; return the residency afterwards.

    With ``refresh``, the file is dropped from the cache first and always read back, so that
    every repetition starts from the same cache layout. Which layout the cache holds matters
    for mapped loads: read back in one sequential sweep, the file sits in 2 MiB folios, which a
    mapping maps 2 MiB per fault (a touch of every page of 2 GiB took 10-20 ms); after the
    cache has been churned it can hold a mix of smaller folios (the same touch: 85-300 ms).
    Without the refresh the layout was whatever the previous cells left, and every mapped arm
    was bimodal with it.
    """
    if refresh:
        evict(path)
    elif residency(path) >= 0.999:
        return 1.0
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(16 << 20)
        off = 0
        while n := os.preadv(fd, [buf], off):
            off += n
    finally:
        os.close(fd)
    return residency(path)


def evict(path: str) -> float:
    """Drop the file from the page cache (sync first: dirty pages cannot be dropped)."""
    os.sync()
    for _ in range(3):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        res = residency(path)
        if res < 0.01:
            return res
        # Pages still mapped somewhere survive fadvise; the global drop (root only) gets them.
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
        except OSError:
            pass
    return residency(path)


#: The cache state of cells that start from a warm page cache without
#: :func:`warm_free_memory`: the memory the operation draws has not been touched just before.
#: The warm-up favours whichever arm allocates in huge pages (ours does, on a kernel whose
#: transparent huge pages are ``madvise``), so the load target is judged with and without it.
WARM_CACHE_ONLY = "warm, no memory warm-up"


def warm_free_memory(nbytes: int) -> None:
    """Touch and free ``nbytes`` of memory, so that the timed operation starts from used memory.

    Same starting memory for every arm. On the VM measured, memory the guest has not touched
    recently is slow to fault in the first time, most of all in large blocks: a 2 GiB
    huge-page touch took 3-5 s where 4 KiB pages took 1 s, and page-cache writes (which use
    large folios) of the same 2 GiB swung between 0.45 s and 2.8 s for the same code, with
    whichever arm happened to draw untouched memory losing. numpy touches this scratch in
    huge pages, so the blocks the operation then draws have been used. The operation runs
    within a second or two of this call.
    """
    scratch = np.ones(nbytes, np.uint8)
    del scratch
