"""Few large requests for many small reads of a remote file, when the reads are known ahead.

Streaming every tensor of a file (``hash``, ``stats``, ``validate --strict``, ``cast``) reads it
front to back, a tensor (or a chunk of one) at a time: over HTTP or S3 each read was a request
of its own, a round trip per tensor (1,000 for a LoRA file). Told which byte ranges will be
read, :class:`PlannedReads` serves them from blocks of at most :data:`BLOCK_BYTES`, each one
read of the source (which the remote sources split into parallel parts), covering the planned
ranges from the first byte asked for, across gaps of at most the source's ``max_gap``. Bytes
fetched are the planned ones plus those gaps, each once when the reads come in file order. A
read out of that order (one before the previous read's end, or skipping planned bytes)
fetches only its own bytes: any order stays correct, and a block fetched beyond what was
asked is one that reads in order had come as far as (and one ahead of it, as large), so an
order that breaks off wastes at most about what it had read.

While the reads in order take a block, the block after it (as far as the reads have come, up
to half the room, as the block itself) is fetched in the background, so that a command
computing over what it read (hashing, statistics, a cast) computes while the network delivers,
and the network is kept busy: a command reads all it planned, so a block fetched ahead is
wasted only when it fails. A block is then at most half of :data:`BLOCK_BYTES`, so that a
block and the one ahead of it fit. A block fetched ahead that the reads go past is dropped; one
that failed is fetched again when a read needs it, which raises the error for that read.

Reads in order may interleave: up to :data:`STREAMS` streams through the file (a cast or a diff
reading dtype groups in name order: F32, BF16, I64...) each keep a block, sharing
:data:`BLOCK_BYTES` (a read larger than a stream's share still gets a block of its size: at
most :data:`BLOCK_BYTES` and one such read per stream in all). One reader at a time holds
blocks among those that share a :class:`BlockBudget`: a model's files are read one after
another, and hundreds of shards must not each hold a block. A reader taking the budget back
from another (reads alternating between shards) reads its own bytes only, and reaches ahead
again from the first block's reach: it no longer knows that its order goes on.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Final, TypeGuard

import numpy as np

from ._remote_read_ahead import fetch_in_background, may_wait_here
from ._remote_source import RemoteSource
from ._sources import ByteSource

__all__ = ["BLOCK_BYTES", "BlockBudget", "PlannedReads", "plan_reads", "reads_remotely"]

#: The largest block fetched at once: eight parts of the remote sources' default 8 MiB, what
#: their default eight connections fetch in parallel.
BLOCK_BYTES: Final = 64 << 20
#: How far the first block of reads in order reaches; later ones reach as far as those reads
#: have come, up to a block.
FIRST_REACH: Final = 1 << 20
#: Reads in order that may interleave (a cast or diff reads a file's dtype groups, F32, F16,
#: I64..., in name order: a stream through the file for each), each with a block of its own.
#: With two, a third group's reads started over the least recently used stream, throwing
#: away its block and the one fetched ahead (1.7-1.9x the bytes of the file).
STREAMS: Final = 4


class BlockBudget:
    """The one reader of a set of :class:`PlannedReads` that may hold blocks."""

    __slots__ = ("_holder",)

    def __init__(self) -> None:
        self._holder: PlannedReads | None = None

    def take(self, reader: PlannedReads) -> None:
        """Make ``reader`` the holder, releasing the previous holder's blocks."""
        if self._holder is not None and self._holder is not reader:
            self._holder.release()
        self._holder = reader

    def taken_by_another(self, reader: PlannedReads) -> bool:
        """Whether another reader than ``reader`` holds blocks now."""
        return self._holder is not None and self._holder is not reader

    def leave(self, reader: PlannedReads) -> None:
        """``reader`` is done: the next reader takes the budget from nobody."""
        if self._holder is reader:
            self._holder = None


def reads_remotely(source: ByteSource) -> TypeGuard[RemoteSource]:
    """Whether :func:`plan_reads` plans ``source``'s reads (a remote source)."""
    return isinstance(source, RemoteSource)


def plan_reads(
    source: ByteSource, ranges: Iterable[tuple[int, int]], budget: BlockBudget | None = None
) -> PlannedReads | None:
    """A :class:`PlannedReads` of ``ranges`` for a remote source (across its own ``max_gap``),
    None for any other: a local file's reads cost no round trip."""
    if not reads_remotely(source):
        return None
    return PlannedReads(source, ranges, max_gap=source.max_gap, budget=budget)


@dataclass(slots=True, eq=False)
class _Ahead:
    """The block after a stream's, being fetched in the background into ``buf``."""

    at: int
    length: int
    buf: np.ndarray
    future: Future[None] = field(init=False)

    def holds(self, offset: int) -> bool:
        return self.at <= offset < self.at + self.length


@dataclass(slots=True, eq=False)  # identity: streams are told apart by which one they are
class _Stream:
    """Reads in the plan's order: where they are, and the block that serves them."""

    last: int = -1  # where its latest read ended (-1: a stream not started)
    first: int = 0  # where its reads in order began
    run: int = 0  # bytes its reads have taken in order
    buf: np.ndarray | None = None
    at: int = 0  # file offset of the block's first byte
    len: int = 0  # bytes of the block that hold file data
    ahead: _Ahead | None = None
    spare: np.ndarray | None = None  # a block the reads are done with, for the next one

    def holds(self, offset: int) -> bool:
        return self.buf is not None and self.at <= offset < self.at + self.len

    @property
    def held(self) -> int:
        """Bytes of memory its blocks take: the one it reads, the one on its way and a spare
        one (their buffers, which a recycled one makes larger than the bytes they hold)."""
        bufs = (self.buf, self.spare, self.ahead.buf if self.ahead is not None else None)
        return sum(buf.size for buf in bufs if buf is not None)

    def drop(self) -> None:
        self.buf = self.spare = self.ahead = None  # a fetch ahead finishes on its own
        self.len = 0


class PlannedReads:
    """A byte source serving planned reads of ``source`` from few large reads (see module).

    Not thread-safe: one reader at a time, as a command streams a file. ``close`` releases the
    blocks, not ``source``, which stays its owner's to close.
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
        # The planned ranges, sorted, overlapping ones merged: starts and ends both ascend, so
        # one bisect finds the first range still ahead of an offset. Ranges that only touch
        # (tensors tile a file) stay apart: a read out of order fetches its own tensor, not
        # the run of tensors around it.
        merged: list[list[int]] = []
        for start, end in sorted((s, e) for s, e in ranges if e > s):
            if merged and start < merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self._starts = [s for s, _ in merged]
        self._ends = [e for _, e in merged]
        # Most recently used first.
        self._streams = [_Stream() for _ in range(STREAMS)]
        # Fetches ahead still running, which close() waits for (futures, not blocks: a
        # done-callback naming a block would keep it alive).
        self._fetching: set[Future[None]] = set()

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
        """Fill ``out`` with the bytes at ``offset``: from a block, or a new block."""
        if out.ndim != 1 or out.format != "B":
            out = out.cast("B")  # slices below count bytes
        n = out.nbytes
        if n == 0 or offset + n > self._source.size:
            # Nothing to fetch, or the source's own error (naming this read's offset).
            self._source.readinto(offset, out)
            return
        stream, in_order = self._stream_for(offset)
        if in_order and self._budget.taken_by_another(self):
            # Reads that alternate between files sharing the budget (a diff of a model whose
            # shards interleave against the other's order) each take it back: each would
            # fetch a block as far as its order had come, and one ahead, both dropped at the
            # next switch (22x the bytes read). Such a read fetches its own range; the reads
            # in order after it reach ahead again from the first block's reach.
            in_order = False
        if stream.last < 0 or not in_order:
            stream.first = offset
        stream.last = offset + n
        stream.run = stream.run + n if in_order else 0
        while True:
            if not stream.holds(offset):
                self._take_ahead(stream, offset)
            # Its own block, else another stream's (a stream's last bytes can lie in the
            # block the next group's stream took over from it).
            holder = next(
                (st for st in (stream, *self._streams) if st.holds(offset)),
                None,
            )
            if holder is None:
                break
            block = holder.buf.data  # type: ignore[union-attr]
            start = offset - holder.at
            held = holder.at + holder.len
            if offset + n <= held:
                out[:] = block[start : start + n]
                if in_order and holder is stream:
                    self._fetch_ahead(stream)
                return
            # Across the block's end: its part from the block, the rest from the next one
            # (which starts where this one ends, so blocks tile a file read in order), or
            # straight from the source when the rest is as large as a block.
            out[: held - offset] = block[start : holder.len]
            out = out[held - offset :]
            offset, n = held, n - (held - offset)
        if n >= self._block_bytes:
            self._fetch(offset, out)  # as large as a block: no copy through one
            return
        # Only reads in a stream's order reach ahead: one out of order (a second pass, a
        # jump) fetches just its bytes, or each jump would fetch a block that the next one
        # throws away (19x the file, before streams). Not the rest of its planned range
        # either: a range read backwards in chunks fetched it again for every chunk (16x),
        # reads in random order up to 1,400x; the reads that follow one in order reach ahead
        # from it. A block reaches as far ahead as its stream's reads have come (1 MiB at
        # first): a guess that the order goes on costs at most what it has been right for.
        # The streams' blocks share ``block_bytes``, half of a stream's room for the block it
        # reads, half for the one fetched ahead.
        room = self._room(stream)
        if in_order:
            stop = self._extent(offset, offset + n, self._reach(stream, room), stream)
            stream.ahead = None  # the reads went past it: its fetch finishes on its own
        else:
            # A second pass over a tensor comes back to where the first left off: the block
            # fetched ahead stays for it.
            stop = offset + n
        self._budget.take(self)
        length = stop - offset
        stream.buf = self._buffer(stream, length, room)
        stream.len = 0  # a failed read must leave no block behind
        self._fetch(offset, stream.buf.data[:length])
        stream.at, stream.len = offset, length
        out[:] = stream.buf.data[:n]
        if in_order:
            self._fetch_ahead(stream)

    def _reach(self, stream: _Stream, room: int) -> int:
        """How far a block of reads in order reaches: as far as they have come (1 MiB at
        first), at most half the stream's room."""
        return min(max(room // 2, 1), max(FIRST_REACH, stream.run))

    def _buffer(self, stream: _Stream, length: int, room: int) -> np.ndarray:
        """A block's memory: the stream's block (or spare block) when it is large enough and
        not far too large, else fresh (the old blocks' memory goes first)."""
        buf = stream.buf if stream.buf is not None else stream.spare
        stream.buf = stream.spare = None
        if buf is None or not length <= buf.size <= max(length, room // 2):
            buf = None
            buf = np.empty(max(length, min(room // 2, 1 << 20)), np.uint8)
        return buf

    def _fetch_ahead(self, stream: _Stream) -> None:
        """Fetch the planned bytes after ``stream``'s block in the background, once (none
        after it: nothing). As soon as the reads enter the block, not at its half: measured
        over a link of 200 MB/s, waiting for the half left the network idle between blocks
        (hash of 336 MB: 2.2 s against 2.1 s)."""
        if stream.ahead is not None or stream.buf is None:
            return
        # The spare block serves the block ahead or goes: kept, it was memory beyond the
        # room (a stream with no block ahead held two blocks while the other's room counted
        # one).
        spare, stream.spare = stream.spare, None
        end = stream.at + stream.len
        i = bisect.bisect_right(self._ends, end)  # the first range ending after the block
        if i == len(self._starts):
            return
        at = max(end, self._starts[i])
        room = self._room(stream)
        reach = min(self._reach(stream, room), room - stream.buf.size)
        if reach < stream.len // 2 or self._limit(at, reach, stream) <= at:
            return  # no room beside the block (another stream holds it), or another's bytes
        length = self._extent(at, at + 1, reach, stream) - at
        if spare is None or not length <= spare.size <= reach:
            spare = None  # its memory goes before the new block's is taken
            buf = np.empty(length, np.uint8)
        else:
            buf = spare
        ahead = _Ahead(at, length, buf)
        try:
            ahead.future = fetch_in_background(
                lambda: self._fetch(at, buf.data[:length]), name="pysafetensors-planned-reads"
            )
        except RuntimeError:  # no thread at interpreter shutdown: read it when it is needed
            stream.spare = spare
            return
        self._fetching.add(ahead.future)
        ahead.future.add_done_callback(self._fetching.discard)
        stream.ahead = ahead

    def _take_ahead(self, stream: _Stream, offset: int) -> None:
        """Make a block fetched ahead that holds ``offset`` ``stream``'s block, once it has
        come: its own, or another stream's (a stream fetched ahead into the bytes where the
        next dtype group begins, before that group's stream started: its first read takes
        them over instead of fetching them again). One that failed is dropped: the read
        fetches its own, which raises the error."""
        owner = next(
            (st for st in self._streams if st.ahead is not None and st.ahead.holds(offset)),
            None,
        )
        if owner is None:
            return
        ahead, owner.ahead = owner.ahead, None
        assert ahead is not None
        try:
            ahead.future.result()
        except Exception:  # noqa: BLE001 - the read's own fetch raises it where it belongs
            return
        spare = stream.buf
        stream.buf, stream.at, stream.len = ahead.buf, ahead.at, ahead.length
        stream.spare = spare

    def _room(self, stream: _Stream) -> int:
        """How large a block ``stream`` may hold: all of ``block_bytes`` alone; with another
        stream holding one, what it leaves, at most half and at least :data:`FIRST_REACH`
        (or half), so that the blocks stay within ``block_bytes`` and a block past it."""
        others = sum(st.held for st in self._streams if st is not stream)
        if not others:
            return self._block_bytes
        half = self._block_bytes // 2  # two streams reading in turn share it evenly
        return max(min(self._block_bytes - others, half), min(FIRST_REACH, half))

    def _stream_for(self, offset: int) -> tuple[_Stream, bool]:
        """The stream a read at ``offset`` belongs to, made the most recently used, and
        whether the read is in its order: one it continues in order (the one whose block
        holds it first), else one not started, when the read is ahead of those started, else
        the one whose block holds it, else one not started, else the least recently used,
        started over (out of order: this read fetches its own range, only the next ones in
        order reach ahead)."""
        streams = self._streams
        # A stream the read continues in order, the one holding it first: a block can be
        # another stream's (one handed over, or a second pass served by the first pass's
        # block), and a read it holds is not that stream's (made its, it started over there:
        # its run and where its reads began were lost, and the next block fetched again).
        continuing = [st for st in streams if st.last >= 0 and self._in_order(st, offset)]
        chosen = next((st for st in continuing if st.holds(offset)), None)
        if chosen is None and continuing:
            chosen = continuing[0]
        in_order = chosen is not None
        fresh = next((st for st in streams if st.last < 0), None)
        if chosen is None and fresh is not None:
            # A stream starts in order ahead of those started (the next dtype group), not
            # behind them (a second pass, a jump back): that read fetches its own range.
            in_order = all(st.last <= offset for st in streams if st.last >= 0)
            chosen = fresh if in_order else None
        if chosen is None:
            chosen = next((st for st in streams if st.holds(offset)), fresh)
        if chosen is None:
            chosen = streams[-1]
        streams.remove(chosen)
        streams.insert(0, chosen)
        return chosen, in_order

    def _fetch(self, offset: int, out: memoryview) -> None:
        """Read from the source as planned: a remote source's own read-ahead (for reads it
        cannot foresee) is bypassed, the plan knows which bytes come next, and the block is
        spread over its connections."""
        spread = getattr(self._source, "readinto_spread", None)
        if spread is not None:
            spread(offset, out)  # a remote source: parts on all its connections
        else:
            self._source.readinto(offset, out)

    def _in_order(self, stream: _Stream, offset: int) -> bool:
        """Whether a read at ``offset`` comes next in ``stream``: not before its latest read's
        end, and no planned byte skipped between them (any read starts a stream not started)."""
        last = stream.last
        if last < 0:
            return True
        if offset < last:
            return False
        i = bisect.bisect_right(self._ends, last)  # the first range ending after last
        if i == len(self._starts):
            return True  # past the plan: nothing to skip
        return offset <= max(last, self._starts[i])

    def _extent(self, offset: int, stop: int, reach: int, stream: _Stream) -> int:
        """Where a block starting at ``offset`` (and reaching ``stop`` at least) ends: past the
        planned ranges ahead that are no further than ``max_gap`` apart, within
        :meth:`_limit`."""
        limit = self._limit(offset, reach, stream)
        i = bisect.bisect_right(self._ends, offset)  # the first range ending after offset
        while i < len(self._starts) and stop < limit:
            if self._starts[i] > stop + self._max_gap:
                break
            stop = max(stop, min(self._ends[i], limit))
            i += 1
        return stop

    def _limit(self, offset: int, reach: int, stream: _Stream) -> int:
        """How far a block of ``stream`` starting at ``offset`` may reach: within ``reach``,
        within the file, short of another stream's blocks ahead (their bytes are fetched) and
        of where another stream's reads began (the bytes it has read since are fetched)."""
        limit = min(offset + reach, self._source.size)
        for other in self._streams:
            if other is stream:
                continue
            if other.last >= 0 and other.first >= offset:
                limit = min(limit, other.first)
            # A block (or one on its way) that holds ``offset`` or begins after it: its
            # bytes are fetched (one beginning at ``offset``, or holding it: nothing to fetch).
            if other.buf is not None and other.at + other.len > offset:
                limit = min(limit, max(other.at, offset))
            if other.ahead is not None and other.ahead.at + other.ahead.length > offset:
                limit = min(limit, max(other.ahead.at, offset))
        return limit

    def release(self) -> None:
        """Let go of the blocks (the next reads fetch others), and of how far the reads in
        order had come: they reach ahead from the first block's reach again."""
        for stream in self._streams:
            stream.drop()
            stream.run = 0

    def close(self) -> None:
        """Release the blocks and wait for the fetches ahead still running (the source is
        closed next, by its owner); the source stays open."""
        self.release()
        self._budget.leave(self)
        if may_wait_here():
            wait(list(self._fetching))  # their outcomes are nobody's: the blocks are dropped
