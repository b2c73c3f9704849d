"""Chunks of tensor values worked on by threads, each in cache-sized scratch memory.

The commands that compute over every value (``stats``, ``diff``) read a tensor a chunk of
:data:`CHUNK_ELEMENTS` elements at a time and decode each into float64 scratch buffers that
each thread reuses: small enough to stay in the processor's cache across the several passes a
chunk needs, and no fresh memory for the kernel to fault in and zero per chunk. Measured on a
2-core EPYC for float16 values: 2.7 ns an element in chunks of 256 Ki elements, 7.8 ns in
chunks of 4 Mi (the size ``stats`` used before, each in fresh memory besides).

:class:`ChunkWorkers` runs a function of each chunk on worker threads (numpy's loops release
the GIL) while the caller reads the next chunks (one reader at a time, as the remote planned
reads need), and hands the results back in the chunks' order, so that what is merged from
them (or written: ``cast`` converts its chunks there too) does not depend on which thread
finished first.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Final, TypeVar

import numpy as np

from .._adapter import chunk_values, numpy_dtype, unpack_subbyte, widened_bf16
from .._dtypes import DType
from .._ordered_opens import submit_or_run
from ._common import TensorRef

__all__ = [
    "CHUNK_ELEMENTS",
    "ChunkWorkers",
    "as_float64",
    "chunk_bytes",
    "element_chunks",
    "take_float64",
    "take_masks",
]

#: Elements worked on at a time (their float64 copy: 2 MiB).
CHUNK_ELEMENTS: Final = 256 << 10

T = TypeVar("T")
R = TypeVar("R")


def chunk_bytes(dtype: DType) -> int:
    """Bytes of :data:`CHUNK_ELEMENTS` elements of ``dtype`` (a multiple of four elements:
    whole bytes of F4 and F6)."""
    return CHUNK_ELEMENTS * dtype.bits // 8


def element_chunks(ref: TensorRef) -> Iterator[np.ndarray]:
    """``ref``'s bytes in chunks of :data:`CHUNK_ELEMENTS` elements (fresh arrays: chunks are
    handed to workers), so that chunks of two tensors of different dtypes hold the same
    elements."""
    return ref.chunks(chunk_bytes(ref.dtype))


class _Scratch(threading.local):
    """Each thread's reusable buffers: three float64 slots (two tensors' chunks side by side,
    and one for what is computed from them), a uint32 one for widening BF16, two masks.

    Only chunks of up to :data:`CHUNK_ELEMENTS` are kept: larger ones (a histogram's second
    pass reads up to 4 Mi elements a chunk) get fresh memory, freed with the chunk, so that no
    thread keeps tens of MiB once the command has returned."""

    def __init__(self) -> None:
        self.release()

    def release(self) -> None:
        """Drop the buffers (the calling thread's, once its command is done)."""
        self.float64 = [np.empty(0, np.float64) for _ in range(3)]
        self.uint32 = np.empty(0, np.uint32)
        self.masks = np.empty((2, 0), np.bool_)

    def take(self, n: int, slot: int) -> np.ndarray:
        """Room for ``n`` float64 values in ``slot``."""
        if n > CHUNK_ELEMENTS:
            return np.empty(n, np.float64)
        if self.float64[slot].size < n:
            self.float64[slot] = np.empty(CHUNK_ELEMENTS, np.float64)
        return self.float64[slot][:n]

    def take_uint32(self, n: int) -> np.ndarray:
        """Room for ``n`` uint32 values."""
        if n > CHUNK_ELEMENTS:
            return np.empty(n, np.uint32)
        if self.uint32.size < n:
            self.uint32 = np.empty(CHUNK_ELEMENTS, np.uint32)
        return self.uint32[:n]

    def take_masks(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Two masks of ``n`` elements."""
        if n > CHUNK_ELEMENTS:
            fresh = np.empty((2, n), np.bool_)
            return fresh[0], fresh[1]
        if self.masks.shape[1] < n:
            self.masks = np.empty((2, CHUNK_ELEMENTS), np.bool_)
        return self.masks[0, :n], self.masks[1, :n]


_scratch = _Scratch()


def take_float64(n: int, slot: int) -> np.ndarray:
    """This thread's scratch ``slot`` (0-2) as ``n`` float64 values (valid until it asks for
    that slot again)."""
    return _scratch.take(n, slot)


def take_masks(n: int) -> tuple[np.ndarray, np.ndarray]:
    """This thread's two scratch masks of ``n`` elements (valid until it asks again)."""
    return _scratch.take_masks(n)


def as_float64(
    dtype: DType, raw: np.ndarray, slot: int = 0
) -> tuple[np.ndarray, np.ndarray | None]:
    """A chunk's values as float64 in this thread's scratch ``slot`` (0-2; valid until this
    thread asks for that slot again; the caller may overwrite them), and its integers for an
    integer dtype (exact extremes), else None.

    Complex values become their magnitude, computed in double precision (``abs`` of a
    complex64 is a float32: a finite 3e38+3e38j became Inf). BF16 is widened by its bits
    (the upper half of a float32, exactly), without ml_dtypes: importing ml_dtypes 0.7 takes
    over a second, most of a small file's ``stats``.
    """
    if dtype.code == "BF16":
        out = _scratch.take(raw.size // 2, slot)
        np.copyto(out, widened_bf16(raw, _scratch.take_uint32(raw.size // 2)))
        return out, None
    if dtype.is_float and dtype.bits <= 8:
        # FP8, F4, F6: one code a byte (sub-byte ones unpacked), looked up in a table of
        # their values: 1.3 ns an element, against 7.4 ns for ml_dtypes' conversion.
        codes = unpack_subbyte(raw, dtype, raw.size * 8 // dtype.bits) if dtype.bits < 8 else raw
        out = _scratch.take(codes.size, slot)
        np.take(_code_values(dtype), codes, out=out, mode="clip")
        return out, None
    values = chunk_values(dtype, raw)
    if values.dtype.kind == "c":
        return np.abs(values.astype(np.complex128)), None
    out = _scratch.take(values.size, slot)
    np.copyto(out, values, casting="unsafe")
    return out, values if values.dtype.kind in "iu" else None


_CODE_VALUES: dict[str, np.ndarray] = {}


def _code_values(dtype: DType) -> np.ndarray:
    """The float64 value of each code (0-255) of a float dtype of at most 8 bits."""
    table = _CODE_VALUES.get(dtype.code)
    if table is None:
        codes = np.arange(1 << dtype.bits, dtype=np.uint8)
        with np.errstate(invalid="ignore", over="ignore"):
            table = codes.view(numpy_dtype(dtype)).astype(np.float64)
        _CODE_VALUES[dtype.code] = table
    return table


def _usable_cores() -> int:
    """Cores this process may run on (its affinity, where the platform tells it)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        return len(getaffinity(0))
    return os.cpu_count() or 1


class ChunkWorkers:
    """Worker threads for chunk functions, whose results come back in order.

    numpy's reductions and conversions release the GIL, so chunks are summarised in parallel
    while the caller reads the next ones. With one core, or one chunk, the caller runs the
    function itself. A context manager: leaving it waits for the workers (a chunk or two).
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, min(4, _usable_cores()) if threads is None else threads)
        self._pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> ChunkWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        # Chunks worked on in the calling thread (one-chunk tensors) left its scratch: the
        # command is done with it (the workers' went with their threads).
        _scratch.release()

    def ordered(
        self, fn: Callable[[T], R], items: Iterable[T], *, alone: bool = False
    ) -> Iterator[tuple[T, R]]:
        """Each item with ``fn`` of it, in the items' order; ``items`` is advanced on the
        calling thread (it may read), at most two chunks per worker ahead of the results
        taken. ``alone``: run on the calling thread (one chunk: a hand-off would cost more)."""
        if alone or self.threads == 1:
            for item in items:
                yield item, fn(item)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="pysafetensors-chunks")
        pending: deque[tuple[T, Future[R]]] = deque()
        try:
            for item in items:
                # On this thread once the interpreter is shutting down (a command still
                # working after the main thread returned: pools then take no more work).
                submit_or_run(self._pool, fn, item, pending)
                if len(pending) >= 2 * self.threads:
                    done, future = pending.popleft()
                    yield done, future.result()
            while pending:
                done, future = pending.popleft()
                yield done, future.result()
        finally:
            # An error (a read, a chunk) or a consumer that stopped: the chunks in flight are
            # not wanted; those not started are cancelled, the others finish on their own.
            for _, future in pending:
                future.cancel()
