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

import numpy as np

__all__ = ["bin_counts", "histogram_edges", "histogram_range"]


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
