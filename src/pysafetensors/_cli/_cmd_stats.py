"""``pysafetensors stats``: per-tensor min/max/mean/std, NaN/Inf/zero counts, histograms.

Tensors are streamed in chunks (a quarter of a million elements at a time, summarised on
worker threads while the next are read: see :mod:`._chunk_work`), so memory stays bounded
whatever the tensor size. Runs of adjacent small tensors (a MoE's experts, a LoRA's adapters) are
read at once and summarised in batches instead (:mod:`._small_tensors`), to the same numbers.
Mean and standard deviation are merged chunk by chunk with Chan's
parallel formula, which stays accurate where a running sum of squares would not. They cover the
finite values only; NaN and Inf are counted separately. Complex tensors are summarised by
magnitude.
"""

from __future__ import annotations

import argparse
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, cast

import numpy as np

from .._dtypes import DType
from . import _chunk_work
from ._chunk_work import ChunkWorkers, as_float64, chunk_bytes, element_chunks
from ._common import (
    LazyRows,
    TensorRef,
    Ui,
    add_filter_args,
    add_header_limit_arg,
    check_filter_matches,
    name_filter,
    open_model,
    print_json,
    quoted,
    shown,
)
from ._histogram import histogram_edges
from ._histogram_spool import HistogramSpool, Kept
from ._remote_args import add_remote_args, remote_options
from ._small_tensors import Batch, batched, read_batch, summarise_batch
from ._value_stats import Part, Summary, summarise

SCHEMA: Final = "pysafetensors.stats/1"
#: Most histogram bins (each an int64 counter).
MAX_BINS: Final = 1_000_000
#: Histogram lines drawn and written at once.
_BLOCK_LINES: Final = 16_384
#: A histogram bar's most characters, and what else its line takes with labels of 11.
_BAR: Final = 40
_BESIDE_BAR: Final = 42


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
        type=_bin_count,
        const=10,
        default=None,
        metavar="BINS",
        help="also compute a histogram of finite values (default 10 bins; reads data twice)",
    )
    p.add_argument("--json", action="store_true", help=f"machine-readable output ({SCHEMA})")
    add_remote_args(p)
    add_header_limit_arg(p)
    p.set_defaults(func=run)


def _bin_count(text: str) -> int:
    """``--histogram``'s optional number. Given before TARGET without one, it takes TARGET as
    its number (argparse's way with optional values): the refusal says how to write it."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a number of bins: {text!r} (put --histogram after TARGET, or give it a"
            " number: --histogram 10 TARGET)"
        ) from None


def _first_pass(dtype: DType) -> Callable[[np.ndarray], Part]:
    def run(raw: np.ndarray) -> Part:
        with np.errstate(invalid="ignore", over="ignore"):  # per thread: NaN and Inf counted
            return summarise(*as_float64(dtype, raw))

    return run


def _counting_pass(
    dtype: DType, bins: int, lo: float, hi: float, edges: np.ndarray, by_range: bool
) -> Callable[[np.ndarray], np.ndarray]:
    def run(raw: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):
            values, _ = as_float64(dtype, raw)
            finite = values[np.isfinite(values)]
            if by_range:
                counts: np.ndarray = np.histogram(finite, bins=bins, range=(lo, hi))[0]
            else:
                counts = np.histogram(finite, bins=edges)[0]
        return counts

    return run


def tensor_stats(
    ref: TensorRef, bins: int | None, progress: Callable[[int], None], workers: ChunkWorkers
) -> Summary:
    """Stream one tensor's data (twice with a histogram) and summarise it."""
    s = Summary()
    step = chunk_bytes(ref.dtype)
    alone = ref.nbytes <= step
    with np.errstate(invalid="ignore", over="ignore"):
        for raw, part in workers.ordered(_first_pass(ref.dtype), element_chunks(ref), alone=alone):
            s.merge(part)
            progress(raw.size)
        if bins and s.finite:
            edges = histogram_edges(s.min, s.max, bins)
            lo, hi = float(edges[0]), float(edges[-1])
            counts = np.zeros(bins, np.int64)
            # numpy's arithmetic path for a count and a range (then corrected against these
            # same edges, so the counts are the same) beats its search of explicit edges, which
            # sorts every chunk: 1.5-2.9 against 9.7-10.7 ms for 262,144 values, 10 to 10,000
            # bins alike (a 1 GiB file with --histogram 10: 2.8-3.3 s against 7.2-8.3 s), and
            # 173 against 777 ms for 1,000,000 bins. Only where the edges are distinct: over a
            # range of a few units in the last place numpy refuses a count and a range ("Too
            # many bins for data range"), while the search takes the repeated edges.
            # numpy's edges for a count and a range are linspace of its ends: ours, where the
            # width is finite (histogram_edges halves a width that overflows).
            by_range = math.isfinite(hi - lo) and bool(np.all(np.diff(edges) > 0))
            # Chunks of at least four values a bin: each chunk's counts are an array of all
            # the bins, which must not cost more than counting the chunk.
            step = max(step, 4 * bins * ref.dtype.bits // 8)  # whole F4/F6 bytes: 4n elements
            count = _counting_pass(ref.dtype, bins, lo, hi, edges, by_range)
            alone = ref.nbytes <= step
            for raw, chunk_counts in workers.ordered(count, ref.chunks(step), alone=alone):
                counts += chunk_counts
                progress(raw.size)
            s.edges, s.counts = edges, counts
    return s


#: Words (float64-sized) a batch of small tensors may hold (see :mod:`._small_tensors`);
#: None: :data:`._chunk_work.CHUNK_ELEMENTS`, as a chunk of the per-tensor path; 0: no
#: batches, every tensor on its own.
BATCH_WORDS: int | None = None


def all_stats(
    refs: Sequence[TensorRef],
    bins: int | None,
    progress: Callable[[int], None],
    workers: ChunkWorkers,
    *,
    batch_words: int | None = None,
) -> Iterator[tuple[TensorRef, Summary]]:
    """Each of ``refs`` with its summary, in order: runs of adjacent small tensors read and
    summarised in batches of at most ``batch_words`` (default :data:`BATCH_WORDS`), the others
    streamed by :func:`tensor_stats`. The summaries are the same either way."""
    if batch_words is None:
        batch_words = _chunk_work.CHUNK_ELEMENTS if BATCH_WORDS is None else BATCH_WORDS
    units = list(batched(refs, bins, batch_words))
    job = summarise_batch(bins)
    i = 0
    while i < len(units):
        unit = units[i]
        if isinstance(unit, TensorRef):
            yield unit, tensor_stats(unit, bins, progress, workers)
            i += 1
            continue
        j = i
        while j < len(units) and isinstance(units[j], Batch):
            j += 1
        group = cast("list[Batch]", units[i:j])
        # Read on this thread (one reader at a time: remote planned reads), summarised on the
        # workers; one batch alone is summarised here (a hand-off would cost more).
        for (batch, _), done in workers.ordered(job, map(read_batch, group), alone=len(group) == 1):
            for ref, summary in zip(batch.refs, done, strict=True):
                progress(ref.nbytes * (1 if summary.counts is None else 2))
                yield ref, summary
        i = j


def _label_digits(edges: np.ndarray) -> int:
    """The fewest significant digits, from four, whose labels tell each edge from its
    neighbours (``[1000, 1000)`` said nothing for bins of width 0.1); 17, float64's round-trip
    digits, where none do (equal edges: a range of a few units in the last place).

    Checked :data:`_BLOCK_LINES` labels at a time, each block given up at its first pair of
    equal labels: a million edges as Python floats and strings at once held ~120 MB. The edges
    are non-decreasing and rounding keeps their order, so labels that repeat are neighbours.
    """
    n = edges.size
    for digits in range(4, 17):
        previous = None
        for start in range(0, n, _BLOCK_LINES):
            labels = [f"{e:.{digits}g}" for e in edges[start : start + _BLOCK_LINES].tolist()]
            if labels[0] == previous or any(map(operator.eq, labels, labels[1:])):
                break
            previous = labels[-1]
        else:
            return digits
    return 17


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
    results: list[tuple[TensorRef, Summary, Kept | None]] = []
    # The histograms wait for the table off the heap (see HistogramSpool).
    with HistogramSpool() as spool:
        with open_model(args.target, remote_options(args), args.max_header_size) as model:
            inconsistent = model.warn_index()
            check_filter_matches(args, model)
            refs = [t for t in model.tensors.values() if accept(t.name)]
            total = sum(t.nbytes for t in refs) * (2 if args.histogram else 1)
            with (
                ui.progress(total, "stats") as update,
                model.planned_reads(refs),
                ChunkWorkers() as workers,
            ):
                summaries = all_stats(refs, args.histogram, update, workers)
                if args.json:

                    def entries() -> Iterator[dict[str, Any]]:
                        # Each tensor summarised as it is written: nothing kept per tensor.
                        for r, s in summaries:
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
                for ref, summary in summaries:
                    kept = None
                    if summary.edges is not None and summary.counts is not None:
                        kept = spool.keep(summary.edges, summary.counts)
                        summary.edges = summary.counts = None
                    results.append((ref, summary, kept))
        _print_results(ui, results, spool)
    return inconsistent


def _print_results(
    ui: Ui, results: list[tuple[TensorRef, Summary, Kept | None]], spool: HistogramSpool
) -> None:
    """The table of every tensor, then each histogram (kept in ``spool``)."""
    rows = []
    for ref, s, _ in results:
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
    # On a terminal, lines that fit it: 82 characters wrapped every bar on 80 columns.
    columns = ui.columns()
    bar = _BAR if columns is None else max(8, min(_BAR, columns - 1 - _BESIDE_BAR))
    for ref, _, kept in results:
        if kept is None:
            continue
        ui.line()
        ui.line(f"{quoted(ref.name)}:", style="bold")
        for block in _histogram_blocks(*spool.get(kept), bar):
            ui.line(block)


def _histogram_blocks(edges: np.ndarray, counts: np.ndarray, bar: int = _BAR) -> Iterator[str]:
    """A histogram's lines, :data:`_BLOCK_LINES` at a time joined by newlines, the largest
    count's bar ``bar`` characters long.

    One write a block: a line each took a third of the time of 300 histograms of 1,000 bins;
    a million bins in one string held ~50 MB more. Only a block's labels and counts are ever
    Python objects."""
    digits = _label_digits(edges)
    peak = int(counts.max()) or 1
    last = counts.size - 1
    for start in range(0, counts.size, _BLOCK_LINES):
        values = counts[start : start + _BLOCK_LINES].tolist()
        labels = [f"{e:.{digits}g}" for e in edges[start : start + len(values) + 1].tolist()]
        # numpy's bins are half-open except the last, which holds the maximum.
        yield "\n".join(
            f"  [{labels[j]:>11}, {labels[j + 1]:>11}{']' if start + j == last else ')'}  "
            f"{c:>10,}  {'#' * round(bar * c / peak)}"
            for j, c in enumerate(values)
        )
