"""Containers of PyTorch checkpoints: the zip format, checked member by member.

``zipfile`` is used only to parse the central directory. Every member's bytes are located by
reading its local header ourselves and checking the result against the file size and against
every other member: no ``ZipFile.read``/``extract`` on
untrusted members, no overlapping or duplicate entries, no prepended data, one central directory
read alike by ``zipfile`` and torch's reader (miniz), STORED or bounded DEFLATE only.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from ._errors import CheckpointError
from ._sources import open_regular_file
from ._zip_directory import EOCD_SIG, LOCAL_SIG, ZIP64_EOCD, end_records

__all__ = ["BoundedFile", "FileBytes", "ZipMember", "ZipView", "caseless", "open_zip"]

#: Chunk size used when streaming storage bytes. Pieces read into one reused buffer are
#: written out while they are still in the caches and in the TLB's reach: a 512 MiB
#: conversion took 0.30-0.31 s in 4 MiB pieces against 0.67-0.79 s in 16 MiB ones (most
#: likely the cost of writing from a reused buffer of 4 KiB pages beyond the TLB's reach),
#: 0.35-0.38 s in 2 MiB ones (which the writer gathers by copying them: below its
#: ``WRITEV_BYTES``).
CHUNK: Final = 4 << 20
#: Largest ratio of inflated to compressed size accepted for a DEFLATE member.
MAX_DEFLATE_RATIO: Final = 100
#: Largest number of central-directory entries.
MAX_ENTRIES: Final = 1_000_000
#: Largest member name in bytes.
MAX_NAME: Final = 4096

#: What chunks come as.
Buffer = bytes | bytearray | memoryview

_LOCAL: Final = struct.Struct("<4sHHHHHIIIHH")
_ASCII_LOWER: Final = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def caseless(name: str) -> str:
    """``name`` as torch's zip reader (miniz) compares names: ASCII letters in lower case."""
    return name.translate(_ASCII_LOWER)


def _bad(message: str, offset: int | None = None) -> CheckpointError:
    return CheckpointError(message, kind="ZipError", offset=offset)


class FileBytes:
    """Bounds-checked positional reads of one open file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._scratch: np.ndarray | None = None
        self._lent = False
        # A FIFO is refused, not waited on for a writer (see open_regular_file).
        self.fd = open_regular_file(self.path)
        try:
            self.size = os.fstat(self.fd).st_size
        except BaseException:
            os.close(self.fd)
            raise

    @classmethod
    def from_fd(cls, fd: int, path: str) -> FileBytes:
        """Take ownership of an open descriptor (``path`` only names it in messages)."""
        self = cls.__new__(cls)
        self.path, self.fd = path, fd
        self._scratch, self._lent = None, False
        try:
            self.size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        return self

    def mapped(self, offset: int, length: int) -> np.ndarray[Any, Any]:
        """``length`` bytes at ``offset`` as a read-only array over a mapping of the file.

        Raises:
            CheckpointError: The range is not inside the file.
        """
        self._check(offset, length)
        aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(
            self.fd, offset + length - aligned, offset=aligned, access=mmap.ACCESS_READ
        )
        # The array keeps the mapping alive; it is unmapped when the array goes.
        return np.frombuffer(mapping, np.uint8, length, offset - aligned)

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise CheckpointError(
                f"truncated file: needs bytes {offset}..{offset + length}, file has {self.size}",
                kind="Truncated",
                offset=offset,
            )

    def read(self, offset: int, length: int) -> bytes:
        """Return exactly ``length`` bytes at ``offset``.

        Raises:
            CheckpointError: The range is not inside the file.
        """
        self._check(offset, length)
        return bytes(self._read_array(offset, length))

    def read_array(self, offset: int, length: int) -> bytearray:
        """Exactly ``length`` bytes at ``offset``, in a ``bytearray`` of their own (one copy,
        where :meth:`read` makes two).

        Raises:
            CheckpointError: The range is not inside the file.
        """
        self._check(offset, length)
        return self._read_array(offset, length)

    def _read_array(self, offset: int, length: int) -> bytearray:
        """Read into fresh memory with one copy (large ``bytearray`` comes from calloc'd pages)."""
        out = bytearray(length)
        self._read_into(memoryview(out), offset)
        return out

    def chunks(
        self, offset: int, length: int, chunk: int | None = None, *, reuse: bool = False
    ) -> Iterator[Buffer]:
        """Yield ``length`` bytes at ``offset`` in pieces of at most ``chunk`` bytes
        (:data:`CHUNK` by default).

        With ``reuse``, every piece is read into the same buffer, so a piece is valid only
        until the next is asked for (the caller uses or copies each first): memory holds one
        piece. Otherwise each piece is memory of its own, which a caller may keep.
        """
        self._check(offset, length)
        chunk = CHUNK if chunk is None else chunk
        if not reuse:
            done = 0
            while done < length:
                n = min(chunk, length - done)
                yield self._read_array(offset + done, n)
                done += n
            return
        with self.scratch(min(chunk, length)) as buffer:
            done = 0
            while done < length:
                n = min(chunk, length - done)
                piece = buffer[:n]
                self._read_into(piece, offset + done)
                yield piece
                done += n

    @contextlib.contextmanager
    def scratch(self, nbytes: int) -> Iterator[memoryview]:
        """A writable buffer of ``nbytes`` for the caller's use until the block ends: the same
        memory for every caller in turn (a fresh one when it is lent already).

        One buffer for the whole file: a fresh buffer per tensor left the previous one's memory
        with the allocator (kept, not given back), which doubled a conversion's peak.
        """
        held = self._scratch
        if held is None or self._lent or len(held) < nbytes:
            # numpy's memory: in huge pages where the kernel allows it (numpy asks for them
            # for arrays of 4 MiB and more), which a bytearray's is not.
            held = np.empty(nbytes, np.uint8)
            if not self._lent:
                self._scratch = held
        own = held is self._scratch and not self._lent
        if own:
            self._lent = True
        try:
            yield held.data[:nbytes]
        finally:
            if own:
                self._lent = False

    def _read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the bytes at ``offset``."""
        done = 0
        while done < view.nbytes:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if not got:
                raise CheckpointError("file shrank while reading", kind="Truncated", offset=offset)
            done += got

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._scratch = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class BoundedFile:
    """A read-only file object over ``size`` bytes whose reads never ask for more than is left.

    ``tarfile`` reads a PAX or GNU long-name record with one ``read(size)`` of the size its
    header claims: a buffered file allocates all of it first (8 GiB for a 1 KiB file), and an
    mmap's ``read`` raises ``OverflowError`` on sizes past 2**63. Here a read is cut to the
    bytes left before ``size``, then served by ``read_at(offset, n)``, which is only asked for
    ranges inside ``0 .. size``. Subclasses refuse reads by overriding :meth:`_check_read`.
    """

    def __init__(self, read_at: Callable[[int, int], bytes], size: int) -> None:
        self._read_at = read_at
        self._size = size
        self._pos = 0

    def read(self, n: int | None = -1) -> bytes:
        at = self._pos
        self._check_read(at, n)
        left = max(self._size - at, 0)
        n = left if n is None or n < 0 else min(n, left)
        out = self._read_at(at, n) if n else b""
        self._pos += len(out)
        return out

    def _check_read(self, at: int, n: int | None) -> None:
        """Raise if a read of ``n`` bytes at ``at`` is refused (all are, here, accepted)."""

    def seek(self, offset: int, whence: int = 0) -> int:
        pos = offset + {0: 0, 1: self._pos, 2: self._size}[whence]
        if pos < 0:
            raise self._seek_error(pos)
        self._pos = pos
        return pos

    def _seek_error(self, pos: int) -> Exception:
        return OSError(f"negative seek position {pos}")

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class ZipMember:
    """One member, located and checked."""

    name: str
    """Central-directory name."""
    method: int
    """``zipfile.ZIP_STORED`` or ``zipfile.ZIP_DEFLATED``."""
    data_offset: int
    """Offset of the member's (compressed) bytes in the file."""
    compress_size: int
    """Stored bytes."""
    file_size: int
    """Bytes after inflation."""
    crc: int
    """CRC-32 from the central directory (0: not computed)."""

    def crc_matches(self, crc: int) -> bool:
        """Whether the content's CRC-32 ``crc`` is the recorded one. A recorded 0 is "not
        computed": torch.save writes it with
        ``torch.utils.serialization.config.save.compute_crc32 = False``, and torch.load reads
        such files (it never checks the CRCs)."""
        return self.crc in (0, crc)


class ZipView:
    """The members of a zip file, validated as a PyTorch checkpoint container would need."""

    def __init__(
        self,
        file: FileBytes,
        members: dict[str, ZipMember],
        order: list[str],
        folded: dict[str, str],
    ) -> None:
        self.file = file
        self.members = members
        self.order = order
        # Each member by its caseless name: open_zip refuses two names that fold alike.
        self._caseless = folded

    def find(self, name: str) -> str | None:
        """The member torch's reader would find for ``name``, which it looks up ignoring ASCII
        case (``data.pkl`` finds ``Data.pkl``); None if there is none."""
        return self._caseless.get(caseless(name))

    def read(self, name: str, *, limit: int, check_crc: bool = True) -> bytes:
        """Return a whole (small) member, refusing one larger than ``limit``."""
        m = self.members[name]
        if m.file_size > limit:
            raise _bad(f"member {name!r} is {m.file_size} bytes, over the {limit} limit")
        data = b"".join(self.chunks(name, 0, m.file_size))
        if check_crc and not m.crc_matches(zlib.crc32(data)):
            raise _bad(f"member {name!r} fails its CRC-32 check")
        return data

    def chunks(
        self, name: str, start: int, length: int, chunk: int | None = None, *, reuse: bool = False
    ) -> Iterator[Buffer]:
        """Yield bytes ``start .. start+length`` of a member's inflated content (``reuse``: as
        :meth:`FileBytes.chunks`)."""
        m = self.members[name]
        if start < 0 or length < 0 or start + length > m.file_size:
            raise _bad(f"read of {start}+{length} bytes past the end of member {name!r}")
        if m.method == zipfile.ZIP_STORED:
            yield from self.file.chunks(m.data_offset + start, length, chunk, reuse=reuse)
            return
        yield from self._inflate(m, start, length, CHUNK if chunk is None else chunk)

    def _inflate(self, m: ZipMember, start: int, length: int, chunk: int) -> Iterator[Buffer]:
        # Streamed with a bounded output per step, so a bomb never materialises more than one
        # chunk, and the total is capped by the declared size (a longer stream is an error).
        # Each output is memory of its own (what a caller of chunks() without reuse may keep).
        dec = zlib.decompressobj(-15)
        pos = 0  # inflated bytes produced so far
        end = start + length
        # The compressed input through one reused buffer: decompress copies what it keeps.
        for comp in self.file.chunks(m.data_offset, m.compress_size, 1 << 20, reuse=True):
            buf = comp
            while True:
                try:
                    out = dec.decompress(buf, chunk)
                except zlib.error as exc:
                    raise _bad(f"member {m.name!r} is not valid DEFLATE data ({exc})") from None
                buf = dec.unconsumed_tail
                if pos + len(out) > m.file_size:
                    raise _bad(f"member {m.name!r} inflates past its declared size")
                lo, hi = max(start - pos, 0), min(end - pos, len(out))
                if lo < hi:
                    yield out if (lo, hi) == (0, len(out)) else memoryview(out)[lo:hi]
                pos += len(out)
                if pos >= end:
                    return
                if not buf and len(out) < chunk:
                    # Input used up and no output held back. An output of a whole chunk may
                    # leave more inside the decompressor even when every input byte is taken:
                    # asked for again (with no input), else a member whose last piece ended
                    # so read short.
                    break
        if pos < end:
            raise _bad(f"member {m.name!r} inflates to fewer bytes than declared")


def _find_eocd(file: FileBytes) -> int:
    """Return the offset of the end-of-central-directory record, which must end the file."""
    tail_len = min(file.size, 22 + 0xFFFF)
    tail = file.read(file.size - tail_len, tail_len)
    idx = tail.rfind(EOCD_SIG)
    while idx >= 0:
        if idx + 22 <= len(tail):
            comment_len = struct.unpack_from("<H", tail, idx + 20)[0]
            if idx + 22 + comment_len == len(tail):
                return file.size - tail_len + idx
        idx = tail.rfind(EOCD_SIG, 0, idx)
    raise _bad("no end-of-central-directory record at the end of the file")


def _stated_directory(file: FileBytes, eocd: int) -> tuple[int, int, int, int]:
    """The central directory as the end records state it, read as torch's reader (miniz)
    reads them: ``(entries, size, offset, where the end records begin)``.

    Python's ``zipfile`` trusts the end records less: it assumes the directory ends where they
    begin and shifts every offset by the difference ("data prepended to the archive"). When
    the two disagree they read two different directories (a second one hidden in front of the
    end records), so torch.load and this reader would see different members: refused.
    """
    records = end_records(file.read, file.size, eocd)
    if records.locator is not None:
        # zipfile reads the zip64 record just before the locator; miniz where the locator says.
        loc_at, rec_at = records.locator, records.located
        expected = loc_at - ZIP64_EOCD.size
        if rec_at != expected or expected < 0 or records.locator_spans_disks:
            raise _bad(
                f"zip64 end-of-directory locator points at byte {rec_at}, not at the record "
                f"right before it (byte {expected})",
                loc_at,
            )
        if records.miniz.records != rec_at:
            raise _bad("zip64 end-of-directory locator without its record", rec_at)
    stated = records.miniz
    if stated.spans_disks:
        raise _bad("zip archive spans several disks")
    if stated.offset + stated.size != stated.records:
        raise _bad(
            f"the end-of-directory record places the central directory at byte {stated.offset} "
            f"({stated.size} bytes), but {stated.records - stated.offset - stated.size:+d} bytes "
            "lie between it and the record: readers disagree on which directory the archive "
            "has (another one may be hidden there); refusing",
            eocd,
        )
    return stated.entries, stated.size, stated.offset, stated.records


def open_zip(file: FileBytes, *, allow_deflate: bool = True, strict: bool = True) -> ZipView:
    """Validate a zip container and locate every member.

    Args:
        file: The open file.
        allow_deflate: Accept DEFLATE members (streamed, with a ratio cap); otherwise STORED only.
        strict: Refuse what ``torch.save`` never writes (encryption and other flag bits, name
            mismatches between local and central headers). The scanner passes False to look
            at the bytes anyway, as torch's reader would.

    Raises:
        CheckpointError: Anything that is not a clean, unambiguous zip.
    """
    if file.size < 4 or file.read(0, 4) != LOCAL_SIG:
        raise _bad("not a zip checkpoint: the file does not start with a local file header")
    eocd = _find_eocd(file)
    if file.read(eocd + 4, file.size - eocd - 4).find(EOCD_SIG) >= 0:
        # zipfile takes the last signature of the file's tail as the end record, whatever
        # its comment length says; _find_eocd the last one whose comment ends the file.
        raise _bad("a second end-of-central-directory signature after the end record", eocd)
    entries, _, _, _ = _stated_directory(file, eocd)
    try:
        with open(file.path, "rb") as fh, zipfile.ZipFile(fh) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, struct.error) as exc:
        raise _bad(f"unreadable zip central directory ({exc})") from None
    except (NotImplementedError, RuntimeError, EOFError) as exc:
        raise _bad(f"unsupported zip ({exc})") from None
    if len(infos) > MAX_ENTRIES:
        raise _bad(f"{len(infos)} zip entries, over the {MAX_ENTRIES} limit")
    if len(infos) != entries:
        # miniz reads as many entries as the end record counts; zipfile every entry in the
        # directory's stated size.
        raise _bad(
            f"the end-of-directory record counts {entries} members, the central directory "
            f"holds {len(infos)}",
            eocd,
        )
    members: dict[str, ZipMember] = {}
    order: list[str] = []
    ranges: list[tuple[int, int, str]] = []
    folded: dict[str, str] = {}
    for info in infos:
        name = info.filename
        if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME:
            raise _bad("zip member name too long")
        if name in members:
            raise _bad(f"duplicate zip member {name!r}")
        other = folded.setdefault(caseless(name), name)
        if other != name:
            # torch's reader finds members ignoring case, so which of the two it reads is its
            # choice, and need not be ours.
            raise _bad(
                f"zip members {other!r} and {name!r} differ only in case (torch's zip reader "
                "does not tell them apart)"
            )
        if strict and info.flag_bits & 0x61:
            raise _bad(f"zip member {name!r} is encrypted or uses unsupported flag bits")
        method = info.compress_type
        if method not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) or (
            method == zipfile.ZIP_DEFLATED and not allow_deflate
        ):
            raise _bad(f"zip member {name!r} uses compression method {method}")
        hdr = info.header_offset
        local = file.read(hdr, 30) if hdr + 30 <= eocd else None
        if local is None:
            raise _bad(f"zip member {name!r}: local header past the central directory")
        sig, _, _, _, _, _, _, _, _, nlen, xlen = _LOCAL.unpack(local)
        if sig != LOCAL_SIG:
            raise _bad(f"zip member {name!r}: no local header at offset {hdr}", hdr)
        local_name = file.read(hdr + 30, nlen)
        central_name = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
        if strict and local_name != central_name:
            raise _bad(f"zip member {name!r}: local header names it {local_name!r}", hdr)
        data_offset = hdr + 30 + nlen + xlen
        if method == zipfile.ZIP_STORED and info.compress_size != info.file_size:
            raise _bad(f"zip member {name!r}: STORED with different sizes")
        if method == zipfile.ZIP_DEFLATED and info.file_size > MAX_DEFLATE_RATIO * max(
            info.compress_size, 1024
        ):
            raise _bad(f"zip member {name!r}: compression ratio over {MAX_DEFLATE_RATIO}")
        stop = data_offset + info.compress_size
        if stop > eocd:
            raise _bad(f"zip member {name!r}: {info.compress_size} bytes claimed past the data")
        members[name] = ZipMember(
            name, method, data_offset, info.compress_size, info.file_size, info.CRC
        )
        order.append(name)
        ranges.append((hdr, stop, name))
    ranges.sort()
    for (_, stop_a, name_a), (start_b, _, name_b) in zip(ranges, ranges[1:], strict=False):
        if start_b < stop_a:
            raise _bad(f"zip members {name_a!r} and {name_b!r} overlap (possible zip bomb)")
    return ZipView(file, members, order, folded)
