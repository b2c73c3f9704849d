"""Small tensors read and summarised together, for ``stats`` over files of thousands of them.

A MoE or LoRA checkpoint holds tens of thousands of tensors of a few hundred elements. Each
paid a tensor's fixed costs (a read, or two with a histogram, and some twenty numpy calls, each
a few microseconds on tiny arrays): summarising 20,000 BF16 tensors of 128 elements took
0.6 s, 1.6 s with a histogram of 10 bins, on a 2-core host; in batches 0.12 and 0.19 s. Here
runs of adjacent small tensors (next to each other in the same file, as a file's tensors are in
its order) are read in one contiguous read and summarised in one worker job, each tensor's
numbers those of the per-tensor path (which reads such a tensor as one chunk), bit for bit.

A batch holds at most ``cap`` float64-sized words (``cap`` is :data:`.CHUNK_ELEMENTS`, a chunk
of the per-tensor path): each tensor's elements and, with a histogram, 8 words a bin, so that
the edges and counts a batch keeps until its tensors are written (2 words a bin) take at most a
quarter of it (the JSON output holds a few batches in flight, not one tensor). A tensor larger
than that (several chunks, or a histogram of some 32,000 bins or more) goes through the per-tensor
path.

Within a batch, tensors of one dtype and element count (a MoE's experts, a LoRA's A and B) are
the rows of one array: each statistic is one numpy call over all of them
(:func:`.summarise_rows`, :func:`.histogram_edges_rows`, :func:`.bin_counts_rows`), each
giving for every row what the per-tensor function gives for that tensor alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from . import _chunk_work
from ._chunk_work import as_float64
from ._common import TensorRef
from ._histogram import bin_counts_rows, histogram_edges_rows
from ._value_stats import Summary, summarise_rows

__all__ = ["Batch", "batch_weight", "batched", "read_batch", "summarise_batch"]


@dataclass(frozen=True, slots=True)
class Batch:
    """Adjacent tensors of one file, in file order, read together."""

    refs: tuple[TensorRef, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of all the tensors (they are adjacent: one contiguous span)."""
        return self.refs[-1].end - self.refs[0].begin


def batch_weight(ref: TensorRef, bins: int | None) -> int:
    """What ``ref`` costs a batch, in float64-sized words: its elements (decoded to float64,
    or magnitudes of complex numbers) and, with a histogram, 8 words a bin (see the module)."""
    return ref.numel + (8 * (bins + 1) if bins else 0)


def batched(refs: Sequence[TensorRef], bins: int | None, cap: int) -> Iterator[Batch | TensorRef]:
    """``refs`` in their order, runs of adjacent small ones as batches of at most ``cap``
    words (:func:`batch_weight`), the others alone (``cap`` 0: every tensor alone)."""
    run: list[TensorRef] = []
    weight = 0
    for ref in refs:
        w = batch_weight(ref, bins)
        small = cap > 0 and w <= cap and ref.numel <= _chunk_work.CHUNK_ELEMENTS  # one chunk
        follows = (
            bool(run)
            and ref.file is run[-1].file
            and ref.begin == run[-1].end
            and weight + w <= cap
        )
        if run and not (small and follows):
            yield Batch(tuple(run))
            run, weight = [], 0
        if small:
            run.append(ref)
            weight += w
        else:
            yield ref
    if run:
        yield Batch(tuple(run))


def read_batch(batch: Batch) -> tuple[Batch, np.ndarray]:
    """``batch`` with its bytes, read in one request (fresh memory: handed to a worker)."""
    first = batch.refs[0]
    raw = np.empty(batch.nbytes, np.uint8)
    if raw.size:
        first.file.data.readinto(first.file_offsets[0], raw.data)
    return batch, raw


def summarise_batch(bins: int | None) -> Callable[[tuple[Batch, np.ndarray]], list[Summary]]:
    """A worker job: each tensor of a read batch summarised (with its histogram of ``bins``)."""

    def run(item: tuple[Batch, np.ndarray]) -> list[Summary]:
        batch, raw = item
        found: dict[int, Summary] = {}
        # Per thread: NaN and Inf are counted, not warned about.
        with np.errstate(invalid="ignore", over="ignore"):
            for members, block_raw in _blocks(batch.refs, raw):
                block = [batch.refs[i] for i in members]
                summaries = _block_summaries(block, block_raw, bins)
                found.update(zip(members, summaries, strict=True))
        return [found[i] for i in range(len(batch.refs))]  # in the batch's order

    return run


def _blocks(refs: Sequence[TensorRef], raw: np.ndarray) -> Iterator[tuple[list[int], np.ndarray]]:
    """The tensors of one dtype and element count, wherever they lie in the batch, with
    their bytes one after another: the rows of one array. Only runs of adjacent tensors
    were taken together before, and a LoRA's A and B matrices, or an expert's w1, w2 and w3,
    alternate: every block was one tensor (~20 numpy calls each; --histogram 3x slower)."""
    starts: list[int] = []
    groups: dict[tuple[str, int], list[int]] = {}
    pos = 0
    for i, ref in enumerate(refs):
        starts.append(pos)
        pos += ref.nbytes
        groups.setdefault((ref.dtype.code, ref.numel), []).append(i)
    for members in groups.values():
        first, last = members[0], members[-1]
        if last - first + 1 == len(members):  # adjacent: a view
            yield members, raw[starts[first] : starts[last] + refs[last].nbytes]
        else:
            yield (
                members,
                np.concatenate([raw[starts[i] : starts[i] + refs[i].nbytes] for i in members]),
            )


def _block_summaries(block: list[TensorRef], raw: np.ndarray, bins: int | None) -> list[Summary]:
    """Summaries of tensors of one dtype and element count, adjacent in ``raw``, each its own
    as the per-tensor path makes it: :func:`.summarise_rows` (:func:`.summarise` of each),
    merged into a fresh :class:`.Summary`, histograms of the same edges and counts."""
    dtype, k, n = block[0].dtype, len(block), block[0].numel
    summaries = [Summary() for _ in range(k)]
    if not n:
        return summaries
    values, integers = as_float64(dtype, raw)
    parts = summarise_rows(
        values.reshape(k, n), None if integers is None else integers.reshape(k, n)
    )
    for s, part in zip(summaries, parts, strict=True):
        s.merge(part)
    if not bins:
        return summaries
    counted = [i for i, s in enumerate(summaries) if s.finite]
    if not counted:
        return summaries
    # summarise_rows overwrote the values: decoded again, as the per-tensor path reads again.
    values = as_float64(dtype, raw)[0].reshape(k, n)
    if len(counted) < k:
        values = values[counted]
    lo = np.array([summaries[i].min for i in counted])
    hi = np.array([summaries[i].max for i in counted])
    edges = histogram_edges_rows(lo, hi, bins)
    counts = bin_counts_rows(values, edges)
    for row, i in enumerate(counted):
        summaries[i].edges, summaries[i].counts = edges[row], counts[row]
    return summaries
