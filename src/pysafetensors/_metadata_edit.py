"""Editing ``__metadata__`` of an existing file: in place when that is safe, else an atomic rewrite.

The header sits before the data, and ``data_offsets`` count from the end of the header, so the
header can only change in place if its length ``N`` stays. Two candidates:

* **The metadata slot**: the ``__metadata__`` object and the JSON whitespace after it. A new
  metadata object that fits there replaces the old one, padded with spaces (JSON whitespace
  between tokens, which every JSON parser and the reference accept); every other byte of the
  header and the file stays.
* **The whole header**: re-serialized into the old ``N`` bytes, padded with spaces at the end
  (this uses the spare room at the end of a header, where earlier edits and other writers
  leave it).

By default a candidate is written only when the bytes that change lie within one page (4 KiB
on most machines), as they do for metadata at the start of an ordinary header: one ``pwrite``
within one page of the page cache, which the kernel copies whole, so a process killed during the
edit leaves the old header or the new one, never a mix (the kernel stops a longer write between
pages when a fatal signal is pending, which tears a header that spans several). Power loss is
another matter: a disk need not write even one page atomically. With ``in_place=True`` a
candidate that spans pages is written too: no rewrite of a large file, but an interrupted write
leaves a broken header.

Otherwise the file is rewritten through :func:`~pysafetensors._writer.atomic_output` (temporary
sibling, permissions and owner of the old file, then ``os.replace``): a new header, then the
data buffer copied with ``os.copy_file_range`` (kernel-side, reflinked on filesystems that can),
falling back to plain reads and writes. Without ``reserve`` the rewritten header is the one the
reference would write for the same tensors and metadata (with at most one metadata key: the
reference orders several at random) in its layout; ``reserve`` leaves that many spaces
after the metadata object, so that later edits fit its slot. Metadata edited in place keeps the
header's length, so the file is not byte-identical to a fresh save of the same tensors (its
JSON is padded with spaces where a fresh save would have none).

SwarmUI #50 and lora-inspector #5 ask for metadata edits that do not rewrite gigabytes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import struct
import time
from collections.abc import Iterable, Mapping
from typing import Final

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

import numpy as np

from ._errors import (
    SafetensorError,
    SerializeError,
    input_path,
    local_path_refused,
    looks_like_url,
)
from ._format import (
    MAX_HEADER_SIZE,
    N_LEN,
    SERIALIZE_PREFIX,
    Header,
    parse_header,
    top_level_members,
)
from ._interrupts import interrupts_deferred
from ._reader import read_header
from ._reshard import copy_range
from ._sources import PreadSource, check_regular
from ._writer import atomic_output, pwrite_all

__all__ = ["LockTimeoutError", "edit_metadata"]


def _metadata_json(metadata: Mapping[str, str]) -> bytes:
    return json.dumps(dict(metadata), ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _header_bytes(header: Header, metadata: Mapping[str, str] | None, slack: int = 0) -> bytes:
    """The JSON of ``header`` with new metadata; tensor entries keep their offsets and order.

    ``slack`` spaces follow the metadata object (room for later edits in its slot).
    """
    # In data order; empty tensors at one offset in the reference's order (dtype rank
    # descending, then name), as its save lays them out: a rewrite of its file is its bytes.
    ordered = sorted(header.tensors.values(), key=lambda i: (i.begin, i.end, -i.dtype.rank, i.name))
    entries = {
        info.name: {
            "dtype": info.dtype.code,
            "shape": list(info.shape),
            "data_offsets": [info.begin, info.end],
        }
        for info in ordered
    }
    body = json.dumps(entries, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if metadata is None:
        return body
    head = b'{"__metadata__":' + _metadata_json(metadata) + b" " * slack
    return head + (b"," + body[1:] if entries else b"}")


def _metadata_slot(region: bytes) -> tuple[int, int] | None:
    """Byte span of the ``__metadata__`` value and the whitespace after it in a header region,
    or None when there is none (no metadata, or an odd header)."""
    try:
        text = region.decode("utf-8")
    except UnicodeDecodeError:
        return None
    for key, _, value_start, end in top_level_members(text):
        if key == "__metadata__":
            # In bytes: the text before it may hold multi-byte characters.
            start = len(text[:value_start].encode("utf-8"))
            return start, start + len(text[value_start:end].encode("utf-8"))
    return None


def _changed_span(old: bytes, new: bytes) -> tuple[int, int] | None:
    """First and one-past-last index where two equally long byte strings differ."""
    diff = np.flatnonzero(np.frombuffer(old, np.uint8) != np.frombuffer(new, np.uint8))
    if diff.size == 0:
        return None
    return int(diff[0]), int(diff[-1]) + 1


def _check_strings(values: Mapping[str, str]) -> None:
    for key, value in values.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"metadata keys and values must be str, got {type(key).__name__}: "
                f"{type(value).__name__} for {key!r}"
            )
        for text in (key, value):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                # A lone surrogate: no UTF-8 header can hold it (nothing is written).
                raise SerializeError(
                    f"{SERIALIZE_PREFIX}metadata {key!r}: {text!r} is not valid Unicode text "
                    "(a lone surrogate)",
                    kind="InvalidMetadata",
                ) from None


def edit_metadata(
    path: str | os.PathLike[str],
    set: Mapping[str, str] | None = None,  # noqa: A002 - the documented keyword
    delete: Iterable[str] = (),
    replace: bool = False,
    *,
    missing_ok: bool = False,
    reserve: int = 0,
    fsync: bool = True,
    max_header_size: int = MAX_HEADER_SIZE,
    in_place: bool | None = None,
    lock_timeout: float | None = None,
) -> bool:
    """Change a file's ``__metadata__``: in place when that is safe, else by an atomic rewrite.

    Args:
        path: A local safetensors file (it is validated first). A symbolic link is followed:
            the file it points to is edited, in place or rewritten beside it, and the link
            stays (so every other link to that file, e.g. in a hub cache, sees the change). A
            file with several hard links is shared only by an in-place edit; a rewrite gives
            this name a new file and the other names keep the old one.
        set: Keys to add or overwrite.
        delete: Keys to remove (a key named twice is removed once).
        replace: Start from empty metadata instead of the file's (then ``set`` is the result,
            and ``delete`` has nothing to remove: its keys are not looked for).
        missing_ok: Ignore ``delete`` keys that are not present instead of raising.
        reserve: Spaces to leave after the metadata object when the file must be rewritten,
            so that later edits fit in place.
        fsync: Make the change durable before returning.
        max_header_size: Largest header accepted, old or new.
        in_place: ``None`` (the default): in place only when the new header fits the old
            one's ``N`` bytes (the new metadata in the old one's slot, or the whole header
            written again into the room at its end) and the bytes that change lie within one
            4 KiB page (a process killed during the edit then leaves the old header or the
            new one), else a rewrite.
            ``True``: in place whenever the new header fits the old one's ``N`` bytes, even
            across pages (fast on huge files; an interrupted multi-page write leaves a broken
            header). ``False``: always rewrite.
        lock_timeout: Seconds to wait for the lock edits take turns on (see below) before
            giving up with ``TimeoutError``; None (the default) waits as long as it takes,
            0 not at all. Any process's ``flock`` on the file holds an edit back, not only
            another edit's (a backup or sync tool's shared lock too).

    Edits of one file at the same time, by other threads or processes, take turns (an
    advisory lock on the file), so each sees the others' changes; not on Windows.

    Returns:
        True if the header was rewritten in place (or nothing changed, and nothing was written),
        False if the whole file was rewritten.

    Raises:
        HeaderError: The file is not a valid safetensors file.
        SafetensorError: A key to delete is missing (``kind="MetadataKeyNotFound"``).
        SerializeError: The new header would be larger than ``max_header_size``.
        TypeError: A key or value is not a string, ``set`` is not a mapping, ``reserve`` is
            not an int.
        ValueError: ``reserve`` or ``lock_timeout`` is negative.
        TimeoutError: Another process held a lock on the file for ``lock_timeout`` seconds
            (nothing was read or written): a ``LockTimeoutError``.
        OSError: The file cannot be read or written: ``FileNotFoundError``,
            ``IsADirectoryError``, ``PermissionError`` (a file without write permission is
            refused, also where a rewrite would not need it), ``NotRegularFileError`` (a FIFO,
            socket or device).

    Example:
        >>> edit_metadata("model.safetensors", set={"format": "pt"})  # doctest: +SKIP
        True
    """
    if not (in_place is None or in_place is True or in_place is False):
        raise TypeError(f"in_place must be None, True or False, not {in_place!r}")
    given = input_path(path, "path")
    if looks_like_url(given):
        raise local_path_refused(
            given, "No such file or directory (metadata is edited in local files only, not URLs)"
        )
    # A symbolic link is followed in both cases: an in-place edit writes through it anyway, so
    # the rewrite goes to the file it points to too (beside that file), and the link stays a
    # link. Replacing it with a regular file would break a hub cache snapshot's dedup.
    target = os.path.realpath(given)
    if set is not None and not isinstance(set, Mapping):
        raise TypeError(f"set must be a mapping of str to str, not {type(set).__name__}")
    if isinstance(reserve, bool) or not isinstance(reserve, int):
        raise TypeError(f"reserve must be an int (bytes), not {type(reserve).__name__}")
    if reserve < 0:
        raise ValueError(f"reserve must be 0 or more bytes, not {reserve}")
    if lock_timeout is not None:
        if isinstance(lock_timeout, bool) or not isinstance(lock_timeout, (int, float)):
            raise TypeError(
                f"lock_timeout must be a number of seconds or None, not "
                f"{type(lock_timeout).__name__}"
            )
        if not lock_timeout >= 0:  # NaN too
            raise ValueError(f"lock_timeout must be 0 or more seconds, not {lock_timeout}")
    updates = dict(set or {})
    _check_strings(updates)
    # One key, not its letters; a key named twice is removed once.
    removals = list(dict.fromkeys([delete] if isinstance(delete, str) else delete))
    for key in removals:
        if not isinstance(key, str):
            raise TypeError(f"delete takes str keys, not {type(key).__name__}: {key!r}")
    fd = _open_locked(given, target, lock_timeout)
    source: PreadSource | None = None
    try:
        source = PreadSource(fd, target, owns_fd=False)
        header = read_header(source, max_header_size=max_header_size, prefix_text=f"{given}: ")
        old = header.metadata
        metadata: dict[str, str] = {} if replace else dict(old or {})
        for key in removals:
            if key in metadata:
                del metadata[key]
            elif not missing_ok and not replace:
                raise SafetensorError(
                    f"{given}: metadata has no key {key!r}", kind="MetadataKeyNotFound"
                )
        metadata.update(updates)
        # Keep "no metadata" distinct from "{}" only when the file had none and gains none.
        new_meta: dict[str, str] | None = metadata if (metadata or old is not None) else None
        if new_meta == old and list((new_meta or {}).items()) == list((old or {}).items()):
            return True  # nothing changes (e.g. deleting absent keys with missing_ok)
        n = header.header_size
        data_size = source.size - N_LEN - n
        if in_place is not False:
            region = _in_place_region(source, header, new_meta, whole=in_place is True)
            if region is not None:
                new_region, start, end = region
                # The gate: never write a header the strict reader would refuse, or one that
                # does not say exactly what was asked.
                checked = parse_header(new_region, data_size)
                if checked.metadata != new_meta or list(checked.tensors.values()) != list(
                    header.tensors.values()
                ):  # pragma: no cover - a defect of the slot logic, caught before writing
                    raise SafetensorError(
                        f"{given}: internal error: the edited header does not read back as "
                        "intended; nothing was written",
                        kind="InternalError",
                    )
                # Within one page, or across pages because in_place=True asked for it.
                pwrite_all(fd, new_region[start:end], N_LEN + start)
                if fsync:
                    os.fsync(fd)
                return True
        # The size is checked before the slack is made: ``reserve`` comes from the caller (the
        # command line's --reserve) and may be any number.
        slack = max(0, reserve) if new_meta is not None else 0
        size = len(_header_bytes(header, new_meta)) + slack
        size += -size % 8
        if size > max_header_size:
            raise SerializeError(
                f"{SERIALIZE_PREFIX}{given}: header too large ({size} bytes; the limit "
                f"is {max_header_size})",
                kind="HeaderTooLarge",
            )
        text = _header_bytes(header, new_meta, slack=slack)
        padded = text + b" " * (size - len(text))
        parse_header(padded, data_size)
        with atomic_output(target, fsync=fsync, like=os.fstat(fd)) as out:
            prefix = struct.pack("<Q", len(padded)) + padded
            pwrite_all(out, prefix, 0)
            copy_range(fd, N_LEN + n, out, len(prefix), data_size, source=given)
            _copy_xattrs(fd, out)
        return False
    finally:
        if source is not None:
            source.close()  # the second descriptor read_header's partial reads opened
        os.close(fd)


def _copy_xattrs(src: int, dst: int) -> None:
    """Give the rewritten file the extended attributes of the one it replaces (user notes,
    POSIX ACLs, security labels), each as far as the file system and the user's rights allow:
    a metadata edit that rewrote the file dropped them, where one in place keeps them."""
    if not hasattr(os, "listxattr"):
        return  # no extended attributes on this platform
    try:
        names = os.listxattr(src)
    except OSError:
        return  # none on this file system
    for name in names:
        # One refused (a trusted.* name needs root; the target's file system may hold no
        # ACLs) leaves the others to copy: the edit itself is what was asked for.
        with contextlib.suppress(OSError):
            os.setxattr(dst, name, os.getxattr(src, name))


#: Errors of a file system that has no locks to take.
_NO_LOCKS: Final = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL})


def _open_locked(given: str, target: str, timeout: float | None = None) -> int:
    """Open ``target`` as :func:`_open_for_edit` does, holding an exclusive lock on it.

    An edit reads the header, then writes it back or replaces the file: two at once both read
    the old header, and the later write dropped the earlier one's keys (or went into the file
    the other had just replaced). Editors take turns on an advisory lock (``flock``: other
    processes and other threads alike, each open being its own). An editor that waited while
    another replaced the file holds a lock on the old one: it opens the new one and locks
    again. The lock goes with the descriptor's close. Without ``fcntl`` (Windows) edits are
    not serialised. ``timeout``: seconds to wait for the lock in all (None: for ever).

    Raises:
        OSError: As :func:`_open_for_edit`.
        LockTimeoutError: The lock was not free within ``timeout`` seconds.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        fd = _open_for_edit(given, target)
        try:
            if fcntl is None:
                return fd
            try:
                _lock(fd, given, deadline)
            except OSError as exc:
                if isinstance(exc, LockTimeoutError) or exc.errno not in _NO_LOCKS:
                    raise
                return fd  # a file system without locks (some FUSE, old NFS): edit unlocked
            held = os.fstat(fd)
            try:
                now = os.stat(target)
            except FileNotFoundError:
                now = None  # removed meanwhile: the next open says so
            if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


class LockTimeoutError(TimeoutError):
    """Raised by :func:`edit_metadata` when another process held a lock on the file for
    ``lock_timeout`` seconds (a ``TimeoutError`` of its own, not one of a slow file system's
    reads)."""


def _lock(fd: int, given: str, deadline: float | None) -> None:
    """``flock(fd, LOCK_EX)``, waiting until ``deadline`` (``time.monotonic()``; None: for
    ever).

    Raises:
        LockTimeoutError: The lock was still held at ``deadline``.
        OSError: ``flock`` failed otherwise (a file system without locks).
    """
    assert fcntl is not None
    if deadline is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    delay = 0.005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            raise LockTimeoutError(
                f"{given}: another process holds a lock on this file (another edit, or a "
                "backup or sync tool); gave up waiting for it, nothing was changed"
            )
        time.sleep(min(delay, left))
        delay = min(2 * delay, 0.1)  # a lock held for a moment is taken soon after


def _open_for_edit(given: str, target: str) -> int:
    """Open ``target`` (``given``, links followed) for reading and writing; only a regular file.

    Opened without blocking and checked by ``fstat``: a FIFO was opened (``O_RDWR`` does not
    wait for a writer) and then read as a file of 0 bytes. The open is held from a Ctrl-C, which
    Python raises as ``os.open`` returns, before its descriptor is stored: it leaked.

    Raises:
        FileNotFoundError: No such file (for a dangling link: named with the link's target).
        IsADirectoryError: A folder.
        NotRegularFileError: A FIFO, socket or device.
        PermissionError: The file may not be written: read-only means not to be changed,
            although a rewrite beside it would need only the folder's permission.
    """
    flags = os.O_RDWR | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = -1
    try:
        with interrupts_deferred():  # a Ctrl-C is raised at its end, and closes fd below
            try:
                fd = os.open(target, flags)
            except OSError as exc:
                # Named as the caller named it (target is its real path); a dangling link
                # says so.
                why = exc.strerror
                if isinstance(exc, FileNotFoundError) and os.path.islink(given):
                    why = f"{why} (a link to {target})"
                raise type(exc)(exc.errno, why, given) from None
            check_regular(given, os.fstat(fd).st_mode)
            os.set_blocking(fd, True)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return fd


#: The unit the kernel copies a write in, stopping between units for a fatal signal.
_PAGE: Final = mmap.PAGESIZE


def _in_place_region(
    source: PreadSource, header: Header, metadata: dict[str, str] | None, *, whole: bool
) -> tuple[bytes, int, int] | None:
    """The header region with new metadata in the same ``N`` bytes, and the span that changed.

    Two candidates: the new metadata object in the old one's slot (the object and the spaces
    after it), and the whole header re-serialized and padded at the end (which uses spare room
    at the end of the header, where older edits and other writers leave it). The first whose
    change lies within one page wins; with ``whole``, else the first that fits at all. None
    when none qualifies.
    """
    n = header.header_size
    buf = bytearray(n)
    source.readinto(N_LEN, memoryview(buf))
    old = bytes(buf)
    candidates: list[bytes] = []
    slot = _metadata_slot(old) if metadata is not None else None
    if slot is not None:
        assert metadata is not None
        start, end = slot
        value = _metadata_json(metadata)
        if len(value) <= end - start:
            candidates.append(old[:start] + value + b" " * (end - start - len(value)) + old[end:])
    text = _header_bytes(header, metadata)
    if len(text) <= n:
        candidates.append(text + b" " * (n - len(text)))
    fallback = None
    for new in candidates:
        span = _changed_span(old, new)
        if span is None:  # pragma: no cover - an unchanged header returned earlier
            continue
        if (N_LEN + span[0]) // _PAGE == (N_LEN + span[1] - 1) // _PAGE:
            return new, span[0], span[1]
        if whole and fallback is None:
            fallback = new, span[0], span[1]
    return fallback
