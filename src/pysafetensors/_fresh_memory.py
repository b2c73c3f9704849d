"""Fresh memory to read into: huge pages while they fault in fast, 4 KiB pages otherwise.

A load must supply fresh memory, which the kernel zeroes as it faults it in; in huge pages that
is several times cheaper while the machine has them at hand, and several times dearer when it
does not (see :class:`_HugeRegion`). Also the ``madvise`` helpers that fault memory in ahead of
the reads, which memory maps use as well.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import threading
import time
from typing import Final

import numpy as np

from . import tuning
from ._reader_pool import READ_THREADS, run_parallel
from ._syscalls import madvise

__all__ = [
    "MADV_POPULATE_READ",
    "POPULATE_STEP",
    "address_of",
    "advise_range",
    "empty_bytes",
    "huge_region",
    "numpy_empty",
]

# Whether fresh destinations use huge pages is ``tuning``'s ``hugepage_destinations``.
_HUGEPAGE_LOCK = threading.Lock()


def _new_lock_in_child() -> None:
    # A child forked while another thread held the lock would wait for it forever: that
    # thread does not exist in the child.
    global _HUGEPAGE_LOCK
    _HUGEPAGE_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)

#: Destinations at least this large are candidates for huge pages. Tensor-parallel slices are
#: mostly 4-32 MiB each: 256 MiB of row slices of a 2 GiB file took ~100 ms to read into 4 KiB
#: pages (faulted in at ~2 GB/s) and ~70 ms into huge pages, measured.
_HUGEPAGE_MIN: Final = 4 << 20

#: Destinations smaller than this are too short to tell slow huge pages by their own steps
#: (:data:`_SLOW_STEPS` of them): they use huge pages only while no destination has met slow
#: ones in the last :data:`_SLOW_MEMORY_HOLD` seconds.
_SELF_PROBED_MIN: Final = 64 << 20

_SLOW_MEMORY_HOLD: Final = 5.0

#: Fault-in rate (bytes/s, per thread) below which a step counts as slow: 4 KiB pages fault in
#: at ~2 GB/s here, fast huge pages at 6-11 GB/s, slow ones at ~0.5 GB/s.
_HUGEPAGE_MIN_RATE: Final = 1e9

#: Consecutive slow steps that switch the rest of a destination to 4 KiB pages.
_SLOW_STEPS: Final = 3


def _collections() -> int:
    """Collections of the cyclic garbage collector so far. A step timed across one also timed
    the wait for the GIL, which the collection holds (a full one walks torch's whole object
    graph: 70-90 ms in a fresh process), and says nothing about the memory: such a step counts
    neither way. Without this, a collection that fell in a load's first steps made it give up
    huge pages (4 KiB pages for the rest of a 256 MiB row split).

    Read from the collector's own counts, not counted by a ``gc.callbacks`` function: Python
    runs a pending signal's handler at the first Python code after a collection, which was
    that callback, and the collector discards what a callback raises ("Exception ignored"),
    so a Ctrl-C that came during any collection in the process was lost (the command ran on
    and exited 0). A collection another thread ran while a step waited holds the GIL until it
    ends, so it is counted when the step's thread reads this again.
    """
    return sum(generation["collections"] for generation in gc.get_stats())


# The populate advices: Linux >= 5.14, not exported by the mmap module.
_MADV_POPULATE_WRITE: Final = 23
MADV_POPULATE_READ: Final = 22

#: Bytes a destination is faulted in by per ``madvise`` call (and the alignment of the reads
#: that follow it, so each read lands in memory already faulted in).
POPULATE_STEP: Final = 4 << 20


def numpy_empty(nbytes: int, hugepages: bool) -> np.ndarray:
    """``np.empty(nbytes, uint8)`` with numpy's huge-page advice switched to ``hugepages``."""
    core = getattr(np, "_core", None) or getattr(np, "core", None)
    setter = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
    if setter is None:  # pragma: no cover - numpy without the switch
        return np.empty(nbytes, np.uint8)
    # numpy's switch is process-wide: flip it only around our own allocation.
    with _HUGEPAGE_LOCK:
        previous = setter(hugepages)
        try:
            return np.empty(nbytes, np.uint8)
        finally:
            setter(previous)


def address_of(mapping: mmap.mmap) -> int:
    """The address of a mapping's first byte (0 for an empty one)."""
    return int(np.frombuffer(mapping, np.uint8).ctypes.data) if len(mapping) else 0


def advise_range(mapping: mmap.mmap, address: int, start: int, length: int, advice: int) -> None:
    """``madvise`` on ``[start, start + length)`` of ``mapping`` (at ``address``), with the GIL
    released where libc's call is available (see :data:`._syscalls.madvise`).

    Raises:
        OSError: The kernel refused the advice.
    """
    if madvise is None:
        mapping.madvise(advice, start, length)  # (map_file's maps start at the file here)
        return
    if madvise(address + start, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class _HugeRegion:
    """A fresh anonymous mapping faulted in in huge pages for as long as they are fast.

    Whether a huge page is cheap depends on the machine's state, not on the code: on the VMs
    measured, huge pages drawn from memory the guest had used recently faulted in at 6-11 GB/s
    (a 2 GiB warm load then took ~0.45 s instead of ~0.7 s), but drawn from memory it had not
    touched they crawled at ~0.5 GB/s (3-5 s for 2 GiB), and a process typically got some of
    each, fast first. So the region is faulted in (``MADV_POPULATE_WRITE``) in 4 MiB steps,
    each timed; after three slow steps in a row the rest of the region is switched to 4 KiB
    pages (``MADV_NOHUGEPAGE``), which reads then fault in as usual. Faulting huge pages in
    ahead of a read, rather than inside it, was itself several times faster.
    """

    #: ``time.monotonic()`` until which small destinations skip huge pages (a destination met
    #: slow ones; the next are likely drawn from the same memory).
    slow_until: float = 0.0

    def __init__(self, region: mmap.mmap, nbytes: int) -> None:
        self._region = region
        self._address = address_of(region)
        self.nbytes = nbytes
        self._slow = threading.Event()
        self._slow_steps = 0  # consecutive slow steps (single hiccups happen in fast memory too)

    @classmethod
    def create(cls, nbytes: int) -> _HugeRegion | None:
        """A region whose first step is faulted in, or None where this cannot be done (no
        ``MADV_POPULATE_WRITE``, not Linux)."""
        if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
            return None
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
        try:
            region = mmap.mmap(-1, nbytes, flags=flags)
            region.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, ValueError):
            return None
        made = cls(region, nbytes)
        try:
            made.populate(0, min(nbytes, POPULATE_STEP), strict=True)
        except OSError:
            region.close()
            return None
        return made

    def populate(self, start: int, length: int, *, strict: bool = False) -> None:
        """Fault in ``[start, start + length)`` step by step, until the steps turn slow.

        A failing step (``ENOMEM`` under a memory limit, a pending signal) ends the faulting
        in, like slow steps do: the reads then fault pages in as usual and meet the same
        condition where they would have anyway. ``strict`` raises instead (the first step,
        which tells whether the kernel supports this at all).
        """
        end = min(self.nbytes, start + length)
        start -= start % mmap.PAGESIZE  # madvise wants page-aligned starts
        while start < end and not self._slow.is_set():
            step = min(POPULATE_STEP, end - start)
            collections = _collections()
            began = time.perf_counter()
            try:
                advise_range(self._region, self._address, start, step, _MADV_POPULATE_WRITE)
            except OSError:
                if strict:
                    raise
                self._give_up()
                return
            elapsed = time.perf_counter() - began
            start += step
            if collections != _collections():
                continue  # a collection held the GIL meanwhile: not a measure of the memory
            if step >= _HUGEPAGE_MIN_RATE * elapsed:
                self._slow_steps = 0
                continue
            self._slow_steps += 1
            if self.nbytes < _SELF_PROBED_MIN or self._slow_steps >= _SLOW_STEPS:
                # Slow memory, as far as this region can tell: the next small destinations
                # start in 4 KiB pages.
                _HugeRegion.slow_until = time.monotonic() + _SLOW_MEMORY_HOLD
            if self._slow_steps >= _SLOW_STEPS:
                self._give_up()

    def _give_up(self) -> None:
        if self._slow.is_set():
            return
        self._slow.set()
        # Pages already faulted in stay huge; all others get 4 KiB pages.
        with contextlib.suppress(OSError):
            self._region.madvise(mmap.MADV_NOHUGEPAGE)

    def array(self) -> np.ndarray:
        """The region as a uint8 array (which keeps the mapping alive through the buffer
        protocol; it is unmapped with the last view)."""
        return np.frombuffer(self._region, np.uint8)


def _hugepages_worth_trying(nbytes: int) -> bool:
    """Whether a fresh destination of ``nbytes`` should start in huge pages ("auto" mode)."""
    if tuning.settings().hugepage_destinations != "auto" or nbytes < _HUGEPAGE_MIN:
        return False
    return nbytes >= _SELF_PROBED_MIN or time.monotonic() >= _HugeRegion.slow_until


def huge_region(nbytes: int) -> _HugeRegion | None:
    """A huge-page region of ``nbytes``, or None where huge pages are not worth trying."""
    if not _hugepages_worth_trying(nbytes):
        return None
    return _HugeRegion.create(nbytes)


def _probed_hugepages(nbytes: int) -> np.ndarray | None:
    """A huge-page destination faulted in ahead of any read (by one thread per core), or None."""
    region = _HugeRegion.create(nbytes)
    if region is None:
        return None
    # One thread per core: the work is zeroing memory, and more threads than cores would
    # each see a fraction of a core and mistake it for slow pages.
    cores = max(1, min(READ_THREADS, os.cpu_count() or 1))
    run_parallel(
        lambda start: region.populate(start, POPULATE_STEP),
        range(POPULATE_STEP, nbytes, POPULATE_STEP),
        cores,
    )
    return region.array()


def empty_bytes(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array to read into, in huge pages as ``tuning`` chooses."""
    mode = tuning.settings().hugepage_destinations
    if nbytes < (4 << 20) or mode is True:
        return np.empty(nbytes, np.uint8)
    if _hugepages_worth_trying(nbytes):
        probed = _probed_hugepages(nbytes)
        if probed is not None:
            return probed
    return numpy_empty(nbytes, False)
