"""Tensors of one shared load buffer that give their memory back when they are dropped.

A load by positioned reads fills one fresh buffer for all tensors (one allocation, read by
every reader thread at once) and hands out views of it. Views alone would keep the whole
buffer while any one tensor lives: ``del sd["lm_head.weight"]`` freed nothing, and keeping
the few tensors of a large file that one needs kept all of it (the reference copies each
tensor into memory of its own). So each large tensor views the buffer through an object of
its own, and when that object goes (with the last array or tensor made from it) the whole
pages of its bytes are handed back to the kernel (``MADV_DONTNEED``): the buffer stays
mapped, and those pages, which no other tensor shares, take no memory any more. Small tensors
(norms, biases, a LoRA file's adapters) are grouped into blocks of about a mebibyte, each
viewed through an object of its own the same way: a block's pages go back once all of its
tensors are gone, so keeping one small tensor keeps its block, not every small tensor's bytes.
A buffer under :data:`RELEASE_BUFFER_MIN` is left whole: malloc reuses its warm pages.
"""

from __future__ import annotations

import mmap
import operator
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Final

import numpy as np

from ._dtypes import DType
from ._format import gc_paused
from ._interrupts import redeliver_interrupt
from ._syscalls import madvise

__all__ = ["RELEASE_BUFFER_MIN", "RELEASE_MIN", "can_release", "releasing_view", "tensors_over"]

#: Tensors at least this large get views of their own; smaller ones (norms, biases) share one
#: per block of about this many bytes, as the object and the finalizer of each (~7 us) would
#: cost more than they free (a page or two).
RELEASE_MIN: Final = 1 << 20

#: Buffers smaller than this keep all their pages until the last tensor goes. Larger ones are
#: mapped by ``malloc`` (glibc's mmap threshold grows to at most 32 MiB) and unmapped when freed,
#: so their pages are faulted in afresh by the next load anyway, and handing some back early
#: costs nothing more. A smaller buffer goes back to malloc's heap, whose warm pages the next
#: load reuses: handing those back made a loop loading an 8 MiB LoRA file take 24 ms a load
#: instead of 8.
RELEASE_BUFFER_MIN: Final = 32 << 20

_MADV_DONTNEED: Final = getattr(mmap, "MADV_DONTNEED", 4)


def can_release() -> bool:
    """Whether pages can be handed back here (libc's ``madvise``: Linux and other POSIX)."""
    return madvise is not None


def releasing_view(buf: np.ndarray, begin: int, end: int) -> np.ndarray:
    """``buf[begin:end]`` (``buf``: fresh, writable, 1-D uint8 memory of the load, viewed by
    nothing else there) as a uint8 array whose whole pages go back to the kernel once it, and
    every array or tensor made from it, is gone.

    The result is an array of its own over a memoryview of those bytes, watched with a weak
    reference. numpy sets a view's base to the first array up the chain that owns its data or
    whose base is not an array: for every view of the result (and their views), that is the
    result itself, whose base is the memoryview. So it lives as long as any of them, or
    torch's storage of one. (``buf[begin:end]``, whose base is ``buf``, would be skipped for
    ``buf``; a ``pickle.PickleBuffer`` is forgotten by the memoryview numpy takes of it; a
    ``ctypes`` array makes a type per size, ~22 us each, kept for good.)
    """
    view: np.ndarray = np.frombuffer(buf.data[begin:end], np.uint8)
    address = int(view.ctypes.data)
    page = mmap.PAGESIZE
    first = -(-address // page) * page  # pages shared with a neighbour's bytes are kept
    last = (address + end - begin) // page * page
    if last > first:
        done = weakref.finalize(view, _release, buf, first, last - first)
        # At exit the memory goes anyway, while tensors may still be read by exit handlers.
        done.atexit = False
    return view


def _release(buf: np.ndarray, address: int, length: int) -> None:
    """Hand back ``length`` bytes of pages at ``address``, inside ``buf`` (held alive here
    until then). A refusal leaves the memory with the buffer, as before.

    A finalizer: a Ctrl-C that comes during the call (``madvise`` of a large tensor's pages
    takes a while, without the GIL) would be printed and dropped by Python, and the program
    would go on; it is handed on to the main thread instead (:func:`redeliver_interrupt`).
    """
    try:
        if madvise is not None:
            madvise(address, length, _MADV_DONTNEED)
    except KeyboardInterrupt:
        redeliver_interrupt()


def tensors_over(
    adapter: Any,
    buf: np.ndarray,
    items: Iterable[tuple[str, DType, tuple[int, ...], int, int]],
    device: Any,
    *,
    fresh: bool = True,
) -> dict[str, Any]:
    """The framework's tensors of ``(name, dtype, shape, begin, end)`` items (in their order)
    over ``buf``, as one batch (``from_bytes_many`` where the adapter has it).

    ``fresh``: ``buf`` is new memory of this load only. On the CPU, where pages can be handed
    back, and for a buffer of at least :data:`RELEASE_BUFFER_MIN` bytes, each tensor of
    :data:`RELEASE_MIN` bytes or more then views it through a :func:`releasing_view` of its
    own, and the smaller ones through one per block of about that many bytes
    (:func:`_blocks`); otherwise (a mapping of the file, a device, a smaller buffer) every
    tensor views ``buf`` directly.
    """
    with gc_paused():  # a tuple and a tensor per item
        if not (
            fresh and can_release() and device.type == "cpu" and buf.nbytes >= RELEASE_BUFFER_MIN
        ):
            return _viewing(adapter, buf, items, device)
        items = list(items)
        out: dict[str, Any] = {}
        for begin, end, block in _blocks(items):
            view = releasing_view(buf, begin, end)
            if len(block) == 1 and end - begin >= RELEASE_MIN:
                name, dtype, shape, _, _ = block[0]
                out[name] = adapter.from_bytes(view, dtype, shape, device)
            else:
                moved = [(n, dt, sh, b - begin, e - begin) for n, dt, sh, b, e in block]
                out.update(_viewing(adapter, view, moved, device))
        names = [item[0] for item in items]
        return out if list(out) == names else {name: out[name] for name in names}


def _blocks(
    items: list[tuple[str, DType, tuple[int, ...], int, int]],
) -> Iterator[tuple[int, int, list[tuple[str, DType, tuple[int, ...], int, int]]]]:
    """``items`` grouped for :func:`tensors_over`, as ``(begin, end, items)`` spans of the
    buffer: each tensor of :data:`RELEASE_MIN` bytes or more alone, the smaller ones in
    buffer order, a block closed once it spans that many bytes or a large tensor comes."""
    block: list[tuple[str, DType, tuple[int, ...], int, int]] = []
    low = high = 0
    for item in sorted(items, key=operator.itemgetter(3)):
        begin, end = item[3], item[4]
        if end - begin >= RELEASE_MIN:
            if block:
                yield low, high, block
                block = []
            yield begin, end, [item]
            continue
        if not block:
            low = high = begin
        block.append(item)
        high = max(high, end)
        if high - low >= RELEASE_MIN:
            yield low, high, block
            block = []
    if block:
        yield low, high, block


def _viewing(
    adapter: Any,
    buf: np.ndarray,
    items: Iterable[tuple[str, DType, tuple[int, ...], int, int]],
    device: Any,
) -> dict[str, Any]:
    """The tensors of ``items``, each viewing ``buf``: all at once where the adapter can
    (``from_bytes_many``: about half the per-tensor cost of ``from_bytes``, ~17 us a tensor
    of a 20,000-tensor ``load_shard``)."""
    many = getattr(adapter, "from_bytes_many", None)
    if many is not None:
        result: dict[str, Any] = many(buf, items, device)
        return result
    return {n: adapter.from_bytes(buf[b:e], dt, sh, device) for n, dt, sh, b, e in items}
