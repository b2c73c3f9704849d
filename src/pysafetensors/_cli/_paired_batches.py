"""Pairs of small tensors read together, for ``diff`` of files of thousands of them.

``diff`` compares each tensor of A with the tensor of the same name in B. Read a tensor at a
time, a small one cost two reads and a worker hand-off: 100,000 tensors of a few hundred
elements took ~10 s on a 2-core host, mostly in per-tensor bookkeeping. Where the tensors
compared one after another lie next to each other in A's file and in B's (two copies of one
model, a model against its cast: the common cases), a run of them is read as one span of each
file and compared pair by pair from the spans' slices, which are the bytes the per-tensor path
reads (such a tensor is one chunk there), so the answers are the same.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from . import _chunk_work
from ._common import TensorRef

__all__ = ["PairBatch", "batched_pairs", "read_pair_batch"]


@dataclass(frozen=True, slots=True)
class PairBatch:
    """Pairs whose A sides lie one after another in one file of A, and B sides in one of B."""

    pairs: tuple[tuple[TensorRef, TensorRef], ...]


def batched_pairs(
    pairs: Sequence[tuple[TensorRef, TensorRef]], cap: int
) -> Iterator[PairBatch | tuple[TensorRef, TensorRef]]:
    """``pairs`` in their order, runs of small pairs adjacent on both sides as batches of at
    most ``cap`` elements a side, the others alone (``cap`` 0: every pair alone)."""
    run: list[tuple[TensorRef, TensorRef]] = []
    elements = 0
    for a, b in pairs:
        n = a.numel  # b's too: the same shape
        # At most one chunk of the per-tensor path (whose answer is then the same).
        small = cap > 0 and n <= cap and n <= _chunk_work.CHUNK_ELEMENTS
        if run:
            last_a, last_b = run[-1]
            follows = (
                small
                and a.file is last_a.file
                and a.begin == last_a.end
                and b.file is last_b.file
                and b.begin == last_b.end
                and elements + n <= cap
            )
            if not follows:
                yield PairBatch(tuple(run)) if len(run) > 1 else run[0]
                run, elements = [], 0
        if small:
            run.append((a, b))
            elements += n
        else:
            yield a, b
    if run:
        yield PairBatch(tuple(run)) if len(run) > 1 else run[0]


def read_pair_batch(batch: PairBatch) -> tuple[PairBatch, np.ndarray, np.ndarray]:
    """``batch`` with its A span and its B span, each read in one request (fresh memory:
    handed to a worker)."""
    spans = []
    for side in (0, 1):
        first, last = batch.pairs[0][side], batch.pairs[-1][side]
        raw = np.empty(last.end - first.begin, np.uint8)
        if raw.size:
            first.file.data.readinto(first.file_offsets[0], raw.data)
        spans.append(raw)
    return batch, spans[0], spans[1]
