"""PlannedReads: planned small reads served from few large reads of the source, byte-exact."""

from __future__ import annotations

import contextlib
import random
import threading

import numpy as np
import pytest

from pysafetensors import _planned_reads
from pysafetensors._errors import SafetensorError
from pysafetensors._planned_reads import BlockBudget, PlannedReads
from pysafetensors._sources import BufferSource


class Counting:
    """A buffer source that records each read and can be told to fail the next one."""

    def __init__(self, data: bytes) -> None:
        self.inner = BufferSource(data)
        self.reads: list[tuple[int, int]] = []
        self.threads: list[str] = []  # the thread of each read
        self.fail_next = False
        self.fail_from: int | None = None  # every read from this offset on fails

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def name(self) -> str:
        return "counting"

    def readinto(self, offset: int, out: memoryview) -> None:
        if self.fail_next or (self.fail_from is not None and offset >= self.fail_from):
            self.fail_next = False
            raise OSError(f"injected failure at {offset}")
        self.reads.append((offset, out.nbytes))
        self.threads.append(threading.current_thread().name)
        self.inner.readinto(offset, out)

    def view(self, offset: int, length: int) -> memoryview | None:
        return None

    def close(self) -> None:
        pass

    @property
    def fetched(self) -> int:
        return sum(n for _, n in self.reads)


def _read(src: object, offset: int, n: int) -> bytes:
    buf = np.empty(n, np.uint8)
    src.readinto(offset, buf.data)  # type: ignore[attr-defined]
    return buf.tobytes()


def _tiling(rng: random.Random, size: int, count: int) -> list[tuple[int, int]]:
    cuts = sorted(rng.sample(range(1, size), count - 1))
    edges = [0, *cuts, size]
    return list(zip(edges, edges[1:], strict=False))


def test_tensors_in_file_order_take_one_read_per_block() -> None:
    rng = random.Random(1)
    data = rng.randbytes(300_000)
    src = Counting(data)
    ranges = _tiling(rng, len(data), 1000)
    planned = PlannedReads(src, ranges, max_gap=0, block_bytes=64 << 10)
    for start, end in ranges:
        # Each tensor in chunks of up to 7 bytes, as a streaming reader takes it.
        for a in range(start, end, 7):
            b = min(end, a + 7)
            assert _read(planned, a, b - a) == data[a:b]
    planned.close()
    # Every byte fetched once, in blocks of at most half of 64 KiB (a block and the one
    # fetched ahead of it share the 64 KiB), every one after the first in the background.
    assert src.fetched == len(data)
    assert len(src.reads) == -(-len(data) // (32 << 10))
    assert all(n <= 32 << 10 for _, n in src.reads)
    assert src.threads[0] == threading.current_thread().name
    assert set(src.threads[1:]) == {"pysafetensors-planned-reads"}


def test_unplanned_bytes_are_not_fetched() -> None:
    """A filtered pass (three small tensors of a large file) fetches those tensors, and the
    gaps between planned ranges only when they are within max_gap."""
    data = bytes(range(256)) * 4096  # 1 MiB
    src = Counting(data)
    ranges = [(1000, 1100), (1150, 1200), (500_000, 500_064)]
    planned = PlannedReads(src, ranges, max_gap=64)
    for start, end in ranges:
        assert _read(planned, start, end - start) == data[start:end]
    assert src.reads == [(1000, 200), (500_000, 64)]  # the 50-byte gap bridged, not the rest
    src.reads.clear()
    planned = PlannedReads(src, ranges, max_gap=0)
    for start, end in ranges:
        assert _read(planned, start, end - start) == data[start:end]
    assert src.reads == [(1000, 100), (1150, 50), (500_000, 64)]


def test_any_order_stays_exact() -> None:
    rng = random.Random(2)
    data = rng.randbytes(200_000)
    src = Counting(data)
    ranges = _tiling(rng, len(data), 300)
    planned = PlannedReads(src, ranges, max_gap=1 << 10, block_bytes=16 << 10)
    for _ in range(2000):
        a = rng.randrange(len(data))
        b = min(len(data), a + rng.randrange(1, 40_000))
        assert _read(planned, a, b - a) == data[a:b]
    # Reads as large as a block go straight to the source.
    src.reads.clear()
    assert _read(planned, 0, 16 << 10) == data[: 16 << 10]
    assert src.reads == [(0, 16 << 10)]


def test_one_block_held_per_budget() -> None:
    data = bytes(1 << 20)
    budget = BlockBudget()
    readers = [
        PlannedReads(
            Counting(data), [(0, 1 << 20)], max_gap=0, block_bytes=256 << 10, budget=budget
        )
        for _ in range(3)
    ]
    for r in readers:
        _read(r, 0, 100)
    held = [any(st.buf is not None for st in r._streams) for r in readers]
    assert held == [False, False, True]
    readers[2].close()
    assert all(st.buf is None for st in readers[2]._streams)


def test_a_failed_read_leaves_no_block() -> None:
    data = bytes(range(256)) * 64
    src = Counting(data)
    planned = PlannedReads(src, [(0, len(data))], max_gap=0)
    src.fail_next = True
    with pytest.raises(OSError, match="injected"):
        _read(planned, 100, 10)
    # Neither the failed block nor stale bytes are served: the next read fetches again (its
    # own bytes: it is not in an order the reads have begun).
    assert _read(planned, 100, 10) == data[100:110]
    assert src.reads == [(100, 10)]


def test_reads_past_the_end_fail_as_the_source_fails() -> None:
    data = bytes(1000)
    planned = PlannedReads(BufferSource(data), [(0, 1000)], max_gap=0)
    with pytest.raises(SafetensorError):
        _read(planned, 990, 20)
    assert _read(planned, 990, 10) == bytes(10)


def test_a_read_across_the_block_end_fetches_only_the_rest() -> None:
    data = bytes(range(256)) * 1024
    src = Counting(data)
    planned = PlannedReads(src, [(0, len(data))], max_gap=0, block_bytes=1000)
    assert _read(planned, 0, 600) == data[:600]
    # 400 bytes from the block fetched ahead (as far as half the room reaches), the other 200
    # from a block of their own, whose next block is fetched ahead in turn.
    assert _read(planned, 600, 600) == data[600:1200]
    for future in list(planned._fetching):
        future.result()
    assert src.reads == [(0, 600), (600, 400), (1000, 500), (1500, 500)]
    # Into memory of another element type: counted in bytes all the same. Its first 500
    # bytes come from the block fetched ahead, the rest (as large as a block) straight into
    # ``out``.
    out = np.empty(400, np.float32)
    planned.readinto(1500, out.data)
    assert out.tobytes() == data[1500:3100]
    planned.close()
    assert src.reads[4:] == [(2000, 1100)]


def _two_groups(rng: random.Random) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """A file laid out as the writers lay out mixed dtypes: a group of large tensors (F32),
    then a group of small ones (F16), each group in name order."""
    names = [f"t{i:03d}" for i in range(120)]
    large = [n for i, n in enumerate(names) if i % 2 == 0]
    small = [n for i, n in enumerate(names) if i % 2 == 1]
    spans: dict[str, tuple[int, int]] = {}
    pos = 0
    for name in large + small:
        size = 20_000 if name in large else 300
        spans[name] = (pos, pos + size)
        pos += size
    return rng.randbytes(pos), spans


def test_two_groups_read_in_name_order_fetch_each_byte_once() -> None:
    """diff and cast read in name order, which over two dtype groups is two streams through
    the file: each keeps a block, and neither throws the other's away (a single block was
    refetched at each jump: 19x the file)."""
    data, spans = _two_groups(random.Random(3))
    src = Counting(data)
    planned = PlannedReads(src, spans.values(), max_gap=0, block_bytes=64 << 10)
    for name in sorted(spans):
        start, end = spans[name]
        for a in range(start, end, 8192):  # in chunks, as the commands read
            b = min(end, a + 8192)
            assert _read(planned, a, b - a) == data[a:b]
    planned.close()
    assert src.fetched == len(data)
    assert len(src.reads) <= len(data) // (16 << 10)  # far fewer than the 180 tensors' reads


def test_three_groups_read_in_name_order_fetch_each_byte_once() -> None:
    """Three dtype groups (F32, F16, I64) read in name order: three streams. With two, the
    third group's reads started over the least recently used stream, throwing away its
    block and the one fetched ahead (1.7-1.9x the file)."""
    rng = random.Random(5)
    sizes = {0: 20_000, 1: 300, 2: 8}
    names = [f"t{i:03d}" for i in range(180)]
    spans: dict[str, tuple[int, int]] = {}
    pos = 0
    for group in range(3):
        for i, name in enumerate(names):
            if i % 3 == group:
                spans[name] = (pos, pos + sizes[group])
                pos += sizes[group]
    data = rng.randbytes(pos)
    src = Counting(data)
    planned = PlannedReads(src, spans.values(), max_gap=0, block_bytes=64 << 10)
    for name in names:
        start, end = spans[name]
        assert _read(planned, start, end - start) == data[start:end]
    planned.close()
    assert src.fetched == len(data)
    assert len(src.reads) <= 3 * len(data) // (16 << 10), len(src.reads)


def test_reads_alternating_between_files_of_one_budget_fetch_their_bytes() -> None:
    """Files sharing a budget read in turn, a tensor at a time (a diff of a model whose
    shards interleave against the other's order): each read took the budget back and fetched
    a block as far as its file's reads had come, and one ahead, both dropped at the next
    switch (22x the bytes read)."""
    tensor = 256 << 10
    budget = BlockBudget()
    sources = [Counting(random.Random(i).randbytes(64 * tensor)) for i in range(2)]
    readers = [
        PlannedReads(
            src,
            [(i * tensor, (i + 1) * tensor) for i in range(64)],
            max_gap=0,
            block_bytes=16 << 20,
            budget=budget,
        )
        for src in sources
    ]
    for i in range(64):
        for src, reader in zip(sources, readers, strict=True):
            got = _read(reader, i * tensor, tensor)
            assert got == src.inner.view(i * tensor, tensor).tobytes()  # type: ignore[union-attr]
            _settle(reader)
    for reader in readers:
        reader.close()
    asked = 2 * 64 * tensor
    assert sum(src.fetched for src in sources) <= 1.1 * asked


def test_a_range_read_backwards_in_chunks_fetches_each_byte_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read out of order fetches its own bytes: it fetched the rest of its planned range,
    again for each chunk read from the end back (16x the range for 32 chunks); reads in a
    random order of single bytes fetched up to 1,400x."""
    data = random.Random(2).randbytes(32 * 4096)
    src = Counting(data)
    planned = PlannedReads(src, [(0, len(data))], max_gap=0, block_bytes=1 << 20)
    for a in reversed(range(0, len(data), 4096)):
        assert _read(planned, a, 4096) == data[a : a + 4096]
    planned.close()
    assert src.fetched == len(data)
    monkeypatch.setattr(_planned_reads, "FIRST_REACH", 4096)
    data = random.Random(3).randbytes(1 << 20)
    rng = random.Random(4)
    src = Counting(data)
    planned = PlannedReads(src, [(0, len(data))], max_gap=0, block_bytes=1 << 20)
    for a in rng.sample(range(len(data)), 500):
        assert _read(planned, a, 1) == data[a : a + 1]
    planned.close()
    # The bytes asked for, and the first blocks of the streams the reads ahead of the
    # others began (each its first reach, and as much fetched ahead).
    assert src.fetched <= 500 + 2 * _planned_reads.STREAMS * 4096, src.fetched


def test_a_second_pass_fetches_its_tensor_again_not_a_block() -> None:
    data = bytes(range(256)) * 4096  # 1 MiB
    src = Counting(data)
    ranges = [(0, 300_000), (300_000, 600_000), (600_000, 1 << 20)]
    planned = PlannedReads(src, ranges, max_gap=0, block_bytes=256 << 10)
    for start, end in ranges:
        for _ in range(2):  # stats --histogram: each tensor twice
            for a in range(start, end, 50_000):
                b = min(end, a + 50_000)
                assert _read(planned, a, b - a) == data[a:b]
    planned.close()  # waits for a block fetched ahead
    # Each tensor at most twice (its second pass), nothing fetched for the gap-free rest.
    assert src.fetched <= 2 * len(data)


def test_any_order_of_whole_tensors_costs_at_most_twice_their_bytes() -> None:
    rng = random.Random(8)
    for trial in range(30):
        data, spans = _two_groups(rng)
        src = Counting(data)
        planned = PlannedReads(src, spans.values(), max_gap=1000, block_bytes=64 << 10)
        order = sorted(spans)
        rng.shuffle(order)
        asked = 0
        for name in order[: rng.randrange(1, len(order))]:
            start, end = spans[name]
            assert _read(planned, start, end - start) == data[start:end]
            asked += end - start
        planned.close()
        assert src.fetched <= 2 * asked + 2 * (64 << 10), trial


class Slow(Counting):
    """A source whose reads off the calling thread wait until ``go`` is set."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.go = threading.Event()

    def readinto(self, offset: int, out: memoryview) -> None:
        if threading.current_thread() is not threading.main_thread():
            assert self.go.wait(10)
        super().readinto(offset, out)


def test_a_block_fetched_ahead_that_failed_is_fetched_again_by_the_read_that_needs_it() -> None:
    data = random.Random(4).randbytes(200_000)
    src = Counting(data)
    planned = PlannedReads(src, [(0, len(data))], max_gap=0, block_bytes=64 << 10)
    assert _read(planned, 0, 100) == data[:100]  # a first block of 1 MiB at most: all 200 KB
    src.reads.clear()
    planned = PlannedReads(src, [(0, len(data))], max_gap=0, block_bytes=16 << 10)
    assert _read(planned, 0, 6000) == data[:6000]  # block 0-8 KiB; past its half: ahead
    for future in list(planned._fetching):
        future.result()
    src.fail_next = True  # the next fetch ahead fails
    assert _read(planned, 6000, 4000) == data[6000:10000]  # the rest, and into the next block
    for future in list(planned._fetching):
        with contextlib.suppress(OSError):
            future.result()
    # Read on: the failed block is fetched again, by the read that needs it (no error), and
    # every byte comes right.
    for a in range(10_000, len(data), 3000):
        b = min(len(data), a + 3000)
        assert _read(planned, a, b - a) == data[a:b]
    planned.close()
    assert src.fetched >= len(data)


def test_a_block_fetched_ahead_that_keeps_failing_fails_the_read_that_needs_it() -> None:
    data = bytes(range(256)) * 256
    src = Counting(data)
    src.fail_from = 8192  # the block fetched ahead (and any fetch of it) fails
    planned = PlannedReads(src, [(0, len(data))], max_gap=0, block_bytes=16 << 10)
    assert _read(planned, 0, 6000) == data[:6000]  # block 0-8 KiB; the next one fails ahead
    for future in list(planned._fetching):
        with contextlib.suppress(OSError):
            future.result()
    # The read reaching it fetches it again, and raises that fetch's error, with its offset.
    with pytest.raises(OSError, match="injected failure at 8192"):
        _read(planned, 6000, 4000)
    assert _read(planned, 7000, 1000) == data[7000:8000]  # bytes before it still read
    planned.close()


def test_close_waits_for_a_block_on_its_way() -> None:
    data = bytes(range(256)) * 256
    src = Slow(data)
    planned = PlannedReads(src, [(0, len(data))], max_gap=0, block_bytes=16 << 10)
    assert _read(planned, 0, 6000) == data[:6000]  # the block after it is on its way, held
    assert planned._fetching
    closing = threading.Thread(target=planned.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive()  # waiting for the fetch, which waits for go
    src.go.set()
    closing.join(10)
    assert not closing.is_alive() and not planned._fetching
    assert not [t for t in threading.enumerate() if t.name == "pysafetensors-planned-reads"]


def test_a_block_fetched_ahead_into_the_next_group_is_taken_over_by_its_stream() -> None:
    """A stream fetching ahead reaches into where the next dtype group begins before that
    group's reads start (cast and diff read groups side by side): the group's first read
    takes the block over instead of fetching its bytes again."""
    data = random.Random(9).randbytes(130_000)
    big = [(i, i + 10_000) for i in range(0, 100_000, 10_000)]
    small = [(i, i + 3_000) for i in range(100_000, 130_000, 3_000)]
    src = Counting(data)
    planned = PlannedReads(src, big + small, max_gap=0, block_bytes=64 << 10)
    order = [*big[:9], small[0], big[9], *small[1:]]
    for start, end in order:
        for a in range(start, end, 4096):
            b = min(end, a + 4096)
            assert _read(planned, a, b - a) == data[a:b]
    planned.close()
    assert src.fetched == len(data), sorted(src.reads)


def _settle(planned: PlannedReads) -> None:
    """Wait for the blocks fetched ahead (what follows does not depend on their timing)."""
    for future in list(planned._fetching):
        with contextlib.suppress(Exception):
            future.result()


def test_a_stream_does_not_fetch_ahead_the_block_another_took_over() -> None:
    """A's block ahead reached into B's group; B's first read took it over (it begins where
    A's block ends). A's next read in order must not fetch those bytes ahead once more: a
    LoRA file's cast fetched 1.18 times the file."""
    rng = random.Random(11)
    data = rng.randbytes(1_800_000)  # LoRA-sized: a first block of 1 MiB, the rest ahead
    group_a = [(i, i + 50_000) for i in range(0, 1_500_000, 50_000)]
    group_b = [(i, i + 10_000) for i in range(1_500_000, 1_800_000, 10_000)]
    src = Counting(data)
    planned = PlannedReads(src, group_a + group_b, max_gap=0)
    for a, b in zip(group_a, group_b, strict=True):  # name order: the groups side by side
        for start, end in (a, b):
            assert _read(planned, start, end - start) == data[start:end]
            _settle(planned)
    planned.close()
    assert src.fetched == len(data), sorted(src.reads)


def test_a_read_in_another_streams_block_stays_its_own_streams() -> None:
    """Both groups begin in the first block. B's reads, served from A's block, are B's: made
    A's (the stream holding them), A started over at each, and B's read across the block's
    end replaced the block A still read from, which A then fetched again."""
    rng = random.Random(12)
    data = rng.randbytes(60_000)
    group_a = [(i, i + 2_000) for i in range(0, 20_000, 2_000)]
    group_b = [(i, i + 4_000) for i in range(20_000, 60_000, 4_000)]
    src = Counting(data)
    planned = PlannedReads(src, group_a + group_b, max_gap=0, block_bytes=64 << 10)
    for a, b in zip(group_a, group_b, strict=True):
        for start, end in (a, b):
            assert _read(planned, start, end - start) == data[start:end]
            _settle(planned)
    planned.close()
    assert src.fetched == len(data), sorted(src.reads)


def test_a_second_pass_leaves_the_first_pass_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """stats --histogram reads each tensor twice. The second pass, served from the first
    pass's block, started that stream over (its run and its blocks back to 1 MiB): each
    tensor larger than those blocks was fetched twice (2.0 times a 34 MB file)."""
    monkeypatch.setattr(_planned_reads, "FIRST_REACH", 64 << 10)  # 1/64 of the room, as 1 MiB
    rng = random.Random(13)
    data = rng.randbytes(12 * 300_000)
    ranges = [(i, i + 300_000) for i in range(0, len(data), 300_000)]
    src = Counting(data)
    planned = PlannedReads(src, ranges, max_gap=0, block_bytes=4 << 20)
    for start, end in ranges:
        for _ in range(2):
            for a in range(start, end, 64 << 10):
                b = min(end, a + (64 << 10))
                assert _read(planned, a, b - a) == data[a:b]
                _settle(planned)
    planned.close()
    assert src.fetched <= 1.35 * len(data), src.fetched / len(data)


def test_blocks_stay_within_their_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks' memory (the block read, the spare one, the one ahead: their buffers, not
    the bytes they hold) stays within block_bytes with two streams: a stream left with its
    block and a spare one (no room for a block ahead) counted one, and the other stream
    took the rest (1.25 times block_bytes)."""
    monkeypatch.setattr(_planned_reads, "FIRST_REACH", 64 << 10)
    rng = random.Random(14)
    data = rng.randbytes(10_000_000)
    group_a = [(i * 200_000, (i + 1) * 200_000) for i in range(40)]
    group_b = [(8_000_000 + i * 100_000, 8_000_000 + (i + 1) * 100_000) for i in range(20)]
    block_bytes = 4 << 20
    planned = PlannedReads(Counting(data), group_a + group_b, max_gap=0, block_bytes=block_bytes)
    order = group_a[:20] + [r for pair in zip(group_a[20:], group_b, strict=True) for r in pair]
    most = 0
    for start, end in order:
        for a in range(start, end, 64 << 10):
            b = min(end, a + (64 << 10))
            assert _read(planned, a, b - a) == data[a:b]
            _settle(planned)
            bufs = [
                buf
                for st in planned._streams
                for buf in (st.buf, st.spare, st.ahead.buf if st.ahead else None)
                if buf is not None
            ]
            most = max(most, sum(buf.size for buf in bufs))
    planned.close()
    assert most <= block_bytes, most / block_bytes


def test_a_failed_block_ahead_is_freed_when_dropped() -> None:
    """A fetch ahead that failed: its error's traceback held the fetching thread's frame,
    which held the future, which held the error: the block's buffer stayed alive until the
    cyclic collector ran (up to 32 MiB a failure)."""
    import gc
    import weakref

    data = bytes(range(256)) * 256
    src = Counting(data)
    src.fail_from = 8192  # the block fetched ahead fails
    planned = PlannedReads(src, [(0, len(data))], max_gap=0, block_bytes=16 << 10)
    enabled = gc.isenabled()
    gc.disable()
    try:
        assert _read(planned, 0, 6000) == data[:6000]
        ahead = planned._streams[0].ahead
        assert ahead is not None
        buf = weakref.ref(ahead.buf)
        assert isinstance(ahead.future.exception(10), OSError)
        del ahead
        for thread in threading.enumerate():
            if thread.name == "pysafetensors-planned-reads":
                thread.join(10)
        planned.release()
        assert buf() is None
    finally:
        if enabled:
            gc.enable()
    planned.close()
