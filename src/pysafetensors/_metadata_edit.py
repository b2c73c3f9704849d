"""Editing ``__metadata__`` of an existing file: in place when it fits, else an atomic rewrite.

The header sits before the data, and ``data_offsets`` count from the end of the header, so the
header can only change in place if its new JSON fits in the old header region of ``N`` bytes:
then the region is rewritten, padded with spaces to the same ``N`` (trailing JSON whitespace is
legal, rule R5), and every tensor byte stays where it is. That is one ``pwrite`` followed by an
``fsync``; a crash in between can leave a torn header only if the kernel splits the write across
pages and loses part of it, a window far smaller than rewriting gigabytes (SwarmUI #50,
lora-inspector #5 ask for exactly this).

Otherwise the file is rewritten through :func:`~pysafetensors._writer.atomic_output` (temporary
sibling, then ``os.replace``): a new header, then the data buffer copied with
``os.copy_file_range`` (kernel-side, reflinked on filesystems that can), falling back to plain
reads and writes. The old file's permission bits are kept. ``reserve`` adds spare padding to a
rewritten header so that later edits fit in place.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import struct
from collections.abc import Iterable, Mapping
from typing import Any

from ._errors import SafetensorError, SerializeError
from ._format import MAX_HEADER_SIZE, N_LEN, SERIALIZE_PREFIX, Header, parse_header
from ._reader import read_header
from ._sources import PreadSource
from ._writer import atomic_output

__all__ = ["edit_metadata"]

_COPY_CHUNK = 64 << 20


def _header_bytes(header: Header, metadata: Mapping[str, str] | None) -> bytes:
    """The JSON of ``header`` with new metadata; tensor entries keep their offsets and order."""
    obj: dict[str, Any] = {}
    if metadata is not None:
        obj["__metadata__"] = dict(metadata)
    for info in header.tensors.values():
        obj[info.name] = {
            "dtype": info.dtype.code,
            "shape": list(info.shape),
            "data_offsets": [info.begin, info.end],
        }
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


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


def _copy_range(src: int, dst: int, offset: int, count: int, dst_offset: int) -> None:
    """Copy ``count`` bytes from ``src`` at ``offset`` to ``dst`` at ``dst_offset``."""
    copy = getattr(os, "copy_file_range", None)
    done = 0
    while done < count and copy is not None:
        try:
            n = copy(src, dst, min(count - done, 1 << 30), offset + done, dst_offset + done)
        except OSError:
            # EXDEV, ENOSYS, EINVAL on some filesystems: fall back to plain copies below.
            break
        if n <= 0:
            break
        done += n
    while done < count:
        chunk = os.pread(src, min(_COPY_CHUNK, count - done), offset + done)
        if not chunk:
            raise SafetensorError(
                f"file ended while copying its data ({done} of {count} bytes copied)",
                kind="ShortRead",
                offset=offset + done,
            )
        view = memoryview(chunk)
        while view:
            written = os.pwrite(dst, view, dst_offset + done)
            view = view[written:]
            done += written


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
) -> bool:
    """Change a file's ``__metadata__``, in place when the new header fits.

    Args:
        path: A local safetensors file (it is validated first). A symbolic link is followed:
            the file it points to is edited, in place or rewritten beside it, and the link
            stays (so every other link to that file, e.g. in a hub cache, sees the change). A
            file with several hard links is shared only by an in-place edit; a rewrite gives
            this name a new file and the other names keep the old one.
        set: Keys to add or overwrite.
        delete: Keys to remove.
        replace: Start from empty metadata instead of the file's (then ``set`` is the result).
        missing_ok: Ignore ``delete`` keys that are not present instead of raising.
        reserve: Extra padding bytes to leave in the header when the file must be rewritten,
            so that later edits can happen in place.
        fsync: Make the change durable before returning.
        max_header_size: Largest header accepted, old or new.

    Returns:
        True if the header was rewritten in place (or nothing changed, and nothing was written),
        False if the whole file was rewritten.

    Raises:
        HeaderError: The file is not a valid safetensors file.
        SafetensorError: A key to delete is missing (``kind="MetadataKeyNotFound"``).
        SerializeError: The new header would be larger than ``max_header_size``.
        TypeError: A key or value is not a string.
        OSError: The file cannot be read or written.

    Example:
        >>> edit_metadata("model.safetensors", set={"format": "pt"})  # doctest: +SKIP
        True
    """
    given = os.fspath(path)
    # A symbolic link is followed in both cases: an in-place edit writes through it anyway, so
    # the rewrite goes to the file it points to too (beside that file), and the link stays a
    # link. Replacing it with a regular file would break a hub cache snapshot's dedup.
    target = os.path.realpath(given)
    updates = dict(set or {})
    _check_strings(updates)
    removals = [delete] if isinstance(delete, str) else list(delete)  # one key, not letters
    fd = os.open(target, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
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
        text = _header_bytes(header, new_meta)
        n = header.header_size
        data_size = source.size - N_LEN - n
        if len(text) <= n:
            region = text + b" " * (n - len(text))
            # The gate: never write a header the strict reader would refuse.
            parse_header(region, data_size)
            os.pwrite(fd, region, N_LEN)
            if fsync:
                os.fsync(fd)
            return True
        # The size is checked before the padding is made: ``reserve`` comes from the caller
        # (the command line's --reserve) and may be any number.
        size = len(text) + (-len(text) % 8) + (max(0, reserve) + 7) // 8 * 8
        if size > max_header_size:
            raise SerializeError(
                f"{SERIALIZE_PREFIX}{given}: header too large ({size} bytes; the limit "
                f"is {max_header_size})",
                kind="HeaderTooLarge",
            )
        padded = text + b" " * (size - len(text))
        parse_header(padded, data_size)
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        with atomic_output(target, fsync=fsync) as out:
            prefix = struct.pack("<Q", len(padded)) + padded
            view = memoryview(prefix)
            while view:
                view = view[os.write(out, view) :]
            _copy_range(fd, out, N_LEN + n, data_size, len(prefix))
        with contextlib.suppress(OSError):
            os.chmod(target, mode)
        return False
    finally:
        os.close(fd)
