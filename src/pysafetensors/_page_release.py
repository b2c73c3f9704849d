"""Tensors of one shared load buffer that give their memory back when they are dropped.

A load by positioned reads fills one fresh buffer for all tensors (one allocation, read by
every reader thread at once) and hands out views of it. Views alone would keep the whole
buffer while any one tensor lives: ``del sd["lm_head.weight"]`` freed nothing, and keeping
the few tensors of a large file that one needs kept all of it (the reference copies each
tensor into memory of its own). So each large tensor views the buffer through an object of
its own, and when that object goes (with the last array or tensor made from it) the whole
pages of its bytes are handed back to the kernel (``MADV_DONTNEED``): the buffer stays
mapped, and those pages, which no other tensor shares, take no memory any more.
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Iterable
from typing import Any, Final

import numpy as np

from ._dtypes import DType
from ._format import gc_paused
from ._syscalls import madvise

__all__ = ["RELEASE_MIN", "can_release", "releasing_view", "tensors_over"]

#: Tensors at least this large get views of their own; smaller ones (norms, biases) view the
#: buffer directly, as the object and the finalizer of each would cost more than they free.
RELEASE_MIN: Final = 1 << 20

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
    until then). A refusal leaves the memory with the buffer, as before."""
    if madvise is not None:
        madvise(address, length, _MADV_DONTNEED)


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
    back, the tensors of :data:`RELEASE_MIN` bytes or more then view it through
    :func:`releasing_view`; otherwise (a mapping of the file, a device) every tensor views
    ``buf`` directly.
    """
    with gc_paused():  # a tuple and a tensor per item
        if not (fresh and can_release() and device.type == "cpu"):
            return _viewing(adapter, buf, items, device)
        items = list(items)
        large = {item[0] for item in items if item[4] - item[3] >= RELEASE_MIN}
        if not large:
            return _viewing(adapter, buf, items, device)
        small = _viewing(adapter, buf, [item for item in items if item[0] not in large], device)
        return {
            name: (
                adapter.from_bytes(releasing_view(buf, begin, end), dtype, shape, device)
                if name in large
                else small[name]
            )
            for name, dtype, shape, begin, end in items
        }


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
