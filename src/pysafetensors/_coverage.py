"""Which byte ranges of a tensor a streaming write has covered, for writes in any order.

One sorted list of ranges made every write that closed a gap cost time in proportion to the
number of ranges (``del`` and ``insert`` move the tail): gathering a column-split tensor rank by
rank, whose last rank closes one gap per row, took 11.7 s for 262,144 rows and 4x the rows took
15x the time. The ranges are kept in buckets of a few hundred instead (as a sorted list of
sorted lists), so that a write costs a search and a short move whatever the count.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from typing import Final

__all__ = ["Coverage"]

#: Ranges a bucket holds before it is split in two.
_BUCKET_MAX: Final = 512


class Coverage:
    """Disjoint ``[start, end)`` ranges, touching ones merged, with the bytes they cover."""

    def __init__(self) -> None:
        self._buckets: list[list[list[int]]] = []
        self._firsts: list[int] = []  # each bucket's first start, for the search
        self.covered = 0
        """Bytes the ranges cover."""

    def _clear(self) -> None:
        self._buckets, self._firsts, self.covered = [], [], 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for bucket in self._buckets:
            # As tuples: the caller cannot change a range.
            yield from ((start, end) for start, end in bucket)

    def __len__(self) -> int:
        return sum(len(bucket) for bucket in self._buckets)

    def add(self, start: int, end: int) -> tuple[int, int] | None:
        """Cover ``[start, end)`` (``start < end``), unless it overlaps a covered range.

        Returns:
            None when added; else the covered range it overlaps (nothing changes).
        """
        if not self._buckets:
            self._buckets.append([[start, end]])
            self._firsts.append(start)
            self.covered += end - start
            return None
        b = max(0, bisect_right(self._firsts, start) - 1)
        bucket = self._buckets[b]
        i = bisect_right(bucket, start, key=lambda r: r[0])
        before = bucket[i - 1] if i else (self._buckets[b - 1][-1] if b else None)
        if i < len(bucket):
            after: list[int] | None = bucket[i]
        else:
            after = self._buckets[b + 1][0] if b + 1 < len(self._buckets) else None
        if before is not None and before[1] > start:
            return before[0], before[1]
        if after is not None and after[0] < end:
            return after[0], after[1]
        self.covered += end - start
        joins_before = before is not None and before[1] == start
        joins_after = after is not None and after[0] == end
        if joins_before and joins_after:
            assert before is not None and after is not None
            before[1] = after[1]
            if i < len(bucket):
                self._remove(b, i)
            else:
                self._remove(b + 1, 0)
        elif joins_before:
            assert before is not None
            before[1] = end
        elif joins_after:
            assert after is not None
            after[0] = start
            if i == len(bucket):
                self._firsts[b + 1] = start
            elif i == 0:
                self._firsts[b] = start
        else:
            bucket.insert(i, [start, end])
            if i == 0:
                self._firsts[b] = start
            if len(bucket) > _BUCKET_MAX:
                half = len(bucket) // 2
                self._buckets.insert(b + 1, bucket[half:])
                self._firsts.insert(b + 1, bucket[half][0])
                del bucket[half:]
        return None

    def _remove(self, b: int, i: int) -> None:
        bucket = self._buckets[b]
        del bucket[i]
        if not bucket:
            del self._buckets[b]
            del self._firsts[b]
        elif i == 0:
            self._firsts[b] = bucket[0][0]

    def discard(self, start: int, end: int) -> None:
        """Uncover ``[start, end)`` (a write that failed); rare, so simply rebuilt."""
        kept: list[tuple[int, int]] = []
        for a, b in self:
            if b <= start or a >= end:
                kept.append((a, b))
                continue
            if a < start:
                kept.append((a, start))
            if b > end:
                kept.append((end, b))
        self._clear()
        for a, b in kept:
            self.add(a, b)
