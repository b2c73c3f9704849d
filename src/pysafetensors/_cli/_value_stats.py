"""Statistics of a tensor's values, merged chunk by chunk.

Each chunk (see :mod:`._chunk_work`) is summarised on its own (:func:`summarise`, a
:class:`Part`) and the parts are merged in file order (:meth:`Summary.merge`, Chan et al.'s
pairwise update), so the result does not depend on which worker finished first: the same
digits with one worker or eight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final, cast

import numpy as np

from ._chunk_work import take_masks
from ._common import array_rows

__all__ = ["Part", "Summary", "summarise", "summarise_rows"]

#: Magnitude from which a chunk's sums are taken over scaled values (below it, as they are).
_SCALE_FROM: Final = 1e150


@dataclass(frozen=True, slots=True)
class Part:
    """One chunk's statistics, to merge into a :class:`Summary` in file order."""

    count: int
    finite: int = 0
    mean: float = 0.0
    """Mean of the finite values divided by ``scale``."""
    m2: float = 0.0
    """Sum of squared deviations from the mean, of the values divided by ``scale``."""
    scale: float = 1.0
    min: float = math.inf
    max: float = -math.inf
    nan: int = 0
    inf: int = 0
    zeros: int = 0
    int_min: int | None = None
    int_max: int | None = None


def summarise(values: np.ndarray, integers: np.ndarray | None = None) -> Part:
    """Statistics of a chunk of float64 ``values`` (overwritten: they are scratch), with the
    same chunk as ``integers`` for exact extremes of an integer dtype."""
    n = values.size
    if not n:
        return Part(0)
    int_min = int_max = None
    if integers is not None:
        int_min, int_max = int(integers.min()), int(integers.max())
    mask, other = take_masks(n)
    # -0.0 is zero, NaN is not (counting non-zeros of floats directly took 3x as long).
    zeros = int(np.count_nonzero(np.equal(values, 0, out=mask)))
    lo, hi = float(values.min()), float(values.max())
    nan = inf = 0
    # min and max propagate NaN and reach Inf: both finite means every value is, the common
    # case, which needs no mask and no copy.
    if not (math.isfinite(lo) and math.isfinite(hi)):
        finite = int(np.count_nonzero(np.isfinite(values, out=mask)))
        nan = int(np.count_nonzero(np.isnan(values, out=other)))
        inf = n - finite - nan
        if not finite:
            return Part(n, nan=nan, inf=inf, zeros=zeros, int_min=int_min, int_max=int_max)
        # A copy of the finite values: cheaper than masked reductions over them (a mask of
        # scattered NaN made a masked min 12x as slow as a plain one).
        values = values[mask]
        lo, hi = float(values.min()), float(values.max())
    if zeros and integers is None and (lo == 0 or hi == 0):
        # numpy's min and max pick either zero where both signs are present, so the sign
        # shown depended on where the chunks began: -0.0 is the smaller, +0.0 the larger.
        signs = np.signbit(values[values == 0])
        if lo == 0:
            lo = -0.0 if signs.any() else 0.0
        if hi == 0:
            hi = -0.0 if signs.all() else 0.0
    # Finite float64 values near the type's maximum overflow a sum and a sum of squares (two
    # values of 1.7e308 gave a mean of inf and a std of NaN): such a chunk is summed scaled.
    big = max(abs(lo), abs(hi))
    scale = big if big > _SCALE_FROM else 1.0
    if scale != 1.0:
        np.divide(values, scale, out=values)
    mean = float(values.mean())
    np.subtract(values, mean, out=values)
    # Squares then a sum, not np.dot: BLAS's own threads fought the workers for the cores.
    m2 = float(np.square(values, out=values).sum())
    return Part(n, values.size, mean, m2, scale, lo, hi, nan, inf, zeros, int_min, int_max)


def summarise_rows(values: np.ndarray, integers: np.ndarray | None = None) -> list[Part]:
    """:func:`summarise` of each row of ``values`` (float64, C-contiguous, ``(k, n)``;
    overwritten), with the same rows of ``integers``: the same numbers, bit for bit.

    Rows of finite values that need neither scaled sums nor a look at their zeros' signs (the
    common case) are summarised together, each reduction one numpy call over all of them:
    numpy sums each row of a C-contiguous array pairwise, as it sums a 1-D array, so a row's
    sum, mean and sum of squares are those of the row alone. The other rows go one by one
    through :func:`summarise`.
    """
    k, n = values.shape
    if not n:
        return [Part(0) for _ in range(k)]
    lo, hi = values.min(axis=1), values.max(axis=1)
    zeros = np.count_nonzero(values == 0, axis=1)
    big = np.maximum(np.abs(lo), np.abs(hi))  # NaN where a row holds NaN: not simple
    simple = np.isfinite(lo) & np.isfinite(hi) & (big <= _SCALE_FROM)
    if integers is None:
        simple &= (zeros == 0) | ((lo != 0) & (hi != 0))
    int_lo = int_hi = None
    if integers is not None:
        int_lo, int_hi = integers.min(axis=1).tolist(), integers.max(axis=1).tolist()
    chosen = np.flatnonzero(simple)
    parts: list[Part | None] = [None] * k
    if chosen.size:
        rows = values if chosen.size == k else values[chosen]  # a copy of some rows
        means = rows.sum(axis=1) / n
        np.subtract(rows, means[:, None], out=rows)
        m2s = np.square(rows, out=rows).sum(axis=1)
        for i, mean, m2, low, high, z in zip(
            chosen.tolist(),
            means.tolist(),
            m2s.tolist(),
            lo[chosen].tolist(),
            hi[chosen].tolist(),
            zeros[chosen].tolist(),
            strict=True,
        ):
            parts[i] = Part(
                n,
                n,
                mean,
                m2,
                1.0,
                low,
                high,
                0,
                0,
                z,
                None if int_lo is None else int_lo[i],
                None if int_hi is None else int_hi[i],
            )
    for i in np.flatnonzero(~simple).tolist():
        parts[i] = summarise(values[i], None if integers is None else integers[i])
    return cast("list[Part]", parts)


@dataclass(slots=True)
class Summary:
    """Running statistics of one tensor."""

    count: int = 0
    finite: int = 0
    mean: float = 0.0
    m2: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    nan: int = 0
    inf: int = 0
    zeros: int = 0
    edges: np.ndarray | None = field(default=None)
    """The histogram's bin edges (float64), when one was asked for."""
    counts: np.ndarray | None = field(default=None)
    """The histogram's counts (int64): arrays, not lists (Python's numbers took ~70 bytes a
    bin; ``stats`` keeps the arrays of every tensor's histogram until it prints them, in a
    temporary file where it can)."""
    int_min: int | None = None
    int_max: int | None = None
    """Exact extremes of an integer tensor (float64 rounds integers beyond 2**53: the max of
    2**63 - 1 showed as 2**63, outside I64)."""
    scale: float = 1.0
    """``m2`` is kept divided by ``scale**2`` (see :func:`summarise`)."""

    def merge(self, part: Part) -> None:
        """Add the chunk after those merged so far (Chan et al.'s pairwise update)."""
        if part.int_min is not None and part.int_max is not None:
            self.int_min = part.int_min if self.int_min is None else min(self.int_min, part.int_min)
            self.int_max = part.int_max if self.int_max is None else max(self.int_max, part.int_max)
        self.count += part.count
        self.nan += part.nan
        self.inf += part.inf
        self.zeros += part.zeros
        n = part.finite
        if not n:
            return
        # min/max keep the first of equal values: a -0.0 after a +0.0 (or the reverse) is
        # taken by its sign, as within a chunk.
        if part.min < self.min or (part.min == self.min == 0 and math.copysign(1, part.min) < 0):
            self.min = part.min
        if part.max > self.max or (part.max == self.max == 0 and math.copysign(1, part.max) > 0):
            self.max = part.max
        if part.scale > self.scale:
            ratio = self.scale / part.scale
            self.m2 = self.m2 * ratio * ratio
            self.scale = part.scale
        scale = self.scale
        mean_s, m2 = part.mean, part.m2
        if part.scale != scale:  # a chunk of smaller values than earlier ones: to their scale
            ratio = part.scale / scale
            mean_s, m2 = mean_s * ratio, m2 * ratio * ratio
        total = self.finite + n
        before_s = self.mean / scale
        delta_s = mean_s - before_s
        # The new mean in scaled units first (a weighted mean of scaled means: at most the
        # largest magnitude), then scaled: the step itself, delta_s * n / total * scale, overflowed
        # where the means are of opposite signs near the float64 maximum (mean: inf).
        self.mean = (before_s + delta_s * n / total) * scale
        self.m2 += m2 + delta_s * delta_s * self.finite * n / total
        self.finite = total

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready values (None where undefined: no finite values)."""
        has = self.finite > 0
        return {
            "count": self.count,
            "min": (self.min if self.int_min is None else self.int_min) if has else None,
            "max": (self.max if self.int_max is None else self.int_max) if has else None,
            "mean": self.mean if has else None,
            "std": self.scale * math.sqrt(self.m2 / self.finite) if has else None,
            "nan": self.nan,
            "inf": self.inf,
            "zeros": self.zeros,
            "histogram": None
            if self.edges is None or self.counts is None
            else {"edges": array_rows(self.edges), "counts": array_rows(self.counts)},
        }
