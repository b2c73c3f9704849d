"""Writing files: plan a layout, then stream every tensor's bytes straight from its memory.

``write_file`` is the one path every save goes through (numpy, torch, the other frameworks,
conversion, resharding, casting): it takes tensors as :class:`TensorData` whose bytes come from a
callable, so a caller can hand over memory it already holds (zero copies) or produce the bytes
chunk by chunk (bounded memory).

Atomicity: bytes go to a sibling temporary file (``.<name>.<random>.partial``) which is renamed
over the target with ``os.replace`` only once complete. A crash leaves the previous file intact;
readers that mapped the old file keep their (now unlinked) inode. Temporary files left by a crash
are removed by the next save to the same target. A new file's permissions follow the umask
(``0o666 & ~umask``), not the ``0o600`` of ``mkstemp``; one saved over a file (not over a
symbolic link, which is replaced) keeps that file's permissions.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import os
import re
import secrets
import stat
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

from . import tuning
from ._dtypes import DType
from ._errors import (
    PathArg,
    SafetensorError,
    SerializeError,
    WriteError,
    add_note,
    output_path,
    write_error,
)
from ._format import MAX_HEADER_SIZE, SERIALIZE_PREFIX, gc_paused
from ._interrupts import interrupts_deferred
from ._layout import Layout, build_layout
from ._syscalls import SYNC_FILE_RANGE_WRITE, sync_file_range

__all__ = [
    "WRITEV_BYTES",
    "CommitReceipt",
    "SaveGroup",
    "StaleFileWarning",
    "TensorData",
    "Writeback",
    "atomic_output",
    "layout_for",
    "pwrite_all",
    "reserve_space",
    "serialize_to_bytes",
    "write_all",
    "write_file",
    "write_layout",
]

#: Small chunks are gathered into ``writev`` calls of about this many bytes, and durable saves
#: cut large tensors into pieces of this size (so that :class:`Writeback` hands them to the
#: disk early). Large tensors are cut at fixed offsets from their own start, never re-cut to
#: fill a batch (several times faster in early measurements).
WRITEV_BYTES: Final = 4 << 20
#: Saves to the page cache write a large tensor in calls of up to this size (whole tensors, in
#: practice). Measured with every arm starting from recently used memory, 2 GiB saves took
#: 434-460 ms this way against 453-677 ms in 4 MiB calls (6 interleaved runs; the reference,
#: which writes whole tensors too, 436-440 ms). Earlier measurements without that warm-up had
#: favoured 4 MiB calls, within their noise.
_LARGE_WRITE_BYTES: Final = 1 << 30
#: Buffers smaller than this are gathered into one ``writev`` with their neighbours.
_IOV_MAX: Final = min(1024, getattr(os, "IOV_MAX", 1024) if hasattr(os, "IOV_MAX") else 1024)

# Reserving the file's space first (``posix_fallocate``) is ``tuning``'s ``preallocate``, off
# by default: on ext4, buffered writes into the preallocated (unwritten) extents made 2 GiB
# saves about 2x slower than plain appends in benchmarks/RESULTS.md (median of 5; the
# raw-write ceiling, which does not preallocate, was 3.7x faster than the preallocating writer).

#: ``posix_fallocate`` errors that mean the file system cannot reserve space (the save then
#: writes as without ``preallocate``); any other (``ENOSPC``, ``EFBIG``, ``EDQUOT``) fails it.
_NO_RESERVING: Final = frozenset(
    getattr(errno, n)
    for n in ("EOPNOTSUPP", "ENOTSUP", "ENOSYS", "EINVAL", "ENODEV", "ESPIPE")
    if hasattr(errno, n)
)

#: A durable save hands its bytes to the disk in pieces of about this size as soon as they are
#: written (:class:`Writeback`).
WRITEBACK_STEP: Final = 16 << 20

Chunks = Iterable[Any]  # buffer-protocol objects (bytes, memoryview, numpy arrays, ...)


# Not frozen: a frozen dataclass sets each field through object.__setattr__ (0.6 us against
# 0.15 us a tensor to make, for 20,000 small arrays ~10 ms of a ~90 ms save). Nothing
# changes one after it is made.
@dataclass(slots=True)
class TensorData:
    """A tensor to be written."""

    name: str
    """Tensor name."""
    dtype: DType
    """Element type."""
    shape: tuple[int, ...]
    """Logical shape."""
    chunks: Callable[[], Chunks]
    """Returns the tensor's bytes (little-endian, row-major) as buffer chunks, in order.

    A producer may reuse a chunk's memory once the chunk after it is asked for (device tensors
    are copied out through a ring of pinned buffers), except for chunks smaller than
    ``WRITEV_BYTES`` and a tensor's last chunk: consumers write every other chunk before
    asking for the next, and may keep those two kinds (``write_layout`` gathers small ones).
    """
    keepalive: Any = field(default=None, compare=False)
    """Anything that must stay alive while the chunks are read (e.g. the source tensor)."""
    whole: memoryview | None = field(default=None, compare=False)
    """The tensor's bytes as one flat ``B`` buffer, where they already lie in memory in file
    order (a contiguous little-endian numpy array); ``chunks()`` then gives just these bytes.
    The writer takes it without calling ``chunks`` (a generator and a view per tensor: ~1 us,
    a sixth of saving each of 20,000 small arrays)."""
    reused: bool = field(default=False, compare=False)
    """Every chunk's memory, the last and small ones too, may be reused once the chunk after
    it is asked for (a converter reading each chunk into the same buffer): consumers copy
    the chunks they keep."""


def layout_for(
    tensors: Sequence[TensorData],
    metadata: Mapping[str, str] | None,
    *,
    max_header_size: int = MAX_HEADER_SIZE,
) -> Layout:
    """Plan the file for ``tensors`` (see ``_layout.build_layout``), with the collector paused
    over the few objects per tensor that the plan keeps (see ``_api._to_data``)."""
    with gc_paused():
        return build_layout(
            ((t.name, t.dtype, t.shape) for t in tensors),
            metadata,
            max_header_size=max_header_size,
        )


def _as_bytes_view(chunk: Any) -> memoryview:
    view = memoryview(chunk)
    if not view.c_contiguous:
        raise SerializeError(f"{SERIALIZE_PREFIX}internal error: a chunk is not contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _ordered_chunks(
    layout: Layout, by_name: Mapping[str, TensorData]
) -> Iterator[tuple[memoryview, bool]]:
    """Yield every tensor's chunks in layout order, each with whether its memory stays valid
    after the next is asked for (a tensor's last chunk: see :attr:`TensorData.chunks`),
    checking each tensor's total size. Small chunks of a :attr:`TensorData.reused` tensor come
    as copies (the writer gathers them with their neighbours), the others as they are."""
    for info in layout.tensors:
        data = by_name[info.name]
        whole = data.whole
        if whole is not None and whole.nbytes == info.nbytes:
            if whole.nbytes:
                yield whole, True
            continue
        got = 0
        reused = data.reused
        for chunk in data.chunks():
            view = _as_bytes_view(chunk)
            got += view.nbytes
            if got > info.nbytes:
                break
            if not view.nbytes:
                continue
            if reused and view.nbytes < WRITEV_BYTES:
                view = memoryview(bytes(view))
            yield view, not reused and got == info.nbytes
            # Not held while the next chunk is made: a tensor's last chunk kept the producer's
            # buffer alive until the next tensor's was allocated (two buffers at the peak).
            del chunk, view
        if got != info.nbytes:
            raise SerializeError(
                f"{SERIALIZE_PREFIX}invalid shape, data type, or offset for tensor "
                f"`{info.name}` (it provided {got}{'+' if got > info.nbytes else ''} bytes but "
                f"{info.dtype.code} {list(info.shape)} needs {info.nbytes})",
                kind="TensorInvalidInfo",
                tensor=info.name,
            )


class Writeback:
    """Starts the disk writing a durable save's bytes while later bytes are still being written.

    A save with ``fsync`` otherwise leaves every page dirty until the final ``fsync``, which
    then waits for the whole file to reach the disk. Asking for writeback of each ~16 MiB as
    soon as it is written (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait)
    overlaps the disk with the rest of the writing: on the VM of ``benchmarks/RESULTS.md`` a
    2 GiB write + ``fsync`` took 0.69-0.97 s this way against 1.10-1.38 s without (8 MiB steps
    about the same, 32-64 MiB slower). Durability still comes from the final ``fsync``; this is
    only a hint, and a no-op where the call is missing or refused.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self._low = -1  # envelope of the bytes written since the last hand-over
        self._high = -1
        self._sync = sync_file_range  # None where the call is missing (not Linux)

    def wrote(self, offset: int, length: int) -> None:
        """Note that ``[offset, offset + length)`` was written; hand it over when enough is."""
        sync = self._sync  # read once: another writer thread may switch it off meanwhile
        if sync is None or length <= 0:
            return
        with self._lock:
            if self._low < 0:
                self._low, self._high = offset, offset + length
            else:
                self._low = min(self._low, offset)
                self._high = max(self._high, offset + length)
            if self._high - self._low < WRITEBACK_STEP:
                return
            low, high = self._low, self._high
            self._low = self._high = -1
        # Pages of the envelope that were not written (out-of-order writers) are not dirty
        # and cost nothing; pages already being written back are skipped by the kernel.
        if sync(self._fd, low, high - low, SYNC_FILE_RANGE_WRITE) != 0:
            self._sync = None  # not supported on this file system: stop asking


def _wrote(n: int) -> int:
    """``n``, the bytes a write call moved, checked for progress: a call that moves nothing while
    bytes remain (a full FUSE or network file system may answer so) would have the loop call it
    forever, so it is an I/O error, as Rust's ``write_all`` makes it (``WriteZero``)."""
    if n <= 0:
        raise OSError(errno.EIO, "a write call wrote 0 bytes of what remained to write")
    return n


def _write_all(fd: int, views: list[memoryview]) -> int:
    """``writev`` until every byte of ``views`` is written (handles short writes).

    Returns:
        The number of bytes written.
    """
    total = sum(v.nbytes for v in views)
    while views:
        n = _wrote(os.writev(fd, views))
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return total


#: Largest single pwrite; Linux moves at most about 2 GiB per call anyway.
_PWRITE_MAX: Final = 1 << 30


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (a call may write less than it was given)."""
    view = memoryview(data)
    done = 0
    while done < view.nbytes:
        done += _wrote(os.pwrite(fd, view[done : done + _PWRITE_MAX], offset + done))


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """``write`` all of ``data`` at ``fd``'s position (a call may write less than it was given)."""
    view = memoryview(data)
    while view:
        view = view[_wrote(os.write(fd, view)) :]


def write_layout(
    fd: int, layout: Layout, tensors: Sequence[TensorData], *, writeback: Writeback | None = None
) -> None:
    """Write the header and every tensor's bytes to ``fd`` at its current position.

    Chunks are written directly from their memory (nothing is copied in user space), in
    ``writev`` calls: small chunks are gathered into calls of about ``WRITEV_BYTES``, large
    ones are written in pieces of up to ``_LARGE_WRITE_BYTES`` (``WRITEV_BYTES`` for durable
    saves). ``writeback`` (durable saves) is told about every write.
    """
    piece = WRITEV_BYTES if writeback is not None else _LARGE_WRITE_BYTES
    by_name = {t.name: t for t in tensors}
    base = os.lseek(fd, 0, os.SEEK_CUR) if writeback is not None else 0
    done = 0  # bytes of the layout written

    def flush(views: list[memoryview]) -> None:
        nonlocal done
        try:
            written = _write_all(fd, views)
        except OSError as exc:
            if exc.errno == errno.EFAULT:
                # The kernel could not read a tensor's memory: name it (the error names only
                # the file written), and the usual cause.
                _name_unreadable(exc, layout, done, done + sum(v.nbytes for v in views))
            raise
        if writeback is not None:
            writeback.wrote(base + done, written)
        done += written

    batch: list[memoryview] = [memoryview(layout.header)]
    batch_bytes = len(layout.header)
    for view, _ in _ordered_chunks(layout, by_name):
        size = view.nbytes
        if size < WRITEV_BYTES:
            # Small chunks are gathered with their neighbours.
            batch.append(view)
            batch_bytes += size
            if len(batch) >= _IOV_MAX or batch_bytes >= WRITEV_BYTES:
                flush(batch)
                batch, batch_bytes = [], 0
            continue
        # Large chunks go out on their own, in pieces cut at fixed offsets from their start.
        if batch:
            flush(batch)
            batch, batch_bytes = [], 0
        for start in range(0, size, piece):
            flush([view[start : start + piece]])
        del view  # written: let its memory go before the next chunk is made (see above)
    flush(batch)


def _name_unreadable(exc: OSError, layout: Layout, start: int, end: int) -> None:
    """Note on ``exc`` the tensors whose bytes lie in ``[start, end)`` of the layout written
    (a write that could not read them)."""
    data = len(layout.header)
    names = [f"`{t.name}`" for t in layout.tensors if data + t.begin < end and data + t.end > start]
    add_note(
        exc,
        f"the memory of tensor {', '.join(names)} could not be read (an array mapped from a "
        "file that has shrunk since?)",
    )


_UMASK_LOCK: Final = threading.Lock()


def _umask() -> int:
    """The process's umask, read without changing it where the OS shows it (Linux 4.7+).

    ``os.umask`` can only read it by setting it: the mask belongs to the whole process, so for
    that moment every other thread creates files world-writable, and two saves interleaving
    their set-and-restore could leave it at 0 for good. The fallback is serialized for the
    second reason; the first remains where ``/proc`` does not show the mask.
    """
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0)
        os.umask(mask)
    return mask


def _replaced_mode(target: str) -> int | None:
    """The permission bits of the regular file a save replaces, or None (no file, or a link or
    something else, which the save replaces with a file of its own)."""
    try:
        info = os.lstat(target)
    except OSError:
        return None
    return info.st_mode & 0o777 if stat.S_ISREG(info.st_mode) else None


#: What ``fsync`` of a folder fails with where the system or file system cannot sync folders at
#: all: nothing more can be done there, and failing every durable save would help no one.
_DIR_SYNC_UNSUPPORTED: Final = frozenset(
    {errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EOPNOTSUPP}
)


def _fsync_dir(folder: str, saved: str | None = None) -> None:
    """Make ``folder``'s entries durable (saves with ``fsync=True``, after their renames).

    A folder that cannot be synced (one the user may write in but not read, an I/O error)
    leaves the new names undurable: raised as a :class:`WriteError` naming the folder, with a
    note that ``saved`` is in place (a save that returned had promised durability). With
    ``saved`` None, best effort: nothing is raised.
    """
    try:
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        if saved is None or exc.errno in _DIR_SYNC_UNSUPPORTED:
            return
        err = write_error(exc, folder)
        add_note(
            err,
            f"{saved} saved and in place, but its folder could not be synced (fsync=True):"
            " the new name may not survive a power cut",
        )
        raise err from exc


def _lock_partial(fd: int) -> bool:
    """Hold an exclusive ``flock`` on a temporary file: it is in use while the lock is held.

    Returns:
        False where the lock is taken by another open file (a live save), or cannot be taken
        at all (no ``fcntl``, a file system without locks); True once it is ours.
    """
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _clean_stale_partials(target: str, partials: list[str] | None = None) -> None:
    """Remove temporary files an earlier, crashed save to ``target`` left behind (its own
    only: a user's ``.model.safetensors.notes.partial``, or the temporary files of
    ``model.safetensors`` when saving ``model``, match the pattern but are not).

    ``partials``: the names of the folder's temporary files, listed once for many targets
    (:meth:`SaveGroup.stale_partials`); else the folder is searched for this target's.
    """
    folder, base = os.path.split(target)
    stem = partial_stem(base)
    if partials is None:
        found = glob.glob(
            os.path.join(glob.escape(folder or "."), f".{glob.escape(stem)}.*.partial")
        )
    else:
        found = [os.path.join(folder, name) for name in partials]
    for stale in found:
        if partial_target(os.path.basename(stale)) == stem:
            remove_stale_partial(stale)


#: A save's temporary file: ``.<stem>.<12 hex digits>.partial`` (see _atomic_output).
_PARTIAL: Final = re.compile(r"\.(.+)\.[0-9a-f]{12}\.partial", re.DOTALL)
#: The longest file name most file systems hold, in bytes (ext4, XFS, btrfs, tmpfs, NTFS).
_NAME_MAX: Final = 255
#: Bytes of a temporary file's name that are not its stem: ``.`` and ``.<12 hex>.partial``.
_PARTIAL_EXTRA: Final = 1 + 1 + 12 + len(".partial")


def partial_stem(base: str) -> str:
    """The part of a temporary file's name that stands for the target file named ``base``.

    The name itself where the temporary name then fits in :data:`_NAME_MAX` bytes; a longer
    one (up to 255 bytes is a valid target) is cut, and a hash of the whole name appended so
    that two long names sharing a beginning still have stems of their own.
    """
    room = _NAME_MAX - _PARTIAL_EXTRA
    if len(os.fsencode(base)) <= room:
        return base
    digest = hashlib.sha256(os.fsencode(base)).hexdigest()[:16]
    stem = base[: room - 17]
    while len(os.fsencode(stem)) > room - 17:  # multi-byte characters
        stem = stem[:-1]
    return f"{stem}~{digest}"


def partial_target(name: str) -> str | None:
    """The stem (:func:`partial_stem`: the target's name, unless that is very long) of the
    target whose save's temporary file ``name`` is, if it is one."""
    found = _PARTIAL.fullmatch(name)
    return None if found is None else found.group(1)


def remove_stale_partial(path: str) -> bool:
    """Delete the temporary file ``path`` if a crashed save left it; whether it did."""
    # A live save holds a lock on its temporary file (a streaming writer may sit idle for
    # hours); a crashed one released it with its process. Files younger than a minute are
    # left alone too, for file systems without locks.
    with contextlib.suppress(OSError):
        if time.time() - os.stat(path).st_mtime <= 60:
            return False
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            if fcntl is None or _lock_partial(fd):
                os.unlink(path)
                return True
        finally:
            os.close(fd)
    return False


@dataclass
class CommitReceipt:
    """Whether an :func:`atomic_output` passed its commit point: the file renamed into place
    (or handed to its group). Set before a Ctrl-C held over that step is raised, so that the
    caller can tell a commit interrupted once done from one that never happened."""

    passed: bool = False


@contextlib.contextmanager
def atomic_output(
    filename: PathArg,
    *,
    fsync: bool = False,
    group: SaveGroup | None = None,
    like: os.stat_result | None = None,
    receipt: CommitReceipt | None = None,
) -> Iterator[int]:
    """Open a temporary sibling of ``filename`` for writing; rename it over ``filename`` on success.

    Args:
        filename: The target.
        fsync: Make the file (and, once renamed, its directory entry) durable.
        group: Leave the finished temporary file to ``group``, which renames it together with
            the group's other files (:meth:`SaveGroup.commit`).
        like: The status of a file this one replaces in its stead (a rewrite of it): its
            permission bits, and where allowed its owner and group, are given to the temporary
            file before the rename, so that the file never shows other permissions under the
            name. Without it, permissions follow the umask.
        receipt: Marked once the file is in place (or handed to ``group``).

    Yields:
        The file descriptor to write to. On any exception the temporary file is removed and the
        target is left untouched.

    Raises:
        WriteError: Creating, writing or renaming the file failed (an ``OSError`` raised in the
            body is turned into one too, as the reference reports every I/O error of a save).
    """
    target = output_path(filename, file=True)
    try:
        with _atomic_output(target, fsync=fsync, group=group, like=like, receipt=receipt) as fd:
            yield fd
    except OSError as exc:
        if isinstance(exc, SafetensorError):  # remote sources' errors, already ours
            raise
        raise write_error(exc, target) from exc


@contextlib.contextmanager
def _atomic_output(
    target: str,
    *,
    fsync: bool,
    group: SaveGroup | None = None,
    like: os.stat_result | None = None,
    receipt: CommitReceipt | None = None,
) -> Iterator[int]:
    folder = os.path.dirname(target) or "."
    if os.path.isdir(target):
        # Before any byte is written: a save of many GiB would otherwise fail only at the end.
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), target)
    try:
        mode = os.lstat(target).st_mode
    except OSError:
        mode = None
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        # The rename would replace the node itself: a save to /dev/null run as root deleted
        # /dev/null for the whole machine (the reference does so), a FIFO stopped being one.
        raise FileExistsError(
            errno.EEXIST,
            "the target is a device, FIFO or socket, not a file; a save would replace it",
            target,
        )
    _clean_stale_partials(target, None if group is None else group.stale_partials(folder))
    stem = partial_stem(os.path.basename(target))
    tmp = os.path.join(folder, f".{stem}.{secrets.token_hex(6)}.partial")
    # (The name's form is what partial_target() reads back.)
    owner = os.getpid()
    fd = -1
    handed_over = False  # the group owns the file (a Ctrl-C held over the hand-over is raised)
    try:
        try:
            # Inside the clean-up from the first step: a KeyboardInterrupt right after the
            # open (Python raises it when a call returns) must not leave the file, locked
            # against every later save's clean-up by a descriptor nobody closes.
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
            fd = os.open(tmp, flags, 0o600)
            _lock_partial(fd)  # marks it live for _clean_stale_partials of other saves
            yield fd
            if like is None:
                # As open(target, "w") would leave them: a replaced file's permissions (a
                # user's chmod 600 survives a save), else the umask's for a new file.
                mode = _replaced_mode(target)
                os.fchmod(fd, 0o666 & ~_umask() if mode is None else mode)
            else:
                if hasattr(os, "fchown") and (like.st_uid, like.st_gid) != (
                    os.geteuid(),
                    os.getegid(),
                ):
                    # Only root may give a file away, and a user only to a group of theirs:
                    # the group alone where the owner cannot be kept, else the file stays ours.
                    try:
                        os.fchown(fd, like.st_uid, like.st_gid)
                    except OSError:
                        with contextlib.suppress(OSError):
                            os.fchown(fd, -1, like.st_gid)
                os.fchmod(fd, stat.S_IMODE(like.st_mode))
            if fsync:
                os.fsync(fd)
        except BaseException:
            with interrupts_deferred():
                if fd < 0:
                    # A signal that came during the open is raised as os.open returns, before
                    # its result is stored: find the descriptor by the file's name.
                    fd = _descriptor_of(tmp)
                if fd >= 0:
                    os.close(fd)
            raise
        if group is not None:
            # Handed over whole: a Ctrl-C between the writeback hint and the hand-over deleted
            # the file and left its descriptor open, which nobody closed.
            with interrupts_deferred():
                try:
                    if sync_file_range is not None and os.path.exists(target):
                        # ext4 starts writing a file out when it replaces another by rename
                        # (auto_da_alloc), which made each rename of the commit take
                        # milliseconds per MiB; start that writeback now, so that the
                        # commit's window stays short.
                        sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)
                except BaseException:
                    os.close(fd)
                    raise
                group._add(tmp, target, fd)  # still open: the lock keeps it from stale cleanup
                handed_over = True
                if receipt is not None:
                    receipt.passed = True
            return
        os.close(fd)
        # The commit. A Ctrl-C that lands in the rename (which can take a while: ext4 writes
        # out a file that replaces another) or right after it is raised once the save is
        # whole, its folder synced where asked: raised as the rename returned, it skipped
        # that sync and looked like a save that had not happened.
        with interrupts_deferred():
            os.replace(tmp, target)
            if receipt is not None:
                receipt.passed = True
            if fsync:
                _fsync_dir(folder, repr(target))
    except BaseException as exc:
        # Not in a forked child that inherited this save (its copy of the generator is
        # finalized when the child exits): the file is the parent's, still being written.
        # Nor a name that was another's (O_EXCL refused it: never with a random name).
        # (try/except: when finalized at interpreter exit, module globals may be gone.)
        try:
            with interrupts_deferred():
                refused = fd < 0 and isinstance(exc, FileExistsError)
                if os.getpid() == owner and not refused and not handed_over:
                    os.unlink(tmp)
        except Exception:  # noqa: BLE001, S110
            pass
        raise


def _descriptor_of(path: str) -> int:
    """The descriptor this process has open on ``path`` (a temporary file of its own, whose
    name no one else opens), or -1 where there is none or it cannot be told (no ``/proc``)."""
    wanted = os.path.realpath(path)
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{entry}") == wanted:
                    return int(entry)
    return -1


def _descriptor_budget() -> int:
    """How many finished files of a group may keep their descriptors: all but a margin of
    the soft limit on open descriptors."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # pragma: no cover - not on POSIX
        return 512
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return max(16, soft - 256)


def allow_descriptors(count: int) -> None:
    """Raise the soft limit on open descriptors to ``count`` (at most the hard limit) where
    it is lower; where it cannot be raised, the save fails as it would have."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < count:
            ceiling = count if hard == resource.RLIM_INFINITY else min(count, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, ceiling), hard))
    except (OSError, ValueError):
        pass


def descriptor_limit() -> int | None:
    """The soft limit on open descriptors; None where there is none (or it is unknown)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return None
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):  # pragma: no cover - getrlimit of a known resource
        return None
    return None if soft == resource.RLIM_INFINITY else soft


class StaleFileWarning(UserWarning):
    """A save completed but could not remove a file of the checkpoint it replaced."""


class SaveGroup:
    """Files saved together (the shards and index of a checkpoint): renamed into place together.

    Each file is written to its temporary sibling as with :func:`atomic_output`, but left there
    until every file of the group is complete (and, with ``fsync``, durable); :meth:`commit`
    then renames them all in the order they were finished, which takes milliseconds. So a save
    that fails or is killed while writing leaves every earlier file of the folder as it was,
    instead of a mix of new and old shards that still looks like one checkpoint.

    Renames of several files cannot be one atomic step, so ``seal`` names the file that makes
    the others one checkpoint (the index): its old version is deleted before anything is
    renamed, and its new one renamed last. A crash in the milliseconds of :meth:`commit` then
    leaves a folder without an index, which refuses to open (several shards, nothing saying
    which belong together), rather than shards of two saves that load silently.

    A rename that fails once a file of the folder's previous save is gone (renamed over, or
    the old index deleted) keeps the files not renamed yet, and names them in the error: they
    may be the only copy of their tensors (a checkpoint resharded into its own folder).

    Args:
        fsync: Make the renames durable (the folder is synced after deleting the old seal and
            after the renames).
        seal: The target whose presence vouches for the others, if any.
        retire: A file of the folder's previous save that this one does not replace but
            that loaders would still open (its index, when the new save is a single file; its
            single file, when the new save is sharded): deleted once every file is renamed,
            so that until then the folder still holds the previous checkpoint whole (the
            source of a reshard into its own folder).
    """

    def __init__(
        self, *, fsync: bool = False, seal: str | None = None, retire: str | None = None
    ) -> None:
        self._fsync = fsync
        self._seal = seal
        self._retire = retire
        self._pending: list[tuple[str, str, int]] = []
        self._held = 0  # pending files that still hold their descriptor
        self._lock = threading.Lock()
        self._partials: dict[str, list[str]] = {}
        self.done = False
        """True once committed or discarded."""
        self.committed = False
        """True once every file is renamed into place (set before a Ctrl-C held over the
        renames is raised, so that the caller can tell a commit interrupted from one that
        did not happen)."""

    def stale_partials(self, folder: str) -> list[str]:
        """The temporary files in ``folder`` when the group first saved there, listed once.

        Searching the folder for each file's own (a glob per shard, while the group's finished
        files add entries) made a save of 20,000 shards take 111 s instead of seconds. Those
        of crashed saves are there before the group starts; the group's own come after.
        """
        with self._lock:
            names = self._partials.get(folder)
            if names is None:
                try:
                    names = [n for n in os.listdir(folder) if n.endswith(".partial")]
                except OSError:
                    names = []
                self._partials[folder] = names
            return names

    def _add(self, tmp: str, target: str, fd: int) -> None:
        with self._lock:
            if self.done:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise SerializeError(f"{SERIALIZE_PREFIX}the save group is already finished")
            # Every finished file keeps its descriptor (and so its lock, which tells other
            # saves' clean-ups it is in use) until the commit. A save of 1,500 shards ran out
            # of descriptors under the common limit of 1,024: the soft limit is raised as the
            # group grows, and past what it allows, files are kept without their descriptor.
            held = self._held
            if held and held % 128 == 0:
                allow_descriptors(held + 256)
            if held >= _descriptor_budget():
                os.close(fd)
                fd = -1
            else:
                self._held += 1
            self._pending.append((tmp, target, fd))

    def commit(self) -> list[str]:
        """Rename every finished file over its target, in order.

        A Ctrl-C (SIGINT) that comes meanwhile is raised once the commit is over, as for a
        single file's rename: raised between two renames, it left a folder without its index
        (the new files not renamed yet deleted, or the old index deleted and nothing renamed).

        Returns:
            The targets, in the order they were renamed.

        Raises:
            WriteError: A rename failed; the files not renamed yet are discarded.
        """
        with interrupts_deferred():
            return self._commit()

    def _commit(self) -> list[str]:
        with self._lock:
            pending, self._pending, self._held = self._pending, [], 0
            self.done = True
        for _, _, fd in pending:
            if fd >= 0:
                os.close(fd)
        done: list[str] = []
        folders: dict[str, None] = {}
        if self._seal is not None:
            sealed = [p for p in pending if p[1] == self._seal]
            pending = [p for p in pending if p[1] != self._seal] + sealed
        # Whether a file of the folder's previous save is gone (deleted, or renamed over).
        changed = False
        try:
            if self._seal is not None and len(pending) > 1:
                # No index while the shards change: a crash now shows, it does not mix.
                changed = self._remove_first(self._seal)
            for tmp, target, _ in pending:
                replacing = os.path.lexists(target)
                try:
                    os.replace(tmp, target)
                except OSError as exc:
                    raise write_error(exc, target) from exc
                changed = changed or replacing
                done.append(target)
                folders[os.path.dirname(target) or "."] = None
            if self._retire is not None:
                # An index this save replaced with a single file (or a single file it
                # replaced with shards): deleted here, not left to the clean-up, which a
                # crash or clean=False would skip and leave the old entry point in charge.
                self._retire_old(self._retire)
        except BaseException as exc:
            left = [tmp for tmp, target, _ in pending if target not in done]
            if changed and left:
                # They may hold the only copy of their tensors: kept, and named.
                add_note(exc, "files of this save not renamed into place, kept: " + ", ".join(left))
            else:
                for tmp in left:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
            raise
        self.committed = True
        if self._fsync:
            for folder in folders:
                _fsync_dir(folder, f"every file of this save in {folder!r}")
        return done

    def _retire_old(self, path: str) -> None:
        """Delete the previous save's other entry point, once every new file is in place.

        Raised from here, a failure read as a save that failed while the new checkpoint stood
        complete (a CLI's exit status 2, a caller retrying or cleaning up): said as the
        clean-up of older files says it, and left.
        """
        try:
            self._remove_first(path)
        except WriteError as exc:
            warnings.warn(
                f"the save to {os.path.dirname(path) or '.'!r} is complete, but the previous "
                f"save's {os.path.basename(path)!r} could not be removed ({exc.strerror or exc}); "
                "loaders that open it first may still read the previous checkpoint",
                StaleFileWarning,
                stacklevel=4,
            )

    def _remove_first(self, path: str) -> bool:
        """Delete ``path`` (if there), durably with ``fsync``; whether it was there.

        Raises:
            WriteError: It is there and could not be deleted.
        """
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno == errno.ENAMETOOLONG:
                # No file of that name can exist: a single file's legal name, and its index's
                # 11 bytes longer, past the file system's limit.
                return False
            raise write_error(exc, path) from exc
        if self._fsync:
            # Best effort: the new checkpoint is durable already; this only retires an old
            # entry point (a failure here would read as one to delete it).
            _fsync_dir(os.path.dirname(path) or ".")
        return True

    def discard(self) -> None:
        """Delete every finished temporary file; the targets stay as they were."""
        # A Ctrl-C held from before the files are taken off the list: between the two, it
        # left them on disk with nothing to delete them.
        with interrupts_deferred():
            with self._lock:
                pending, self._pending, self._held = self._pending, [], 0
                self.done = True
            for tmp, _, fd in pending:
                if fd >= 0:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def __enter__(self) -> SaveGroup:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None and not self.done:
            self.commit()
        else:
            self.discard()


def write_file(
    filename: PathArg,
    tensors: Sequence[TensorData],
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = False,
    max_header_size: int = MAX_HEADER_SIZE,
    group: SaveGroup | None = None,
) -> Layout:
    """Write a safetensors file atomically.

    Args:
        filename: Target path.
        tensors: Tensors to write, in any order.
        metadata: ``__metadata__`` or None.
        fsync: Make the file and its directory entry durable before returning.
        max_header_size: Largest header accepted.
        group: Rename the file into place with the rest of ``group`` (see :class:`SaveGroup`).

    Returns:
        The layout written.

    Raises:
        SerializeError: The tensors cannot be written as given.
        OSError: The file cannot be written.
    """
    layout = layout_for(tensors, metadata, max_header_size=max_header_size)
    with atomic_output(filename, fsync=fsync, group=group) as fd:
        reserve_space(fd, layout.file_size)
        write_layout(fd, layout, tensors, writeback=Writeback(fd) if fsync else None)
    return layout


def reserve_space(fd: int, size: int) -> None:
    """With ``tuning``'s ``preallocate`` on, reserve ``size`` bytes of the file ``fd`` before
    anything is written (``posix_fallocate``), so that a full disk or a file size limit
    fails the save at once rather than after streaming gigabytes. Files of 1 MiB or less,
    systems without the call and file systems that cannot reserve space write as without it.

    Raises:
        OSError: No room for the file (``ENOSPC``, ``EFBIG``, ``EDQUOT``...).
    """
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None or size <= (1 << 20) or not tuning.settings().preallocate:
        return
    try:
        fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in _NO_RESERVING:
            raise


def serialize_to_bytes(
    tensors: Sequence[TensorData],
    metadata: Mapping[str, str] | None = None,
    *,
    max_header_size: int = MAX_HEADER_SIZE,
) -> bytes:
    """Return a whole safetensors file as bytes.

    The bytes are joined straight from the tensors' memory into the one ``bytes`` object
    returned: filling a ``bytearray`` and converting it held the file twice at the peak (a
    4 GiB save peaked at 8 GiB more). A chunk whose memory its producer may reuse (a device
    tensor's pieces through a ring of pinned buffers) is copied as it comes.
    """
    layout = layout_for(tensors, metadata, max_header_size=max_header_size)
    parts: list[Any] = [layout.header]
    for view, last in _ordered_chunks(layout, {t.name: t for t in tensors}):
        # TensorData.chunks: only a tensor's last chunk and small ones stay valid.
        parts.append(view if last or view.nbytes < WRITEV_BYTES else bytes(view))
    return b"".join(parts)
