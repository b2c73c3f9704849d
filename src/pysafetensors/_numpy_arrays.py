"""numpy arrays pickled inside a checkpoint, decoded from their bytes without numpy's unpickling.

numpy pickles an array as ``_reconstruct(numpy.ndarray, (0,), b"b")`` (an empty int8 array),
then BUILD with ``(1, shape, dtype, is_fortran, rawdata)``: the shape, a ``numpy.dtype``, the
memory order and the elements' bytes. :mod:`._torch_policy` accepts exactly that form, with a
dtype it decoded itself from a fixed list of numeric codes; this module checks the state and
fills the array with numpy's own ``__setstate__``, handing it only values checked here (a tuple
of ints, a real dtype, a bool and ``bytes`` of exactly the size the shape needs), so nothing
from the pickle is looked up or called. Object, string and structured dtypes are never decoded
(an object array's data is a list of pickled objects): their arrays stay unknown objects.

A decoded array is a non-tensor value of the checkpoint, as ``torch.load`` gives it (a
``numpy.ndarray``, not a tensor): rendered as nested JSON lists, abbreviated like every other
value (see ``_jsonable`` in :mod:`._torch_pickle`), never a tensor of the safetensors file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import numpy as np

from ._errors import CheckpointError

__all__ = ["MAX_ARRAY_NDIM", "fill_array", "new_array", "substitute"]

#: Most dimensions of a pickled array (numpy 2's own limit).
MAX_ARRAY_NDIM: Final = 64
#: Largest element count of an array, counting only its non-zero dimensions (an empty array of
#: shape ``(0, 2**62)`` has no bytes, but numpy refuses a size that overflows its index type).
MAX_ARRAY_ELEMENTS: Final = (1 << 63) - 1


def _bad(message: str, offset: int) -> CheckpointError:
    return CheckpointError(f"{message} (at byte {offset})", kind="CheckpointError", offset=offset)


def new_array() -> np.ndarray[Any, Any]:
    """What ``_reconstruct(numpy.ndarray, (0,), b"b")`` makes: an empty int8 array, filled by
    the BUILD that follows (the pickle memoizes it in between, so later references to it are
    this very object)."""
    return np.empty((0,), dtype=np.int8)


def fill_array(
    array: np.ndarray[Any, Any],
    state: tuple[Any, ...],
    dtype: np.dtype[Any],
    offset: int,
    describe: Callable[[Any], str],
) -> None:
    """Give ``array`` the ``(version, shape, dtype, is_fortran, rawdata)`` state numpy pickles.

    Args:
        array: From :func:`new_array`, not yet filled.
        state: The BUILD state (five items; its dtype already checked and decoded).
        dtype: The decoded dtype (a whitelisted numeric code, byte order as pickled).
        offset: The BUILD's byte offset, for errors.
        describe: Bounded rendering of a hostile value for messages.

    Raises:
        CheckpointError: A version, shape, order flag or data that numpy does not write, or
            data whose length is not the shape's element count times the item size.
    """
    version, shape, _, fortran, raw = state
    if type(version) is not int or version != 1:
        raise _bad(f"numpy array state version {describe(version)} (numpy writes 1)", offset)
    if type(shape) is not tuple or not all(type(d) is int for d in shape):
        raise _bad(f"numpy array shape {describe(shape)} is not a tuple of ints", offset)
    if len(shape) > MAX_ARRAY_NDIM:
        raise _bad(
            f"numpy array has {len(shape)} dimensions, over the {MAX_ARRAY_NDIM} limit", offset
        )
    # Multiplied one dimension at a time, stopping at the cap: a hostile shape of 64 dimensions
    # of 2**62 is never multiplied out.
    count = 1
    empty = False
    for d in shape:
        if d < 0:
            raise _bad(f"numpy array shape {describe(shape)} has a negative dimension", offset)
        empty = empty or d == 0
        count *= max(d, 1)
        if count > MAX_ARRAY_ELEMENTS:
            raise _bad(f"numpy array shape {describe(shape)} is too large", offset)
    if empty:
        count = 0
    if type(fortran) is not bool:
        raise _bad(f"numpy array order flag {describe(fortran)} is not a bool", offset)
    if type(raw) is not bytes:
        # An object array's data is a list; its dtype is never decoded, so this is malformed.
        raise _bad(f"numpy array data is a {type(raw).__name__}, not bytes", offset)
    need = count * dtype.itemsize
    if len(raw) != need:
        raise _bad(
            f"numpy array of shape {describe(shape)} and dtype {dtype.str} needs {need} bytes "
            f"of data, the pickle holds {len(raw)}",
            offset,
        )
    try:
        # The stubs type the flag as numpy.bool; numpy itself takes any int (pickles hold bool).
        array.__setstate__((1, shape, dtype, fortran, raw))  # type: ignore[arg-type]
    except (ValueError, TypeError, MemoryError) as exc:  # checked above: not expected
        raise _bad(f"numpy refused the array state ({type(exc).__name__}: {exc})", offset) from None


def substitute(root: Any, replace: dict[int, Any]) -> Any:
    """``root`` with every value whose id is a key of ``replace`` replaced by its value, in the
    dict values, list items and tuple items reachable from it.

    For arrays that turned out to be unknown objects (a dtype not decoded, in skip mode): their
    placeholder is known only at their BUILD, after the pickle may have referred to them
    elsewhere. Dicts and lists are changed in place (they may be shared or hold themselves);
    tuples that hold a replaced value, directly or through other tuples, are rebuilt once each
    (a tuple cannot hold itself but through a list or dict, so tuples alone form no cycle).
    Arrays are unhashable, so they are never dict keys or set items. Iterative, cycle-safe.
    """
    if not replace:
        return root
    # Every dict, list and tuple reachable, each once.
    found: dict[int, Any] = {}
    todo = [root]
    while todo:
        obj = todo.pop()
        kind = type(obj)
        if kind not in (dict, list, tuple) or id(obj) in found:
            continue
        found[id(obj)] = obj
        todo.extend(obj.values() if kind is dict else obj)
    # Tuples, children first (post-order), each rebuilt only when something in it changed.
    new: dict[int, Any] = dict(replace)
    done: set[int] = set()
    for top in [o for o in found.values() if type(o) is tuple]:
        stack: list[tuple[tuple[Any, ...], bool]] = [(top, False)]
        while stack:
            t, expanded = stack.pop()
            if id(t) in done:
                continue
            if not expanded:
                stack.append((t, True))
                stack.extend((x, False) for x in t if type(x) is tuple and id(x) not in done)
                continue
            done.add(id(t))
            if any(id(x) in new for x in t):
                new[id(t)] = tuple(new.get(id(x), x) for x in t)
    for obj in found.values():
        if type(obj) is dict:
            for k, v in obj.items():
                if id(v) in new:
                    obj[k] = new[id(v)]
        elif type(obj) is list:
            for i, v in enumerate(obj):
                if id(v) in new:
                    obj[i] = new[id(v)]
    return new.get(id(root), root)
