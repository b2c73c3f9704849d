"""Slices read as the row blocks that cover them, then gathered in memory.

A fragmented selection (a column split: thousands of runs of a few KiB) is read as a few large
reads of its covering rows and copied into place, instead of one read per run; small tensors'
selections are cut out of the tensors read whole. Used by ``safe_open``'s slice reads and by
``parallel.load_shard``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Final, TypeAlias

import numpy as np

from ._format import TensorInfo, gc_paused
from ._fresh_memory import empty_bytes
from ._reader_pool import run_parallel, worker_count
from ._representable import MAX_NDIM, check_representable
from ._slicing import Part, SlicePlan, contiguous_strides, part_run
from ._sources import ByteSource, PreadSource

__all__ = [
    "Batched",
    "GatherBlock",
    "Selected",
    "byte_selection",
    "copy_in_parallel",
    "fetch_gathered",
    "gather_blocks",
    "gather_slice",
    "part_selection",
]

#: Scratch bytes :meth:`safe_open._gather_small` reads at a time.
SMALL_BATCH: Final = 64 << 20
#: Slices whose byte runs average less than this are read as whole row blocks and gathered in
#: memory: one large read beats thousands of tiny ones (a 1/8 column split of a 4096-wide bf16
#: matrix is 4096 runs of 1 KiB per tensor).
_GATHER_RUN_BYTES: Final = 256 << 10
#: ... unless the selection is so sparse that reading the covering rows would waste too much
#: (less than this fraction of their bytes selected) ...
_GATHER_MIN_DENSITY: Final = 1 / 64
#: ... and its runs so far apart (more than this many bytes from one to the next, on average)
#: that a read per run costs less than reading through. Closer than this, a read per run is a
#: system call, and on a cold file a page read, for every few KiB: ``[:, :, 0]`` of a 64 MiB
#: F32 cube (4 bytes every KiB, every page needed) took 65,538 reads, 1.7 s cold against the
#: reference's 60 ms by reading the whole tensor.
_GATHER_MAX_SPACING: Final = 16 << 10
#: Rows are read and gathered in blocks of about this size, each by one worker thread.
_GATHER_BLOCK: Final = 8 << 20

#: A part that is one byte run, for ``_read_slices``: ``(name, info, shape of the part, offset
#: of its run in the tensor, its bytes, the index asked for)``.
Batched: TypeAlias = tuple[str, TensorInfo, tuple[int, ...], int, int, Any]

#: A fragmented selection of a small tensor for ``_gather_small``: ``(name, info, shape of the
#: selection, its bytes)`` and its :func:`byte_selection` ``(source shape, index, destination
#: shape)``.
Selected: TypeAlias = tuple[
    str,
    TensorInfo,
    tuple[int, ...],
    int,
    tuple[int, ...],
    tuple[int | slice, ...],
    tuple[int, ...],
]


def copy_selections(
    parts: Sequence[Selected],
    scratch: np.ndarray,
    starts: Sequence[int],
    dest: np.ndarray,
    offsets: Sequence[int],
) -> None:
    """Copy each part's selection out of its tensor's bytes at ``scratch[starts[i]:]`` into
    ``dest[offsets[i]:]`` (``_gather_small``).

    Consecutive parts of one selection (same shapes and index) whose tensors and
    destinations lie at constant strides are copied as one: a strided view of all the
    tensors, one numpy copy. A mixture of experts' column split is thousands of such parts,
    and one copy each cost ~2 us.
    """
    count = len(parts)
    i = 0
    while i < count:
        part = parts[i]
        nbytes, src_shape, index, dest_shape = part[3:]
        start, at = starts[i], offsets[i]
        j = i + 1
        if j < count:
            step, dest_step = starts[j] - start, offsets[j] - at
            while (
                j < count
                and parts[j][3:] == part[3:]
                and starts[j] - starts[j - 1] == step
                and offsets[j] - offsets[j - 1] == dest_step
            ):
                j += 1
        if j - i == 1:
            whole = scratch[start : start + part[1].nbytes].reshape(src_shape)
            np.copyto(dest[at : at + nbytes].reshape(dest_shape), whole[index])
        else:
            every: tuple[int | slice, ...] = (slice(None), *index)  # each tensor's selection
            np.copyto(
                _stacked(dest, at, j - i, dest_step, dest_shape),
                _stacked(scratch, start, j - i, step, src_shape)[every],
            )
        i = j


def _stacked(
    buf: np.ndarray, offset: int, count: int, step: int, shape: tuple[int, ...]
) -> np.ndarray:
    """``count`` C-contiguous uint8 arrays of ``shape`` in ``buf``, the first at ``offset``
    and each ``step`` bytes after the one before, as one array of shape ``(count, *shape)``."""
    stacked: np.ndarray = np.ndarray(
        (count, *shape),
        np.uint8,
        buffer=buf,
        offset=offset,
        strides=(step, *contiguous_strides(shape)),
    )
    return stacked


#: How :meth:`._reader.safe_open._read_requests` reads one part: its byte run
#: (:func:`part_run`), else its selection to gather (:func:`part_selection`), else neither
#: (the general path).
PartRead: TypeAlias = tuple[
    tuple[tuple[int, ...], int, int] | None,
    tuple[tuple[int, ...], int, tuple[int, ...], tuple[int | slice, ...], tuple[int, ...]] | None,
]


def part_read(
    info: TensorInfo, part: Part, batching: bool, gathers_small: bool, framework: str = "np"
) -> PartRead:
    """:data:`PartRead` for ``part`` of a tensor like ``info`` (its shape and dtype decide,
    so the answer holds for every tensor of that shape and dtype), whose shape ``framework``
    must hold.

    Raises:
        TensorInfoError: The part's shape cannot be held (``check_representable``), named
            after ``info``'s tensor.
    """
    shape, dtype = info.shape, info.dtype
    if len(shape) <= MAX_NDIM:
        run = part_run(shape, dtype, part) if batching else None
        if run is not None:
            check_representable(run[0], dtype, info.name, framework=framework)
            return run, None
    selected = part_selection(shape, dtype.bits // 8, part) if gathers_small else None
    if selected is not None:
        check_representable(selected[0], dtype, info.name, framework=framework)
    return None, selected


def part_selection(
    shape: tuple[int, ...], itemsize: int, part: Part
) -> tuple[tuple[int, ...], int, tuple[int, ...], tuple[int | slice, ...], tuple[int, ...]] | None:
    """A tensor-parallel part (of a whole-byte tensor) as ``(shape of the part, its bytes)`` and
    :func:`byte_selection`'s ``(source shape, index, destination shape)``, without a plan (a
    mixture of experts' column split plans thousands); None when it selects nothing or does
    not fit the shape (the general path words that)."""
    dim, start, stop = part
    ndim = len(shape)
    if dim is None or not 0 <= dim < ndim or not 0 <= start < stop <= shape[dim] or 0 in shape:
        return None
    size = stop - start
    part_shape = (*shape[:dim], size, *shape[dim + 1 :])
    nbytes = itemsize
    for extent in part_shape:
        nbytes *= extent
    last = ndim - 1
    index: tuple[int | slice, ...] = (
        *(slice(start, stop) if d == dim else slice(None) for d in range(last)),
        slice(start * itemsize, stop * itemsize) if dim == last else slice(None),
    )
    src_shape = (*shape[:-1], shape[-1] * itemsize)
    dest_shape = (*part_shape[:-1], part_shape[-1] * itemsize)
    return part_shape, nbytes, src_shape, index, dest_shape


def byte_selection(
    shape: tuple[int, ...], itemsize: int, plan: SlicePlan
) -> tuple[tuple[int, ...], tuple[int | slice, ...], tuple[int, ...]]:
    """Express a slice over the tensor's bytes: ``(source shape, index, destination shape)``.

    The last dimension is folded into bytes, so that numpy copies each contiguous run as one
    inner loop instead of ``itemsize`` bytes at a time (a 1/8 column split of a bf16 matrix
    copies 1 KiB runs, not 2-byte elements).
    """
    *lead, last = plan.selection
    if isinstance(last, int):
        index_last = slice(last * itemsize, (last + 1) * itemsize)
        dest = (*plan.shape, itemsize)
    elif last.step == 1:
        index_last = slice(last.start * itemsize, last.stop * itemsize)
        dest = (*plan.shape[:-1], plan.shape[-1] * itemsize)
    else:
        return (*shape, itemsize), (*plan.selection, slice(None)), (*plan.shape, itemsize)
    return (*shape[:-1], shape[-1] * itemsize), (*lead, index_last), dest


def gather_slice(
    source: ByteSource,
    base: int,
    info: TensorInfo,
    plan: SlicePlan,
    out: np.ndarray,
) -> bool:
    """Read a fragmented slice as blocks of whole rows and gather the selection from each.

    Local files read the blocks on the reader threads; remote sources (HTTP, S3, fsspec) in
    one plan of coalesced, parallel requests (:func:`fetch_gathered`). For those, a request
    per run meant a Python object per run: ``[:, ::2]`` of a 4 MiB tensor over HTTP took
    1.45 s and ~150 MB for a 2 MiB result (their ranges were merged into the covering rows
    anyway, closer than ``max_gap``).

    Other sources (file objects, which have one position) read the blocks one after
    another on the calling thread: a read per run took ``[:, ::2]`` of a 4 MiB tensor in an
    ``io.BytesIO`` 0.94 s.

    Returns False (reading nothing) when per-run reads are the better plan (see
    :func:`gather_blocks`).
    """
    blocks = gather_blocks(base, info, plan, out)
    if blocks is None:
        return False
    if hasattr(source, "readinto_many"):  # a RemoteSource, without importing it here
        fetch_gathered(source, blocks)
        return True
    # Each thread's scratch holds the largest block (not always _GATHER_BLOCK: allocating
    # and freeing 8 MiB cost a one-block slice more than its read).
    size = max(block[1] for block in blocks)
    local = threading.local()
    read = source.pread_exact if isinstance(source, PreadSource) else source.readinto

    def one(block: GatherBlock) -> None:
        at, want, src_shape, index, target = block
        scratch = getattr(local, "buf", None)
        if scratch is None:
            scratch = local.buf = np.empty(size, np.uint8)
        read(at, scratch.data[:want])
        target[...] = scratch[:want].reshape(src_shape)[index]

    if isinstance(source, PreadSource):
        run_parallel(one, blocks, worker_count(source))
    else:
        for block in blocks:
            one(block)
    return True


#: A block of a gathered selection: ``(file offset, bytes read there, the shape they are read
#: as, the selection within that, where the selected elements go)``.
GatherBlock: TypeAlias = tuple[int, int, tuple[int, ...], tuple[Any, ...], np.ndarray]


def gather_blocks(
    base: int, info: TensorInfo, plan: SlicePlan, out: np.ndarray
) -> list[GatherBlock] | None:
    """The blocks of whole rows (of at most about :data:`_GATHER_BLOCK` bytes) that a
    fragmented selection of the tensor at file offset ``base`` lies in, each with what it
    gives to ``out`` (``plan.nbytes`` bytes, uint8).

    None when per-run reads are the better plan: few or large runs, a very sparse selection,
    a sub-byte tensor whose rows are not whole bytes (the others come here as bytes, see
    :func:`._slicing.as_whole_bytes`), rows too large to buffer that cannot be split.
    """
    shape = info.shape
    if info.dtype.bits % 8 or not shape:
        return None
    # Counted without listing the runs (a strided slice has millions).
    runs = plan.run_count()
    if runs < 2 or plan.nbytes // runs >= _GATHER_RUN_BYTES:
        return None
    first, last = int(plan.starts[0]), int(plan.starts[-1]) + plan.run_bytes
    span = last - first
    if plan.nbytes < span * _GATHER_MIN_DENSITY and span > runs * _GATHER_MAX_SPACING:
        return None
    itemsize = info.dtype.bits // 8
    src_shape: tuple[int, ...]
    dest_shape: tuple[int, ...]
    index: tuple[int | slice, ...]
    if len(shape) == 1:
        # A vector's elements as rows of one element: a stepped slice of one (``[::3]``) was
        # a read per element, 15 s for a 64 MiB vector by pread against 0.15 s.
        src_shape, index = (shape[0], itemsize), (plan.selection[0], slice(None))
        dest_shape, shape = (plan.shape[0], itemsize), (shape[0], 1)
    else:
        src_shape, index, dest_shape = byte_selection(shape, itemsize, plan)
    row_bytes = info.nbytes // shape[0]
    sel0, rest = index[0], index[1:]
    inner = src_shape[1:]
    dest = out.reshape(dest_shape)
    if isinstance(sel0, int) and row_bytes <= _GATHER_BLOCK:
        # One row: read it whole and pick the selection out of it.
        return [(base + sel0 * row_bytes, row_bytes, inner, rest, dest)]
    if isinstance(sel0, int):  # one row too large to buffer: as one of several below
        start, step, dest = sel0, 1, dest[np.newaxis]
    else:
        start, _, step = sel0.indices(shape[0])
    blocks: list[GatherBlock] = []
    if row_bytes <= _GATHER_BLOCK:
        per_block = max(1, _GATHER_BLOCK // max(1, row_bytes * step))
        for j0 in range(0, plan.shape[0], per_block):
            j1 = min(plan.shape[0], j0 + per_block)
            at = base + (start + j0 * step) * row_bytes
            nrows = (j1 - j0 - 1) * step + 1
            blocks.append(
                (
                    at,
                    nrows * row_bytes,
                    (nrows, *inner),
                    (slice(None, None, step), *rest),
                    dest[j0:j1],
                )
            )
        return blocks
    # Rows too large to buffer (a fused-experts weight split along its last dimension: each
    # reader thread held a 112 MiB row for a 14 MiB share of it): each selected row is
    # gathered in blocks of its second dimension, or the runs are read one by one.
    sel1 = rest[0] if rest else None
    if not isinstance(sel1, slice) or len(inner) < 2:
        return None
    sub_bytes = row_bytes // inner[0]
    if sub_bytes > _GATHER_BLOCK:
        return None
    start1, stop1, step1 = sel1.indices(inner[0])
    count1 = len(range(start1, stop1, step1))
    per_block = max(1, _GATHER_BLOCK // max(1, sub_bytes * step1))
    for j in range(len(dest)):
        row_at = base + (start + j * step) * row_bytes
        for k0 in range(0, count1, per_block):
            k1 = min(count1, k0 + per_block)
            at = row_at + (start1 + k0 * step1) * sub_bytes
            nsub = (k1 - k0 - 1) * step1 + 1
            blocks.append(
                (
                    at,
                    nsub * sub_bytes,
                    (nsub, *inner[1:]),
                    (slice(None, None, step1), *rest[1:]),
                    dest[j, k0:k1],
                )
            )
    return blocks


def fetch_gathered(
    source: ByteSource,
    blocks: list[GatherBlock],
    pieces: list[tuple[int, int, memoryview, int]] | None = None,
    *,
    max_gap: int | None = None,
) -> None:
    """Fetch gather ``blocks`` and plain ``pieces`` (``(file offset, length, buffer, position
    in it)``) from a remote source in one plan of coalesced, parallel requests
    (``readinto_scattered``), and gather each block's selection to its place.

    Taken in file order, in batches of at most :data:`SMALL_BATCH` bytes of blocks (their
    scratch buffer, reused): a batch's requests span only its own pieces' offsets, so no byte
    is fetched twice, and each batch's requests run in parallel. Fetched apart, a request
    merged across a gap of one group fetched again the bytes another group's requests
    fetched (a 6 MB file's column split fetched 10.3 MB), and a large tensor's column split
    came one 8 MiB request after another.
    """
    readinto_scattered = source.readinto_scattered  # type: ignore[attr-defined]
    with gc_paused():  # a few objects per piece
        # (file offset, position in blocks, or -1 - position in pieces), in file order.
        order = sorted(
            [(block[0], k) for k, block in enumerate(blocks)]
            + [(piece[0], -1 - k) for k, piece in enumerate(pieces or ())]
        )
        largest = max((block[1] for block in blocks), default=0)
        total = sum(block[1] for block in blocks)
    # Blocks back to back in one scratch buffer, so that touching ones are received in place.
    scratch = empty_bytes(min(total, max(SMALL_BATCH, largest)))
    scratch_view = scratch.data
    # Each batch: its pieces for readinto_scattered, and its blocks in scratch order.
    batches: list[tuple[list[tuple[int, int, memoryview, int]], list[GatherBlock]]] = [([], [])]
    at = 0
    with gc_paused():
        for offset, k in order:
            batch_pieces, batch_blocks = batches[-1]
            if k < 0:
                batch_pieces.append(pieces[-1 - k])  # type: ignore[index]
                continue
            block = blocks[k]
            if at + block[1] > scratch.nbytes:
                batch_pieces, batch_blocks, at = [], [], 0
                batches.append((batch_pieces, batch_blocks))
            batch_pieces.append((offset, block[1], scratch_view, at))
            batch_blocks.append(block)
            at += block[1]
    for batch_pieces, batch_blocks in batches:
        readinto_scattered(batch_pieces, max_gap=max_gap)
        with gc_paused():
            at = 0
            for _, want, src_shape, index, target in batch_blocks:
                target[...] = scratch[at : at + want].reshape(src_shape)[index]
                at += want


#: Rows of a fragmented selection larger than this go to a device by one plain copy: staging
#: them through pinned buffers would pin a few of them at once.
STAGED_ROW_MAX: Final = 64 << 20

#: Copies out of a mapping smaller than this stay on the calling thread.
_PARALLEL_COPY_MIN: Final = 4 << 20


def copy_in_parallel(dest: np.ndarray, src: np.ndarray, source: ByteSource) -> None:
    """``dest[...] = src``, split along the first axis across the reader threads.

    A fresh destination costs a page fault per 4 KiB page, and faults (like the copy) run on
    one core per thread: with both cores a row or column split copied out of a mapping takes
    about half the time (the reference's torch ``clone`` copies with all cores too). numpy
    releases the GIL for these copies.
    """
    rows = dest.shape[0] if dest.ndim else 0
    threads = worker_count(source)
    if dest.nbytes < _PARALLEL_COPY_MIN or rows < 2 or threads < 2:
        dest[...] = src
        return
    pieces = min(rows, threads, dest.nbytes // (_PARALLEL_COPY_MIN // 2))
    step = -(-rows // pieces)

    def one(start: int) -> None:
        dest[start : start + step] = src[start : start + step]

    run_parallel(one, range(0, rows, step), threads)
