"""Moving tensor bytes between files and accelerator memory through reused pinned buffers.

**Loads** (:func:`stage_items_to_device`) overlap disk and transfer.

The reference copies each tensor with one blocking host-to-device transfer after reading it, so
the disk, the ``memcpy`` into pinned memory and the PCIe transfer take turns. Here the bytes of
the requested tensors are read in chunks by worker threads (one per core, 4 to 16, or as many as
the caller's ``threads`` or ``tuning``'s ``read_threads`` ask, up to 16), each chunk
into one of a ring of pinned host buffers, and copied to the tensors' device allocations (one
per tensor, as the reference's) with asynchronous copies on the worker's own stream. A buffer
goes back into the ring with the event of its copy, and is reused only once that event has
completed, so chunk ``i + 1`` is read from disk while chunk ``i`` crosses the bus. Positioned
reads release the GIL, so the threads really overlap.

**Saves** of device tensors (:func:`chunks_from_device`) copy each tensor to the host in 16 MiB
pieces through a ring of three pinned buffers, while the writer writes the piece before: no
host copy of the whole tensor is made (a plain ``tensor.to("cpu")`` allocates and faults in one
per tensor), so the extra host memory of a save stays at 48 MiB whatever the model size.

The device is reached only through :class:`DeviceOps`; :class:`TorchCudaOps` is the real one and
tests substitute a CPU stand-in to check the staging logic (bytes land where they should,
buffers are reused, nothing is overwritten before its copy completed) without a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from . import tuning
from ._format import gc_paused
from ._interrupts import interrupts_deferred
from ._range_reads import run_pieces
from ._reader_pool import run_parallel

__all__ = [
    "CHUNK_BYTES",
    "PIECE_BYTES",
    "DeviceOps",
    "StagingStats",
    "TorchCudaOps",
    "chunks_from_device",
    "gather_to_device",
    "stage_items_to_device",
    "stage_to_device",
    "staging_workers",
]

#: Bytes per chunk: large enough for full-speed reads and transfers, small enough to pipeline.
CHUNK_BYTES: Final = 16 << 20
#: Smallest chunk a range is split into so that more workers get one (a single 32 MiB tensor
#: loaded with ``get_tensor`` would otherwise be two chunks, for two of the workers). Each chunk
#: costs Python work under the GIL, so not smaller: a ``get_tensor`` loop over a 2 GiB LLaMA
#: file on an H200 took 235 ms with a 2 MiB floor, 192 ms with 4 MiB, 164 ms with 8 MiB.
MIN_CHUNK_BYTES: Final = 8 << 20
#: Worker threads, each with its own stream. From the page cache the work is the kernel's copy
#: into pinned memory, one core per reading thread, and the link is far faster than one core
#: (an H200 over PCIe 5 x16: 55 GB/s for one pinned copy), so one thread per core up to 16:
#: staging 2 GiB ran at 15-20 GB/s with 4 threads, 25-30 GB/s with 16 (benchmarks/GPU.md).
WORKERS: Final = max(4, min(16, os.cpu_count() or 4))
#: The most workers a load may ask for: each holds a 16 MiB pinned buffer and a stream.
MAX_WORKERS: Final = 16
#: Pinned buffers beyond one per worker. A buffer's copy to the device takes far less time than
#: filling the next one (16 MiB: 0.3 ms over the link, ~3 ms to read), so a worker rarely waits
#: for one; two spares cover that, where two buffers per worker would pin twice the memory.
SPARE_BUFFERS: Final = 2
#: Bytes per piece of a device tensor copied to the host for a save. At least the writer's
#: batching threshold (``_writer.WRITEV_BYTES``), so that every piece but a tensor's last is
#: written before the next one is asked for, which is what lets the ring reuse its buffers.
PIECE_BYTES: Final = 16 << 20
#: Pinned buffers per device tensor being saved: one being written, two in flight.
SAVE_RING: Final = 3
#: Pinned buffers a gathered part (a column split) goes through: one being filled, two in
#: flight to the device.
GATHER_RING: Final = 3

#: ``(device buffer, offset in it, offset in the host buffer, bytes)``: one copy of part of a
#: staged chunk into the device allocation of the tensor it belongs to.
Piece = tuple[Any, int, int, int]


class DeviceOps(Protocol):
    """What the staging pipeline needs from a device runtime."""

    def alloc_device(self, nbytes: int) -> Any:
        """A 1-D uint8 device buffer of ``nbytes``."""
        ...

    def alloc_host(self, nbytes: int) -> tuple[Any, memoryview]:
        """A pinned host buffer and a writable byte view of it."""
        ...

    def new_stream(self) -> Any:
        """A stream (queue of asynchronous work) for one worker."""
        ...

    def copy_async(self, host: Any, pieces: Sequence[Piece], stream: Any) -> Any:
        """Start copying each ``(dst, dst_offset, host_offset, nbytes)`` piece of ``host`` to
        ``dst[dst_offset:]``, in order on ``stream``; return the event of the last one."""
        ...

    def copy_to_host_async(
        self, host: Any, src: Any, src_offset: int, nbytes: int, stream: Any
    ) -> Any:
        """Start copying ``src[src_offset:][:nbytes]`` (device) to ``host[:nbytes]``; return
        its event."""
        ...

    def wait_for_producer(self, stream: Any) -> None:
        """Order ``stream`` after the work already queued on the current stream (the kernels
        that computed the tensor being copied)."""
        ...

    def producer_event(self) -> Any:
        """An event marking the work queued so far on the calling thread's current stream
        (for streams of other threads to wait on, see :meth:`wait_event`)."""
        ...

    def wait_event(self, stream: Any, event: Any) -> None:
        """Order ``stream`` after ``event``, without blocking the host."""
        ...

    def wait(self, event: Any) -> None:
        """Block until ``event`` (from a copy) has completed."""
        ...

    def done(self, event: Any) -> bool:
        """Whether ``event`` (from a copy) has completed, without blocking."""
        ...

    def synchronize(self, streams: Iterable[Any]) -> None:
        """Block until the work queued on ``streams`` has completed (only theirs: other work
        on the device, a training step or another thread's load, is not waited for)."""
        ...


@dataclass
class StagingStats:
    """What one staging run did (for tests and benchmarks)."""

    chunks: int = 0
    """Chunks copied."""
    host_buffers: int = 0
    """Pinned buffers allocated (at most the ring size: the ring is pinned as the workers
    need it); each is reused for many chunks."""
    bytes: int = 0
    """Bytes transferred."""
    reuse: dict[int, int] = field(default_factory=dict)
    """Times each host buffer (by ring index) was filled."""


#: Whether the fallback to pageable staging buffers was reported (once per process).
_PAGEABLE_WARNED = False

#: Whether ``torch._foreach_copy_`` copies a chunk's pieces (cleared where it fails once).
_FOREACH_COPY: list[bool] = [True]

#: Pieces from which a chunk goes to the device through a scratch allocation (see
#: :func:`copy_pieces`). Below it the extra device-side pass saves too few host-side calls.
SCRATCH_PIECES = 8

#: Loads after a scratch allocation ran out of memory on a device before the next one tries
#: again: each refusal costs torch a pass of emptying its cache (a synchronisation) first, and
#: a device nearly full for one load is most often as full for the next.
SCRATCH_RETRY_LOADS = 16

#: Devices whose scratch allocation was refused, with the loads left before one is tried.
_SCRATCH_REFUSED: dict[Any, int] = {}

#: Each thread's side streams, by device, kept across loads: model loaders call ``get_tensor``
#: once per tensor, and the reader threads live for the whole process.
_STREAMS = threading.local()


def copy_pieces(torch: Any, host: Any, pieces: Sequence[Piece], device: Any = None) -> bool:
    """Queue the copies of a chunk's pieces of ``host`` (``non_blocking``, on the current
    stream).

    A chunk of at least :data:`SCRATCH_PIECES` pieces (many small tensors) with ``device``
    given crosses the link in one copy, into a scratch allocation on ``device``, and reaches
    its tensors by one device-side ``torch._foreach_copy_``: between tensors of one device and
    dtype that call copies a list of tensors per kernel launch, where copies from host memory
    are one ``cudaMemcpyAsync`` each (a mixture of experts' 20,000 tensors of 256 bytes were
    20,000 of them, from one thread: its whole file is one chunk). The scratch is freed on the
    current stream, which the allocator reuses it on only after the copies queued there.
    Where the scratch does not fit on the device, the pieces go straight from ``host``, and
    False is returned (for the caller to stop asking: torch empties its cache and retries
    before it reports out-of-memory, a synchronising pass each time); else True.

    Otherwise one ``torch._foreach_copy_`` call for several pieces (its loop runs in C++), else,
    or where that call fails once (a torch without it, or refusing copies between devices), one
    ``copy_`` per piece.
    """
    dsts = []
    for dst, at, _, nbytes in pieces:
        dsts.append(dst if at == 0 and nbytes == dst.numel() else dst[at : at + nbytes])
    srcs = None
    fits = True
    if device is not None and len(pieces) >= SCRATCH_PIECES and _FOREACH_COPY[0]:
        try:
            srcs = _scratch_views(torch, host, pieces, device)
        except torch.cuda.OutOfMemoryError:
            # Up to a chunk (16 MiB) per worker at once: on a device the load nearly fills,
            # the pieces go straight from the host buffer instead, as the reference's copies.
            fits = False
    if srcs is None:
        srcs = [host[begin : begin + nbytes] for _, _, begin, nbytes in pieces]
    if len(dsts) > 1 and _FOREACH_COPY[0]:
        try:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
            return fits
        except (AttributeError, TypeError, NotImplementedError, RuntimeError):
            _FOREACH_COPY[0] = False  # a piece copied again below holds the same bytes
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src, non_blocking=True)
    return fits


def _scratch_views(torch: Any, host: Any, pieces: Sequence[Piece], device: Any) -> Any:
    """The bytes of ``pieces`` (in host order, disjoint) copied in one piece to a fresh
    allocation on ``device``: a view of it per piece, cut by one ``split`` (one C++ call where
    a slice each cost a Python call per piece). Bytes between pieces cross too, unused."""
    low = pieces[0][2]
    high = pieces[-1][2] + pieces[-1][3]
    scratch = torch.empty(high - low, dtype=torch.uint8, device=device)
    scratch.copy_(host[low:high], non_blocking=True)
    sizes: list[int] = []
    wanted: list[int] = []  # which of the split's parts are pieces (the others are gaps)
    at = low
    for _, _, begin, nbytes in pieces:
        if begin > at:
            sizes.append(begin - at)
        wanted.append(len(sizes))
        sizes.append(nbytes)
        at = begin + nbytes
    parts = scratch.split(sizes)
    return parts if len(wanted) == len(parts) else [parts[i] for i in wanted]


class TorchCudaOps:
    """:class:`DeviceOps` over ``torch.cuda``: pinned buffers, side streams, events."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch: Any = torch
        self.device = torch.device(device)
        # Where chunks of many pieces go through a scratch allocation: None once one did not
        # fit (for the rest of this load, any worker may clear it, and the next
        # SCRATCH_RETRY_LOADS loads to the device).
        self._scratch_on: Any = self.device
        left = _SCRATCH_REFUSED.get(self.device, 0)
        if left > 0:
            _SCRATCH_REFUSED[self.device] = left - 1
            self._scratch_on = None

    def alloc_device(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self.device)

    def alloc_host(self, nbytes: int) -> tuple[Any, memoryview]:
        torch = self._torch
        try:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            # Page-locked memory is scarce in some places (WSL2, containers with a low
            # RLIMIT_MEMLOCK): stage through ordinary memory instead, which a plain .to()
            # would use anyway. A copy from pageable memory returns once its source was read,
            # so the buffer's reuse rules still hold; it is only slower.
            global _PAGEABLE_WARNED
            if not _PAGEABLE_WARNED:
                _PAGEABLE_WARNED = True
                warnings.warn(
                    f"pinned host memory unavailable ({exc}); staging through ordinary "
                    "memory (slower)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf, memoryview(buf.numpy()).cast("B")

    def new_stream(self) -> Any:
        streams: dict[Any, Any] | None = getattr(_STREAMS, "by_device", None)
        if streams is None:
            streams = _STREAMS.by_device = {}
        stream = streams.get(self.device)
        if stream is None:
            stream = streams[self.device] = self._torch.cuda.Stream(device=self.device)
        return stream

    def _on(self, stream: Any) -> contextlib.ExitStack:
        """``stream`` made current, inside its device's guard.

        ``torch.cuda.stream`` alone, on a reader thread (whose current device is 0 whatever
        the caller's is), restored device 0's stream on exit by ``cudaSetDevice(0)``, which
        creates a CUDA context on device 0: every process loading to ``cuda:N`` would hold one
        there too. Inside ``torch.cuda.device(N)`` it saves and restores device N's stream,
        and the guard leaves the thread's device as it was without creating a context.
        """
        torch = self._torch
        stack = contextlib.ExitStack()
        try:
            if self.device.type == "cuda":
                stack.enter_context(torch.cuda.device(self.device))
            stack.enter_context(torch.cuda.stream(stream))
        except BaseException:
            stack.close()  # the device guard entered: the thread's device put back
            raise
        return stack

    def copy_async(self, host: Any, pieces: Sequence[Piece], stream: Any) -> Any:
        torch = self._torch
        with self._on(stream):
            if not copy_pieces(torch, host, pieces, self._scratch_on):
                self._scratch_on = None
                _SCRATCH_REFUSED[self.device] = SCRATCH_RETRY_LOADS
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def copy_to_host_async(
        self, host: Any, src: Any, src_offset: int, nbytes: int, stream: Any
    ) -> Any:
        return self._copy_on(stream, host[:nbytes], src[src_offset : src_offset + nbytes])

    def _copy_on(self, stream: Any, dst: Any, src: Any) -> Any:
        """``dst.copy_(src)`` queued on ``stream``; the event of its completion."""
        torch = self._torch
        with self._on(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def wait_for_producer(self, stream: Any) -> None:
        stream.wait_stream(self._torch.cuda.current_stream(self.device))

    def producer_event(self) -> Any:
        event = self._torch.cuda.Event()
        event.record(self._torch.cuda.current_stream(self.device))
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def wait(self, event: Any) -> None:
        event.synchronize()

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, streams: Iterable[Any]) -> None:
        for stream in streams:
            stream.synchronize()


def staging_workers(threads: int | None = None) -> int:
    """Worker threads for one staging run: the caller's ``threads`` (a handle opened with
    ``threads=``), else ``tuning``'s ``read_threads`` where set, else :data:`WORKERS`; at most
    :data:`MAX_WORKERS`. A caller capping its reader threads caps its device loads too."""
    count = threads or tuning.settings().read_threads or WORKERS
    return max(1, min(count, MAX_WORKERS))


def stage_to_device(
    read: Callable[[int, memoryview], None],
    offset: int,
    nbytes: int,
    ops: DeviceOps,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    workers: int | None = None,
    spare_buffers: int = SPARE_BUFFERS,
) -> tuple[Any, StagingStats]:
    """Copy ``nbytes`` starting at ``offset`` of a source into one new device buffer.

    Args:
        read: ``read(offset, view)`` fills ``view`` with the source's bytes at ``offset``
            (e.g. a byte source's ``readinto``); called from worker threads.
        offset: First byte to copy.
        nbytes: Bytes to copy.
        ops: The device runtime.
        chunk_bytes: Bytes per chunk (and per pinned buffer).
        workers: Threads reading and issuing copies, each on its own stream (default
            :func:`staging_workers`).
        spare_buffers: Pinned buffers in the ring beyond one per worker (buffers whose copy
            to the device is still in flight while their worker fills another).

    Returns:
        The device buffer and what the pipeline did.
    """
    buffers, stats = stage_items_to_device(
        read,
        [(offset, nbytes)],
        ops,
        chunk_bytes=chunk_bytes,
        workers=workers,
        spare_buffers=spare_buffers,
    )
    return buffers[0], stats


def stage_items_to_device(
    read: Callable[[int, memoryview], None],
    items: Sequence[tuple[int, int]],
    ops: DeviceOps,
    *,
    max_gap: int = 0,
    chunk_bytes: int = CHUNK_BYTES,
    workers: int | None = None,
    spare_buffers: int = SPARE_BUFFERS,
    buffers: Sequence[Any] | None = None,
) -> tuple[list[Any], StagingStats]:
    """Copy several ``(offset, nbytes)`` items of a source (tensors, or parts of tensors)
    into device buffers of their own, through one pipeline.

    Each item gets an allocation of its own, as the reference's one ``.to(device)`` per tensor
    gives it: a tensor kept alone keeps only its own bytes on the device, ``torch.save`` of it
    writes only them, and tensors free their memory one by one. The reads need not follow
    the items: items in file order at most ``max_gap`` bytes apart are read as one run (the
    bytes between read and dropped), so that a file of many small tensors is read in a few
    large chunks, and a chunk spanning several items reaches each through its own
    asynchronous copy (all of a chunk's copies in one call). Overlapping items are read apart.
    ``buffers``, if given, are the items' device buffers (1-D bytes of their sizes: a
    model's parameters, loaded in place) instead of new allocations; the copies into them
    wait for the work queued on the caller's stream, as for new ones. Other arguments as for
    :func:`stage_to_device`.

    Returns:
        The device buffer of each item, in the order given, and what the pipeline did.
    """
    targets = _Targets(ops, items, max_gap, buffers)
    runs = targets.runs
    nbytes = sum(length for _, length in runs)
    stats = StagingStats(bytes=nbytes)
    if nbytes == 0:
        return targets.buffers, stats
    # Ranges smaller than a chunk per worker are cut finer (down to MIN_CHUNK_BYTES), so that
    # all workers read.
    if workers is None:
        workers = staging_workers()
    per_worker = max(MIN_CHUNK_BYTES, -(-nbytes // max(1, workers)))
    chunk_bytes = max(1, min(chunk_bytes, nbytes, per_worker))
    with gc_paused():  # a few objects per chunk and per item
        chunks = run_pieces(runs, targets.run_starts, chunk_bytes)
        copies = targets.copies_of(chunks)
    workers = max(1, min(workers, len(chunks)))
    ring = _GrowingRing(ops, chunk_bytes, max(1, min(len(chunks), workers + max(0, spare_buffers))))
    lock = threading.Lock()
    local = threading.local()  # per call: each worker's stream waits for the producer once
    # The fresh device buffers may reuse memory that work queued on the caller's stream still
    # uses (the allocator hands a freed block straight back to its stream): the copies on
    # the workers' streams wait for that work. The event is taken here, on the caller's
    # thread, whose current stream it is.
    producer = ops.producer_event()
    used: list[Any] = []  # the streams this call copied on, to wait for at the end
    # Set once the call stops waiting for its workers: only a second interrupt returns before
    # they all have (run_parallel), and a worker's copies queued after the final synchronize
    # would write into device buffers the caller then frees (the allocator hands them to the
    # next allocation on the caller's stream while the copies still run). From then on no
    # worker queues a copy, and those being queued (counted in ``queuing``) are waited for
    # before that synchronize.
    abandoned = threading.Event()
    queuing = [0]
    queued = threading.Condition(lock)

    def one(number: int) -> None:
        src, _, n = chunks[number]
        taken = ring.take()
        if taken is None:
            return  # no buffer could be pinned: the worker that tried raises the error
        index, host, view, pending = taken
        event = pending
        stream = None
        try:
            if pending is not None:
                # The previous copy out of this buffer must finish before it is overwritten.
                ops.wait(pending)
                event = None
            read(src, view[:n])
            pieces = copies[number]
            if pieces:
                stream = getattr(local, "stream", None)
                if stream is None:
                    stream = local.stream = ops.new_stream()
                    ops.wait_event(stream, producer)
                    with lock:
                        used.append(stream)
                with lock:
                    go = not abandoned.is_set()
                    if go:
                        queuing[0] += 1
                if go:
                    try:
                        with gc_paused():  # a slice or two per piece: thousands for tiny tensors
                            event = ops.copy_async(host, pieces, stream)
                    finally:
                        with lock:
                            queuing[0] -= 1
                            queued.notify_all()
        except BaseException:
            if event is None and stream is not None:
                # copy_async failed after queuing some copies out of the buffer: they must
                # land before another worker refills it (an in-place load keeps what landed).
                with contextlib.suppress(Exception):
                    ops.synchronize([stream])
            ring.give((index, host, view, event))
            raise
        ring.give((index, host, view, event))
        with lock:
            stats.chunks += 1
            stats.reuse[index] = stats.reuse.get(index, 0) + 1

    try:
        run_parallel(one, range(len(chunks)), workers)
    finally:
        # Every copy must have landed before the pinned buffers can be freed or reused, and
        # before the tensors are used (also when a read failed half way).
        # A Ctrl-C held meanwhile (a third one, after the second stopped the waiting): raised
        # between the two, it would skip the synchronize the copies need.
        with interrupts_deferred():
            with lock:
                abandoned.set()  # no copy is queued after this
                while queuing[0]:
                    queued.wait()  # copies being queued, which the synchronize then waits for
            ops.synchronize(used)
        stats.host_buffers = ring.made
    return targets.buffers, stats


class _Targets:
    """The device buffers of a staging run's items, the runs read for them, and which bytes
    of a chunk go where.

    The runs are laid end to end in one "staging space" (where chunks say their bytes go);
    each item with bytes is a span of it, the spans sorted and disjoint.
    """

    def __init__(
        self,
        ops: DeviceOps,
        items: Sequence[tuple[int, int]],
        max_gap: int,
        buffers: Sequence[Any] | None = None,
    ) -> None:
        self.buffers: list[Any] = []
        self.runs: list[tuple[int, int]] = []  # (source offset, length)
        self.run_starts: list[int] = []  # each run's start in the staging space
        self._spans: list[tuple[int, int, Any]] = []  # (start, end, buffer), by start
        if buffers is not None and len(buffers) != len(items):
            raise ValueError(f"{len(buffers)} buffers for {len(items)} items")
        with gc_paused():  # a few objects per item, thousands of items in a mixture of experts
            if buffers is None:
                self.buffers = [ops.alloc_device(nbytes) for _, nbytes in items]
            else:
                self.buffers = list(buffers)
            self._lay_out(items, max_gap)

    def _lay_out(self, items: Sequence[tuple[int, int]], max_gap: int) -> None:
        run_end = -1  # source offset where the current run ends
        space = 0  # staging space used so far
        for i in sorted(range(len(items)), key=lambda i: items[i][0]):
            offset, nbytes = items[i]
            if nbytes <= 0:
                continue
            if self.runs and run_end <= offset <= run_end + max_gap:
                run_offset, _ = self.runs[-1]
                self.runs[-1] = (run_offset, offset + nbytes - run_offset)
                start = self.run_starts[-1] + offset - run_offset
            else:
                self.runs.append((offset, nbytes))
                self.run_starts.append(space)
                start = space
            run_end = offset + nbytes
            space = start + nbytes
            self._spans.append((start, start + nbytes, self.buffers[i]))

    def copies_of(self, chunks: Sequence[tuple[int, int, int]]) -> list[list[Piece]]:
        """The copies of each ``(source offset, staging offset, length)`` chunk, in staging
        order as :func:`run_pieces` makes them: to each item the chunk overlaps (none for
        bytes between items)."""
        spans = self._spans
        out: list[list[Piece]] = []
        i = 0
        for _, dest, nbytes in chunks:
            end = dest + nbytes
            while i < len(spans) and spans[i][1] <= dest:
                i += 1  # spans wholly before this chunk (chunks come in staging order)
            pieces: list[Piece] = []
            j = i
            while j < len(spans) and spans[j][0] < end:
                start, stop, buffer = spans[j]
                lo = max(start, dest)
                hi = min(stop, end)
                pieces.append((buffer, lo - start, lo - dest, hi - lo))
                j += 1
            out.append(pieces)
        return out


#: A ring entry: (index, host tensor, byte view, event of the copy last issued from it or None).
_Slot = tuple[int, Any, memoryview, Any]


class _GrowingRing:
    """The staging workers' pinned buffers, pinned as the workers need them, one at a time.

    Pinning is slow the first time a process asks for it: ``cudaHostAlloc`` took ~0.9 ms per
    MiB on an H200, so the 288 MiB ring of 16 workers took ~0.25 s (``benchmarks/GPU.md``,
    "First calls"), while torch's caching host allocator makes later rings nearly free. Pinned
    all up front, the ring held back every read of a process's first load for that long. Here
    a worker takes a free buffer whose copy has completed; else, while the ring may grow and
    no other worker is pinning, it pins one; else it takes the oldest free buffer (and waits
    for its copy), or waits for one to come back. The first chunk is read as soon as the
    first buffer exists, the others are pinned while chunks flow through those already made,
    a load that finishes early pins fewer, and one worker alone still reads its next chunk
    while the last crosses the bus (taking back the buffer it had just given made it wait for
    every copy: the ring never grew past one buffer). Where copies complete faster than
    chunks are read, no more is pinned than the workers use.

    Where pinning fails once some buffers exist (a limit on locked memory, say), the ring stops
    growing and the load goes on with those; where the first fails, its worker raises and the
    waiting workers give up (:meth:`take` returns None).
    """

    def __init__(self, ops: DeviceOps, nbytes: int, size: int) -> None:
        self._ops = ops
        self._nbytes = nbytes
        self._size = size  # 0 once the first pinning failed
        self._free: collections.deque[_Slot] = collections.deque()
        self._cond = threading.Condition()
        self._pinning = False
        self.made = 0

    def take(self) -> _Slot | None:
        """A buffer for the next chunk: a free one, a newly pinned one, or the next returned;
        None when none can be had."""
        with self._cond:
            while True:
                free = self._free
                for i, slot in enumerate(free):
                    if slot[3] is None or self._ops.done(slot[3]):
                        del free[i]
                        return slot
                if not self._pinning and self.made < self._size:
                    self._pinning = True
                    break
                if free:
                    return free.popleft()
                if self._size == 0:
                    return None
                self._cond.wait()
        try:
            host, view = self._ops.alloc_host(self._nbytes)
        except BaseException as exc:
            with self._cond:
                self._pinning = False
                self._size = self.made  # stop growing; go on with the buffers there are
                self._cond.notify_all()
                if self.made == 0 or not isinstance(exc, Exception):
                    raise
            return self.take()
        with self._cond:
            self._pinning = False
            index = self.made
            self.made += 1
            # A waiting worker may now pin the next buffer.
            self._cond.notify_all()
        return index, host, view, None

    def give(self, slot: _Slot) -> None:
        """Return a buffer (with the event of the copy last issued from it)."""
        with self._cond:
            self._free.append(slot)
            self._cond.notify()


#: ``fill(first, end, view)``: writes rows ``[first, end)`` of a part into ``view``.
Fill = Callable[[int, int, memoryview], None]


def gather_to_device(
    parts: list[tuple[Fill, int, int]],
    ops: DeviceOps,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    ring: int = GATHER_RING,
) -> tuple[list[Any], StagingStats]:
    """Copy parts assembled on the host, block of rows by block, into new device buffers, one
    per part.

    For selections that are not one byte run (a column split reads a piece of every row). Each
    part is ``(fill, rows, row_bytes)``: ``fill(first, end, view)`` writes the part's rows
    ``first`` to ``end`` (their bytes, row after row) into ``view``, one of a ring of pinned
    buffers, on the calling thread (the gather itself runs on several cores: torch's copy out
    of a mapping, or the reader threads' positioned reads). The block's asynchronous copy to
    the device then runs while the next block is gathered, and the parts of one call (a
    tensor-parallel rank's column splits) share the ring and one final synchronisation. The
    pinned memory stays at ``ring`` buffers of about ``chunk_bytes`` (or of one row, where a
    row is larger; the reader stages no row over 64 MiB) whatever the parts' size,
    where a plain ``.to(device)`` needs the whole part in pageable memory first and then makes
    one blocking, driver-staged transfer (on an H200 a TP=8 column split of a 2 GiB file took
    ~85 ms that way).

    Args:
        parts: ``(fill, rows, row_bytes)`` of each part.
        ops: The device runtime.
        chunk_bytes: Bytes per block (at least one row).
        ring: Pinned buffers.

    Returns:
        The device buffer of each part, and what the pipeline did.
    """
    stats = StagingStats(bytes=sum(rows * row_bytes for _, rows, row_bytes in parts))
    device_bufs = [ops.alloc_device(rows * row_bytes) for _, rows, row_bytes in parts]
    # (part, first row, end row) of every block, part by part.
    blocks: list[tuple[int, int, int]] = []
    block_bytes = 0
    for number, (_, rows, row_bytes) in enumerate(parts):
        if rows * row_bytes == 0:
            continue
        per_block = max(1, min(rows, chunk_bytes // max(1, row_bytes)))
        block_bytes = max(block_bytes, per_block * row_bytes)
        blocks += [(number, j, min(rows, j + per_block)) for j in range(0, rows, per_block)]
    if not blocks:
        return device_bufs, stats
    buffers: list[list[Any]] = []  # [host tensor, byte view, event of its last copy or None]
    stream = ops.new_stream()
    # The fresh device buffers may reuse memory that work queued on the current stream still
    # uses: the copies on the side stream wait for that work.
    ops.wait_for_producer(stream)
    try:
        for number, (part, first, end) in enumerate(blocks):
            fill, _, row_bytes = parts[part]
            slot = number % max(1, ring)
            if slot == len(buffers):
                buffers.append([*ops.alloc_host(block_bytes), None])
            host, view, pending = buffers[slot]
            if pending is not None:
                # The copy out of this buffer must finish before it is refilled.
                ops.wait(pending)
            n = (end - first) * row_bytes
            fill(first, end, view[:n])
            piece = (device_bufs[part], first * row_bytes, 0, n)
            buffers[slot][2] = ops.copy_async(host, [piece], stream)
            stats.chunks += 1
            stats.reuse[slot] = stats.reuse.get(slot, 0) + 1
    finally:
        # Every copy must have landed before the buffers are freed and the parts are used
        # (also when a fill failed half way).
        ops.synchronize([stream])
    stats.host_buffers = len(buffers)
    return device_bufs, stats


def chunks_from_device(
    src: Any,
    nbytes: int,
    ops: DeviceOps,
    *,
    piece_bytes: int = PIECE_BYTES,
    ring: int = SAVE_RING,
) -> Iterator[memoryview]:
    """Yield the bytes of a device buffer in pieces, copied through a ring of pinned buffers.

    The copies of the next pieces run while the consumer writes the current one. A piece's
    buffer is refilled once the consumer asks for the piece after it, so a consumer must be
    done with each piece by then, except with a tensor's last (see ``TensorData.chunks``).

    Args:
        src: A 1-D uint8 device buffer (the tensor's bytes).
        nbytes: Bytes to yield (``src``'s length).
        ops: The device runtime.
        piece_bytes: Bytes per piece (and per pinned buffer).
        ring: Pinned buffers.

    Yields:
        Byte views of pinned host memory, in order.
    """
    if nbytes <= 0:
        return
    piece = max(1, min(piece_bytes, nbytes))
    starts = range(0, nbytes, piece)
    stream = ops.new_stream()
    ops.wait_for_producer(stream)
    buffers = [ops.alloc_host(piece) for _ in range(max(1, min(ring, len(starts))))]
    events: list[Any] = [None] * len(buffers)

    def issue(i: int) -> None:
        k = i % len(buffers)
        start = starts[i]
        events[k] = ops.copy_to_host_async(
            buffers[k][0], src, start, min(piece, nbytes - start), stream
        )

    try:
        for i in range(len(buffers)):
            issue(i)
        for i, start in enumerate(starts):
            k = i % len(buffers)
            ops.wait(events[k])
            yield buffers[k][1][: min(piece, nbytes - start)]
            if i + len(buffers) < len(starts):
                issue(i + len(buffers))
    finally:
        # A consumer that stopped early (a failed write) leaves copies in flight into buffers
        # about to be freed: let them land first (only these: other streams' work, a training
        # step say, is not waited for).
        for event in events:
            if event is not None:
                ops.wait(event)
