"""A histogram's bin edges and counts for ``stats --histogram``.

The edges are numpy's (``numpy.histogram(values, bins)``: ``bins`` equal bins from the smallest
to the largest value, ``numpy.linspace`` of them) wherever numpy gives any, and the counts are
numpy's for those edges: bins are half-open, ``[a, b)``, except the last, ``[a, b]``, which
holds the maximum. Where numpy gives no histogram the edges are still defined:

* one value ``v`` (every finite value equal): numpy's ``[v - 0.5, v + 0.5]``; where half a
  unit is below ``v``'s precision (``|v| >= 2**52``, where numpy refuses "Too many bins for
  data range"), bins two float64 units in the last place of ``v`` wide around it, shifted to
  stay finite next to the float64 maximum;
* a range whose width overflows float64 (``-1.7e308`` to ``1.7e308``; numpy's edges are NaN):
  the edges of half the range, doubled (exact, as halving and doubling are);
* a range of a few units in the last place (numpy refuses to count, for bins as a number):
  numpy's ``linspace`` edges, which repeat; the bins between two equal edges are empty.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np

#: Values counted at a time by :func:`bin_counts_rows`.
_BLOCK: Final = 65_536

__all__ = [
    "bin_counts",
    "bin_counts_rows",
    "histogram_edges",
    "histogram_edges_rows",
    "histogram_range",
]


def histogram_range(lo: float, hi: float, bins: int) -> tuple[float, float]:
    """The first and last edge of ``bins`` bins over finite values from ``lo`` to ``hi``.

    Raises:
        ValueError: ``bins`` is below one, or ``lo`` and ``hi`` are not finite with ``lo <= hi``
            (no finite values: there is no range to bin).
    """
    if bins < 1:
        raise ValueError(f"a histogram has at least one bin, not {bins}")
    if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
        raise ValueError(f"no histogram range from {lo!r} to {hi!r}: not finite and ordered")
    if lo != hi:
        return lo, hi
    v = lo
    if v - 0.5 < v < v + 0.5:
        return v - 0.5, v + 0.5  # numpy's
    # Half a unit is lost in v's precision (numpy's range would be [v, v]): bins of two
    # units in the last place, around v (bins * ulp stays far below the float64 maximum).
    half = bins * math.ulp(v)
    low, high = v - half, v + half
    if math.isinf(high):  # v next to the float64 maximum: the range ends at v
        return v - 2 * half, v
    if math.isinf(low):
        return v, v + 2 * half
    return low, high


def histogram_edges(lo: float, hi: float, bins: int) -> np.ndarray:
    """The ``bins + 1`` edges (float64) of a histogram of finite values from ``lo`` to ``hi``
    (their minimum and maximum): ``numpy.histogram``'s where it gives any (see the module).

    Raises:
        ValueError: as :func:`histogram_range`.
    """
    first, last = histogram_range(lo, hi, bins)
    # linspace's last step may overflow near the float64 maximum (3 * (max / 3) rounds up to
    # Inf) before it puts the last edge in place: no warning for an edge it replaces.
    with np.errstate(over="ignore"):
        if math.isfinite(last - first):
            return np.linspace(first, last, bins + 1)
        # The width overflows: the ends halved (exact: both are far from the subnormals),
        # spaced, doubled back (exact), so the first and last edges are the range's own.
        return np.linspace(first / 2, last / 2, bins + 1) * 2


def bin_counts(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """``numpy.histogram(values, bins=edges)[0]`` (int64) for float64 ``values``, without its
    sort (NaN, Inf and values outside the edges are not counted).

    A value's bin is the last edge at or below it (``searchsorted(..., "right") - 1``), which
    skips the empty bins between equal edges as numpy's cumulative counts do; a value equal to
    the last edge goes to the last bin, as numpy's last bin is closed.
    """
    bins = edges.size - 1
    inside = values[(values >= edges[0]) & (values <= edges[-1])]
    index = np.searchsorted(edges, inside, side="right")
    index -= 1
    np.minimum(index, bins - 1, out=index)  # the last edge's values: the last bin
    return np.bincount(index, minlength=bins).astype(np.int64, copy=False)


def histogram_edges_rows(lo: np.ndarray, hi: np.ndarray, bins: int) -> np.ndarray:
    """:func:`histogram_edges` of each ``(lo[i], hi[i])``, as the rows of a ``(k, bins + 1)``
    array: the same edges, bit for bit.

    Ranges of a finite, nonzero step are spaced all at once with ``numpy.linspace``'s own
    arithmetic (``arange(bins + 1) * step + lo``, then ``hi`` put in place as the last edge;
    ``linspace`` of arrays would switch every row to its arithmetic for subnormal steps as soon
    as one row had one); the others (one value, a width that overflows, a zero step) one by one.
    """
    edges = np.empty((lo.size, bins + 1))
    with np.errstate(over="ignore", invalid="ignore"):
        step = (hi - lo) / bins
        regular = (lo < hi) & np.isfinite(step) & (step != 0)
        chosen = np.flatnonzero(regular)
        if chosen.size:
            spaced = np.arange(bins + 1, dtype=np.float64) * step[chosen, None]
            spaced += lo[chosen, None]
            spaced[:, -1] = hi[chosen]
            edges[chosen] = spaced
    for i in np.flatnonzero(~regular).tolist():
        edges[i] = histogram_edges(float(lo[i]), float(hi[i]), bins)
    return edges


def bin_counts_rows(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """:func:`bin_counts` of each row of float64 ``values`` (``(k, n)``) with the same row
    of ``edges`` (``(k, bins + 1)``, non-decreasing), as a ``(k, bins)`` int64 array.

    Each value's bin is first guessed by arithmetic (as ``numpy.histogram`` does for a count
    and a range), then moved down while the value is below its bin's first edge and up while it
    is at or past its last (the last bin taking the last edge): the moves end at the last edge
    at or below the value, :func:`bin_counts`'s bin, whatever the guess. Rows whose width is
    not finite and positive are counted one by one.
    """
    k, bins = edges.shape[0], edges.shape[1] - 1
    with np.errstate(over="ignore", invalid="ignore"):
        width = edges[:, -1] - edges[:, 0]
        regular = np.isfinite(width) & (width > 0)
    chosen = np.flatnonzero(regular)
    counts = np.empty((k, bins), np.int64)
    # Rows counted a block of about _BLOCK values at a time: the counting's temporaries take
    # ~50 bytes a value (numpy.histogram counts in blocks of 65,536 values too).
    step = max(1, _BLOCK // max(1, values.shape[1]))
    for start in range(0, chosen.size, step):
        rows = chosen[start : start + step]
        if rows.size == k:  # all of them: no copies
            counts[:] = _counted_rows(values, edges, width, bins)
        else:
            counts[rows] = _counted_rows(values[rows], edges[rows], width[rows], bins)
    for i in np.flatnonzero(~regular).tolist():
        counts[i] = bin_counts(values[i], edges[i])
    return counts


def _counted_rows(
    values: np.ndarray, edges: np.ndarray, width: np.ndarray, bins: int
) -> np.ndarray:
    """:func:`bin_counts_rows` of rows whose ``width`` (last edge less first) is finite and
    positive."""
    m = edges.shape[0]
    first, last = edges[:, :1], edges[:, -1:]
    inside = (values >= first) & (values <= last)  # NaN, Inf and values outside: not counted
    x = np.where(inside, values, first)
    guess = (x - first) / width[:, None] * bins
    index = guess.astype(np.intp)
    np.clip(index, 0, bins - 1, out=index)
    at = np.arange(m, dtype=np.intp)[:, None] * (bins + 1)  # each row's start in edges.flat
    flat = edges.ravel()
    while True:
        down = x < flat[at + index]
        up = (x >= flat[at + index + 1]) & (index < bins - 1)
        if not (down.any() or up.any()):
            break
        index -= down
        index += up
    # The rows side by side in one count; the values not counted in a slot past them all.
    index += np.arange(m, dtype=np.intp)[:, None] * bins
    index[~inside] = m * bins
    found = np.bincount(index.ravel(), minlength=m * bins + 1)
    counts: np.ndarray = found[:-1].reshape(m, bins).astype(np.int64, copy=False)
    return counts
