"""The streaming writer's record of written byte ranges, against a plain set of bytes."""

from __future__ import annotations

import random

import pytest

from pysafetensors._coverage import Coverage


def _naive_clash(covered: set[int], start: int, end: int) -> bool:
    return any(b in covered for b in range(start, end))


@pytest.mark.parametrize("seed", range(20))
def test_coverage_agrees_with_a_set_of_bytes(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.choice([50, 400, 3000])
    coverage, covered = Coverage(), set()
    for _ in range(4000):
        start = rng.randrange(size)
        end = min(size, start + rng.choice([1, 1, 2, 5, 17]))
        clash = coverage.add(start, end)
        if _naive_clash(covered, start, end):
            assert clash is not None
            # The range named is a covered one that the write overlaps.
            assert clash[0] < end and start < clash[1]
            assert set(range(*clash)) <= covered
        else:
            assert clash is None
            covered.update(range(start, end))
        if rng.random() < 0.01:  # a failed write forgets its bytes
            a = rng.randrange(size)
            b = min(size, a + rng.randrange(1, 40))
            coverage.discard(a, b)
            covered.difference_update(range(a, b))
        assert coverage.covered == len(covered)
    ranges = list(coverage)
    assert [b for r in ranges for b in range(*r)] == sorted(covered)
    # Merged: no two ranges touch.
    assert all(x[1] < y[0] for x, y in zip(ranges, ranges[1:], strict=False))


def test_gaps_closed_last_merge_into_one_range() -> None:
    """A column split gathered rank by rank: the last rank closes one gap per row."""
    rows, ranks, width = 20_000, 4, 8
    coverage = Coverage()
    for rank in range(ranks):
        for row in range(rows):
            start = (row * ranks + rank) * width
            assert coverage.add(start, start + width) is None
        assert len(coverage) == (rows if rank < ranks - 1 else 1)
    assert list(coverage) == [(0, rows * ranks * width)]
    assert coverage.covered == rows * ranks * width
