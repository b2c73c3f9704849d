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

Remote sources (HTTP, S3, fsspec) live in ``_remote`` and implement the same protocol. The
reader threads are ``_reader_pool``'s, fresh destinations come from ``_fresh_memory``, page
cache residency and read-ahead are ``_residency``'s, and reads of many ranges at once (with
direct I/O for large cold ones) are ``_range_reads``'.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import stat
import sys
import threading
import weakref
from collections.abc import Callable
from typing import IO, Any, Final, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from . import tuning
from ._errors import ClosedFileError, SafetensorError, read_error
from ._fresh_memory import (
    MADV_POPULATE_READ,
    POPULATE_STEP,
    address_of,
    advise_range,
    empty_bytes,
    huge_region,
)
from ._interrupts import ClosedWhenDropped, interrupts_deferred
from ._reader_pool import default_threads, run_parallel, worker_count
from ._residency import mapped_mostly_uncached, mostly_uncached, read_ahead
from ._syscalls import MAP_FIXED, MAP_NORESERVE, libc_mmap, madvise, mincore

__all__ = [
    "BufferSource",
    "ByteSource",
    "FileObjSource",
    "MmapSource",
    "NotRegularFileError",
    "PreadSource",
    "Shared",
    "check_range",
    "check_regular",
    "open_regular_file",
    "read_fresh",
    "starts_like_safetensors",
]

_T = TypeVar("_T")

#: Reads larger than this are split across threads.
PARALLEL_CHUNK: Final = 16 << 20

#: Smallest piece a read is split into for parallel threads.
MIN_PARALLEL_CHUNK: Final = 2 << 20

#: Reads into fresh memory (:func:`read_fresh`) up to this size are one read on the calling
#: thread. In a fresh process (where the reader threads start at their first read) an 8 MiB
#: LoRA file's data took ~3-4 ms that way against ~4-7 ms in parallel into huge pages; the
#: two met at 16-24 MiB warm and cold, and at 32 MiB the parallel read took ~6 against ~19 ms.
ONE_READ_MAX: Final = 16 << 20


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

    Every map is ``MAP_NORESERVE``: a private writable map is otherwise charged in full against
    the kernel's commit limit when made, as if every page were to be copied, and the kernel's
    default (heuristic) overcommit refuses a map larger than RAM and swap together. A 1 TiB
    file then failed to open with ENOMEM on a machine with 23 GiB of RAM, a file the
    reference (which maps read-only) opens. Only pages written to are copied; under strict
    overcommit (``vm.overcommit_memory=2``) the kernel ignores the flag and may still refuse.

    Raises:
        ValueError: The range is not inside the file (as ``mmap.mmap`` refuses it: touching
            pages past the end would be SIGBUS).
        OSError: The kernel refused the map (ENOMEM: out of address space or maps).
    """
    # Copy-on-write (ACCESS_COPY's flags and protection), charged for the pages written only.
    flags = mmap.MAP_PRIVATE | MAP_NORESERVE
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    if sys.version_info >= (3, 13):  # trackfd is new in 3.13
        owner = mmap.mmap(fd, length, flags, prot, offset=offset, trackfd=False)
        return owner, 0
    if libc_mmap is None or madvise is None or not length:
        # (Where libc's madvise cannot be called either, the prefetch advises through the
        # mmap object's own.)
        return mmap.mmap(fd, length, flags, prot, offset=offset), 0
    if offset + length > os.fstat(fd).st_size:
        raise ValueError("mmap length is greater than file size")
    # Address space only (MAP_NORESERVE: no memory is set aside for it), then the file over it;
    # room to slide it to the 2 MiB phase of its offset where it is large enough to care.
    room = _HUGE if length >= _HUGE else 0
    owner = mmap.mmap(-1, length + room, flags=flags)
    base = address_of(owner)
    at = (offset - base) % _HUGE if room else 0
    got = libc_mmap(base + at, length, prot, flags | MAP_FIXED, fd, offset)
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
    """Fill ``out`` from ``offset`` of ``fd`` (loops on short reads; raises at end of file).

    Raises:
        SafetensorError: The file ended first (kind ``ShortRead``).
        ReadError: The read failed (an I/O error of the disk or of a network file system),
            naming the file and the bytes, where a bare ``OSError`` named neither.
    """
    done = 0
    total = out.nbytes
    try:
        while done < total:
            n = os.preadv(fd, [out[done:]], offset + done)
            if n <= 0:
                raise _short_read(name, offset, total, done)
            done += n
    except OSError as exc:
        raise read_error(exc, name, offset + done, total - done) from exc


def check_range(source: ByteSource, offset: int, length: int) -> None:
    """Refuse a read of ``length`` bytes at ``offset`` that does not lie inside ``source``."""
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
        check_range(self, offset, out.nbytes)
        out[:] = self._view[offset : offset + out.nbytes]

    def view(self, offset: int, length: int) -> memoryview | None:
        check_range(self, offset, length)
        return self._view[offset : offset + length]

    def close(self) -> None:
        # Views handed out stay valid; only drop our reference.
        self._view = memoryview(b"")


#: Mapped ranges at least this large are read into the page cache before a copy out of them,
#: when mostly uncached (:meth:`MmapSource.prefetch`).
PREFETCH_MIN: Final = 4 << 20

#: Piece each reader thread populates at a time: on the disk measured, 2 MiB pieces on all
#: reader threads kept the device busiest (4 MiB varied more, 8-16 MiB was slower than none).
_PREFETCH_STEP: Final = 2 << 20


def read_fresh(source: ByteSource, offset: int, nbytes: int) -> np.ndarray:
    """Read ``nbytes`` at ``offset`` of ``source`` into new memory.

    From a :class:`PreadSource`, up to :data:`ONE_READ_MAX` bytes are one read on the calling
    thread; a larger destination is a huge-page region that each reader thread faults in
    (:class:`._fresh_memory._HugeRegion`) right before reading its piece, so on a cold file
    the faults overlap the other threads' waits for the disk instead of preceding them. Other
    sources read into :func:`._fresh_memory.empty_bytes`.
    """
    if isinstance(source, MmapSource) and nbytes > ONE_READ_MAX and source.fd >= 0:
        # numpy's copies of a mapped file (its arrays are copies, as the reference's are):
        # positioned reads of the mapping's descriptor on the reader threads, into huge pages,
        # as from a PreadSource. One read on this thread: 256 MiB in 47-72 ms (median of 12,
        # interleaved), 38-44 this way, as the pread backend's 36-54.
        reader = PreadSource(
            source.fd,
            source.name,
            size=source.size,
            owns_fd=False,
            threads=getattr(source, "threads", None),
        )
        try:
            return read_fresh(reader, offset, nbytes)
        except SafetensorError:
            source._check_not_truncated(offset, nbytes)  # a file cut short: said as a view would
            raise
    if isinstance(source, PreadSource) and nbytes <= ONE_READ_MAX:
        # One read on this thread into plain memory: cheaper than starting the reader threads
        # and faulting in a huge-page region, up to about this size.
        buf = np.empty(nbytes, np.uint8)
        source.readinto(offset, buf.data, parallel=False)
        return buf
    region = huge_region(nbytes) if isinstance(source, PreadSource) else None
    if isinstance(source, PreadSource) and region is not None:
        buf = region.array()
        source.readinto(offset, buf.data, prepare=region.populate, align=POPULATE_STEP)
        return buf
    buf = empty_bytes(nbytes)
    if nbytes:
        source.readinto(offset, buf.data)
    return buf


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
            if not self._closing:
                self._holders += 1
                return self._value
        # Raised with the lock released: making the exception can set off a collection whose
        # finalizers (a slice's hold, garbage in a cycle) release a hold, taking this lock on
        # this very thread. Nothing under the lock allocates an object the collector tracks.
        raise ClosedFileError("File is closed", kind="FileClosed")

    # ``with shared as value:`` holds it for the block (a class context manager: reads of a
    # few bytes each, millions for a strided slice, pay no generator frame).
    __enter__ = acquire

    def release(self, *_exc: object) -> None:
        """Let go of one hold; the last one after :meth:`close` closes the resource.

        Also the ``with`` block's exit (whose exception arguments it ignores), called directly:
        a call less for each of those small reads.
        """
        with self._lock:
            self._holders -= 1
            last = self._closing and self._holders == 0
        if last:
            held = interrupts_deferred()  # see close()
            try:
                held.__enter__()
            except KeyboardInterrupt:
                # Entering it runs the handlers of signals that came meanwhile: this Ctrl-C,
                # raised before the close; nothing else would close it (the count is 0).
                self._on_close(self._value)
                raise
            try:
                self._on_close(self._value)
            finally:
                held.__exit__(None, None, None)

    __exit__ = release

    def close(self) -> None:
        """Close now if nobody holds the resource, else when the last holder lets go.

        A Ctrl-C is held over it: one landing after ``_closing`` was set and before the
        resource was closed left it open for good (a later ``close``, a finalizer's retry
        included, returns at once), and one inside ``_on_close`` could cut a close short
        between its steps.
        """
        with interrupts_deferred():
            with self._lock:
                if self._closing:
                    return
                self._closing = True
                idle = self._holders == 0
            if idle:
                self._on_close(self._value)


class PreadSource(ClosedWhenDropped):
    """Positioned reads from a file descriptor into caller memory.

    Attributes:
        threads: Threads used for one large read (by default ``tuning``'s ``read_threads``, else
            ``READ_THREADS``).
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
        self.threads = threads or default_threads()
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
        check_range(self, offset, out.nbytes)
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


class PrefetchSupport:
    """Whether the kernel lets :meth:`MmapSource.prefetch` populate ranges (switched off for
    the process the first time it refuses; ``tuning``'s ``prefetch`` turns the prefetch off)."""

    enabled: bool = hasattr(mmap.mmap, "madvise") and mincore is not None


class MmapSource(ClosedWhenDropped):
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
            try:
                self._map, self._at = map_file(fd, self._size)
            except OSError as exc:
                # mmap's error names neither the file nor the size (ENOMEM under a memory
                # limit: RLIMIT_AS, strict overcommit).
                raise OSError(
                    exc.errno,
                    f"{exc.strerror} (mapping its {self._size:,} bytes failed; "
                    "backend='pread' reads the file without a map)",
                    name,
                ) from None
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
        self._positioned: PreadSource | None = None  # partial_reads(), made at first use
        self._lock = threading.Lock()

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
                # The first byte asked for that is gone: where the tensor reading it is found
                # (the new end may lie in the header, before any tensor).
                offset=max(offset, now),
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
        check_range(self, offset, out.nbytes)
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
        check_range(self, offset, length)
        self._closed_check(length)
        self._check_not_truncated(offset, length)
        return self._view[offset : offset + length]

    def _closed_check(self, length: int) -> None:
        # A closed source has an empty view: slicing it would hand out 0 bytes for a tensor.
        if self._map is None and length:
            raise ClosedFileError("File is closed", kind="FileClosed")

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
        check_range(self, offset, length)
        self._check_not_truncated(offset, length)
        if not self.mostly_uncached(offset, length):
            return False
        mapping = self._map
        address = address_of(mapping) + self._at
        start = offset - offset % mmap.PAGESIZE
        end = offset + length

        def populate(at: int) -> None:
            # Without the GIL (see advise_range): a thread waiting here for the disk no longer
            # stops every other thread of the process. Populating a cold 2 GiB file ran at the
            # disk's ~2 GB/s either way; the kernel's readahead kept its queue busy.
            advise_range(mapping, address, at, min(_PREFETCH_STEP, end - at), MADV_POPULATE_READ)

        try:
            run_parallel(populate, range(start, end, _PREFETCH_STEP), worker_count(self))
        except OSError as exc:
            # Kernels before 5.14 refuse the advice (EINVAL): stop asking. Anything else (a
            # file truncated meanwhile) is left to the copy, which checks and reports it.
            if exc.errno == errno.EINVAL:
                PrefetchSupport.enabled = False
            return False
        return True

    def mostly_uncached(self, offset: int, length: int) -> bool:
        """Whether most (sampled) pages of the range are not in the page cache; False if the
        kernel cannot say or the source is closed."""
        mapping = self._map
        if mapping is None:
            return False
        return mapped_mostly_uncached(address_of(mapping) + self._at + offset, length)

    def partial_reads(self) -> PreadSource | None:
        """Positioned reads of this file with kernel readahead off, for a part of a tensor
        that is not cached (made at first use, closed with this source); None once closed.

        A copy out of a cold mapping faults its pages in by readahead windows, which run past
        the part: a cold 1/8 row slice of four 64 MiB tensors read 130-162 MiB off the disk
        for its 32 MiB, in 86-106 ms, where these reads took 32 MiB in 36-39 ms (the
        reference's mapping read 68-72 MiB in 141-149 ms).
        """
        with self._lock:
            if self._positioned is None:
                if self._fd < 0:
                    return None
                # A second descriptor of its own (readahead state is the open file's), as
                # PreadSource's partial reads have: two a file, as descriptor budgets count.
                # None where it cannot be opened (out of descriptors): the mapping serves.
                ours = PreadSource(self._fd, self._name, size=self._size, owns_fd=False)
                self._positioned = ours._reopen_random()
            return self._positioned

    def close(self) -> None:
        # Tensors may still view the mapping; the map is unmapped when the last view dies.
        self._view = memoryview(bytearray())
        self._map = None
        with self._lock:
            positioned, self._positioned = self._positioned, None
        if positioned is not None:
            positioned.close()  # reads in flight finish first
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


#: Streams that decompress as they are read, by module and class (looked up only where the
#: module was imported: an object of a module never imported cannot be one).
_DECOMPRESSING: Final = (
    ("gzip", "GzipFile"),
    ("bz2", "BZ2File"),
    ("lzma", "LZMAFile"),
    ("zipfile", "ZipExtFile"),
    ("tarfile", "ExFileObject"),
)


#: Decompressing streams some source has read and not yet closed: the caller's position and
#: how many sources read it (two handles on one stream: put back when the last one closes,
#: to where the caller had it, not where the first left it).
_HOMES: Final[weakref.WeakKeyDictionary[Any, list[int]]] = weakref.WeakKeyDictionary()
_HOMES_LOCK: Final = threading.Lock()


def _leave_home(fileobj: Any) -> None:
    """Count a source that moves ``fileobj``, noting the caller's position if it is first."""
    with _HOMES_LOCK:
        entry = _HOMES.get(fileobj)
        if entry is None:
            entry = _HOMES[fileobj] = [fileobj.tell(), 0]
        entry[1] += 1


def _come_home(fileobj: Any) -> None:
    """A source that moved ``fileobj`` is done with it; the last one puts its position back."""
    with _HOMES_LOCK:
        entry = _HOMES.get(fileobj)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _HOMES[fileobj]
    with contextlib.suppress(Exception):  # closed by its owner meanwhile
        fileobj.seek(entry[0])


def _decompresses(fileobj: object) -> bool:
    """Whether ``fileobj`` is a stream whose backward seeks decompress again from its start
    (a tar member too: in a compressed archive it is read through the archive's stream)."""
    for module_name, class_name in _DECOMPRESSING:
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None) if module is not None else None
        if isinstance(cls, type) and isinstance(fileobj, cls):
            return True
    return False


class FileObjSource:
    """Reads from a binary file object with ``seek`` and ``readinto`` or ``read``.

    The file is read from its start (offset 0), whatever the object's position, as a plain
    file read through its descriptor is; the position is put back after every access, so
    that the caller's next ``write`` or ``read`` goes where it would have (an ``io.BytesIO``
    left at a tensor's end took a caller's appended bytes over that tensor). A stream that
    decompresses (:func:`_decompresses`: read-only, and seeking back in it decompresses again
    from its start, which after every read made a loop over its tensors quadratic) gets its
    position back once, at :meth:`close`. Reads are serialised with a lock because a file
    object has one position.
    """

    def __init__(self, fileobj: IO[bytes] | Any, name: str | None = None) -> None:
        self._f = fileobj
        self._name = name or str(getattr(fileobj, "name", "<file object>"))
        self._lock = threading.Lock()
        self._restore_at_close = _decompresses(fileobj)
        self._moved = False  # whether this source counts in the object's _HOMES entry
        where = fileobj.tell()
        try:
            fileobj.seek(0, os.SEEK_END)
            self._size = int(fileobj.tell())
        finally:
            fileobj.seek(where)

    @property
    def size(self) -> int:
        return self._size

    @property
    def name(self) -> str:
        return self._name

    def readinto(self, offset: int, out: memoryview) -> None:
        out = out.cast("B")
        check_range(self, offset, out.nbytes)
        with self._lock:
            if self._restore_at_close:
                if not self._moved:
                    _leave_home(self._f)
                    self._moved = True
                self._read_at(offset, out)
                return
            where = self._f.tell()
            try:
                self._read_at(offset, out)
            finally:
                self._f.seek(where)

    def _read_at(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` from ``offset`` (the lock held; the position is left after it)."""
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
        # The caller owns the file object: only its position is put back (see the class).
        with self._lock:
            if self._moved:
                self._moved = False
                _come_home(self._f)
