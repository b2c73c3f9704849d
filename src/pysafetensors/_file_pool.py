"""Local files kept open within a descriptor budget, opened again when next read.

A model of thousands of shards, each kept open from its header's reading to the end of a
command, ran out of descriptors (a hard limit of 4,096 is common, 1,024 too). A
:class:`PooledFile` holds its descriptor only while it is among the most recently read files
of its :class:`FilePool`; one closed for the budget is opened again by path when read, and must
then still be the file whose header was read (same device, inode, size and modification
time), or the read fails instead of mixing two versions of a file.
"""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict
from typing import Final

from ._errors import ClosedFileError, SafetensorError
from ._sources import PreadSource, open_regular_file
from ._writer import allow_descriptors, descriptor_limit

__all__ = ["FilePool", "PooledFile", "descriptor_budget", "file_identity"]

#: Files kept open at once whatever the descriptor limit.
MIN_OPEN: Final = 8
#: Descriptors a pool leaves to the rest of the process (its own files, sockets, pipes).
SPARE_DESCRIPTORS: Final = 128


def descriptor_budget(files_open: int) -> int | None:
    """How many files to keep open, two descriptors each, with ``files_open`` open now: as many
    as the soft limit allows once raised towards the hard one for those and more, less
    :data:`SPARE_DESCRIPTORS` (at least :data:`MIN_OPEN`); None where there is no limit.

    Two descriptors a file: a header read leaves a second one open with readahead off, for
    partial reads (see ``PreadSource.without_readahead``).
    """
    allow_descriptors(2 * (files_open + 1) + 2 * SPARE_DESCRIPTORS)
    soft = descriptor_limit()
    return None if soft is None else max(MIN_OPEN, (soft - SPARE_DESCRIPTORS) // 2)


def file_identity(st: os.stat_result) -> tuple[int, ...]:
    """What tells one version of a file from another: a file renamed over it, or rewritten."""
    # Not st_ctime: a chmod, chown or new link changes it and is no new save.
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class FilePool:
    """The open files of several :class:`PooledFile` sources, the least recently read closed
    first past the budget. Thread-safe; a read in progress keeps its file open.

    Args:
        capacity: Files open at once; None: as many as :func:`descriptor_budget` allows.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self._capacity = capacity
        self._open: OrderedDict[PooledFile, None] = OrderedDict()
        self._lock = threading.RLock()
        self._limit: int | None = capacity  # files open at once (None: no limit)
        self._limit_until = 0 if capacity is None else capacity  # open files it was asked for

    def capacity(self) -> int | None:
        """Files this pool keeps open at once (None: no limit)."""
        if self._capacity is not None:
            return self._capacity
        return descriptor_budget(len(self._open))

    def adopt(self, path: str, source: PreadSource) -> PooledFile:
        """``source`` (open on ``path``) as a pooled file; the pool now closes it."""
        pooled = PooledFile(self, path, source)
        with self._lock:
            self._used(pooled)
        return pooled

    def _used(self, pooled: PooledFile) -> None:
        """``pooled`` is open and the most recently read. Called under the lock."""
        self._open[pooled] = None
        self._open.move_to_end(pooled)
        if len(self._open) > self._limit_until:
            # Asked again once the files outgrow the answer: the soft limit may be raised
            # further (towards the hard one).
            self._limit = self.capacity()
            self._limit_until = len(self._open) + SPARE_DESCRIPTORS
            if self._limit is not None:
                self._limit_until = max(self._limit_until, self._limit)
        self._shrink()

    def _shrink(self) -> None:
        """Close the least recently read files not being read, down to the limit. Called
        under the lock."""
        if self._limit is None or len(self._open) <= self._limit:
            return
        for pooled in list(self._open):
            if len(self._open) <= self._limit:
                break
            if not pooled._reading:
                self._open.pop(pooled)
                pooled._release()

    def _starved(self) -> None:
        """The process ran out of descriptors (files of its own): close every file not being
        read, for the open that ran out to take one of theirs, and keep half as many open
        from now on. Called under the lock.

        Shrinking to the new limit alone freed nothing with :data:`MIN_OPEN` files or fewer
        open (half of them is still ``MIN_OPEN``): the retry failed while the pool held that
        many idle descriptors.
        """
        self._capacity = self._limit = self._limit_until = max(MIN_OPEN, len(self._open) // 2)
        for pooled in list(self._open):
            if not pooled._reading:
                self._open.pop(pooled)
                pooled._release()

    def _forget(self, pooled: PooledFile) -> None:
        with self._lock:
            self._open.pop(pooled, None)


class PooledFile:
    """A local file read through positioned reads (a :class:`~._sources.ByteSource`), whose
    descriptor its :class:`FilePool` may close between reads."""

    def __init__(self, pool: FilePool, path: str, source: PreadSource) -> None:
        self._pool = pool
        self._path = path
        self._size = source.size
        self._identity = file_identity(os.fstat(source.fd))
        self._source: PreadSource | None = source
        self._closed = False
        self._reading = 0  # reads in progress: the pool does not close the file under them

    @property
    def size(self) -> int:
        return self._size

    @property
    def name(self) -> str:
        return self._path

    def _reopened(self) -> PreadSource:
        """The open file, opened again if the pool closed it. Called under the pool's lock."""
        source = self._source
        if source is None:
            if self._closed:
                raise ClosedFileError("File is closed", kind="FileClosed")
            try:
                fd = open_regular_file(self._path)
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                self._pool._starved()
                try:
                    fd = open_regular_file(self._path)
                except OSError as again:
                    if again.errno not in (errno.EMFILE, errno.ENFILE):
                        raise
                    raise OSError(
                        again.errno,
                        f"out of file descriptors reopening {self._path}: the files being read "
                        f"keep {len(self._pool._open)} open, the rest are the process's own; "
                        "raise the limit (`ulimit -n`)",
                        self._path,
                    ) from again
            try:
                if file_identity(os.fstat(fd)) != self._identity:
                    raise SafetensorError(
                        f"{self._path} changed since its header was read (replaced or "
                        "rewritten): its tensors may not be where the header said. Run the "
                        "command again.",
                        kind="FileChanged",
                    )
                source = PreadSource(fd, self._path, size=self._size)
            except BaseException:
                os.close(fd)
                raise
            self._source = source
        self._pool._used(self)
        return source

    def readinto(self, offset: int, out: memoryview) -> None:
        with self._pool._lock:
            self._reading += 1  # first: the pool may close files as this one is reopened
            try:
                source = self._reopened()
            except BaseException:
                self._reading -= 1
                raise
        try:
            source.readinto(offset, out)
        finally:
            with self._pool._lock:
                self._reading -= 1
                # Files kept open over the limit because they were being read (this one
                # among them) close now, not at the pool's next read, which may never come.
                self._pool._shrink()

    def view(self, offset: int, length: int) -> memoryview | None:
        return None

    def _release(self) -> None:
        """Close the descriptor (the pool's budget); the next read opens the file again."""
        source, self._source = self._source, None
        if source is not None:
            source.close()

    def close(self) -> None:
        with self._pool._lock:  # not released twice, by this and by the pool's budget
            self._closed = True
            self._pool._forget(self)
            self._release()
