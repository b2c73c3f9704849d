"""Histograms kept by ``stats`` until its table is printed, off the heap where it can.

The text output prints the table of every tensor before any histogram, so each tensor's
histogram waits for the whole run. Kept as arrays on the heap, they grew it with the model (a
million bins are 16 MB a tensor: 40 such tensors held 1 GB). Here each is written, as its raw
edges and counts (the same 16 bytes a bin; drawn as text they would take ~50), to a temporary
file: in memory up to :data:`MEMORY_BYTES`, then on disk. Where no temporary file can be
written (an unwritable or full temporary folder), the rest are kept on the heap as before: the
command still runs as it did.
"""

from __future__ import annotations

import tempfile
from typing import IO, Final

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
        self._memory = MEMORY_BYTES if memory_bytes is None else memory_bytes
        self._file: IO[bytes] | None = None
        self._end = 0  # where the next histogram goes: a failed write leaves nothing counted
        self._failed = False

    def __enter__(self) -> HistogramSpool:
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def keep(self, edges: np.ndarray, counts: np.ndarray) -> Kept:
        """Keep one histogram (``bins + 1`` float64 edges, ``bins`` int64 counts)."""
        if not self._failed:
            try:
                if self._file is None:
                    self._file = tempfile.SpooledTemporaryFile(max_size=self._memory)  # noqa: SIM115
                self._file.seek(self._end)
                self._file.write(np.ascontiguousarray(edges, np.float64).tobytes())
                self._file.write(np.ascontiguousarray(counts, np.int64).tobytes())
            except OSError:
                # No room, or no temporary folder to write in: the heap, as before.
                self._failed = True
            else:
                kept = (self._end, len(counts))
                self._end += 8 * (2 * len(counts) + 1)
                return kept
        return edges, counts

    def get(self, kept: Kept) -> tuple[np.ndarray, np.ndarray]:
        """The edges and counts of a kept histogram."""
        first, second = kept
        if isinstance(first, np.ndarray):
            assert isinstance(second, np.ndarray)
            return first, second
        assert self._file is not None and isinstance(second, int)
        self._file.seek(first)
        edges = np.frombuffer(self._file.read(8 * (second + 1)), np.float64)
        counts = np.frombuffer(self._file.read(8 * second), np.int64)
        return edges, counts
