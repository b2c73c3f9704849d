"""Byte sources: one interface over a memory map, positioned reads, file objects and buffers.

A reader never touches a file directly; it asks a :class:`ByteSource` for byte ranges. Bounds
are checked here, once, so a header that claims bytes past the end of the source can never make
a backend return short data silently.

* :class:`MmapSource` maps the file privately (copy-on-write): views are zero-copy and writable,
  and writes never reach the file.
* :class:`PreadSource` reads with ``os.preadv`` into fresh memory, in parallel threads for large
  ranges (the GIL is released while the kernel copies).
* :class:`FileObjSource` serves any binary file object with ``seek``/``readinto`` (or ``read``).
* :class:`BufferSource` serves bytes already in memory.

Remote sources (HTTP, S3, fsspec) live in ``_remote`` and implement the same protocol.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import mmap
import os
import queue
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import IO, Any, Final, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from . import tuning
from ._errors import ClosedFileError, SafetensorError
from ._format import gc_paused
from ._syscalls import MAP_FIXED, MAP_NORESERVE, libc_mmap, madvise, mincore

__all__ = [
    "MAX_READ_THREADS",
    "BufferSource",
    "ByteSource",
    "FileObjSource",
    "MmapSource",
    "NotRegularFileError",
    "PreadSource",
    "Shared",
    "check_regular",
    "empty_bytes",
    "open_regular_file",
    "read_fresh",
    "read_pieces_into",
    "read_ranges_into",
    "reader_thread_count",
    "run_parallel",
    "starts_like_safetensors",
    "worker_count",
]

#: Reads larger than this are split across threads.
PARALLEL_CHUNK: Final = 16 << 20
#: Smallest piece a read is split into for parallel threads.
MIN_PARALLEL_CHUNK: Final = 2 << 20
#: Reads into fresh memory (:func:`read_fresh`) up to this size are one read on the calling
#: thread. In a fresh process (where the reader threads start at their first read) an 8 MiB
#: LoRA file's data took ~3-4 ms that way against ~4-7 ms in parallel into huge pages; the
#: two met at 16-24 MiB warm and cold, and at 32 MiB the parallel read took ~6 against ~19 ms.
ONE_READ_MAX: Final = 16 << 20
#: Threads used for one large read. Positioned reads release the GIL, so threads overlap the
#: kernel's copies (and, for cold files, the device's queue).
READ_THREADS: Final = max(2, min(8, (os.cpu_count() or 2) * 2))

#: The most reader threads a process keeps, whatever ``threads=`` asks for.
MAX_READ_THREADS: Final = 64

_T = TypeVar("_T")
# Reader threads live for the whole process, in one pool as large as the largest thread count
# asked for so far (at most MAX_READ_THREADS): starting threads for every read cost more than
# the reads themselves for tensors of a few MiB (a row split of a 2 GiB file took ~1.2x longer
# with a pool per read than with a kept one). A call asking for fewer threads runs that many
# workers in the shared pool. (One pool per thread count kept every count ever asked for.)
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOLS_LOCK = threading.Lock()
_WORKER = threading.local()


def _mark_worker() -> None:
    _WORKER.active = True


def _submit(task: Callable[[], None], copies: int) -> list[Future[None]]:
    """Run ``copies`` of ``task`` in the shared pool, grown first (replaced by a larger one)
    to at least ``copies`` workers. Submitting under the lock: a pool being replaced is never
    handed out, so nothing is submitted to one that was shut down."""
    global _POOL, _POOL_SIZE
    with _POOLS_LOCK:
        if _POOL is None or copies > _POOL_SIZE:
            old = _POOL
            _POOL = ThreadPoolExecutor(
                max_workers=copies,
                thread_name_prefix="pysafetensors-read",
                initializer=_mark_worker,
            )
            _POOL_SIZE = copies
            if old is not None:
                old.shutdown(wait=False)  # its threads finish their work, then exit
        return [_POOL.submit(task) for _ in range(copies)]


def reader_thread_count() -> int:
    """How many reader threads the process may keep now (the shared pool's size)."""
    return _POOL_SIZE


def _forget_pools() -> None:
    # A forked child has the pool object but not its threads.
    global _POOL, _POOL_SIZE, _POOLS_LOCK
    _POOL, _POOL_SIZE = None, 0
    _POOLS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def run_parallel(fn: Callable[[_T], object], items: Iterable[_T], threads: int) -> None:
    """Call ``fn`` on every item using up to ``threads`` kept reader threads.

    Items are taken in order by however many workers run (so reads sweep a file front to
    back). Runs inline when there is one item, one thread, or when called from a reader thread
    itself (a read split inside a read already running in parallel): waiting on the same pool
    from one of its own workers could deadlock. The first exception raised by ``fn``
    propagates, and the workers take no new item after it. If the caller is interrupted
    while it waits (``KeyboardInterrupt``), the workers take no new item either, and the
    interrupt is raised only once every worker has returned: callers clean up after the
    work (free buffers, synchronise a device) and must not do so while it still runs. A
    second interrupt is raised at once (a read that hangs must stay interruptible).
    """
    work = list(items)
    threads = min(threads, MAX_READ_THREADS, len(work))
    if threads <= 1 or getattr(_WORKER, "active", False):
        for item in work:
            fn(item)
        return
    pending = iter(work)
    lock = threading.Lock()
    failed = threading.Event()

    def worker() -> None:
        while not failed.is_set():
            with lock:
                item = next(pending, _DONE)
            if item is _DONE:
                return
            try:
                fn(item)  # type: ignore[arg-type]
            except BaseException:
                failed.set()
                raise

    # Waited for in a function of its own: its frame, which holds the futures (and they the
    # exception), is gone before the raise here. Raised from a frame that holds them, the
    # exception and the frame form a cycle that keeps all the traceback reaches (the caller's
    # destination buffer) until the cyclic collector runs.
    error = _run_workers(worker, threads, failed)
    if error is not None:
        try:
            raise error
        finally:
            del error


def _run_workers(
    worker: Callable[[], None], threads: int, failed: threading.Event
) -> BaseException | None:
    """``threads`` copies of ``worker`` on the shared pool, waited for (:func:`_wait_all`).
    Once the interpreter is shutting down (a thread still loading after the main thread
    returned) pools take no more work: this thread then does it all, and a failure is raised
    from here as it happens."""
    try:
        futures = _submit(worker, threads)
    except RuntimeError:
        worker()
        return None
    return _wait_all(futures, failed)


def _wait_all(futures: list[Future[None]], failed: threading.Event) -> BaseException | None:
    """Wait for every worker of :func:`run_parallel`; return what it must raise: an interrupt
    that came while waiting (raised only once every worker has returned), else the first
    worker's exception, else None. A second interrupt is raised at once."""
    interrupted: BaseException | None = None
    errors = []
    for future in futures:
        while True:
            try:
                errors.append(future.exception())  # waits for this worker
                break
            except CancelledError:
                break
            except BaseException as exc:
                if interrupted is not None:
                    raise  # a second interrupt: the caller insists (a read that hangs)
                failed.set()
                interrupted = exc
    if interrupted is not None:
        return interrupted
    return next((e for e in errors if e is not None), None)


_DONE: Final = object()


@runtime_checkable
class ByteSource(Protocol):
    """What a reader needs from storage."""

    @property
    def size(self) -> int:
        """Total number of bytes in the source."""
        ...

    @property
    def name(self) -> str:
        """A printable description for error messages."""
        ...

    def readinto(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; raise if fewer are available."""
        ...

    def view(self, offset: int, length: int) -> memoryview | None:
        """Return a zero-copy view of a range, or None if the source cannot map memory."""
        ...

    def close(self) -> None:
        """Release the resources held by the source."""
        ...


class NotRegularFileError(OSError):
    """A path names a FIFO, socket or device where a file was expected (``errno`` EINVAL)."""


#: Files are mapped at addresses that can take them 2 MiB at a time (see :func:`map_file`).
_HUGE: Final = 2 << 20


def map_file(fd: int, length: int, *, offset: int = 0) -> tuple[mmap.mmap, int]:
    """A private, copy-on-write memory map of ``length`` bytes of the open file ``fd`` from
    ``offset`` (a multiple of ``mmap.ALLOCATIONGRANULARITY``); writes stay in the process.
    Returns ``(owner, at)``: the bytes are ``owner[at : at + length]``, and they stay mapped for
    as long as anything views ``owner``.

    A map lives as long as the arrays and tensors that view it, and Python's ``mmap`` holds a
    duplicate of the file's descriptor all that time (the reference's maps hold none): a process
    that kept tensors from more files than its descriptor limit allows ran out. So the map is
    made without one: by ``mmap`` with ``trackfd=False`` from Python 3.13; before that, as an
    anonymous ``mmap`` (which has no descriptor) that libc's ``mmap`` then replaces, in place
    (``MAP_FIXED``), with the file. The ``mmap`` object owns the memory either way and unmaps it
    in C when the last view goes, so no exception (a Ctrl-C) can come between a map and its
    owner. The file goes where its 2 MiB boundaries fall on the address's (``at``), so that
    the kernel can map cached 2 MiB folios a fault each, as it does for maps it places itself
    (a warm 2 GiB load + touch: 17-18 ms so placed, 46 ms mapped a page at a time). Only where
    libc cannot be called, by Python's ``mmap`` as it is.

    Raises:
        ValueError: The range is not inside the file (as ``mmap.mmap`` refuses it: touching
            pages past the end would be SIGBUS).
        OSError: The kernel refused the map (ENOMEM: out of address space or maps).
    """
    if sys.version_info >= (3, 13):  # trackfd is new in 3.13
        owner = mmap.mmap(fd, length, access=mmap.ACCESS_COPY, offset=offset, trackfd=False)
        return owner, 0
    if libc_mmap is None or madvise is None or not length:
        # (Where libc's madvise cannot be called either, the prefetch advises through the
        # mmap object's own.)
        return mmap.mmap(fd, length, access=mmap.ACCESS_COPY, offset=offset), 0
    if offset + length > os.fstat(fd).st_size:
        raise ValueError("mmap length is greater than file size")
    # Address space only (MAP_NORESERVE: no memory is set aside for it), then the file over it;
    # room to slide it to the 2 MiB phase of its offset where it is large enough to care.
    room = _HUGE if length >= _HUGE else 0
    owner = mmap.mmap(-1, length + room, flags=mmap.MAP_PRIVATE | MAP_NORESERVE)
    base = _address_of(owner)
    at = (offset - base) % _HUGE if room else 0
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    got = libc_mmap(base + at, length, prot, mmap.MAP_PRIVATE | MAP_FIXED, fd, offset)
    if got != base + at:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))  # the anonymous map goes with ``owner``
    return owner, at


def _special_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return kind
    return "a special file"


def check_regular(path: str, mode: int, *, devices: bool = False) -> None:
    """Raise unless ``mode`` (``st_mode`` of ``path``) is a regular file (or, with
    ``devices``, a character or block device).

    Raises:
        IsADirectoryError: A folder.
        NotRegularFileError: A FIFO, socket or (without ``devices``) device.
    """
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
    if stat.S_ISREG(mode) or (devices and (stat.S_ISCHR(mode) or stat.S_ISBLK(mode))):
        return
    raise NotRegularFileError(errno.EINVAL, f"{_special_kind(mode)}, not a regular file", path)


def open_regular_file(path: str, *, devices: bool = False) -> int:
    """Open a local file for reading; return its descriptor (the caller closes it).

    Opened with ``O_NONBLOCK``: ``open(2)`` of a FIFO for reading waits for a writer, for ever
    when none comes, so a FIFO among a model's files (or a folder's files) hung every command.
    The descriptor's type is checked with ``fstat`` (not a ``stat`` before opening, which a
    path swapped meanwhile would defeat); only a regular file is returned, in blocking mode.
    A device (``/dev/zero``, a terminal) is refused as well, its size not being its content,
    unless ``devices`` (``safe_open`` reads one as the reference does, as a file of its
    reported size).

    Raises:
        IsADirectoryError: ``path`` is a folder.
        NotRegularFileError: ``path`` is a FIFO, socket or (without ``devices``) device.
        OSError: ``path`` cannot be opened.
    """
    nonblock = getattr(os, "O_NONBLOCK", 0)
    fd = os.open(
        path,
        os.O_RDONLY | nonblock | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0),
    )
    try:
        check_regular(path, os.fstat(fd).st_mode, devices=devices)
        if nonblock:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def starts_like_safetensors(path: str) -> bool:
    """Whether the local file ``path`` begins as a safetensors file does: a length ``N`` that
    fits the file, then ``{``. No JSON text does (its first 8 bytes would be a length of over
    2**56), so a file named ``*.index.json`` that holds tensors is told from a shard index."""
    try:
        fd = open_regular_file(path)
    except OSError:
        return False
    try:
        head = os.pread(fd, 9, 0)
        size = os.fstat(fd).st_size
    except OSError:
        return False
    finally:
        os.close(fd)
    return len(head) == 9 and head[8:] == b"{" and 8 + int.from_bytes(head[:8], "little") <= size


def pread_exact(fd: int, name: str, offset: int, out: memoryview) -> None:
    """Fill ``out`` from ``offset`` of ``fd`` (loops on short reads; raises at end of file)."""
    done = 0
    total = out.nbytes
    while done < total:
        n = os.preadv(fd, [out[done:]], offset + done)
        if n <= 0:
            raise _short_read(name, offset, total, done)
        done += n


def _check_range(source: ByteSource, offset: int, length: int) -> None:
    if offset < 0 or length < 0 or offset + length > source.size:
        raise SafetensorError(
            f"read of {length} bytes at offset {offset} is outside {source.name} "
            f"({source.size} bytes)",
            kind="OutOfBounds",
            offset=offset,
        )


def _short_read(name: str, offset: int, wanted: int, got: int) -> SafetensorError:
    return SafetensorError(
        f"{name} ended early: wanted {wanted} bytes at offset {offset}, got {got} "
        "(was the file truncated or replaced while open?)",
        kind="ShortRead",
        offset=offset + got,
    )


class BufferSource:
    """A source over bytes already in memory (``bytes``, ``bytearray``, ``memoryview``)."""

    def __init__(self, data: bytes | bytearray | memoryview, name: str = "<buffer>") -> None:
        self._view = memoryview(data).cast("B")
        self._name = name

    @property
    def size(self) -> int:
        return self._view.nbytes

    @property
    def name(self) -> str:
        return self._name

    def readinto(self, offset: int, out: memoryview) -> None:
        _check_range(self, offset, out.nbytes)
        out[:] = self._view[offset : offset + out.nbytes]

    def view(self, offset: int, length: int) -> memoryview | None:
        _check_range(self, offset, length)
        return self._view[offset : offset + length]

    def close(self) -> None:
        # Views handed out stay valid; only drop our reference.
        self._view = memoryview(b"")


# Huge pages for fresh destinations and direct reads are chosen by ``tuning``.
_HUGEPAGE_LOCK = threading.Lock()
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


_MADV_POPULATE_WRITE: Final = 23  # Linux >= 5.14; not exported by the mmap module
_MADV_POPULATE_READ: Final = 22
_POPULATE_STEP: Final = 4 << 20
#: Mapped ranges at least this large are read into the page cache before a copy out of them,
#: when mostly uncached (:meth:`MmapSource.prefetch`).
PREFETCH_MIN: Final = 4 << 20
#: Piece each reader thread populates at a time: on the disk measured, 2 MiB pieces on all
#: reader threads kept the device busiest (4 MiB varied more, 8-16 MiB was slower than none).
_PREFETCH_STEP: Final = 2 << 20
#: A range with at least this fraction of its pages cached counts as cached: it is copied from
#: as it is, with no read-in (mapped slices) and no read-ahead thread (large preads).
_MOSTLY_RESIDENT: Final = 0.5


def _numpy_empty(nbytes: int, hugepages: bool) -> np.ndarray:
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


def _address_of(mapping: mmap.mmap) -> int:
    """The address of a mapping's first byte (0 for an empty one)."""
    return int(np.frombuffer(mapping, np.uint8).ctypes.data) if len(mapping) else 0


def _madvise(mapping: mmap.mmap, address: int, start: int, length: int, advice: int) -> None:
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
        self._address = _address_of(region)
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
            made.populate(0, min(nbytes, _POPULATE_STEP), strict=True)
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
            step = min(_POPULATE_STEP, end - start)
            collections = _collections()
            began = time.perf_counter()
            try:
                _madvise(self._region, self._address, start, step, _MADV_POPULATE_WRITE)
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


def _huge_region(nbytes: int) -> _HugeRegion | None:
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
        lambda start: region.populate(start, _POPULATE_STEP),
        range(_POPULATE_STEP, nbytes, _POPULATE_STEP),
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
    return _numpy_empty(nbytes, False)


def read_fresh(source: ByteSource, offset: int, nbytes: int) -> np.ndarray:
    """Read ``nbytes`` at ``offset`` of ``source`` into new memory.

    From a :class:`PreadSource`, up to :data:`ONE_READ_MAX` bytes are one read on the calling
    thread; a larger destination is a huge-page region that each reader thread faults in
    (:class:`_HugeRegion`) right before reading its piece, so on a cold file the faults overlap
    the other threads' waits for the disk instead of preceding them. Other sources read into
    :func:`empty_bytes`.
    """
    if isinstance(source, PreadSource) and nbytes <= ONE_READ_MAX:
        # One read on this thread into plain memory: cheaper than starting the reader threads
        # and faulting in a huge-page region, up to about this size.
        buf = np.empty(nbytes, np.uint8)
        source.readinto(offset, buf.data, parallel=False)
        return buf
    region = _huge_region(nbytes) if isinstance(source, PreadSource) else None
    if isinstance(source, PreadSource) and region is not None:
        buf = region.array()
        source.readinto(offset, buf.data, prepare=region.populate, align=_POPULATE_STEP)
        return buf
    buf = empty_bytes(nbytes)
    if nbytes:
        source.readinto(offset, buf.data)
    return buf


def lay_out_runs(runs: Sequence[tuple[int, int]], align: int) -> tuple[list[int], int]:
    """Where ``(offset, length)`` runs go when packed into one buffer, each at a multiple of
    ``align`` (the first at 0): the offset of each, and the buffer's size."""
    offsets: list[int] = []
    total = 0
    for _, length in runs:
        total += -total % align
        offsets.append(total)
        total += length
    return offsets, total


def run_pieces(
    runs: Sequence[tuple[int, int]], offsets: Sequence[int], piece: int
) -> list[tuple[int, int, int]]:
    """``(source offset, destination offset, length)`` of every piece of at most ``piece``
    bytes of the runs, run by run (``offsets`` as from :func:`lay_out_runs`)."""
    return [
        (offset + at, dest + at, min(piece, length - at))
        for (offset, length), dest in zip(runs, offsets, strict=True)
        for at in range(0, length, piece)
    ]


#: Runs of at least this many bytes that are not in the page cache are read with direct I/O...
DIRECT_RUN_MIN: Final = 1 << 20
#: ... when such runs add up to at least this many bytes (below, the page cache is as fast).
DIRECT_MIN: Final = 64 << 20
#: Direct reads start, end and land on multiples of this (the largest logical block size in
#: common use; a multiple of the smaller ones).
_DIRECT_BLOCK: Final = 4096


def _cold_large_runs(source: PreadSource, runs: Sequence[tuple[int, int]]) -> set[int]:
    """The runs :func:`read_runs_fresh` reads directly: large ones mostly not in the page cache
    (each sampled with ``mincore``), if they add up to :data:`DIRECT_MIN`; else none.

    A direct read goes to the disk even for cached pages, so a cached run keeps the page cache.
    """
    if not tuning.settings().direct_reads or not getattr(os, "O_DIRECT", 0):
        return set()
    # (Never a run small enough to be read in a span with its neighbours.)
    smallest = max(DIRECT_RUN_MIN, _SMALL_RUN + 1)
    large = [i for i, (_, length) in enumerate(runs) if length >= smallest]
    if sum(runs[i][1] for i in large) < DIRECT_MIN:
        return set()
    # One sample of the whole span first (~0.05 ms): a warm file stops here, where sampling
    # every run of a row split took ~1.5 ms.
    start = min(runs[i][0] for i in large)
    end = max(runs[i][0] + runs[i][1] for i in large)
    if not source.uncached(start, end - start):
        return set()
    cold = {i for i in large if source.uncached(*runs[i])}
    return cold if sum(runs[i][1] for i in cold) >= DIRECT_MIN else set()


def _lay_out(
    runs: Sequence[tuple[int, int]], align: int, direct: set[int]
) -> tuple[list[int], int]:
    """As :func:`lay_out_runs`, but each run in ``direct`` is placed at its file offset's phase
    within a block (:data:`_DIRECT_BLOCK`), with room before and after it for the whole blocks
    a direct read covers."""
    if not direct:
        return lay_out_runs(runs, align)
    offsets: list[int] = []
    total = 0
    for i, (offset, length) in enumerate(runs):
        if i in direct:
            head = offset % _DIRECT_BLOCK
            total += -total % _DIRECT_BLOCK
            offsets.append(total + head)
            total += head + length
            total += -total % _DIRECT_BLOCK
        else:
            total += -total % align
            offsets.append(total)
            total += length
    return offsets, total


def _direct_pieces(
    runs: Sequence[tuple[int, int]], offsets: Sequence[int]
) -> list[tuple[int, int, int, int]]:
    """``(source offset, destination offset, length, bytes wanted)`` of the direct reads of the
    runs (placed by :func:`_lay_out`): each run's whole blocks, in pieces of at most
    :data:`PARALLEL_CHUNK`. The bytes wanted end at the run's end; the rest of its last block
    may lie past the end of the file."""
    pieces = []
    for (offset, length), dest in zip(runs, offsets, strict=True):
        head = offset % _DIRECT_BLOCK
        start, end = offset - head, offset + length
        size = end - start + (-(end - start) % _DIRECT_BLOCK)
        for at in range(0, size, PARALLEL_CHUNK):
            piece = min(PARALLEL_CHUNK, size - at)
            pieces.append((start + at, dest - head + at, piece, min(piece, end - start - at)))
    return pieces


def _read_direct(fd: int, source: PreadSource, offset: int, out: memoryview, wanted: int) -> None:
    """Fill at least ``out[:wanted]`` from ``offset`` by direct reads on ``fd``; what they leave
    (the end of the file, a device refusing the request) is read through the page cache, which
    raises as any read of ``source`` does."""
    got = 0
    with contextlib.suppress(OSError):
        while got < wanted:
            n = os.preadv(fd, [out[got:]], offset + got)
            got += n
            if n <= 0 or got % _DIRECT_BLOCK:
                break  # the end of the file: whatever is missing is past it, or was cut off
    if got < wanted:
        source.pread_exact(offset + got, out[got:wanted])


def read_runs_fresh(
    source: PreadSource, runs: Sequence[tuple[int, int]], align: int = 64, *, spans: bool = True
) -> tuple[np.ndarray, list[int]]:
    """Read several ``(offset, length)`` runs of a file into one new buffer, in parallel.

    Each run starts at a multiple of ``align`` in the buffer, so that tensors viewing it are
    aligned. One destination for all runs (huge pages faulted in by the thread that reads each
    piece, as in :func:`read_fresh`) costs fewer page faults than one per run, and all runs
    are read at once: a rank's rows of every tensor of a 2 GiB file (256 MiB in 39 runs of
    4-32 MiB) took 50-71 ms this way against 77-104 ms one tensor at a time (10 runs each; in
    the machine's slow spells, 147-166 ms against 204-225 ms). Small runs less than a page
    apart are read as one span each and copied to their places (see :data:`_SMALL_RUN`),
    unless ``spans`` is False (only the runs' own bytes are read).

    Large runs mostly not in the page cache (:func:`_cold_large_runs`) are read with direct
    I/O (``tuning``'s ``direct_reads``): the disk writes straight into the buffer, in requests
    as large as the device takes, where reads through the page cache fill it 4 KiB page by
    page (requests of ~1 MiB here) and then copy it. A cold row split of a 2 GiB file (255
    MiB in 39 runs) took 103-127 ms this way against 164-206 ms (fresh processes,
    alternating). Such a run is placed at its file offset's phase within a 4 KiB block (its
    tensor as aligned as in a mapping of the file), and its whole blocks are read, so the
    buffer holds up to 4 KiB of its neighbours' bytes either side.

    Returns:
        The buffer and the offset of each run in it.
    """
    # The plan of the reads makes a few objects per run (the collector paused: its
    # collections walk torch's whole object graph once it is imported); the reads run after.
    direct = _cold_large_runs(source, runs)
    direct_fd: int | None = None
    try:
        if direct:
            direct_fd = source.reopen_direct()
        if direct_fd is None:
            direct = set()
        with gc_paused():
            offsets, total = _lay_out(runs, align, direct)
            small, large = _group_small_runs(runs) if spans else ([], list(range(len(runs))))
            plain = [i for i in large if i not in direct]
            pieces: list[tuple[int, ...]] = [
                *run_pieces([runs[i] for i in plain], [offsets[i] for i in plain], PARALLEL_CHUNK),
                *_direct_pieces([runs[i] for i in direct], [offsets[i] for i in direct]),
            ]
            # In file order, so that the reads sweep the file front to back.
            work: list[tuple[int, ...] | list[int]] = sorted(
                [*small, *pieces],
                key=lambda item: item[0] if type(item) is tuple else runs[item[0]][0],
            )
        return _read_work(source, runs, work, offsets, total, direct_fd)
    finally:
        if direct_fd is not None:
            os.close(direct_fd)


def _read_work(
    source: PreadSource,
    runs: Sequence[tuple[int, int]],
    work: list[tuple[int, ...] | list[int]],
    offsets: list[int],
    total: int,
    direct_fd: int | None,
) -> tuple[np.ndarray, list[int]]:
    """The reads of :func:`read_runs_fresh`, into a fresh buffer of ``total`` bytes."""
    region = _huge_region(total)
    if region is not None:
        buf = region.array()
    elif direct_fd is not None:
        # Direct reads land on block boundaries of the buffer: pages of a private map (numpy's
        # own allocations are aligned to 64 bytes only).
        buf = np.frombuffer(
            mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)),
            np.uint8,
        )
    else:
        # Numpy's own huge pages where asked for (True), else 4 KiB pages.
        buf = _numpy_empty(total, tuning.settings().hugepage_destinations is True)
    view = buf.data.cast("B")

    def one(item: tuple[int, ...] | list[int]) -> None:
        if type(item) is tuple:
            offset, dest, length, *wanted = item
            if region is not None:
                region.populate(dest, length)
            if wanted:
                assert direct_fd is not None  # direct pieces exist only with a descriptor
                _read_direct(direct_fd, source, offset, view[dest : dest + length], wanted[0])
                return
            source.pread_exact(offset, view[dest : dest + length])
            return
        # Runs close together in the file: their whole span in one read, then each run
        # copied to its place.
        first, last = item[0], item[-1]
        span_start = runs[first][0]
        span = np.empty(runs[last][0] + runs[last][1] - span_start, np.uint8).data
        source.pread_exact(span_start, span)
        if region is not None:
            region.populate(offsets[first], offsets[last] + runs[last][1] - offsets[first])
        for i in item:
            offset, length = runs[i]
            at = offset - span_start
            view[offsets[i] : offsets[i] + length] = span[at : at + length]

    run_parallel(one, work, source.threads)
    return buf, offsets


#: Runs of at most this many bytes...
_SMALL_RUN: Final = 64 << 10
#: ... less than a page apart (so reading the span reads no page the runs do not touch) are
#: read as one span of at most this many bytes. A rank's rows of a checkpoint of many small
#: tensors (a mixture of experts: 20,000 tensors of a few hundred bytes) were one positioned
#: read each, ~2 us of Python apiece on the reader threads.
_SMALL_SPAN: Final = 4 << 20


def _group_small_runs(runs: Sequence[tuple[int, int]]) -> tuple[list[list[int]], list[int]]:
    """Split runs (as indices) into groups of small runs read as one span (see
    :data:`_SMALL_RUN`) and the rest, read one by one. Only runs that follow each other in
    the file, in the order given, are grouped."""
    groups: list[list[int]] = []
    alone: list[int] = []
    group: list[int] = []
    span_start = span_end = 0
    for i, (offset, length) in enumerate(runs):
        if length <= _SMALL_RUN and length:
            end = offset + length
            near = span_end <= offset < span_end + mmap.PAGESIZE
            if group and near and end - span_start <= _SMALL_SPAN:
                group.append(i)
                span_end = end
                continue
            if len(group) > 1:
                groups.append(group)
            else:
                alone.extend(group)
            group, span_start, span_end = [i], offset, end
            continue
        alone.append(i)
    if len(group) > 1:
        groups.append(group)
    else:
        alone.extend(group)
    return groups, alone


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


def worker_count(source: object) -> int:
    """Threads to use for parallel reads from ``source`` (its ``threads``, else the default)."""
    threads = getattr(source, "threads", None)
    return max(1, int(threads)) if threads else READ_THREADS


class Shared(Generic[_T]):
    """A resource used by several holders, closed once it was asked to close and none holds it.

    A pread source's descriptor is held by each read in flight (so that ``close`` on another
    thread cannot hand its number to a file opened meanwhile), and a handle's byte source by
    each of its slices (which stay readable after the handle is closed, as with the reference).
    """

    def __init__(self, value: _T, on_close: Callable[[_T], object]) -> None:
        self._value = value
        self._on_close = on_close
        self._holders = 0
        self._closing = False
        self._lock = threading.Lock()

    def acquire(self) -> _T:
        """The resource, held until the matching :meth:`release`.

        Raises:
            ClosedFileError: :meth:`close` was called.
        """
        with self._lock:
            if self._closing:
                raise ClosedFileError("File is closed", kind="FileClosed")
            self._holders += 1
            return self._value

    # ``with shared as value:`` holds it for the block (a class context manager: reads of a
    # few bytes each, millions for a strided slice, pay no generator frame).
    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Let go of one hold; the last one after :meth:`close` closes the resource."""
        with self._lock:
            self._holders -= 1
            last = self._closing and self._holders == 0
        if last:
            self._on_close(self._value)

    def close(self) -> None:
        """Close now if nobody holds the resource, else when the last holder lets go."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            idle = self._holders == 0
        if idle:
            self._on_close(self._value)


class PreadSource:
    """Positioned reads from a file descriptor into caller memory.

    Attributes:
        threads: Threads used for one large read (``READ_THREADS`` by default).
        chunk_size: Bytes per thread task for large reads (``PARALLEL_CHUNK`` by default).
    """

    def __init__(
        self,
        fd: int,
        name: str,
        *,
        size: int | None = None,
        owns_fd: bool = True,
        threads: int | None = None,
        chunk_size: int | None = None,
    ):
        self._fd = fd
        self._name = name
        self._owns_fd = owns_fd
        self._size = os.fstat(fd).st_size if size is None else size
        self.threads = threads or READ_THREADS
        self.chunk_size = chunk_size or PARALLEL_CHUNK
        self._exact: PreadSource | None = None
        self._exact_lock = threading.Lock()
        # Reads in flight hold the descriptor open: close() from another thread must not let
        # the number be reused by a file opened meanwhile (those reads would read that file).
        self._held = Shared(fd, self._close_fd)

    @property
    def size(self) -> int:
        return self._size

    @property
    def name(self) -> str:
        return self._name

    @property
    def fd(self) -> int:
        """The file descriptor read from."""
        return self._fd

    def _acquire(self) -> int:
        """The descriptor, held open until the matching :meth:`_release`.

        Raises:
            ClosedFileError: The source was closed.
        """
        return self._held.acquire()

    def _release(self) -> None:
        self._held.release()

    def pread_exact(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` from ``offset`` with one thread (loops on short reads)."""
        with self._held as fd:
            pread_exact(fd, self._name, offset, out)

    def mapped(self) -> MmapSource:
        """A copy-on-write mapping of the same open file (the same inode, also if its path has
        been replaced since this source was opened), for copies of selections that need a
        piece of every row. The caller closes it."""
        with self._held as fd:
            return MmapSource(fd, self._name, size=self._size)

    def without_readahead(self) -> PreadSource:
        """This file through a second descriptor with kernel readahead off, for partial reads.

        On a cold file the kernel reads ahead of every read (up to the device's readahead
        window, 8 MiB here), so reading the first eighth of each tensor fetched ~25% more than
        asked. Readahead state belongs to the open file description, so partial reads get
        their own (reopened through ``/proc/self/fd``, checked to be the same inode) with
        ``POSIX_FADV_RANDOM``; whole-buffer reads keep readahead on the original. Returns
        ``self`` where that is unavailable.
        """
        with self._exact_lock:
            if self._exact is None:
                self._exact = self._reopen_random() or self
            # The handle's threads= may be set after the reopen (read_header makes it first).
            self._exact.threads = self.threads
            self._exact.chunk_size = self.chunk_size
            return self._exact

    def _reopen_random(self) -> PreadSource | None:
        if not hasattr(os, "posix_fadvise"):
            return None
        fd = self._reopen(0)
        if fd is None:
            return None
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException as exc:  # a KeyboardInterrupt too: the descriptor is ours
            os.close(fd)
            if isinstance(exc, OSError):
                return None
            raise
        return PreadSource(
            fd, self._name, size=self._size, threads=self.threads, chunk_size=self.chunk_size
        )

    def reopen_direct(self) -> int | None:
        """A new descriptor of this file (the same inode) opened for direct I/O, or None where
        the filesystem refuses it (tmpfs) or it cannot be reopened. The caller closes it."""
        flag = getattr(os, "O_DIRECT", 0)
        return self._reopen(flag) if flag else None

    def _reopen(self, flags: int) -> int | None:
        """This file opened again through ``/proc/self/fd`` with ``flags``, checked to be the
        same inode (a path swapped meanwhile is not followed), or None."""
        with self._held as own:
            try:
                fd = os.open(
                    f"/proc/self/fd/{own}", os.O_RDONLY | flags | getattr(os, "O_CLOEXEC", 0)
                )
            except OSError:
                return None
            try:
                mine, theirs = os.fstat(own), os.fstat(fd)
            except BaseException as exc:  # a KeyboardInterrupt too: the descriptor is ours
                os.close(fd)
                if isinstance(exc, OSError):
                    return None
                raise
            if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
                os.close(fd)
                return None
        return fd

    def uncached(self, offset: int, nbytes: int) -> bool:
        """Whether most of ``[offset, offset + nbytes)`` is not in the page cache (sampled; False
        where that cannot be told)."""
        with self._held as fd:
            return mostly_uncached(fd, offset, nbytes)

    def _split(self, total: int, align: int = 1) -> list[tuple[int, int]]:
        """``(start, length)`` pieces of a ``total``-byte read, one per thread task.

        Mid-sized reads (a row split of one tensor: a few MiB to a few tens of MiB) are split
        too, into at least MIN_PARALLEL_CHUNK pieces, so that both cores take page faults.
        Pieces start on multiples of ``align``.
        """
        chunk = min(self.chunk_size, max(MIN_PARALLEL_CHUNK, -(-total // self.threads)))
        chunk += -chunk % align
        return [(start, min(chunk, total - start)) for start in range(0, total, chunk)]

    def readinto(
        self,
        offset: int,
        out: memoryview,
        *,
        prepare: Callable[[int, int], None] | None = None,
        align: int = 1,
        parallel: bool = True,
    ) -> None:
        """Fill ``out`` from ``offset``, split across the reader threads when large.

        ``prepare(start, length)``, if given, runs on each piece of ``out`` right before the
        read into it, on the thread that reads it (see :func:`read_fresh`); pieces then start
        on multiples of ``align``. With ``parallel`` False (and no ``prepare``), one read on the
        calling thread whatever the size.
        """
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        _check_range(self, offset, out.nbytes)
        if prepare is None and (not parallel or out.nbytes <= MIN_PARALLEL_CHUNK):
            # One piece, read here (the path below would too): without its set-up, which
            # cost small reads (a tensor of a few KiB) more than the read itself.
            with self._held as fd:
                pread_exact(fd, self._name, offset, out)
            return

        with self._held as fd:  # one hold for the whole read, all threads

            def one(piece: tuple[int, int]) -> None:
                start, length = piece
                if prepare is not None:
                    prepare(start, length)
                pread_exact(fd, self._name, offset + start, out[start : start + length])

            # Threads take pieces in file order, so together they sweep the file front to back
            # while their page faults on the fresh destination and their kernel copies overlap.
            with read_ahead(fd, offset, out.nbytes):
                pieces = self._split(out.nbytes, align) if out.nbytes else []
                run_parallel(one, pieces, self.threads)

    def view(self, offset: int, length: int) -> memoryview | None:
        return None

    def close(self) -> None:
        """Close the file; reads in flight on other threads finish first (the last one closes
        the descriptor), and later reads raise :class:`ClosedFileError`."""
        exact, self._exact = self._exact, None
        if exact is not None and exact is not self:
            exact.close()
        self._held.close()

    def _close_fd(self, fd: int) -> None:
        if self._owns_fd and fd >= 0:
            os.close(fd)
        self._fd = -1

    def __del__(self) -> None:
        # A source its owner never took over (a KeyboardInterrupt between its creation and the
        # hand-off, or a handle dropped unclosed) still closes its descriptor. Never raise from
        # a finalizer (nor need a module global: at exit they may be gone).
        try:  # noqa: SIM105
            self.close()
        except Exception:  # noqa: BLE001, S110
            pass


class PrefetchSupport:
    """Whether the kernel lets :meth:`MmapSource.prefetch` populate ranges (switched off for
    the process the first time it refuses; ``tuning``'s ``prefetch`` turns the prefetch off)."""

    enabled: bool = hasattr(mmap.mmap, "madvise") and mincore is not None


class MmapSource:
    """A private (copy-on-write) memory map of a whole file.

    Views are writable; writes stay in this process. If the file is truncated while mapped,
    touching a page past the new end raises SIGBUS in the process, which Python cannot catch.
    To make that unlikely, every ``view``/``readinto`` first compares the range with the file's
    current size (``fstat`` on a descriptor kept for that purpose) and raises a
    ``SafetensorError`` of kind ``FileTruncated`` instead of handing out pages past the end.
    This cannot protect views handed out earlier, nor a truncation racing the check: use the
    pread backend for files that may change under the reader (see ``SECURITY.md``). A file
    replaced with ``os.replace`` is harmless: the mapping keeps the old inode's data.
    """

    def __init__(self, fd: int, name: str, *, size: int | None = None) -> None:
        self._name = name
        self._size = os.fstat(fd).st_size if size is None else size
        # mmap refuses empty files; a file that small is refused by the header checks anyway.
        self._map: mmap.mmap | None = None
        self._at = 0  # where the file starts in the map
        if self._size:
            self._map, self._at = map_file(fd, self._size)
        self._view = (
            memoryview(self._map)[self._at : self._at + self._size]
            if self._map is not None
            else memoryview(bytearray())
        )
        if self._map is not None and hasattr(os, "posix_fadvise"):
            # Page faults on a file mapping read ahead by the file's readahead window; the
            # sequential hint doubles it, which halves the faults that wait for the disk when
            # tensors are touched front to back (cold lazy loads: ~1.6x faster measured). The
            # reference sets the same hint.
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, self._size, os.POSIX_FADV_SEQUENTIAL)
        # Our own descriptor, only to fstat: the caller's may be closed right after mapping.
        self._fd = os.dup(fd) if self._map is not None else -1

    @property
    def size(self) -> int:
        return self._size

    @property
    def name(self) -> str:
        return self._name

    @property
    def fd(self) -> int:
        """A descriptor of the mapped file (-1 once closed, or for an empty file)."""
        return self._fd

    def _check_not_truncated(self, offset: int, length: int) -> None:
        """Refuse a range the file no longer holds (touching it would be SIGBUS)."""
        fd = self._fd
        if fd < 0 or not length:
            return
        try:
            now = os.fstat(fd).st_size
        except OSError:  # pragma: no cover - fstat on an open descriptor does not fail
            return
        if offset + length > now:
            raise SafetensorError(
                f"{self._name} was truncated to {now} bytes after it was opened; reading "
                f"{length} bytes at offset {offset} from the memory map would crash the process "
                "(SIGBUS). Reopen the file, or use backend='pread' for files that change.",
                kind="FileTruncated",
                offset=now,
            )

    def readinto(self, offset: int, out: memoryview) -> None:
        """Copy bytes of the file into ``out``.

        Through positioned reads on the descriptor kept for ``fstat``, not out of the mapping:
        a copy out of the mapping holds the GIL and takes a page fault per 4 KiB page not yet
        mapped, where ``preadv`` releases the GIL and copies straight from the page cache.
        Staging 2 GiB to a GPU from 4 threads: 5.2 GB/s out of the mapping, 17.6 GB/s by pread.
        The bytes are the file's, as in the mapping: the descriptor is the mapped file's (a
        file replaced since keeps its old inode for both). Writes this process made into
        views of the copy-on-write mapping are private to the mapping and not read here.
        """
        _check_range(self, offset, out.nbytes)
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        if self._fd < 0:
            out[:] = self._view[offset : offset + out.nbytes]
            return
        try:
            pread_exact(self._fd, self._name, offset, out)
        except SafetensorError:
            # A read past the end: say that the file was truncated, as a view would. Checked
            # only then (a read cannot fault, unlike the mapping): an fstat before every read
            # was a fifth of a small tensor's get_tensor.
            self._check_not_truncated(offset, out.nbytes)
            raise

    def view(self, offset: int, length: int) -> memoryview | None:
        _check_range(self, offset, length)
        self._closed_check(length)
        self._check_not_truncated(offset, length)
        return self._view[offset : offset + length]

    def _closed_check(self, length: int) -> None:
        # A closed source has an empty view: slicing it would hand out 0 bytes for a tensor.
        if self._map is None and length:
            raise ClosedFileError("File is closed", kind="FileClosed")

    def private_view(self, offset: int, length: int) -> memoryview | None:
        """Like :meth:`view`, over a new copy-on-write mapping of the range: writes through it
        stay out of this source's mapping and out of every other private view.

        None for a closed source (as :meth:`view` would fail for it).
        """
        _check_range(self, offset, length)
        self._closed_check(length)
        self._check_not_truncated(offset, length)
        fd = self._fd  # once: a concurrent close() sets it to -1
        if fd < 0 or length == 0:
            return self.view(offset, length)
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        mapping, at = map_file(fd, offset + length - start, offset=start)
        begin = at + offset - start
        return memoryview(mapping)[begin : begin + length]

    def prefetch(self, offset: int, length: int) -> bool:
        """Read a mostly uncached range into the page cache ahead of a copy out of it.

        A copy out of a cold mapping stops at every readahead window to wait for the disk,
        one window at a time per copying thread. Populating the range first
        (``MADV_POPULATE_READ``) in 2 MiB pieces on all reader threads keeps the device's queue
        full: a cold 1/8 column split of a 2 GiB file (bytes from every other page) took
        ~1.1 s instead of ~1.45 s, measured. A range already mostly cached (``mincore``) is
        left alone: mapping all its pages would cost more than the copy's own faults.

        Returns:
            Whether the range was populated (False: small, mostly cached, or unsupported).
        """
        if self._map is None or length < PREFETCH_MIN or not PrefetchSupport.enabled:
            return False
        if not tuning.settings().prefetch:
            return False
        _check_range(self, offset, length)
        self._check_not_truncated(offset, length)
        mapping = self._map
        address = _address_of(mapping) + self._at
        if not mapped_mostly_uncached(address + offset, length):
            return False
        start = offset - offset % mmap.PAGESIZE
        end = offset + length

        def populate(at: int) -> None:
            # Without the GIL (see _madvise): a thread waiting here for the disk no longer
            # stops every other thread of the process. Populating a cold 2 GiB file ran at the
            # disk's ~2 GB/s either way; the kernel's readahead kept its queue busy.
            _madvise(mapping, address, at, min(_PREFETCH_STEP, end - at), _MADV_POPULATE_READ)

        try:
            run_parallel(populate, range(start, end, _PREFETCH_STEP), READ_THREADS)
        except OSError as exc:
            # Kernels before 5.14 refuse the advice (EINVAL): stop asking. Anything else (a
            # file truncated meanwhile) is left to the copy, which checks and reports it.
            if exc.errno == errno.EINVAL:
                PrefetchSupport.enabled = False
            return False
        return True

    def close(self) -> None:
        # Tensors may still view the mapping; the map is unmapped when the last view dies.
        self._view = memoryview(bytearray())
        self._map = None
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        # Never raise from a finalizer (nor need a module global: at exit they may be gone).
        try:  # noqa: SIM105
            self.close()
        except Exception:  # noqa: BLE001, S110
            pass


class FileObjSource:
    """Reads from a binary file object with ``seek`` and ``readinto`` or ``read``.

    Reads are serialised with a lock because a file object has one position.
    """

    def __init__(self, fileobj: IO[bytes] | Any, name: str | None = None) -> None:
        self._f = fileobj
        self._name = name or str(getattr(fileobj, "name", "<file object>"))
        self._lock = threading.Lock()
        fileobj.seek(0, os.SEEK_END)
        self._size = int(fileobj.tell())

    @property
    def size(self) -> int:
        return self._size

    @property
    def name(self) -> str:
        return self._name

    def readinto(self, offset: int, out: memoryview) -> None:
        out = out.cast("B")
        _check_range(self, offset, out.nbytes)
        with self._lock:
            self._f.seek(offset)
            done = 0
            reader = getattr(self._f, "readinto", None)
            while done < out.nbytes:
                if reader is not None:
                    n = reader(out[done:])
                else:
                    chunk = self._f.read(out.nbytes - done)
                    n = len(chunk)
                    out[done : done + n] = chunk
                if not n:
                    raise _short_read(self._name, offset, out.nbytes, done)
                done += n

    def view(self, offset: int, length: int) -> memoryview | None:
        return None

    def close(self) -> None:
        # The caller owns the file object.
        return None


def read_ranges_into(
    source: ByteSource, ranges: Sequence[tuple[int, int]], out: memoryview, *, exact: bool = False
) -> None:
    """Read several ``(offset, length)`` ranges back to back into ``out``.

    Ranges are read in parallel threads when the source is a :class:`PreadSource` and there is
    enough work; otherwise one after another. A source with a ``readinto_many`` method (the
    remote ones) is handed all ranges at once; with ``exact`` it fetches only their bytes
    (no merging across gaps).
    """
    out = out.cast("B") if out.format != "B" else out
    many = getattr(source, "readinto_many", None)
    if many is not None:
        # Remote sources coalesce nearby ranges into few requests and fetch them in parallel.
        if exact:
            many(ranges, out, max_gap=0)
        else:
            many(ranges, out)
        return
    total = sum(length for _, length in ranges)
    if total != out.nbytes:
        raise ValueError(f"ranges cover {total} bytes but the buffer holds {out.nbytes}")
    positions = []
    pos = 0
    for offset, length in ranges:
        positions.append((offset, pos, length))
        pos += length
    if isinstance(source, PreadSource) and len(ranges) > 1 and total > PARALLEL_CHUNK:
        run_parallel(
            lambda p: source.readinto(p[0], out[p[1] : p[1] + p[2]]),
            positions,
            worker_count(source),
        )
        return
    for offset, start, length in positions:
        if length:
            source.readinto(offset, out[start : start + length])


def read_pieces_into(source: ByteSource, pieces: Sequence[tuple[int, memoryview]]) -> None:
    """Fill each ``(offset, out)`` piece from ``source``: reads into memory the caller owns.

    From a local file (positioned reads or a mapping, whose reads are positioned reads too)
    the pieces are cut into :data:`PARALLEL_CHUNK` parts that the reader threads take in file
    order, with the disk kept busy ahead of them on a cold file (:func:`read_ahead`); remote
    sources fetch all pieces in one plan (``readinto_scattered``); file objects and buffers
    read piece after piece.
    """
    ordered = sorted(
        (
            (offset, out.cast("B") if out.format != "B" or out.ndim != 1 else out)
            for offset, out in pieces
        ),
        key=lambda piece: piece[0],
    )
    scattered = getattr(source, "readinto_scattered", None)
    if scattered is not None:
        # Remote sources: one plan for all pieces (nearby ranges merged into balanced requests
        # on parallel connections), each received straight into its buffer; it checks the
        # ranges itself.
        scattered([(offset, out.nbytes, out, 0) for offset, out in ordered])
        return
    for offset, out in ordered:
        _check_range(source, offset, out.nbytes)
    total = sum(out.nbytes for _, out in ordered)
    first = ordered[0][0] if ordered else 0
    last = max((offset + out.nbytes for offset, out in ordered), default=0)
    if isinstance(source, PreadSource) and _read_pieces_direct(source, ordered, total, first, last):
        return
    local = isinstance(source, (PreadSource, MmapSource))
    if not local or total <= MIN_PARALLEL_CHUNK or worker_count(source) < 2:
        for offset, out in ordered:
            if out.nbytes:
                source.readinto(offset, out)
        return
    parts = [
        (offset + at, out[at : at + PARALLEL_CHUNK])
        for offset, out in ordered
        for at in range(0, out.nbytes, PARALLEL_CHUNK)
    ]
    if isinstance(source, PreadSource):
        with source._held as fd, read_ahead(fd, first, last - first):
            run_parallel(
                lambda part: pread_exact(fd, source.name, part[0], part[1]),
                parts,
                worker_count(source),
            )
        return
    run_parallel(lambda part: source.readinto(part[0], part[1]), parts, worker_count(source))


#: Direct reads for :func:`read_pieces_into` go through bounce buffers of this size (the
#: destinations are the caller's memory: neither they nor the pieces' file offsets need be
#: aligned as direct I/O requires)...
_BOUNCE_BYTES: Final = 8 << 20
#: ... read by this many threads at once (128 MiB of bounce buffers in all). Each is one
#: synchronous read the device serves as a few requests; together they keep its queue full,
#: while other threads copy what has arrived. A cold 2 GiB model read in place took 666-679 ms
#: this way against 740-765 ms with 8 threads of 16 MiB, 704-891 ms with 16 of 4 MiB, and
#: 1.16-2.08 s through the page cache (4 reader threads, read-ahead thread), in alternating
#: fresh processes.
DIRECT_THREADS: Final = 16


def _bounce_plan(
    ordered: Sequence[tuple[int, memoryview]],
) -> list[tuple[int, int, list[tuple[int, np.ndarray]]]]:
    """The bounce reads that cover ``ordered`` (pieces sorted by offset, disjoint):
    ``(block-aligned offset, bytes wanted, [(piece offset, piece array)])`` for every
    :data:`_BOUNCE_BYTES` stretch that holds bytes of a piece."""
    arrays = [(offset, np.frombuffer(out, np.uint8)) for offset, out in ordered if out.nbytes]
    plan: list[tuple[int, int, list[tuple[int, np.ndarray]]]] = []
    i = 0
    at = arrays[0][0] - arrays[0][0] % _DIRECT_BLOCK if arrays else 0
    while i < len(arrays):
        offset, array = arrays[i]
        if offset + array.nbytes <= at:
            i += 1
            continue
        if offset >= at + _BOUNCE_BYTES:
            at = offset - offset % _DIRECT_BLOCK  # a gap: skip to the next piece's block
        end = at + _BOUNCE_BYTES
        inside = []
        j = i
        while j < len(arrays) and arrays[j][0] < end:
            inside.append(arrays[j])
            j += 1
        last_offset, last_array = inside[-1]  # (sorted and disjoint: it ends last)
        plan.append((at, min(end, last_offset + last_array.nbytes) - at, inside))
        at = end
    return plan


def _read_pieces_direct(
    source: PreadSource,
    ordered: Sequence[tuple[int, memoryview]],
    total: int,
    first: int,
    last: int,
) -> bool:
    """:func:`read_pieces_into` by direct I/O through bounce buffers, for a large, dense and
    mostly uncached range (a model loaded in place from a cold file); False (nothing read)
    where that does not apply. ``total`` is the pieces' bytes, ``first`` and ``last`` the
    start and end of the range they span.

    The pages read this way are not left in the page cache: a load that reads the file once
    leaves the cache to the memory it just filled. Whatever the direct reads leave (the end of
    the file, a refusal) is read through the page cache, which raises as any read does.
    """
    if not tuning.settings().direct_reads or not getattr(os, "O_DIRECT", 0) or total < DIRECT_MIN:
        return False
    span = last - first
    if total * 2 < span or not source.uncached(first, span):
        return False  # sparse (a bounce read would fetch mostly unwanted bytes), or cached
    fd = source.reopen_direct()
    if fd is None:
        return False
    try:
        plan = _bounce_plan(ordered)
        threads = min(DIRECT_THREADS, len(plan))
        region = mmap.mmap(-1, threads * _BOUNCE_BYTES)  # page-aligned, as direct reads need
        bounce = np.frombuffer(region, np.uint8)
        free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(threads):
            free.put(slot * _BOUNCE_BYTES)

        def one(item: tuple[int, int, list[tuple[int, np.ndarray]]]) -> None:
            at, wanted, inside = item
            slot = free.get()
            try:
                size = wanted + -wanted % _DIRECT_BLOCK
                _read_direct(fd, source, at, bounce.data[slot : slot + size], wanted)
                for offset, array in inside:
                    lo, hi = max(offset, at), min(offset + array.nbytes, at + wanted)
                    # numpy copies without the GIL: the other threads' copies run alongside.
                    array[lo - offset : hi - offset] = bounce[slot + lo - at : slot + hi - at]
            finally:
                free.put(slot)

        run_parallel(one, plan, threads)  # the buffers go with this frame
    finally:
        os.close(fd)
    return True
