"""Turning a numpy-style index into the byte runs it selects. No framework code, no I/O.

Semantics (the same for every framework and backend):

* A basic index is an int, a ``slice``, ``Ellipsis`` (at most one), ``()``, or a tuple of
  these; :func:`plan_slice` turns it into byte runs. An empty list selects nothing along the
  first dimension. Floats and strings are refused with :class:`SliceError`.
* Advanced items (``None``, bools, integer and boolean arrays or lists, torch tensors) follow
  numpy's rules, which torch's indexing shares: :func:`split_advanced` turns such an index into
  a basic one that reads the smallest box holding every selected element, and the index that
  picks the result out of that box in memory.
* Integers may be negative (wrapped once); an integer outside the dimension is an error, as in
  numpy. An integer removes its dimension.
* Slices follow Python/numpy: bounds are clamped to the dimension and negative bounds count from
  the end, so ``[:20]`` on a dimension of 10 selects all 10 and ``[5:2]`` selects nothing. Steps
  must be positive.
* For sub-byte dtypes (F4, F6) every contiguous run must start and end on a byte boundary.

The reference's Rust slicer errors on out-of-range slice bounds and on negative bounds, while its
torch path clamps; we clamp everywhere so numpy and torch agree (see ``docs/differences.md``).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import numpy as np

from ._dtypes import DType, dtype_from_code
from ._errors import SliceError, SliceTypeError, SliceValueError

__all__ = [
    "BYTES",
    "AdvancedSplit",
    "Part",
    "SlicePlan",
    "SPARSE_GAP",
    "as_whole_bytes",
    "compact_box",
    "is_advanced",
    "part_run",
    "plan_slice",
    "render_index",
    "split_advanced",
]


@dataclass(frozen=True, slots=True)
class SlicePlan:
    """Where the bytes of a slice are, relative to the start of the tensor's data."""

    shape: tuple[int, ...]
    """Logical shape of the result."""
    starts: np.ndarray
    """Byte offset of each run, ascending (int64)."""
    run_bytes: int
    """Length of every run in bytes."""
    nbytes: int
    """Total bytes selected."""
    selection: tuple[int | slice, ...] = ()
    """The normalized index, one int or step>0 slice per dimension (for strided copies)."""

    def run_count(self) -> int:
        """How many runs :meth:`coalesced` would give, without building them."""
        if self.nbytes == 0:
            return 0
        starts = self.starts
        return 1 + int(np.count_nonzero(starts[1:] != starts[:-1] + self.run_bytes))

    def coalesced(self) -> list[tuple[int, int]]:
        """Runs as ``(offset, length)`` with touching runs merged: exactly the bytes needed."""
        if self.nbytes == 0:
            return []
        starts = self.starts
        if len(starts) == 1:
            return [(int(starts[0]), self.run_bytes)]
        breaks = np.nonzero(starts[1:] != starts[:-1] + self.run_bytes)[0] + 1
        bounds = np.concatenate(([0], breaks, [len(starts)]))
        return [
            (int(starts[a]), int(starts[b - 1]) + self.run_bytes - int(starts[a]))
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]


def render_index(index: Any, shape: tuple[int, ...] | None = None) -> str:
    """Render an index the way error messages show it, e.g. ``[2:, 20]``.

    With ``shape``, as the reference's slicer shows a basic index it has read: the ellipsis
    spelled out as ``:`` per dimension and negative integers wrapped (``-1`` of 4 as ``3``).
    """
    items = index if isinstance(index, tuple) else (index,)
    if shape is not None and sum(1 for item in items if item is Ellipsis) == 1:
        at = items.index(Ellipsis)
        fill = (slice(None),) * max(0, len(shape) - len(items) + 1)
        items = items[:at] + fill + items[at + 1 :]
    parts = []
    for dim, item in enumerate(items):
        if isinstance(item, slice):
            start, stop, step = (
                bound if _as_int(bound) is None else _as_int(bound)
                for bound in (item.start, item.stop, item.step)
            )
            text = ("" if start is None else str(start)) + ":"
            text += "" if stop is None else str(stop)
            if step is not None and step != 1:
                text += f":{step}"
            parts.append(text)
        elif item is Ellipsis:
            parts.append("...")
        elif not isinstance(item, (bool, np.bool_)) and _as_int(item) is not None:
            value = _as_int(item)  # np.int64(1) shows as 1, as in the reference
            assert value is not None
            if shape is not None and dim < len(shape) and -shape[dim] <= value < 0:
                value += shape[dim]
            parts.append(str(value))
        elif isinstance(item, (list, np.ndarray)) or type(item).__name__ == "Tensor":
            # An index array, in outline: a message must not print a million indices.
            flat = np.asarray(item).reshape(-1)
            shown = [str(v) for v in flat[:8].tolist()] + (["..."] if flat.size > 8 else [])
            parts.append("[" + ", ".join(shown) + "]")
        else:
            parts.append(repr(item))
    return "[" + ", ".join(parts) + "]"


def _as_int(value: Any) -> int | None:
    try:
        return operator.index(value)
    except TypeError:
        return None


def _normalize(index: Any, shape: tuple[int, ...]) -> list[int | range]:
    """One entry per dimension: an int (dimension dropped) or a range of indices."""
    ndim = len(shape)
    if type(index) is tuple and len(index) <= ndim:
        # The common case first (load_shard's indices: slices of plain ints with positive
        # steps), which needs none of the checks below: a 20,000-tensor load_shard spent
        # ~23 us a tensor here.
        quick: list[int | range] = []
        for item, size in zip(index, shape, strict=False):
            if type(item) is not slice:
                break
            start, stop, step = item.start, item.stop, item.step
            if not (
                (start is None or type(start) is int)
                and (stop is None or type(stop) is int)
                and (step is None or (type(step) is int and step > 0))
            ):
                break
            first, last, step = item.indices(size)
            quick.append(range(first, max(first, last), step))
        else:
            quick.extend(range(d) for d in shape[len(index) :])
            return quick
    items = index if isinstance(index, tuple) else (index,)
    if isinstance(index, list):
        if index:
            raise SliceError("Non empty lists are not implemented", kind="InvalidSlice")
        if ndim == 0:
            raise SliceError(
                "Error during slicing [0:0] with shape []: more slicing indexes than dimensions "
                "in tensor",
                kind="TooManySlices",
            )
        selected: list[int | range] = [range(0)]
        selected.extend(range(d) for d in shape[1:])
        return selected
    ellipses = sum(1 for item in items if item is Ellipsis)
    if ellipses > 1:
        raise SliceError("Only one ellipsis (...) is allowed in slice index", kind="InvalidSlice")
    explicit = len(items) - ellipses
    expanded: list[Any] = []
    for item in items:
        if item is Ellipsis:
            expanded.extend([slice(None)] * max(0, ndim - explicit))
        else:
            expanded.append(item)
    # As the reference: every item's type and step is checked (at its position once the
    # ellipsis is spelled out) before their number is.
    for dim, item in enumerate(expanded):
        if isinstance(item, slice):
            for bound in (item.start, item.stop, item.step):
                if bound is not None and _as_int(bound) is None:
                    # The reference's words (Python's, from its slice conversion).
                    raise SliceTypeError(
                        f"'{type(bound).__name__}' object cannot be interpreted as an integer",
                        kind="InvalidSlice",
                    )
            step = 1 if item.step is None else operator.index(item.step)
            if step <= 0:
                raise SliceValueError(
                    f"Slice step must be a positive integer, got {step}", kind="InvalidSlice"
                )
        # A bool is an int to Python but a mask to numpy and torch (get_slice hands bools to
        # split_advanced); never read it as row 0 or 1.
        elif isinstance(item, (bool, np.bool_)) or _as_int(item) is None:
            raise SliceTypeError(
                f"Unsupported slice index at position {dim}: expected slice, int, or ellipsis",
                kind="InvalidSlice",
            )
        elif operator.index(item) + (size := shape[dim] if dim < ndim else 0) < 0:
            # Negative indices are resolved as the items are read, in order (an item past the
            # last dimension against a size of 0, as the reference).
            raise SliceError(
                f"Invalid index {operator.index(item)} for dimension {dim} of size {size}",
                kind="SliceOutOfRange",
            )
    if len(expanded) > ndim:
        raise SliceError(
            # The index rendered only here (as the reference shows it: the ellipsis spelled
            # out), not for every slice: it cost a load_shard of 20,000 tensors ~17%.
            f"Error during slicing {render_index(index, shape)} with shape {list(shape)}: more "
            "slicing indexes than dimensions in tensor",
            kind="TooManySlices",
        )
    expanded.extend([slice(None)] * (ndim - len(expanded)))

    out: list[int | range] = []
    for item, size in zip(expanded, shape, strict=True):
        if isinstance(item, slice):
            step = 1 if item.step is None else operator.index(item.step)
            start, stop, step = slice(item.start, item.stop, step).indices(size)
            out.append(range(start, max(start, stop), step))
            continue
        value = operator.index(item)  # not below -size: refused above
        out.append(value + size if value < 0 else value)
    # As the reference: indices past the end are checked last dimension first, once every
    # negative one has been.
    for dim in reversed(range(ndim)):
        picked, size = out[dim], shape[dim]
        if isinstance(picked, int) and picked >= size:
            raise SliceError(
                f"Error during slicing {render_index(index, shape)} with shape {list(shape)}: "
                f"index {operator.index(expanded[dim])} out of bounds for tensor dimension "
                f"#{dim} of size {size}",
                kind="SliceOutOfRange",
            )
    return out


def plan_slice(shape: tuple[int, ...], dtype: DType, index: Any) -> SlicePlan:
    """Compute the result shape and byte runs of ``tensor[index]``.

    Raises:
        SliceError: The index is malformed, out of range, or splits a byte of a sub-byte dtype.
    """
    simple = _plan_contiguous_slices(shape, dtype, index)
    if simple is not None:
        return simple
    return _plan_general(shape, dtype, index)


def _length(r: range) -> int:
    """``len(r)``, also for a range longer than ``sys.maxsize``, where ``len`` raises
    ``OverflowError`` (a dimension of 2^63 or more, which a zero-size tensor may declare):
    the plan's shape then says so, and the shape check refuses it with a named error."""
    try:
        return len(r)
    except OverflowError:
        return max(0, (r.stop - r.start + r.step - (1 if r.step > 0 else -1)) // r.step)


def _plan_general(shape: tuple[int, ...], dtype: DType, index: Any) -> SlicePlan:
    """:func:`plan_slice` for any index (see the module docstring)."""
    if isinstance(index, tuple) and index == ():
        index = (Ellipsis,)
    sel = _normalize(index, shape)
    out_shape = tuple(_length(s) for s in sel if isinstance(s, range))
    selection = tuple(s if isinstance(s, int) else slice(s.start, s.stop, s.step) for s in sel)
    counts = [1 if isinstance(s, int) else _length(s) for s in sel]
    nelem = 1
    for c in counts:
        nelem *= c
    if nelem == 0:
        return SlicePlan(out_shape, np.zeros(0, np.int64), 0, 0, selection)

    # Element strides of the row-major tensor.
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]

    # The contiguous tail: trailing dimensions taken whole, plus one more taken with step 1. A
    # dimension of size 1 is whole whatever selects its one element (``[:, 0]`` of an (N, 1)
    # tensor is one run, not N runs of one element: F4 refused them as misaligned).
    k = len(sel)
    while k > 0:
        s, size = sel[k - 1], shape[k - 1]
        if size == 1 or (isinstance(s, range) and s.step == 1 and _length(s) == size):
            k -= 1
            continue
        break
    run_elems = 1
    for d in range(k, len(sel)):
        run_elems *= shape[d]
    lead = k
    if k > 0:
        s = sel[k - 1]
        if isinstance(s, int) or s.step == 1 or _length(s) == 1:
            # A step-1 range (or a single index) extends the run; its start is the base offset.
            run_elems *= 1 if isinstance(s, int) else _length(s)
            lead = k - 1

    # Offsets are computed in bytes where elements are whole bytes, and in place: a selection
    # of one element per run (``[:, 0]``) has as many runs as elements, and each temporary the
    # size of ``starts`` would add 8 bytes per selected element to the peak.
    bits = dtype.bits
    unit = bits // 8 if bits % 8 == 0 else 1
    base = 0
    if lead < len(sel) and lead < k:
        s = sel[lead]
        base = (s if isinstance(s, int) else s.start) * strides[lead] * unit
    starts = np.array([base], dtype=np.int64)
    for d in range(lead - 1, -1, -1):
        s = sel[d]
        # np.arange, not np.array(range): converting a range walks it in Python (~11 ms for
        # the row ranges of a 2 GiB model's column split).
        rows = (
            np.array([s], np.int64)
            if isinstance(s, int)
            else np.arange(s.start, s.stop, s.step, dtype=np.int64)
        )
        rows *= strides[d] * unit
        if len(starts) == 1:
            rows += starts[0]
            starts = rows
        else:
            starts = (rows[:, None] + starts[None, :]).reshape(-1)

    if bits % 8:
        if (run_elems * bits) % 8 or np.any((starts * bits) % 8):
            raise SliceError(
                f"Error during slicing {render_index(index, shape)} with shape {list(shape)}: The "
                "slice is slicing for subbytes dtypes, and the slice does not end up at a byte "
                f"boundary, this is invalid. (dtype {dtype.code})",
                kind="MisalignedSlice",
            )
        starts = starts * bits // 8
    run_bytes = run_elems * bits // 8
    return SlicePlan(out_shape, starts, run_bytes, run_bytes * len(starts), selection)


def _plan_contiguous_slices(shape: tuple[int, ...], dtype: DType, index: Any) -> SlicePlan | None:
    """:func:`plan_slice` for the indices a tensor-parallel load makes, or None.

    Those are ``...`` (a whole tensor) and plain step-1 slices of which only the last one that
    is not the whole dimension may be partial (rows, columns, any one dimension), of a
    whole-byte dtype, selecting something: the runs are then one arithmetic progression. The
    general path normalizes every item and builds the runs dimension by dimension, ~5-7 us a
    tensor, which a load_shard of a 20,000-tensor checkpoint paid for each; this is ~1.5 us.
    Anything else (ints, steps, several partial dimensions, nothing selected, sub-byte dtypes)
    returns None, and the general path decides, words the errors and plans it.
    """
    if index is Ellipsis or (type(index) is tuple and not index):
        items: tuple[Any, ...] = ()
    elif type(index) is tuple:
        items = index
    elif type(index) is slice:
        items = (index,)
    else:
        return None
    bits = dtype.bits
    ndim = len(shape)
    if bits % 8 or len(items) > ndim:
        return None
    unit = bits // 8
    partial = -1  # the last dimension not taken whole
    first = 0
    taken = 0
    for dim, item in enumerate(items):
        if type(item) is not slice:
            return None
        start, stop, step = item.start, item.stop, item.step
        if not (
            (start is None or type(start) is int)
            and (stop is None or type(stop) is int)
            and (step is None or (type(step) is int and step == 1))
        ):
            return None
        size = shape[dim]
        begin, end, _ = item.indices(size)
        if end - begin == size:
            continue
        if partial >= 0 or end <= begin:
            return None  # two partial dimensions, or nothing selected: the general path
        partial, first, taken = dim, begin, end - begin
    if 0 in shape:
        return None
    inner = 1
    for size in shape[partial + 1 :]:
        inner *= size
    selection = [slice(0, size, 1) for size in shape]
    if partial < 0:
        nbytes = inner * unit
        return SlicePlan(shape, np.zeros(1, np.int64), nbytes, nbytes, tuple(selection))
    run_bytes = taken * inner * unit
    outer = 1
    for size in shape[:partial]:
        outer *= size
    base = first * inner * unit
    if outer == 1:
        starts = np.array([base], np.int64)
    else:
        stride = shape[partial] * inner * unit
        starts = np.arange(base, base + outer * stride, stride, dtype=np.int64)
    out_shape = (*shape[:partial], taken, *shape[partial + 1 :])
    selection[partial] = slice(first, first + taken, 1)
    return SlicePlan(out_shape, starts, run_bytes, run_bytes * outer, tuple(selection))


class Part(NamedTuple):
    """``[start, stop)`` along one dimension, every other dimension whole (a tensor-parallel
    part); ``dim`` None is the whole tensor."""

    dim: int | None
    start: int
    stop: int

    @property
    def index(self) -> Any:
        """The same selection as an index (``...`` for the whole tensor)."""
        if self.dim is None:
            return ...
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides, in elements, of a C-contiguous array of ``shape`` (bytes for uint8)."""
    strides = []
    step = 1
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def part_run(
    shape: tuple[int, ...], dtype: DType, part: Part
) -> tuple[tuple[int, ...], int, int] | None:
    """Where ``part`` of a tensor lies when it is one byte run: ``(shape of the part, offset of
    the run in the tensor's bytes, its length)``; None when it is not one run (a split after a
    dimension of more than one entry: columns), selects nothing, is out of range, or is of a
    sub-byte dtype (those go through :func:`plan_slice`, which decides them).

    Without building an index or a plan: a load_shard of 20,000 tensors paid ~4 us a tensor
    for those.
    """
    bits = dtype.bits
    if bits % 8:
        return None
    unit = bits // 8
    dim, start, stop = part
    if dim is None:
        nbytes = unit
        for size in shape:
            nbytes *= size
        return (shape, 0, nbytes) if nbytes else None
    if not 0 <= dim < len(shape) or not 0 <= start < stop <= shape[dim]:
        return None
    outer = 1
    for size in shape[:dim]:
        outer *= size
    if outer != 1 and stop - start != shape[dim]:
        return None
    row = unit
    for size in shape[dim + 1 :]:
        row *= size
    nbytes = outer * (stop - start) * row
    if not nbytes:
        return None
    return (*shape[:dim], stop - start, *shape[dim + 1 :]), start * row, nbytes


#: The dtype :func:`as_whole_bytes` reads sub-byte selections as.
BYTES: Final = dtype_from_code("U8")


def as_whole_bytes(
    shape: tuple[int, ...], dtype: DType, plan: SlicePlan
) -> tuple[tuple[int, ...], SlicePlan] | None:
    """The same bytes as ``plan`` (of a sub-byte tensor) selected from a :data:`BYTES` tensor.

    Returns ``(byte shape, byte plan)``: a tensor of whole bytes whose basic slice selects
    exactly ``plan``'s bytes in the same order, so that sub-byte slices take the strided copies
    and block reads of byte dtypes instead of one Python step per run (a column split of a
    16 MiB F4 tensor has 4,096 runs). The dimensions that make up a run are folded into one;
    None when that folded dimension or its selected range does not fall on byte boundaries
    (``[::2, :2]`` of a 3x3 F4 tensor: its runs do, its rows do not).
    """
    bits = dtype.bits
    sel = plan.selection
    if not plan.nbytes or len(sel) != len(shape):
        return None
    # The run's dimensions: the trailing ones taken whole, and the step-1 one before them.
    k = len(sel)
    while k > 0 and isinstance(sel[k - 1], slice) and sel[k - 1] == slice(0, shape[k - 1], 1):
        k -= 1
    if k == 0:
        return None  # the whole tensor: one run already
    last = sel[k - 1]
    if isinstance(last, int):
        last = slice(last, last + 1, 1)
    count = _length(range(last.start, last.stop, last.step))
    if last.step == 1 or count == 1:
        begin, end = last.start, last.start + count
    elif k < len(sel):
        # A strided dimension before the whole ones: it stays as it is, the runs are the rest.
        k, begin, end = k + 1, 0, shape[k]
    else:
        return None  # runs of single elements, which no sub-byte selection has
    inner = math.prod(shape[k:])
    folded = shape[k - 1] * inner
    if (folded * bits) % 8 or (begin * inner * bits) % 8 or (end * inner * bits) % 8:
        return None
    byte_shape = (*shape[: k - 1], folded * bits // 8)
    byte_index = (*sel[: k - 1], slice(begin * inner * bits // 8, end * inner * bits // 8))
    byte_plan = plan_slice(byte_shape, BYTES, byte_index)
    return byte_shape, byte_plan


def _advanced_item(item: Any) -> np.ndarray | None:
    """``item`` as an index array when it is an advanced item (bool, array, list, tensor)."""
    if item is None or item is Ellipsis or isinstance(item, slice):
        return None
    if isinstance(item, (bool, np.bool_)):
        return np.asarray(item)
    if isinstance(item, range):
        # A 1-D integer index whatever its values; they are built by _range_values once the
        # dimension is known, as a range's length is not bounded by anything in the file.
        return _RANGE_STANDIN
    if isinstance(item, (list, tuple, np.ndarray)) or hasattr(item, "__array__"):
        try:
            arr = np.asarray(item)
        except (ValueError, TypeError):  # ragged nesting
            return np.asarray(item, dtype=object)
        if arr.ndim == 0 and arr.dtype.kind in "iu":
            return None  # a 0-d integer array (or tensor) is an integer
        if isinstance(item, (list, tuple)) and arr.size == 0:
            arr = arr.astype(np.int64)  # [] is an empty integer index, not float64
        return arr
    return None


#: What _advanced_item gives for a range: its kind and number of dimensions, not its values.
_RANGE_STANDIN: Final = np.zeros(0, np.int64)
#: The most entries a range index is built with when it cannot be all in bounds, or indexes a
#: tensor of no elements, whose dimensions bound nothing in the file (2^24 int64s: 128 MiB).
_LONG_RANGE: Final = 2**24


def _range_values(item: range, index: Any, shape: tuple[int, ...], dim: int) -> np.ndarray:
    """The values of a ``range`` index for dimension ``dim``; a long one is refused before
    it is built where nothing in the file bounds it.

    A range's values are distinct, so one of more than ``2 * size`` entries (``-size`` to
    ``size - 1``) holds some out of bounds. numpy and torch check them only where the
    selection is not empty (torch: where it picks an element), so a short one is built and
    checked as any index array; a long one (``range(2**40)``) would take more memory than any
    file could justify.

    Raises:
        SliceError: Too many entries, or values that do not fit an int64 (out of bounds).
    """
    size = shape[dim]
    count = _length(item)
    where = f"Error during slicing {render_index(index)} with shape {list(shape)}: index {item}"
    if count > _LONG_RANGE and count > 2 * size:
        raise SliceError(
            f"{where} has {count} entries, so some are out of bounds for tensor dimension "
            f"#{dim} of size {size}",
            kind="SliceOutOfRange",
        )
    if count > _LONG_RANGE and 0 in shape:
        raise SliceError(
            f"{where} has {count} entries, more than {_LONG_RANGE} on a tensor of no elements",
            kind="InvalidSlice",
        )
    try:
        return np.arange(item.start, item.stop, item.step, dtype=np.int64)
    except OverflowError:  # a value of 2^63 or more: out of bounds for any dimension
        raise SliceError(
            f"{where} out of bounds for tensor dimension #{dim} of size {size}",
            kind="SliceOutOfRange",
        ) from None


def is_advanced(index: Any) -> bool:
    """Whether ``index`` needs :func:`split_advanced` (``None``, bools, arrays, lists).

    An empty list on its own keeps its basic meaning (nothing along the first dimension), as
    with the reference's slicer.
    """
    if isinstance(index, list) and not index:
        return False
    items = index if isinstance(index, tuple) else (index,)
    return any(item is None or _advanced_item(item) is not None for item in items)


@dataclass(frozen=True, slots=True)
class AdvancedSplit:
    """An advanced index as a box to read and the index that picks the result out of it."""

    box: tuple[slice, ...]
    """One slice per dimension: the smallest range holding every selected element."""
    pick: tuple[Any, ...]
    """The index to apply to the box (same items and positions as the original, ``...``
    included, so that numpy's and torch's placement rules give the same result)."""
    out_of_range: SliceError | None
    """An index value outside its dimension. numpy raises only if the selection is not empty
    (its index arrays broadcast to something), so this is raised when picking fails."""
    arrays: tuple[tuple[int, int, np.ndarray], ...] = ()
    """The integer index arrays, along which :func:`compact_box` may read the box in parts:
    ``(dimension, position in pick, the values in range, sorted and unique)`` each."""


#: Rows of a box dimension skipped between two selected ones are read through (one read) when
#: they are fewer bytes than this, else the box is read in separate parts.
SPARSE_GAP: Final = 1 << 20

#: At most this many parts (the closest ones are read as one beyond it).
SPARSE_PARTS: Final = 1024


def compact_box(
    split: AdvancedSplit, shape: tuple[int, ...], itemsize: int, max_gap: int, *, mapped: bool
) -> tuple[list[tuple[slice, ...]], tuple[Any, ...], int] | None:
    """The box of ``split`` read in parts along one of its index arrays: ``[[3, 17, 40000]]`` of
    an embedding selects 3 rows, and its box is 39,998 rows.

    Returns ``(boxes, pick, dim)``: the boxes to read, each ``split.box`` but for a range of
    dimension ``dim``, whose reads joined along ``dim`` ``pick`` picks the selection from;
    None where the box is better read whole (one part).

    Args:
        split: The advanced index.
        shape: The tensor's shape.
        itemsize: Bytes per element.
        max_gap: Bytes skipped between two parts below which they are read as one (0: every
            gap splits, as ``slice_reads="exact"`` wants).
        mapped: The tensor is mapped, where a part is a strided copy of what it selects, along
            any dimension. Read from a file, a part along a later dimension than the first
            the box spans would be a read per row (``[:, [0, 4095]]`` of a tall tensor: 100x
            slower than its box as one read), so only that first one is split there, where
            each part is one span of the file and a gap is bytes not read.
    """
    box = split.box
    if not split.arrays:
        return None
    try:
        lengths = [_length(range(*part.indices(n))) for part, n in zip(box, shape, strict=True)]
    except (TypeError, ValueError):
        return None  # a slice of the index no plan takes: planning the box says why
    best: tuple[float, int, int, np.ndarray, int] | None = None
    for dim, at, rows in split.arrays:
        extent = lengths[dim]
        leading = all(n == 1 for n in lengths[:dim])
        if len(rows) < 2 or len(rows) == extent or not (leading or mapped):
            continue
        # Bytes a skipped row of ``dim`` saves: the file's span of it where parts are spans,
        # else the box's elements in it.
        unit = itemsize * (math.prod(shape[dim + 1 :]) if leading else math.prod(lengths) // extent)
        if best is None or len(rows) / extent < best[0]:
            best = (len(rows) / extent, dim, at, rows, unit)
    if best is None:
        return None
    _, dim, at, rows, unit = best
    extent = lengths[dim]
    gaps = np.diff(rows) - 1
    split_at = gaps * unit >= max(max_gap, 1)  # a gap of 0 rows never splits
    candidates = np.nonzero(split_at)[0]
    if len(candidates) >= SPARSE_PARTS:
        # Too many parts: only the widest gaps split.
        widest = candidates[np.argsort(gaps[candidates], kind="stable")[-(SPARSE_PARTS - 1) :]]
        split_at = np.zeros_like(split_at)
        split_at[widest] = True
    if not split_at.any():
        return None
    firsts = np.concatenate(([0], np.nonzero(split_at)[0] + 1))
    lows = rows[firsts]
    highs = np.concatenate((rows[firsts[1:] - 1], rows[-1:]))
    boxes = [
        (*box[:dim], slice(int(lo), int(hi) + 1), *box[dim + 1 :])
        for lo, hi in zip(lows, highs, strict=True)
    ]
    # Positions in the joined parts: each part starts where the ones before it end. Values
    # outside the tensor (at the box's length) stay outside: the joined length.
    starts = np.concatenate(([0], np.cumsum(highs - lows + 1)[:-1]))
    old = split.pick[at]
    values = old + box[dim].start
    part = np.searchsorted(lows, values, side="right") - 1
    inside = old < extent
    new = np.where(inside, starts[part] + values - lows[part], int(np.sum(highs - lows + 1)))
    pick = (*split.pick[:at], new, *split.pick[at + 1 :])
    return boxes, pick, dim


def split_advanced(
    index: Any, shape: tuple[int, ...], *, empty_mask_axes_match: bool = True
) -> AdvancedSplit:
    """Split an advanced index into a box to read and the index that picks from the box.

    ``tensor[index] == tensor[box][pick]``, by numpy's rules or torch's alike, where ``box``
    has one slice per dimension. Index values outside their dimension are replaced in ``pick``
    by values outside the box, so that picking raises where indexing the whole tensor would.

    Args:
        index: The index, as given to ``get_slice(name)[index]``.
        shape: The tensor's shape.
        empty_mask_axes_match: numpy's rule that a boolean mask's axis of length 0 matches a
            dimension of any size (``a[np.array([], bool)]`` on 4 rows selects none of them);
            torch refuses such a mask, and its rules pass False.

    Raises:
        SliceError: Masks of the wrong shape, items of no index type, too many indices, or
            out-of-range integers where there are no index arrays.
    """
    items = index if isinstance(index, tuple) else (index,)
    arrays = [_advanced_item(item) for item in items]
    consumed = 0
    for item, arr in zip(items, arrays, strict=True):
        if item is None or item is Ellipsis:
            continue
        if arr is None:
            consumed += 1
        elif arr.dtype == np.bool_:
            consumed += arr.ndim
        else:
            consumed += 1
    ndim = len(shape)
    if sum(1 for item in items if item is Ellipsis) > 1:
        raise SliceError("Only one ellipsis (...) is allowed in slice index", kind="InvalidSlice")
    if consumed > ndim:
        raise SliceError(
            f"Error during slicing {render_index(index)} with shape {list(shape)}: more slicing "
            "indexes than dimensions in tensor",
            kind="TooManySlices",
        )
    # With index arrays, integers are advanced indices too: numpy checks them only when the
    # broadcast selection is not empty. Without, they are checked at once.
    lazy = any(arr is not None and arr.ndim > 0 for arr in arrays)
    out_of_range: SliceError | None = None
    box: list[slice] = []
    pick: list[Any] = []
    index_arrays: list[tuple[int, int, np.ndarray]] = []
    for item, arr in zip(items, arrays, strict=True):
        dim = len(box)
        if item is Ellipsis:
            box.extend([slice(None)] * (ndim - consumed))
            pick.append(Ellipsis)
        elif item is None:
            pick.append(None)
        elif arr is None:
            if isinstance(item, slice):
                box.append(item)
                pick.append(slice(None))
                continue
            value = _as_int(item)
            if value is None:
                raise SliceTypeError(
                    f"Unsupported slice index at position {dim}: expected slice, int, ellipsis, "
                    f"None, or an integer or boolean array (got {type(item).__name__})",
                    kind="InvalidSlice",
                )
            size = shape[dim]
            wrapped = value + size if value < 0 else value
            if 0 <= wrapped < size:
                box.append(slice(wrapped, wrapped + 1))
                pick.append(0)
                continue
            error = SliceError(
                f"Error during slicing {render_index(index)} with shape {list(shape)}: index "
                f"{value} out of bounds for tensor dimension #{dim} of size {size}",
                kind="SliceOutOfRange",
            )
            if not lazy:
                raise error
            out_of_range = out_of_range or error
            box.append(slice(0, 0))
            pick.append(0)  # outside the empty box
        elif arr.dtype == np.bool_ and arr.ndim == 0:
            # A new axis of length 1 (True) or 0 (False). A numpy bool scalar stays one: numpy
            # takes it as a bool, torch refuses it (it takes Python bools and 0-d arrays).
            pick.append(item if isinstance(item, np.bool_) else bool(arr))
        elif arr.dtype == np.bool_:
            dims = shape[dim : dim + arr.ndim]
            mismatched = any(
                length != size and (length or not empty_mask_axes_match)
                for length, size in zip(arr.shape, dims, strict=True)
            )
            if mismatched:
                raise SliceError(
                    f"Error during slicing {render_index(index)} with shape {list(shape)}: "
                    f"boolean index of shape {list(arr.shape)} does not match dimensions "
                    f"{list(dims)} starting at #{dim}",
                    kind="InvalidSlice",
                )
            hits = np.nonzero(arr)
            if hits[0].size:
                crop = tuple(slice(int(h.min()), int(h.max()) + 1) for h in hits)
            else:
                crop = tuple(slice(0, 0) for _ in hits)
            box.extend(crop)
            pick.append(arr[crop])
        elif arr.dtype.kind in "iu":
            size = shape[dim]
            values = (
                _range_values(item, index, shape, dim)
                if isinstance(item, range)
                else arr.astype(np.int64)
            )
            bad = (values < -size) | (values >= size)
            if bad.any():
                out_of_range = out_of_range or SliceError(
                    f"Error during slicing {render_index(index)} with shape {list(shape)}: index "
                    f"{int(values[bad].flat[0])} out of bounds for tensor dimension #{dim} of "
                    f"size {size}",
                    kind="SliceOutOfRange",
                )
            values = np.where(values < 0, values + size, values)
            good = values[~bad]
            if good.size:
                low, high = int(good.min()), int(good.max())
                box.append(slice(low, high + 1))
                # Bad values become the box's length: out of range there too, never wrapped.
                pick.append(np.where(bad, high + 1 - low, values - low))
                index_arrays.append((dim, len(pick) - 1, np.unique(good)))
            elif values.size and size:
                # Every value out of range: a box of one, and values past it. An empty box would
                # make torch refuse even an empty selection (it checks nothing else lazily).
                box.append(slice(0, 1))
                pick.append(np.ones_like(values))
            else:
                box.append(slice(0, 0))
                pick.append(np.zeros_like(values))  # nothing to pick, or outside the empty box
        else:
            raise SliceError(
                f"Unsupported slice index at position {dim}: arrays used as indices must be of "
                f"integer or boolean type (got {arr.dtype})",
                kind="InvalidSlice",
            )
    box.extend([slice(None)] * (ndim - len(box)))
    return AdvancedSplit(tuple(box), tuple(pick), out_of_range, tuple(index_arrays))
