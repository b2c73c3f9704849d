"""``pysafetensors stats``: per-tensor min/max/mean/std, NaN/Inf/zero counts, histograms.

Tensors are streamed in chunks (a few million elements at a time), so memory stays bounded
whatever the tensor size. Mean and standard deviation are merged chunk by chunk with Chan's
parallel formula, which stays accurate where a running sum of squares would not. They cover the
finite values only; NaN and Inf are counted separately. Complex tensors are summarised by
magnitude.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from ._common import (
    LazyRows,
    TensorRef,
    Ui,
    add_filter_args,
    decode,
    name_filter,
    open_model,
    print_json,
    quoted,
    shown,
    to_float64,
)
from ._remote_args import add_remote_args, remote_options

SCHEMA: Final = "pysafetensors.stats/1"
#: Most histogram bins (each an int64 counter).
MAX_BINS: Final = 1_000_000
#: Elements decoded per step; float64 copies of them bound the memory used (~32 MiB).
_CHUNK_ELEMENTS: Final = 4 << 20


def register(sub: Any) -> None:
    """Add the ``stats`` subcommand."""
    p = sub.add_parser(
        "stats",
        help="per-tensor min/max/mean/std, NaN/Inf/zero counts, optional histogram",
        description="Compute statistics of every tensor, streaming the data in bounded memory.",
    )
    p.add_argument("target", metavar="TARGET", help="file, model folder, index or URL")
    add_filter_args(p)
    p.add_argument(
        "--histogram",
        nargs="?",
        type=int,
        const=10,
        default=None,
        metavar="BINS",
        help="also compute a histogram of finite values (default 10 bins; reads data twice)",
    )
    p.add_argument("--json", action="store_true", help=f"machine-readable output ({SCHEMA})")
    add_remote_args(p)
    p.set_defaults(func=run)


#: Magnitude from which running sums are taken over scaled values (below it, as they are).
_SCALE_FROM: Final = 1e150


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
    """The histogram's counts (int64): arrays, not lists, as a command may keep thousands of
    histograms until it prints them (Python's numbers took ~70 bytes a bin, 1 GB for 20,000
    tensors of 1,000 bins)."""
    int_min: int | None = None
    int_max: int | None = None
    """Exact extremes of an integer tensor (float64 rounds integers beyond 2**53: the max of
    2**63 - 1 showed as 2**63, outside I64)."""
    scale: float = 1.0
    """``m2`` is kept divided by ``scale**2``, and sums are taken over values divided by it:
    finite float64 values near the type's maximum overflowed the mean and the sum of squares
    (two values of 1.7e308 gave a mean of inf and a std of NaN)."""

    def add(self, values: np.ndarray, integers: np.ndarray | None = None) -> None:
        """Merge a chunk of float64 values (Chan et al.'s pairwise update); ``integers``: the
        same chunk as its integers, for exact extremes."""
        if integers is not None and integers.size:
            lo_i, hi_i = int(integers.min()), int(integers.max())
            self.int_min = lo_i if self.int_min is None else min(self.int_min, lo_i)
            self.int_max = hi_i if self.int_max is None else max(self.int_max, hi_i)
        self.count += values.size
        # One pass for "all finite", the common case; NaN and Inf counted apart only if not.
        is_finite = np.isfinite(values)
        bad = values.size - int(np.count_nonzero(is_finite))
        if bad:
            nan = int(np.count_nonzero(np.isnan(values)))
            self.nan += nan
            self.inf += bad - nan
        self.zeros += int(np.count_nonzero(values == 0))
        finite = values[is_finite] if bad else values
        n = finite.size
        if not n:
            return
        lo, hi = float(finite.min()), float(finite.max())
        self.min = min(self.min, lo)
        self.max = max(self.max, hi)
        big = max(abs(lo), abs(hi))
        if big > max(self.scale, _SCALE_FROM):
            self.m2 *= (self.scale / big) ** 2
            self.scale = big
        scale = self.scale
        scaled = finite / scale if scale != 1.0 else finite
        mean_s = float(scaled.mean())
        deviations = scaled - mean_s
        m2 = float(np.dot(deviations, deviations))  # one pass, where ** 2 then sum took two
        total = self.finite + n
        delta_s = mean_s - self.mean / scale
        self.mean += delta_s * n / total * scale
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
            else {"edges": self.edges.tolist(), "counts": self.counts.tolist()},
        }


def _values(ref: TensorRef) -> Any:
    """The tensor's values as float64 chunks, with the chunk's integers for integer dtypes
    (else None)."""
    per = max(ref.dtype.bits, 8)
    chunk = max(24, (_CHUNK_ELEMENTS * per // 8) // 24 * 24)
    for raw in ref.chunks(chunk):
        values = decode(ref.dtype, raw)
        exact = values if values.dtype.kind in "iu" else None
        yield raw.size, to_float64(values), exact


#: Up to this many histogram bins, numpy's search of explicit edges is the faster way.
_SEARCHED_BINS: Final = 10_000


def tensor_stats(ref: TensorRef, bins: int | None, progress: Callable[[int], None]) -> Summary:
    """Stream one tensor's data (twice with a histogram) and summarise it."""
    s = Summary()
    with np.errstate(invalid="ignore", over="ignore"):
        for nbytes, values, exact in _values(ref):
            s.add(values, exact)
            progress(nbytes)
        if bins and s.finite:
            lo, hi = s.min, s.max
            counts = np.zeros(bins, np.int64)
            if hi <= lo:
                # One value: numpy's own choice, bins around it ([v - 0.5, v + 0.5]).
                lo, hi = lo - 0.5, hi + 0.5
            spanned = math.isfinite(hi - lo)
            if spanned:
                edges = np.linspace(lo, hi, bins + 1)
            else:  # the range itself overflows: halve the ends (exact), space, double back
                edges = np.linspace(lo / 2, hi / 2, bins + 1) * 2
            # Many bins: numpy's arithmetic path for a count and a range (then corrected against
            # these same edges, so the counts are the same) beats its search of explicit edges
            # (1,000,000 bins: 173 against 777 ms a 3M-value chunk; 10-5,000 bins: slower).
            # Only where the edges are distinct: over a range of a few units in the last place
            # numpy refuses a count and a range ("Too many bins for data range"), while the
            # search takes the repeated edges (10,000 bins ran, 10,001 failed the command).
            by_range = spanned and bins > _SEARCHED_BINS and bool(np.all(np.diff(edges) > 0))
            for nbytes, values, _ in _values(ref):
                finite = values[np.isfinite(values)]
                if by_range:
                    counts += np.histogram(finite, bins=bins, range=(lo, hi))[0]
                else:
                    counts += np.histogram(finite, bins=edges)[0]
                progress(nbytes)
            s.edges, s.counts = edges, counts
    return s


def _edge_labels(edges: list[float]) -> list[str]:
    """The edges as short text, with as many significant digits as tell neighbours apart
    (four where that is enough; ``[1000, 1000)`` said nothing for bins of width 0.1)."""
    labels = [f"{e:.4g}" for e in edges]
    for digits in range(5, 18):
        if len(set(labels)) == len(labels):
            break
        labels = [f"{e:.{digits}g}" for e in edges]
    return labels


def _fmt(value: float | None) -> str:
    if isinstance(value, int):  # an integer tensor's exact extreme, all its digits
        return str(value)
    return "-" if value is None else f"{value:.6g}"


def run(args: argparse.Namespace) -> int:
    """Run ``stats``."""
    ui = Ui(args)
    accept = name_filter(args)
    if args.histogram is not None and not 1 <= args.histogram <= MAX_BINS:
        from ._common import UsageError

        # Each bin is an int64 counter per tensor: 10**10 bins would ask for 75 GiB.
        raise UsageError(f"--histogram takes 1 to {MAX_BINS:,} bins, not {args.histogram:,}")
    results: list[tuple[TensorRef, Summary]] = []
    with open_model(args.target, remote_options(args)) as model:
        inconsistent = model.warn_index()
        refs = [t for t in model.tensors.values() if accept(t.name)]
        total = sum(t.nbytes for t in refs) * (2 if args.histogram else 1)
        with ui.progress(total, "stats") as update, model.planned_reads(refs):
            if args.json:

                def entries() -> Iterator[dict[str, Any]]:
                    # Each tensor summarised as it is written: nothing kept per tensor.
                    for r in refs:
                        s = tensor_stats(r, args.histogram, update)
                        yield {
                            "name": r.name,
                            "dtype": r.dtype.code,
                            "shape": list(r.shape),
                            **s.as_dict(),
                        }

                print_json(
                    {
                        "schema": SCHEMA,
                        "target": shown(args.target),
                        "tensors": LazyRows(len(refs), entries),
                    }
                )
                return inconsistent
            for ref in refs:
                results.append((ref, tensor_stats(ref, args.histogram, update)))
    rows = []
    for ref, s in results:
        d = s.as_dict()
        rows.append(
            [
                quoted(ref.name),
                ref.dtype.code,
                f"{s.count:,}",
                _fmt(d["min"]),
                _fmt(d["max"]),
                _fmt(d["mean"]),
                _fmt(d["std"]),
                str(s.nan),
                str(s.inf),
                f"{s.zeros:,}",
            ]
        )
    numeric = ("COUNT", "MIN", "MAX", "MEAN", "STD", "NAN", "INF", "ZEROS")
    ui.table(["NAME", "DTYPE", *numeric], rows, right=numeric)
    for ref, s in results:
        if s.edges is None or s.counts is None:
            continue
        ui.line()
        ui.line(f"{quoted(ref.name)}:", style="bold")
        counts = s.counts.tolist()
        labels = _edge_labels(s.edges.tolist())
        peak = max(counts) or 1
        # numpy's bins are half-open except the last, which holds the maximum. One write a
        # histogram: a line each took a third of the time of 300 histograms of 1,000 bins.
        closes = [")"] * (len(counts) - 1) + ["]"]
        ui.line(
            "\n".join(
                f"  [{lo:>11}, {hi:>11}{close}  {int(c):>10,}  {'#' * round(40 * c / peak)}"
                for lo, hi, close, c in zip(labels[:-1], labels[1:], closes, counts, strict=True)
            )
        )
    return inconsistent
