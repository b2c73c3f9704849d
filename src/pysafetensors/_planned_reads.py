"""Few large requests for many small reads of a remote file, when the reads are known ahead.

Streaming every tensor of a file (``hash``, ``stats``, ``validate --strict``, ``cast``) reads it
front to back, a tensor (or a chunk of one) at a time: over HTTP or S3 each read was a request
of its own, a round trip per tensor (1,000 for a LoRA file). Told which byte ranges will be
read, :class:`PlannedReads` serves them from blocks of at most :data:`BLOCK_BYTES`, each one
read of the source (which the remote sources split into parallel parts), covering the planned
ranges from the first byte asked for, across gaps of at most the source's ``max_gap``. Bytes
fetched are the planned ones plus those gaps, each once when the reads come in file order; a
read outside the block fetches a new one, so any order stays correct.

One block is held at a time by all the readers that share a :class:`BlockBudget`: a model's
files are read one after another, and hundreds of shards must not each hold a block.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Final

import numpy as np

from ._sources import ByteSource

__all__ = ["BLOCK_BYTES", "BlockBudget", "PlannedReads"]

#: The largest block fetched at once: eight parts of the remote sources' default 8 MiB, what
#: their default eight connections fetch in parallel.
BLOCK_BYTES: Final = 64 << 20


class BlockBudget:
    """The one block a set of :class:`PlannedReads` may hold between them."""

    __slots__ = ("_holder",)

    def __init__(self) -> None:
        self._holder: PlannedReads | None = None

    def take(self, reader: PlannedReads) -> None:
        """Make ``reader`` the holder, releasing the previous holder's block."""
        if self._holder is not None and self._holder is not reader:
            self._holder.release()
        self._holder = reader


class PlannedReads:
    """A byte source serving planned reads of ``source`` from few large reads (see module).

    Not thread-safe: one reader at a time, as a command streams a file. ``close`` releases the
    block, not ``source``, which stays its owner's to close.
    """

    def __init__(
        self,
        source: ByteSource,
        ranges: Iterable[tuple[int, int]],
        *,
        max_gap: int,
        block_bytes: int = BLOCK_BYTES,
        budget: BlockBudget | None = None,
    ) -> None:
        self._source = source
        self._max_gap = max_gap
        self._block_bytes = block_bytes
        self._budget = budget if budget is not None else BlockBudget()
        # The planned ranges, sorted and merged: starts and ends both ascend, so one bisect
        # finds the first range still ahead of an offset.
        merged: list[list[int]] = []
        for start, end in sorted((s, e) for s, e in ranges if e > s):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self._starts = [s for s, _ in merged]
        self._ends = [e for _, e in merged]
        self._buf: np.ndarray | None = None
        self._at = 0  # file offset of the block's first byte
        self._len = 0  # bytes of the block that hold file data

    @property
    def size(self) -> int:
        """The source's size."""
        return self._source.size

    @property
    def name(self) -> str:
        """The source's name."""
        return self._source.name

    def view(self, offset: int, length: int) -> memoryview | None:
        """None: blocks are replaced as reads move on, so no view could stay valid."""
        return None

    def readinto(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``: from the block, or a new block."""
        if out.ndim != 1 or out.format != "B":
            out = out.cast("B")  # slices below count bytes
        n = out.nbytes
        held = self._at + self._len
        if self._buf is not None and self._at <= offset < held:
            start = offset - self._at
            if offset + n <= held:
                out[:] = self._buf.data[start : start + n]
                return
            if n < self._block_bytes:
                # Across the block's end: its part from the block, the rest from the next one
                # (which starts where this one ends, so blocks tile a file read in order).
                out[: held - offset] = self._buf.data[start : self._len]
                out = out[held - offset :]
                offset, n = held, n - (held - offset)
        if n >= self._block_bytes:
            self._fetch(offset, out)  # as large as a block: no copy through one
            return
        stop = self._extent(offset, offset + n)
        self._budget.take(self)
        length = stop - offset
        if self._buf is None or self._buf.size < length:
            self._buf = None  # the old block's memory goes before the new one is taken
            self._buf = np.empty(max(length, min(self._block_bytes, 1 << 20)), np.uint8)
        self._len = 0  # a failed read must leave no block behind
        self._fetch(offset, self._buf.data[:length])
        self._at, self._len = offset, length
        out[:] = self._buf.data[:n]

    def _fetch(self, offset: int, out: memoryview) -> None:
        """Read from the source as planned: a remote source's own read-ahead (for reads it
        cannot foresee) is bypassed, the plan knows which bytes come next."""
        many = getattr(self._source, "readinto_many", None)
        if many is not None:
            many([(offset, out.nbytes)], out)
        else:
            self._source.readinto(offset, out)

    def _extent(self, offset: int, stop: int) -> int:
        """Where a block starting at ``offset`` (and reaching ``stop`` at least) ends: past the
        planned ranges ahead that are no further than ``max_gap`` apart, within the block size,
        within the file."""
        limit = min(offset + self._block_bytes, self._source.size)
        i = bisect.bisect_right(self._ends, offset)  # the first range ending after offset
        while i < len(self._starts) and stop < limit:
            if self._starts[i] > stop + self._max_gap:
                break
            stop = max(stop, min(self._ends[i], limit))
            i += 1
        return stop

    def release(self) -> None:
        """Let go of the block (the next read fetches another)."""
        self._buf = None
        self._len = 0

    def close(self) -> None:
        """Release the block; the source stays open."""
        self.release()
