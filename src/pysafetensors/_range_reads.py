"""Reads of many byte ranges at once, by the reader threads.

* :func:`read_runs_fresh`: runs into one fresh buffer (a tensor-parallel rank's parts).
* :func:`read_ranges_into`: ranges back to back into one buffer.
* :func:`read_pieces_into`: pieces into buffers the caller owns (``read_into``).

Through the page cache, or, for large ranges that are mostly not cached, with direct I/O
(``O_DIRECT``; ``tuning``'s ``direct_reads``), which lets the disk write straight into the
destination or into bounce buffers.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
from collections.abc import Sequence
from typing import Final

import numpy as np

from . import tuning
from ._format import gc_paused
from ._fresh_memory import huge_region, numpy_empty
from ._reader_pool import run_parallel, worker_count
from ._residency import read_ahead
from ._sources import (
    MIN_PARALLEL_CHUNK,
    PARALLEL_CHUNK,
    ByteSource,
    MmapSource,
    PreadSource,
    check_range,
    pread_exact,
)

__all__ = [
    "DIRECT_MIN",
    "DIRECT_RUN_MIN",
    "DIRECT_THREADS",
    "lay_out_runs",
    "read_pieces_into",
    "read_ranges_into",
    "read_runs_fresh",
    "run_pieces",
]


def lay_out_runs(runs: Sequence[tuple[int, int]], align: int) -> tuple[list[int], int]:
    """Where ``(offset, length)`` runs go when packed into one buffer, each at a multiple of
    ``align`` (the first at 0): the offset of each, and the buffer's size."""
    offsets: list[int] = []
    total = 0
    for _, length in runs:
        total += -total % align
        offsets.append(total)
        total += length
    return offsets, total


def run_pieces(
    runs: Sequence[tuple[int, int]], offsets: Sequence[int], piece: int
) -> list[tuple[int, int, int]]:
    """``(source offset, destination offset, length)`` of every piece of at most ``piece``
    bytes of the runs, run by run (``offsets`` as from :func:`lay_out_runs`)."""
    return [
        (offset + at, dest + at, min(piece, length - at))
        for (offset, length), dest in zip(runs, offsets, strict=True)
        for at in range(0, length, piece)
    ]


#: Runs of at least this many bytes that are not in the page cache are read with direct I/O...
DIRECT_RUN_MIN: Final = 1 << 20

#: ... when such runs add up to at least this many bytes (below, the page cache is as fast).
DIRECT_MIN: Final = 64 << 20

#: Direct reads start, end and land on multiples of this (the largest logical block size in
#: common use; a multiple of the smaller ones).
_DIRECT_BLOCK: Final = 4096


def _cold_large_runs(source: PreadSource, runs: Sequence[tuple[int, int]]) -> set[int]:
    """The runs :func:`read_runs_fresh` reads directly: large ones mostly not in the page cache
    (each sampled with ``mincore``), if they add up to :data:`DIRECT_MIN`; else none.

    A direct read goes to the disk even for cached pages, so a cached run keeps the page cache.
    """
    if not tuning.settings().direct_reads or not getattr(os, "O_DIRECT", 0):
        return set()
    # (Never a run small enough to be read in a span with its neighbours.)
    smallest = max(DIRECT_RUN_MIN, _SMALL_RUN + 1)
    large = [i for i, (_, length) in enumerate(runs) if length >= smallest]
    if sum(runs[i][1] for i in large) < DIRECT_MIN:
        return set()
    # One sample of the whole span first (~0.05 ms): a warm file stops here, where sampling
    # every run of a row split took ~1.5 ms.
    start = min(runs[i][0] for i in large)
    end = max(runs[i][0] + runs[i][1] for i in large)
    if not source.uncached(start, end - start):
        return set()
    cold = {i for i in large if source.uncached(*runs[i])}
    return cold if sum(runs[i][1] for i in cold) >= DIRECT_MIN else set()


def _lay_out(
    runs: Sequence[tuple[int, int]], align: int, direct: set[int]
) -> tuple[list[int], int]:
    """As :func:`lay_out_runs`, but each run in ``direct`` is placed at its file offset's phase
    within a block (:data:`_DIRECT_BLOCK`), with room before and after it for the whole blocks
    a direct read covers."""
    if not direct:
        return lay_out_runs(runs, align)
    offsets: list[int] = []
    total = 0
    for i, (offset, length) in enumerate(runs):
        if i in direct:
            head = offset % _DIRECT_BLOCK
            total += -total % _DIRECT_BLOCK
            offsets.append(total + head)
            total += head + length
            total += -total % _DIRECT_BLOCK
        else:
            total += -total % align
            offsets.append(total)
            total += length
    return offsets, total


def _direct_pieces(
    runs: Sequence[tuple[int, int]], offsets: Sequence[int]
) -> list[tuple[int, int, int, int]]:
    """``(source offset, destination offset, length, bytes wanted)`` of the direct reads of the
    runs (placed by :func:`_lay_out`): each run's whole blocks, in pieces of at most
    :data:`PARALLEL_CHUNK`. The bytes wanted end at the run's end; the rest of its last block
    may lie past the end of the file."""
    pieces = []
    for (offset, length), dest in zip(runs, offsets, strict=True):
        head = offset % _DIRECT_BLOCK
        start, end = offset - head, offset + length
        size = end - start + (-(end - start) % _DIRECT_BLOCK)
        for at in range(0, size, PARALLEL_CHUNK):
            piece = min(PARALLEL_CHUNK, size - at)
            pieces.append((start + at, dest - head + at, piece, min(piece, end - start - at)))
    return pieces


def _read_direct(fd: int, source: PreadSource, offset: int, out: memoryview, wanted: int) -> None:
    """Fill at least ``out[:wanted]`` from ``offset`` by direct reads on ``fd``; what they leave
    (the end of the file, a device refusing the request) is read through the page cache, which
    raises as any read of ``source`` does."""
    got = 0
    with contextlib.suppress(OSError):
        while got < wanted:
            n = os.preadv(fd, [out[got:]], offset + got)
            got += n
            if n <= 0 or got % _DIRECT_BLOCK:
                break  # the end of the file: whatever is missing is past it, or was cut off
    if got < wanted:
        source.pread_exact(offset + got, out[got:wanted])


def read_runs_fresh(
    source: PreadSource, runs: Sequence[tuple[int, int]], align: int = 64, *, spans: bool = True
) -> tuple[np.ndarray, list[int]]:
    """Read several ``(offset, length)`` runs of a file into one new buffer, in parallel.

    Each run starts at a multiple of ``align`` in the buffer, so that tensors viewing it are
    aligned. One destination for all runs (huge pages faulted in by the thread that reads each
    piece, as in :func:`._sources.read_fresh`) costs fewer page faults than one per run, and
    all runs are read at once: a rank's rows of every tensor of a 2 GiB file (256 MiB in 39 runs of
    4-32 MiB) took 50-71 ms this way against 77-104 ms one tensor at a time (10 runs each; in
    the machine's slow spells, 147-166 ms against 204-225 ms). Small runs less than a page
    apart are read as one span each and copied to their places (see :data:`_SMALL_RUN`),
    unless ``spans`` is False (only the runs' own bytes are read).

    Large runs mostly not in the page cache (:func:`_cold_large_runs`) are read with direct
    I/O (``tuning``'s ``direct_reads``): the disk writes straight into the buffer, in requests
    as large as the device takes, where reads through the page cache fill it 4 KiB page by
    page (requests of ~1 MiB here) and then copy it. A cold row split of a 2 GiB file (255
    MiB in 39 runs) took 103-127 ms this way against 164-206 ms (fresh processes,
    alternating). Such a run is placed at its file offset's phase within a 4 KiB block (its
    tensor as aligned as in a mapping of the file), and its whole blocks are read, so the
    buffer holds up to 4 KiB of its neighbours' bytes either side.

    Returns:
        The buffer and the offset of each run in it.
    """
    # The plan of the reads makes a few objects per run (the collector paused: its
    # collections walk torch's whole object graph once it is imported); the reads run after.
    direct = _cold_large_runs(source, runs)
    direct_fd: int | None = None
    try:
        if direct:
            direct_fd = source.reopen_direct()
        if direct_fd is None:
            direct = set()
        with gc_paused():
            offsets, total = _lay_out(runs, align, direct)
            small, large = _group_small_runs(runs) if spans else ([], list(range(len(runs))))
            plain = [i for i in large if i not in direct]
            pieces: list[tuple[int, ...]] = [
                *run_pieces([runs[i] for i in plain], [offsets[i] for i in plain], PARALLEL_CHUNK),
                *_direct_pieces([runs[i] for i in direct], [offsets[i] for i in direct]),
            ]
            # In file order, so that the reads sweep the file front to back.
            work: list[tuple[int, ...] | list[int]] = sorted(
                [*small, *pieces],
                key=lambda item: item[0] if type(item) is tuple else runs[item[0]][0],
            )
        return _read_work(source, runs, work, offsets, total, direct_fd)
    finally:
        if direct_fd is not None:
            os.close(direct_fd)


def _read_work(
    source: PreadSource,
    runs: Sequence[tuple[int, int]],
    work: list[tuple[int, ...] | list[int]],
    offsets: list[int],
    total: int,
    direct_fd: int | None,
) -> tuple[np.ndarray, list[int]]:
    """The reads of :func:`read_runs_fresh`, into a fresh buffer of ``total`` bytes."""
    region = huge_region(total)
    if region is not None:
        buf = region.array()
    elif direct_fd is not None:
        # Direct reads land on block boundaries of the buffer: pages of a private map (numpy's
        # own allocations are aligned to 64 bytes only).
        buf = np.frombuffer(
            mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)),
            np.uint8,
        )
    else:
        # Numpy's own huge pages where asked for (True), else 4 KiB pages.
        buf = numpy_empty(total, tuning.settings().hugepage_destinations is True)
    view = buf.data.cast("B")

    def one(item: tuple[int, ...] | list[int]) -> None:
        if type(item) is tuple:
            offset, dest, length, *wanted = item
            if region is not None:
                region.populate(dest, length)
            if wanted:
                assert direct_fd is not None  # direct pieces exist only with a descriptor
                _read_direct(direct_fd, source, offset, view[dest : dest + length], wanted[0])
                return
            source.pread_exact(offset, view[dest : dest + length])
            return
        # Runs close together in the file: their whole span in one read, then each run
        # copied to its place.
        first, last = item[0], item[-1]
        span_start = runs[first][0]
        span = np.empty(runs[last][0] + runs[last][1] - span_start, np.uint8).data
        source.pread_exact(span_start, span)
        if region is not None:
            region.populate(offsets[first], offsets[last] + runs[last][1] - offsets[first])
        for i in item:
            offset, length = runs[i]
            at = offset - span_start
            view[offsets[i] : offsets[i] + length] = span[at : at + length]

    run_parallel(one, work, source.threads)
    return buf, offsets


#: Runs of at most this many bytes...
_SMALL_RUN: Final = 64 << 10

#: ... less than a page apart (so reading the span reads no page the runs do not touch) are
#: read as one span of at most this many bytes. A rank's rows of a checkpoint of many small
#: tensors (a mixture of experts: 20,000 tensors of a few hundred bytes) were one positioned
#: read each, ~2 us of Python apiece on the reader threads.
_SMALL_SPAN: Final = 4 << 20


def _group_small_runs(runs: Sequence[tuple[int, int]]) -> tuple[list[list[int]], list[int]]:
    """Split runs (as indices) into groups of small runs read as one span (see
    :data:`_SMALL_RUN`) and the rest, read one by one. Only runs that follow each other in
    the file, in the order given, are grouped."""
    groups: list[list[int]] = []
    alone: list[int] = []
    group: list[int] = []
    span_start = span_end = 0
    for i, (offset, length) in enumerate(runs):
        if length <= _SMALL_RUN and length:
            end = offset + length
            near = span_end <= offset < span_end + mmap.PAGESIZE
            if group and near and end - span_start <= _SMALL_SPAN:
                group.append(i)
                span_end = end
                continue
            if len(group) > 1:
                groups.append(group)
            else:
                alone.extend(group)
            group, span_start, span_end = [i], offset, end
            continue
        alone.append(i)
    if len(group) > 1:
        groups.append(group)
    else:
        alone.extend(group)
    return groups, alone


def read_ranges_into(
    source: ByteSource, ranges: Sequence[tuple[int, int]], out: memoryview, *, exact: bool = False
) -> None:
    """Read several ``(offset, length)`` ranges back to back into ``out``.

    Ranges are read in parallel threads when the source is a :class:`PreadSource` and there is
    enough work; otherwise one after another. A source with a ``readinto_many`` method (the
    remote ones) is handed all ranges at once; with ``exact`` it fetches only their bytes
    (no merging across gaps).
    """
    out = out.cast("B") if out.format != "B" else out
    many = getattr(source, "readinto_many", None)
    if many is not None:
        # Remote sources coalesce nearby ranges into few requests and fetch them in parallel.
        if exact:
            many(ranges, out, max_gap=0)
        else:
            many(ranges, out)
        return
    total = sum(length for _, length in ranges)
    if total != out.nbytes:
        raise ValueError(f"ranges cover {total} bytes but the buffer holds {out.nbytes}")
    positions = []
    pos = 0
    for offset, length in ranges:
        positions.append((offset, pos, length))
        pos += length
    if isinstance(source, PreadSource) and len(ranges) > 1 and total > PARALLEL_CHUNK:
        run_parallel(
            lambda p: source.readinto(p[0], out[p[1] : p[1] + p[2]]),
            positions,
            worker_count(source),
        )
        return
    for offset, start, length in positions:
        if length:
            source.readinto(offset, out[start : start + length])


def read_pieces_into(source: ByteSource, pieces: Sequence[tuple[int, memoryview]]) -> None:
    """Fill each ``(offset, out)`` piece from ``source``: reads into memory the caller owns.

    From a local file (positioned reads or a mapping, whose reads are positioned reads too)
    the pieces are cut into :data:`PARALLEL_CHUNK` parts that the reader threads take in file
    order, with the disk kept busy ahead of them on a cold file (:func:`read_ahead`); remote
    sources fetch all pieces in one plan (``readinto_scattered``); file objects and buffers
    read piece after piece.
    """
    ordered = sorted(
        (
            (offset, out.cast("B") if out.format != "B" or out.ndim != 1 else out)
            for offset, out in pieces
        ),
        key=lambda piece: piece[0],
    )
    scattered = getattr(source, "readinto_scattered", None)
    if scattered is not None:
        # Remote sources: one plan for all pieces (nearby ranges merged into balanced requests
        # on parallel connections), each received straight into its buffer; it checks the
        # ranges itself.
        scattered([(offset, out.nbytes, out, 0) for offset, out in ordered])
        return
    for offset, out in ordered:
        check_range(source, offset, out.nbytes)
    total = sum(out.nbytes for _, out in ordered)
    first = ordered[0][0] if ordered else 0
    last = max((offset + out.nbytes for offset, out in ordered), default=0)
    if isinstance(source, PreadSource) and _read_pieces_direct(source, ordered, total, first, last):
        return
    local = isinstance(source, (PreadSource, MmapSource))
    if not local or total <= MIN_PARALLEL_CHUNK or worker_count(source) < 2:
        for offset, out in ordered:
            if out.nbytes:
                source.readinto(offset, out)
        return
    parts = [
        (offset + at, out[at : at + PARALLEL_CHUNK])
        for offset, out in ordered
        for at in range(0, out.nbytes, PARALLEL_CHUNK)
    ]
    if isinstance(source, PreadSource):
        with source._held as fd, read_ahead(fd, first, last - first):
            run_parallel(
                lambda part: pread_exact(fd, source.name, part[0], part[1]),
                parts,
                worker_count(source),
            )
        return
    run_parallel(lambda part: source.readinto(part[0], part[1]), parts, worker_count(source))


#: Direct reads for :func:`read_pieces_into` go through bounce buffers of this size (the
#: destinations are the caller's memory: neither they nor the pieces' file offsets need be
#: aligned as direct I/O requires)...
_BOUNCE_BYTES: Final = 8 << 20

#: ... read by this many threads at once (128 MiB of bounce buffers in all). Each is one
#: synchronous read the device serves as a few requests; together they keep its queue full,
#: while other threads copy what has arrived. A cold 2 GiB model read in place took 666-679 ms
#: this way against 740-765 ms with 8 threads of 16 MiB, 704-891 ms with 16 of 4 MiB, and
#: 1.16-2.08 s through the page cache (4 reader threads, read-ahead thread), in alternating
#: fresh processes.
DIRECT_THREADS: Final = 16


def _bounce_plan(
    ordered: Sequence[tuple[int, memoryview]],
) -> list[tuple[int, int, list[tuple[int, np.ndarray]]]]:
    """The bounce reads that cover ``ordered`` (pieces sorted by offset, disjoint):
    ``(block-aligned offset, bytes wanted, [(piece offset, piece array)])`` for every
    :data:`_BOUNCE_BYTES` stretch that holds bytes of a piece."""
    arrays = [(offset, np.frombuffer(out, np.uint8)) for offset, out in ordered if out.nbytes]
    plan: list[tuple[int, int, list[tuple[int, np.ndarray]]]] = []
    i = 0
    at = arrays[0][0] - arrays[0][0] % _DIRECT_BLOCK if arrays else 0
    while i < len(arrays):
        offset, array = arrays[i]
        if offset + array.nbytes <= at:
            i += 1
            continue
        if offset >= at + _BOUNCE_BYTES:
            at = offset - offset % _DIRECT_BLOCK  # a gap: skip to the next piece's block
        end = at + _BOUNCE_BYTES
        inside = []
        j = i
        while j < len(arrays) and arrays[j][0] < end:
            inside.append(arrays[j])
            j += 1
        last_offset, last_array = inside[-1]  # (sorted and disjoint: it ends last)
        plan.append((at, min(end, last_offset + last_array.nbytes) - at, inside))
        at = end
    return plan


def _read_pieces_direct(
    source: PreadSource,
    ordered: Sequence[tuple[int, memoryview]],
    total: int,
    first: int,
    last: int,
) -> bool:
    """:func:`read_pieces_into` by direct I/O through bounce buffers, for a large, dense and
    mostly uncached range (a model loaded in place from a cold file); False (nothing read)
    where that does not apply. ``total`` is the pieces' bytes, ``first`` and ``last`` the
    start and end of the range they span.

    The pages read this way are not left in the page cache: a load that reads the file once
    leaves the cache to the memory it just filled. Whatever the direct reads leave (the end of
    the file, a refusal) is read through the page cache, which raises as any read does.
    """
    if not tuning.settings().direct_reads or not getattr(os, "O_DIRECT", 0) or total < DIRECT_MIN:
        return False
    span = last - first
    if total * 2 < span or not source.uncached(first, span):
        return False  # sparse (a bounce read would fetch mostly unwanted bytes), or cached
    fd = source.reopen_direct()
    if fd is None:
        return False
    try:
        plan = _bounce_plan(ordered)
        threads = min(DIRECT_THREADS, len(plan))
        region = mmap.mmap(-1, threads * _BOUNCE_BYTES)  # page-aligned, as direct reads need
        bounce = np.frombuffer(region, np.uint8)
        free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(threads):
            free.put(slot * _BOUNCE_BYTES)

        def one(item: tuple[int, int, list[tuple[int, np.ndarray]]]) -> None:
            at, wanted, inside = item
            slot = free.get()
            try:
                size = wanted + -wanted % _DIRECT_BLOCK
                _read_direct(fd, source, at, bounce.data[slot : slot + size], wanted)
                for offset, array in inside:
                    lo, hi = max(offset, at), min(offset + array.nbytes, at + wanted)
                    # numpy copies without the GIL: the other threads' copies run alongside.
                    array[lo - offset : hi - offset] = bounce[slot + lo - at : slot + hi - at]
            finally:
                free.put(slot)

        run_parallel(one, plan, threads)  # the buffers go with this frame
    finally:
        os.close(fd)
    return True
