"""Histograms kept by ``stats`` until its table is printed, off the heap where it can.

The text output prints the table of every tensor before any histogram, so each tensor's
histogram waits for the whole run. Kept as arrays on the heap, they grew it with the model (a
million bins are 16 MB a tensor: 40 such tensors held 1 GB). Here each is written, as its raw
edges and counts (the same 16 bytes a bin; drawn as text they would take ~50), to memory up to
:data:`MEMORY_BYTES` in all, then to a temporary file. Where the file cannot be made or a write
to it fails (an unwritable or full temporary folder, a file size limit), what it already holds
stays readable and the rest wait on the heap as before: the command still runs as it did.

Not :class:`tempfile.SpooledTemporaryFile`: its move to disk drops the memory copy before the
file holds it (a full disk then lost histograms already kept), and its buffered writes fail
later, at a seek or the close, after they were counted as kept.
"""

from __future__ import annotations

import io
import tempfile
from typing import Any, Final

import numpy as np

__all__ = ["MEMORY_BYTES", "HistogramSpool", "Kept"]

#: Bytes of histograms kept in memory before the spool moves to a temporary file.
MEMORY_BYTES: Final = 1 << 20

#: A kept histogram: ``(offset, bins)`` in the spool, or the arrays themselves.
Kept = tuple[int, int] | tuple[np.ndarray, np.ndarray]


class HistogramSpool:
    """Edges and counts of histograms, each kept until :meth:`get` reads it back.

    Use as a context manager: the temporary file (deleted as soon as it is made) is closed
    on exit.
    """

    def __init__(self, memory_bytes: int | None = None) -> None:
        self._memory_bytes = MEMORY_BYTES if memory_bytes is None else memory_bytes
        self._memory: io.BytesIO | None = io.BytesIO()
        # An unbuffered binary file (a FileIO; on Windows, tempfile's wrapper of one): a
        # write that returns has landed.
        self._disk: Any = None
        self._end = 0  # where the next histogram goes: a failed write leaves nothing counted
        self._failed = False

    def __enter__(self) -> HistogramSpool:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._memory = None
        if self._disk is not None:
            disk, self._disk = self._disk, None
            disk.close()  # unbuffered: nothing left to write, so nothing to fail

    def keep(self, edges: np.ndarray, counts: np.ndarray) -> Kept:
        """Keep one histogram (``bins + 1`` float64 edges, ``bins`` int64 counts)."""
        parts = [
            np.ascontiguousarray(edges, np.float64).data.cast("B"),
            np.ascontiguousarray(counts, np.int64).data.cast("B"),
        ]
        size = sum(p.nbytes for p in parts)
        if not self._failed:
            try:
                if self._disk is None and self._end + size > self._memory_bytes:
                    self._move_to_disk()
                at = self._end
                for part in parts:
                    self._write_at(at, part)
                    at += part.nbytes
            except OSError:
                # No room, or no temporary folder to write in: the heap, as before.
                self._failed = True
            else:
                kept = (self._end, len(counts))
                self._end = at
                return kept
        return edges, counts

    def get(self, kept: Kept) -> tuple[np.ndarray, np.ndarray]:
        """The edges and counts of a kept histogram.

        Raises:
            OSError: The temporary file did not give back what was written.
        """
        first, second = kept
        if isinstance(first, np.ndarray):
            assert isinstance(second, np.ndarray)
            return first, second
        assert isinstance(second, int)
        edges = np.frombuffer(self._read_at(first, 8 * (second + 1)), np.float64)
        counts = np.frombuffer(self._read_at(first + 8 * (second + 1), 8 * second), np.int64)
        return edges, counts

    def _move_to_disk(self) -> None:
        """Copy what memory holds to a new temporary file, and write there from now on; the
        memory copy is let go only once the file holds all of it."""
        disk = tempfile.TemporaryFile(buffering=0)  # noqa: SIM115 - kept until __exit__
        assert self._memory is not None
        try:
            with self._memory.getbuffer() as held:
                _write_all(disk, 0, held[: self._end])
        except BaseException:
            disk.close()
            raise
        self._disk, self._memory = disk, None

    def _write_at(self, at: int, data: memoryview) -> None:
        if self._disk is not None:
            _write_all(self._disk, at, data)
        else:
            assert self._memory is not None
            self._memory.seek(at)
            self._memory.write(data)

    def _read_at(self, at: int, nbytes: int) -> bytearray:
        out = bytearray(nbytes)
        if self._disk is None:
            assert self._memory is not None
            with self._memory.getbuffer() as held:
                got = len(held[at : at + nbytes])
                out[:got] = held[at : at + got]
        else:
            self._disk.seek(at)
            view = memoryview(out)
            got = 0
            while got < nbytes:
                n = self._disk.readinto(view[got:])
                if not n:
                    break
                got += n
        if got != nbytes:
            raise OSError(f"histogram spool: {got} of {nbytes} bytes read back at offset {at}")
        return out


def _write_all(file: Any, at: int, data: memoryview) -> None:
    """Write all of ``data`` at ``at`` (an unbuffered write may take part of it)."""
    file.seek(at)
    done = 0
    while done < data.nbytes:
        n = file.write(data[done:])
        if not n:  # None (non-blocking) or 0: no progress, as a full disk would give
            raise OSError(f"histogram spool: no progress writing at offset {at + done}")
        done += n
