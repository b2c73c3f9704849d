"""The pinned-buffer staging pipeline of ``_cuda_staging``, checked on CPU.

A stand-in device runtime performs each "asynchronous" copy only when its event is waited on
(or at ``synchronize``), as late as a real stream could. If the pipeline refilled a staging
buffer before the copy out of it had completed, the stand-in would copy the wrong bytes and the
comparison with a plain CPU load would fail.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pysafetensors import SafetensorError, safe_open  # noqa: E402
from pysafetensors._cuda_staging import chunks_from_device, stage_to_device  # noqa: E402
from pysafetensors._devices import CPU  # noqa: E402
from pysafetensors._sources import BufferSource  # noqa: E402


class LateCopyOps:
    """A CPU "device" whose copies complete as late as possible.

    With ``producer_fill`` set, every fresh device buffer still has a write of that byte
    queued on the caller's stream (as when the allocator hands back a block that kernels
    queued earlier still use): it lands when a stream is ordered after the caller's work
    (``wait_event`` / ``wait_for_producer``), else as late as possible, after every copy.
    """

    def __init__(self, producer_fill: int | None = None) -> None:
        self.lock = threading.Lock()
        self.pending: list[dict[str, Any]] = []
        self.host_allocs = 0
        self.streams = 0
        self.max_in_flight = 0
        self.producer_waits = 0
        self.stream_waits = 0
        self.producer_fill = producer_fill
        self.producer_writes: list[Any] = []
        self.copies = 0
        self.spanning = 0  # copies of a chunk holding pieces of several items

    def alloc_device(self, nbytes: int) -> Any:
        buf = torch.full((nbytes,), 0xEE, dtype=torch.uint8)
        if self.producer_fill is not None:
            with self.lock:
                self.producer_writes.append(buf)
        return buf

    def _land_producer_writes(self) -> None:
        for buf in self.producer_writes:
            buf.fill_(self.producer_fill)
        self.producer_writes.clear()

    def producer_event(self) -> Any:
        return {"producer": True}

    def wait_event(self, stream: Any, event: Any) -> None:
        assert event.get("producer")
        with self.lock:
            self.stream_waits += 1
            self._land_producer_writes()

    def alloc_host(self, nbytes: int) -> tuple[Any, memoryview]:
        with self.lock:
            self.host_allocs += 1
        buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf, memoryview(buf.numpy()).cast("B")

    def new_stream(self) -> Any:
        with self.lock:
            self.streams += 1
        return object()

    def copy_async(self, host: Any, pieces: Any, stream: Any) -> Any:
        assert pieces, "a copy of nothing"
        self.spanning += len(pieces) > 1
        event = {"pieces": list(pieces), "host": host, "stream": stream, "done": False}
        self._queue(event)
        return event

    def copy_to_host_async(
        self, host: Any, src: Any, src_offset: int, nbytes: int, stream: Any
    ) -> Any:
        event = {"to_host": True, "host": host, "src": src, "off": src_offset, "n": nbytes}
        event.update(stream=stream, done=False)
        self._queue(event)
        return event

    def _queue(self, event: dict[str, Any]) -> None:
        with self.lock:
            self.pending.append(event)
            self.copies += 1
            self.max_in_flight = max(self.max_in_flight, len(self.pending))

    def wait_for_producer(self, stream: Any) -> None:
        with self.lock:
            self.producer_waits += 1
            self._land_producer_writes()

    def _complete(self, event: dict[str, Any]) -> None:
        if not event["done"]:
            if event.get("to_host"):
                off, n = event["off"], event["n"]
                event["host"][:n].copy_(event["src"][off : off + n])
            else:
                for dst, at, begin, n in event["pieces"]:
                    assert at >= 0 and at + n <= dst.numel() and n > 0
                    dst[at : at + n].copy_(event["host"][begin : begin + n])
            event["done"] = True

    def wait(self, event: Any) -> None:
        with self.lock:
            # A stream runs its work in order: the copies queued on the event's stream before
            # it have completed too (and only those).
            ids = [id(e) for e in self.pending]
            upto = ids.index(id(event)) if id(event) in ids else -1
            done = [
                e for e in self.pending[: upto + 1] if e is event or e["stream"] is event["stream"]
            ]
            for e in done:
                self._complete(e)
            # By identity (events hold tensors, which do not compare as booleans); waiting on
            # an event a second time is allowed, as for CUDA events.
            self.pending = [e for e in self.pending if not any(e is d for d in done)]

    def done(self, event: Any) -> bool:
        with self.lock:
            return bool(event["done"])

    def synchronize(self, streams: Any) -> None:
        with self.lock:
            self.synced_streams = len(list(streams))
            for event in self.pending:
                self._complete(event)
            self.pending.clear()
            # Work queued on the caller's stream that no copy was ordered after: it may run
            # last, over the copied bytes.
            self._land_producer_writes()


def _data(n: int) -> bytes:
    return np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize(
    ("nbytes", "chunk", "workers"),
    [(1000, 64, 1), (10_000, 256, 3), (65_536, 4096, 4), (100, 1000, 2), (4097, 4096, 2)],
)
def test_bytes_land_and_buffers_are_reused(nbytes: int, chunk: int, workers: int) -> None:
    data = _data(nbytes + 7)
    source = BufferSource(data)
    ops = LateCopyOps()
    dev, stats = stage_to_device(
        source.readinto, 7, nbytes, ops, chunk_bytes=chunk, workers=workers
    )
    assert bytes(dev.numpy()) == data[7 : 7 + nbytes]
    chunks = -(-nbytes // min(chunk, nbytes))
    assert stats.chunks == chunks
    # The ring is pinned as the workers need it, up to one buffer per worker and two spares.
    assert 1 <= ops.host_allocs == stats.host_buffers <= workers + 2
    assert sum(stats.reuse.values()) == chunks
    if chunks > workers + 2:
        assert max(stats.reuse.values()) > 1
    assert ops.streams <= workers
    assert not ops.pending


class CountedWaitOps(LateCopyOps):
    """Counts the waits that found their copy still in flight (a worker blocked on the bus);
    with ``instant``, a copy has completed by the time anyone asks."""

    def __init__(self, instant: bool = False) -> None:
        super().__init__()
        self.instant = instant
        self.blocked = 0

    def done(self, event: Any) -> bool:
        if self.instant:
            super().wait(event)  # landed, not waited for
        return super().done(event)

    def wait(self, event: Any) -> None:
        if not event["done"]:
            self.blocked += 1
        super().wait(event)


def test_one_worker_reads_its_next_chunk_while_the_last_is_copied() -> None:
    # The worker gave its buffer back with the copy in flight and took the same one again:
    # it waited for every copy before reading on (one buffer, 255 blocking waits of 256).
    data = _data(1 << 20)
    ops = CountedWaitOps()
    dev, stats = stage_to_device(
        BufferSource(data).readinto, 0, len(data), ops, chunk_bytes=4096, workers=1
    )
    assert bytes(dev.numpy()) == data and stats.chunks == 256
    assert stats.host_buffers == 3  # the worker's buffer and the two spares
    # Past the ring's three buffers a chunk waits for the copy out of its buffer two chunks
    # back, not for the one just issued: two copies stay in flight behind every read.
    assert ops.blocked == 256 - 3 and ops.max_in_flight >= 3

    # Copies that complete at once pin no more than the one buffer they need.
    fast = CountedWaitOps(instant=True)
    dev, stats = stage_to_device(
        BufferSource(data).readinto, 0, len(data), fast, chunk_bytes=4096, workers=1
    )
    assert bytes(dev.numpy()) == data and stats.host_buffers == 1 and fast.blocked == 0


@pytest.mark.parametrize("workers", [1, 4])
def test_copies_wait_for_work_queued_on_the_callers_stream(workers: int) -> None:
    # A fresh device buffer may be memory that kernels queued earlier on the caller's stream
    # still write: every worker's stream must be ordered after them, or those writes land over
    # the loaded bytes (the copies ran on side streams that waited for nothing).
    data = _data(10_000)
    ops = LateCopyOps(producer_fill=0xAA)
    dev, _ = stage_to_device(
        BufferSource(data).readinto, 0, len(data), ops, chunk_bytes=1000, workers=workers
    )
    assert bytes(dev.numpy()) == data
    assert 1 <= ops.stream_waits <= workers


def test_empty_range() -> None:
    ops = LateCopyOps()
    dev, stats = stage_to_device(BufferSource(b"abc").readinto, 0, 0, ops)
    assert dev.numel() == 0 and stats.chunks == 0 and ops.host_allocs == 0


def test_read_errors_propagate_and_leave_nothing_in_flight() -> None:
    def bad_read(offset: int, view: memoryview) -> None:
        if offset >= 300:
            raise OSError(5, "I/O error")
        view[:] = b"x" * len(view)

    ops = LateCopyOps()
    with pytest.raises(OSError):
        stage_to_device(bad_read, 0, 1000, ops, chunk_bytes=100, workers=2)


class SlowPinOps(LateCopyOps):
    """Pinning takes a while (as a process's first ``cudaHostAlloc`` calls do), and may fail
    from the ``fail_from``-th buffer on; reads and pinnings are logged in order."""

    def __init__(self, pin_seconds: float = 0.0, fail_from: int | None = None) -> None:
        super().__init__()
        self.pin_seconds = pin_seconds
        self.fail_from = fail_from
        self.log: list[str] = []
        self.pinning_now = 0
        self.most_pinning_at_once = 0

    def alloc_host(self, nbytes: int) -> tuple[Any, memoryview]:
        with self.lock:
            self.pinning_now += 1
            self.most_pinning_at_once = max(self.most_pinning_at_once, self.pinning_now)
            failing = self.fail_from is not None and self.host_allocs + 1 >= self.fail_from
        try:
            time.sleep(self.pin_seconds)
            if failing:
                raise RuntimeError("CUDA error: out of memory (pinned)")
            made = super().alloc_host(nbytes)
        finally:
            with self.lock:
                self.pinning_now -= 1
        with self.lock:
            self.log.append("pinned")
        return made

    def logged_read(self, source: BufferSource) -> Any:
        def read(offset: int, view: memoryview) -> None:
            time.sleep(0.002)  # long enough that one buffer cannot serve every worker
            source.readinto(offset, view)
            with self.lock:
                self.log.append("read")

        return read


def test_reads_start_before_the_ring_is_pinned() -> None:
    """The first chunk is read as soon as one buffer is pinned, and buffers are pinned one at
    a time while the others flow (a process's first load no longer waits for the whole ring)."""
    nbytes, chunk, workers = 64 * 1024, 1024, 4
    data = _data(nbytes)
    ops = SlowPinOps(pin_seconds=0.02)
    dev, stats = stage_to_device(
        ops.logged_read(BufferSource(data)), 0, nbytes, ops, chunk_bytes=chunk, workers=workers
    )
    assert bytes(dev.numpy()) == data
    assert ops.most_pinning_at_once == 1
    assert ops.log[0] == "pinned"
    last_pin = max(i for i, what in enumerate(ops.log) if what == "pinned")
    assert "read" in ops.log[:last_pin], ops.log[:10]
    assert stats.chunks == nbytes // chunk
    assert 1 <= stats.host_buffers <= workers + 2
    assert not ops.pending


def test_a_load_goes_on_with_the_buffers_pinned_before_pinning_failed() -> None:
    nbytes = 40 * 1000
    data = _data(nbytes)
    ops = SlowPinOps(fail_from=3)
    source = BufferSource(data)

    def slow_read(offset: int, view: memoryview) -> None:
        time.sleep(0.005)  # every worker wants a buffer of its own
        source.readinto(offset, view)

    dev, stats = stage_to_device(slow_read, 0, nbytes, ops, chunk_bytes=1000, workers=4)
    assert bytes(dev.numpy()) == data
    assert stats.host_buffers == ops.host_allocs == 2
    assert sum(stats.reuse.values()) == 40
    assert not ops.pending


def test_a_first_pinning_failure_is_raised_without_a_hang() -> None:
    ops = SlowPinOps(pin_seconds=0.01, fail_from=1)
    result: list[BaseException] = []

    def run() -> None:
        try:
            stage_to_device(
                BufferSource(_data(8000)).readinto, 0, 8000, ops, chunk_bytes=1000, workers=4
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            result.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "the staging workers hung after the first pinning failed"
    assert len(result) == 1 and "out of memory" in str(result[0])
    assert ops.host_allocs == 0 and not ops.pending


def test_adapter_loads_a_file_through_the_pipeline(tmp_path: Path) -> None:
    from pysafetensors._torch_adapter import ADAPTER
    from pysafetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(300, 70, generator=gen).to(torch.bfloat16),
        "b": torch.randn(17, generator=gen),
        "c": torch.randint(0, 100, (5, 6, 7), generator=gen, dtype=torch.int64),
        "d": torch.randn(2, 3, generator=gen).to(torch.float16),
        "e": torch.zeros(0, 4),
        # Packed pairs of 4-bit floats: one byte each, torch's shape half the file's.
        "f4": torch.randint(0, 256, (5, 3), generator=gen, dtype=torch.uint8).view(
            torch.float4_e2m1fn_x2
        ),
        "f4_empty": torch.zeros(0, 2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, path)
    with safe_open(path, "pt", backend="pread") as f:
        want = f.get_tensors()
        header = f.header
        source = f._live()
        items = [(i.name, i.dtype, i.shape, i.begin, i.end) for i in header.tensors.values()]
        ops = LateCopyOps()
        got = ADAPTER.to_device_many(source.readinto, header.data_start, items, CPU, ops=ops)
        # A subset: only the requested tensors' bytes are staged.
        some = ADAPTER.to_device_many(
            source.readinto, header.data_start, items[1:3], CPU, ops=LateCopyOps()
        )
    assert got is not None and some is not None
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(
            got[name].view(-1).view(torch.uint8), want[name].view(-1).view(torch.uint8)
        )
    for name in some:
        assert torch.equal(some[name], want[name])
    assert ops.host_allocs >= 1
    # Each tensor has a storage of its own bytes, as the reference's .to(device) gives it:
    # one kept alone keeps no other, torch.save of one writes its bytes alone, and no two
    # are shared tensors to save_model.
    for name, t in got.items():
        storage = t.untyped_storage()
        assert storage.nbytes() == t.numel() * t.element_size(), name
    pointers = [t.untyped_storage().data_ptr() for t in got.values() if t.numel()]
    assert len(set(pointers)) == len(pointers)


def test_a_range_smaller_than_a_chunk_per_worker_is_cut_finer() -> None:
    """A range of 16 chunk floors with 16 workers: 16 chunks, not two of the default size."""
    from pysafetensors._cuda_staging import MIN_CHUNK_BYTES

    nbytes = 16 * MIN_CHUNK_BYTES
    data = _data(nbytes)
    ops = LateCopyOps()
    dev, stats = stage_to_device(
        BufferSource(data).readinto, 0, nbytes, ops, chunk_bytes=8 * MIN_CHUNK_BYTES, workers=16
    )
    assert bytes(dev.numpy()) == data
    assert stats.chunks == 16
    # Never below the floor: a small range with many workers stays in MIN_CHUNK_BYTES pieces.
    _, stats = stage_to_device(
        BufferSource(data).readinto, 0, 3 * MIN_CHUNK_BYTES, LateCopyOps(), workers=16
    )
    assert stats.chunks == 3


# --- saves: device tensors copied to the host piece by piece through a ring of pinned buffers


@pytest.mark.parametrize(
    ("nbytes", "piece", "ring"), [(1000, 64, 3), (1000, 100, 3), (50, 64, 3), (4097, 1024, 2)]
)
def test_device_bytes_come_out_in_order_through_a_small_ring(
    nbytes: int, piece: int, ring: int
) -> None:
    data = _data(nbytes)
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    ops = LateCopyOps()
    got = b""
    for view in chunks_from_device(src, nbytes, ops, piece_bytes=piece, ring=ring):
        # Read each piece as the writer would, right when it is handed over.
        got += bytes(view)
    assert got == data
    assert ops.host_allocs <= ring and ops.producer_waits == 1
    assert not ops.pending


def test_a_consumer_that_stops_early_leaves_no_copy_in_flight() -> None:
    data = _data(10_000)
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    ops = LateCopyOps()
    gen = chunks_from_device(src, len(data), ops, piece_bytes=1000, ring=3)
    assert bytes(next(gen)) == data[:1000]
    assert ops.pending  # the next pieces are in flight
    gen.close()  # e.g. the write failed
    assert not ops.pending


def test_saving_device_tensors_through_the_ring_gives_the_reference_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapter's device path end to end (CPU tensors routed through it): a tensor of five
    16 MiB pieces reuses the three buffers; the file equals the reference's byte for byte."""
    from safetensors.torch import save_file as ref_save_file

    import pysafetensors._torch_adapter as adapter
    from pysafetensors._cuda_staging import PIECE_BYTES, SAVE_RING
    from pysafetensors.torch import save_file

    stand_ins: list[LateCopyOps] = []

    def ops_for(device: Any) -> LateCopyOps:
        stand_ins.append(LateCopyOps())
        return stand_ins[-1]

    monkeypatch.setattr(adapter, "_device_ops", ops_for)
    gen = torch.Generator().manual_seed(1)
    big = torch.randint(
        -(2**15), 2**15, (5 * PIECE_BYTES // 2 - 7,), dtype=torch.int16, generator=gen
    )
    tensors = {
        "big": big,
        "small": torch.randn(33, 17, generator=gen),
        "flags": torch.rand(100, generator=gen) > 0.5,
        "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 5),
        "grad": torch.randn(8, 8, generator=gen, requires_grad=True),
    }
    ours, ref = tmp_path / "ours.safetensors", tmp_path / "ref.safetensors"
    save_file(tensors, ours)
    ref_save_file({k: v.detach().contiguous() for k, v in tensors.items()}, ref)
    assert ours.read_bytes() == ref.read_bytes()
    by_size = max(stand_ins, key=lambda o: o.host_allocs)
    assert by_size.host_allocs == SAVE_RING
    assert all(not o.pending for o in stand_ins)


# --- several runs (a tensor-parallel rank's parts) through one pipeline


def test_items_land_in_device_buffers_of_their_own() -> None:
    """Items in any order, one empty, two overlapping: each gets a buffer of exactly its
    bytes; only the items' bytes are read with no gap allowed."""
    from pysafetensors._cuda_staging import stage_items_to_device

    data = _data(50_000)
    items = [(9001, 20_000), (10, 3000), (7000, 1), (40_000, 0), (45_000, 4999), (9500, 100)]
    ops = LateCopyOps()
    reads: list[tuple[int, int]] = []

    def read(offset: int, view: memoryview) -> None:
        reads.append((offset, len(view)))
        BufferSource(data).readinto(offset, view)

    bufs, stats = stage_items_to_device(read, items, ops, chunk_bytes=4096, workers=3)
    assert len(bufs) == len(items)
    for (offset, n), buf in zip(items, bufs, strict=True):
        assert buf.numel() == n
        assert bytes(buf.numpy()) == data[offset : offset + n]
    assert stats.bytes == sum(n for _, n in items)
    assert sum(n for _, n in reads) == stats.bytes
    assert ops.host_allocs == stats.host_buffers <= 3 + 2
    assert not ops.pending


@pytest.mark.parametrize("max_gap", [0, 100, 10_000])
def test_items_close_together_are_read_as_one_run(max_gap: int) -> None:
    """Adjacent items (many small tensors) are read in chunks that ignore their bounds, each
    chunk copied to every item it holds; items up to max_gap apart too, the gap read and
    dropped."""
    from pysafetensors._cuda_staging import stage_items_to_device

    data = _data(200_000)
    sizes = [1, 7, 64, 300, 0, 5000, 2, 999, 4096, 13]
    items: list[tuple[int, int]] = []
    at = 100
    for i, n in enumerate(sizes * 5):
        items.append((at, n))
        at += n + (50 if i % 7 == 6 else 0)  # a gap of 50 bytes now and then
    reads: list[tuple[int, int]] = []

    def read(offset: int, view: memoryview) -> None:
        reads.append((offset, len(view)))
        BufferSource(data).readinto(offset, view)

    ops = LateCopyOps()
    bufs, stats = stage_items_to_device(read, items, ops, max_gap=max_gap, chunk_bytes=8000)
    for (offset, n), buf in zip(items, bufs, strict=True):
        assert bytes(buf.numpy()) == data[offset : offset + n]
    # Every gap is of 50 bytes: read only with a max_gap of 50 or more (then all is one run).
    spanned = items[-1][0] + items[-1][1] - items[0][0]
    assert stats.bytes == (sum(n for _, n in items) if max_gap < 50 else spanned)
    assert stats.chunks == len(reads) < len(items)
    assert ops.copies == stats.chunks  # one copy call per chunk, whatever it holds
    assert not ops.pending


def _stand_in_cuda(monkeypatch: pytest.MonkeyPatch, calls: list[int] | None = None) -> None:
    """Open every file as if on ``"cuda:0"``, with the staging pipeline's copies done by a
    stand-in (``calls`` gets the number of runs of each pipeline run)."""
    from pysafetensors._torch_adapter import TorchAdapter

    real = TorchAdapter.to_device_runs

    def staged(
        self: Any, read: Any, items: Any, device: Any, *, ops: Any = None, threads: Any = None
    ) -> Any:
        if calls is not None:
            calls.append(len(items))
        return real(self, read, items, device, ops=LateCopyOps(), threads=threads)

    monkeypatch.setattr(TorchAdapter, "to_device_runs", staged)
    _on_cuda(monkeypatch)


def owns_its_storage(t: Any) -> bool:
    """Whether ``t``'s storage holds exactly its bytes, as a tensor of the reference's own
    ``.to`` does (none shared with another tensor)."""
    return bool(t.untyped_storage().nbytes() == t.numel() * t.element_size())


def stage_on_cuda(monkeypatch: pytest.MonkeyPatch) -> list[LateCopyOps]:
    """Open every file as if on ``"cuda:0"`` and stage every load through a fresh stand-in
    (whatever its size: the direct path of small tensors needs a real device); returns the
    stand-ins made, one per pipeline run."""
    import pysafetensors._torch_adapter as adapter

    made: list[LateCopyOps] = []

    def stand_in(device: Any, ops: Any) -> Any:
        if ops is None and device.type == "cuda":
            made.append(LateCopyOps())
            return made[-1]
        return ops

    monkeypatch.setattr(adapter, "_staging_ops", stand_in)
    monkeypatch.setattr(adapter, "_direct_target", lambda device, ops, nbytes: None)
    _on_cuda(monkeypatch)
    return made


def _on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Open every file as if on ``"cuda:0"``."""
    from pysafetensors._devices import Device

    real_open = safe_open.__init__

    def on_device(self: Any, *args: Any, **kwargs: Any) -> None:
        real_open(self, *args, **kwargs)
        self._device = Device("cuda", 0)  # as if opened with device="cuda:0"
        self._small_reads = None  # get_tensor's CPU short path, never taken on a device

    monkeypatch.setattr(safe_open, "__init__", on_device)


def test_shard_parts_go_to_the_device_through_one_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load_shard on a (stand-in) CUDA device: every row part and whole tensor is staged in
    one pipeline run, and equals the CPU load_shard."""
    from pysafetensors.parallel import load_shard
    from pysafetensors.torch import save_file

    gen = torch.Generator().manual_seed(2)
    tensors = {
        "a": torch.randn(96, 70, generator=gen).to(torch.bfloat16),
        "b": torch.randint(0, 100, (40, 6, 7), generator=gen, dtype=torch.int64),
        "norm": torch.randn(33, generator=gen),
        "flags": torch.rand(16, 3, generator=gen) > 0.5,
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, path)
    rules = {"norm": "replicate", "*": "rows"}
    want = load_shard(path, 1, 4, rules, framework="pt")

    calls: list[int] = []
    _stand_in_cuda(monkeypatch, calls)
    for backend in ("pread", "mmap"):
        got = load_shard(path, 1, 4, rules, framework="pt", backend=backend)
        assert list(got) == list(want)
        for name, t in want.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape
            assert torch.equal(got[name].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
            # A part has a storage of its own (one kept alone keeps no other rank's rows).
            assert owns_its_storage(got[name])
    assert calls == [len(tensors), len(tensors)]


# --- fragmented selections (column splits) gathered through a ring of pinned buffers


@pytest.mark.parametrize(
    ("shapes", "chunk"),
    [([(100, 24)], 64), ([(7, 1000)], 2500), ([(1, 9)], 4), ([(30, 7), (0, 5), (9, 100)], 50)],
)
def test_gathered_blocks_land_in_order_and_reuse_the_ring(
    shapes: list[tuple[int, int]], chunk: int
) -> None:
    """Each block is filled into a buffer only after the copy out of it completed (the
    stand-in copies as late as it can, so an early refill would land the wrong bytes); the
    parts of one call share the ring and land each in a buffer of its own."""
    from pysafetensors._cuda_staging import GATHER_RING, gather_to_device

    datas = [_data(rows * row_bytes + 1)[: rows * row_bytes] for rows, row_bytes in shapes]
    filled: list[tuple[int, int, int]] = []

    def filler(part: int) -> Any:
        row_bytes = shapes[part][1]

        def fill(first: int, end: int, view: memoryview) -> None:
            filled.append((part, first, end))
            view[:] = datas[part][first * row_bytes : end * row_bytes]

        return fill

    ops = LateCopyOps()
    parts = [(filler(i), rows, row_bytes) for i, (rows, row_bytes) in enumerate(shapes)]
    bufs, stats = gather_to_device(parts, ops, chunk_bytes=chunk)
    for data, buf in zip(datas, bufs, strict=True):
        assert bytes(buf.numpy()) == data
    blocks = [
        (i, j, min(rows, j + max(1, chunk // row_bytes)))
        for i, (rows, row_bytes) in enumerate(shapes)
        if rows * row_bytes
        for j in range(0, rows, max(1, chunk // row_bytes))
    ]
    assert filled == blocks
    assert stats.chunks == len(blocks)
    assert ops.host_allocs == stats.host_buffers == min(GATHER_RING, len(blocks))
    assert ops.producer_waits == 1
    assert not ops.pending


def test_a_failed_gather_raises_and_leaves_nothing_in_flight() -> None:
    from pysafetensors._cuda_staging import gather_to_device

    def fill(first: int, end: int, view: memoryview) -> None:
        if first >= 30:
            raise OSError("disk gone")
        view[:] = bytes(len(view))

    ops = LateCopyOps()
    with pytest.raises(OSError, match="disk gone"):
        gather_to_device([(fill, 50, 10)], ops, chunk_bytes=100)
    assert not ops.pending


def test_column_splits_go_to_the_device_through_the_gather_ring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """get_slice and load_shard column parts on a (stand-in) CUDA device, both backends, in
    blocks of a few rows: equal to the CPU's, byte for byte. A part that is one byte run (the
    replicated norm) goes through the staging pipeline instead."""
    from pysafetensors._torch_adapter import TorchAdapter
    from pysafetensors.parallel import load_shard
    from pysafetensors.torch import save_file

    gen = torch.Generator().manual_seed(3)
    tensors = {
        "w": torch.randn(96, 70, generator=gen).to(torch.bfloat16),
        "cube": torch.randint(0, 100, (13, 6, 8), generator=gen, dtype=torch.int64),
        "flags": torch.rand(16, 12, generator=gen) > 0.5,
        "norm": torch.randn(33, generator=gen),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, path)
    rules = {"norm": "replicate", "*": "columns"}
    want_shard = load_shard(path, 1, 4, rules, framework="pt")
    indices = {
        "w": (slice(3, 90, 2), slice(5, 40)),
        "cube": (slice(None), 2, slice(1, 7, 3)),
        "flags": (slice(None), slice(0, 12, 5)),
        "norm": (slice(0, 33, 4),),
    }
    with safe_open(path, "pt") as f:
        want_slices = {name: f.get_slice(name)[index] for name, index in indices.items()}

    calls: list[list[tuple[int, int]]] = []
    real = TorchAdapter.gather_to_device

    def staged(self: Any, parts: Any, device: Any) -> Any:
        calls.append([(rows, row_bytes) for _, _, rows, row_bytes, _, _ in parts])
        return real(self, parts, device, ops=LateCopyOps(), chunk_bytes=300)

    monkeypatch.setattr(TorchAdapter, "gather_to_device", staged)
    _stand_in_cuda(monkeypatch)

    def same(a: Any, b: Any) -> bool:
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)

    for backend in ("auto", "pread", "mmap"):
        calls.clear()
        got = load_shard(path, 1, 4, rules, framework="pt", backend=backend)
        assert list(got) == list(want_shard)
        assert all(same(got[name], t) for name, t in want_shard.items())
        # The split tensors went through one ring together; the replicated norm (one run) did
        # not.
        assert calls == [[(13, 128), (96, 36), (16, 3)]]  # in file order
        if backend == "auto":
            continue  # not a safe_open backend
        calls.clear()
        with safe_open(path, "pt", backend=backend) as f:
            for name, index in indices.items():
                assert same(f.get_slice(name)[index], want_slices[name]), (backend, name)
        assert calls == [[(44, 70)], [(13, 16)], [(16, 3)], [(9, 4)]]


def test_a_sharded_folders_parts_go_to_the_device_shard_by_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load_shard of a sharded folder on a (stand-in) CUDA device: each shard's row parts go
    through one staging run and its column splits through one gather ring; every part equals
    the CPU load_shard's, with the default backend and both others."""
    from pysafetensors._torch_adapter import TorchAdapter
    from pysafetensors.parallel import load_shard
    from pysafetensors.torch import save_sharded

    gen = torch.Generator().manual_seed(4)
    tensors = {
        f"layer{i}.{kind}": torch.randn(40, 24, generator=gen).to(torch.bfloat16)
        for i in range(3)
        for kind in ("up", "down")
    } | {"norm": torch.randn(24, generator=gen)}
    folder = tmp_path / "model"
    save_sharded(tensors, folder, max_shard_size=4000)
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) >= 3
    rules = {"*.up": "rows", "*.down": "columns", "norm": "replicate"}
    want = load_shard(folder, 1, 2, rules, framework="pt", backend="pread")

    gathers: list[list[str]] = []
    real = TorchAdapter.gather_to_device

    def staged(self: Any, parts: Any, device: Any) -> Any:
        gathers.append([name for name, *_ in parts])
        return real(self, parts, device, ops=LateCopyOps(), chunk_bytes=256)

    monkeypatch.setattr(TorchAdapter, "gather_to_device", staged)
    runs: list[int] = []
    _stand_in_cuda(monkeypatch, runs)
    for backend in ("auto", "pread", "mmap"):
        gathers.clear()
        runs.clear()
        got = load_shard(folder, 1, 2, rules, framework="pt", backend=backend)
        assert sorted(got) == sorted(want)
        for name, t in want.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape
            assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), (backend, name)
        # One gather per shard that holds column splits, one staging run per shard with rows.
        assert sorted(n for group in gathers for n in group) == [f"layer{i}.down" for i in range(3)]
        assert len(gathers) <= len(shards) and len(runs) <= len(shards)
        assert sum(runs) == 4  # three row parts and the norm


def test_staging_buffers_fall_back_to_ordinary_memory_when_pinning_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Loads and saves raised where page-locked memory is scarce, although a plain .to() works.
    from pysafetensors import _cuda_staging
    from pysafetensors._cuda_staging import TorchCudaOps

    real_empty = torch.empty

    def no_pinning(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory (pinned)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", no_pinning)
    monkeypatch.setattr(_cuda_staging, "_PAGEABLE_WARNED", False)
    ops = TorchCudaOps("cuda:0")
    with pytest.warns(RuntimeWarning, match="pinned host memory unavailable"):
        buf, view = ops.alloc_host(64)
    assert buf.numel() == 64 and len(view) == 64 and not buf.is_pinned()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process
        ops.alloc_host(64)


def test_save_pieces_are_at_least_the_writers_batch() -> None:
    # A smaller piece would let the writer hold a pinned buffer, batched, that the ring is
    # about to refill (the chunk contract of TensorData.chunks).
    from pysafetensors import _writer
    from pysafetensors._cuda_staging import PIECE_BYTES

    assert PIECE_BYTES >= _writer.WRITEV_BYTES


# --- the real runtime's copy of a chunk's pieces (run on CPU tensors; streams need a GPU)


@pytest.mark.parametrize("foreach_works", [True, False])
def test_copy_pieces_lands_each_piece(foreach_works: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """TorchCudaOps.copy_async's copies: whole destinations and parts of them, by one
    _foreach_copy_ call or, where that raises, one copy_ per piece (remembered)."""
    import pysafetensors._cuda_staging as staging

    monkeypatch.setattr(staging, "_FOREACH_COPY", [True])
    calls: list[int] = []
    real = torch._foreach_copy_

    def foreach(dsts: Any, srcs: Any, non_blocking: bool = False) -> None:
        calls.append(len(dsts))
        if not foreach_works:
            raise RuntimeError("expected all tensors to be on the same device")
        real(dsts, srcs, non_blocking=non_blocking)

    monkeypatch.setattr(torch, "_foreach_copy_", foreach)
    host = torch.from_numpy(np.frombuffer(bytearray(_data(1000)), np.uint8))
    a, b, c = (torch.zeros(n, dtype=torch.uint8) for n in (10, 300, 50))
    staging.copy_pieces(torch, host, [(a, 0, 0, 10), (b, 100, 10, 200), (c, 0, 500, 50)])
    assert torch.equal(a, host[:10]) and torch.equal(c, host[500:550])
    assert torch.equal(b[100:], host[10:210]) and not b[:100].any()
    staging.copy_pieces(torch, host, [(b, 0, 800, 100)])  # one piece: a plain copy_
    assert torch.equal(b[:100], host[800:900])
    assert calls == [3]
    assert staging._FOREACH_COPY[0] is foreach_works
    staging.copy_pieces(torch, host, [(a, 0, 20, 5), (a, 5, 40, 5)])
    assert torch.equal(a, torch.cat([host[20:25], host[40:45]]))
    assert calls == ([3, 2] if foreach_works else [3])


@pytest.mark.parametrize("foreach_works", [True, False])
def test_copy_pieces_through_a_scratch_allocation(
    foreach_works: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk of many pieces with a device given crosses in one copy (to a scratch
    allocation on that device) and is scattered from there by one _foreach_copy_ between
    tensors of one device: partial first and last pieces, gaps between pieces (not copied to
    any tensor), pieces of one tensor. Where _foreach_copy_ raises, one copy_ per piece."""
    import pysafetensors._cuda_staging as staging

    monkeypatch.setattr(staging, "_FOREACH_COPY", [True])
    calls: list[tuple[int, set[int]]] = []  # (pieces, ids of the sources' storages)
    real = torch._foreach_copy_

    def foreach(dsts: Any, srcs: Any, non_blocking: bool = False) -> None:
        calls.append((len(dsts), {s.untyped_storage().data_ptr() for s in srcs}))
        if not foreach_works:
            raise RuntimeError("expected all tensors to be on the same device")
        real(dsts, srcs, non_blocking=non_blocking)

    monkeypatch.setattr(torch, "_foreach_copy_", foreach)
    host = torch.from_numpy(np.frombuffer(bytearray(_data(4000)), np.uint8))
    n = staging.SCRATCH_PIECES + 3
    head = torch.zeros(100, dtype=torch.uint8)  # its last 40 bytes start the chunk
    tail = torch.zeros(100, dtype=torch.uint8)  # its first 30 bytes end it
    smalls = [torch.zeros(17 + i, dtype=torch.uint8) for i in range(n)]
    pieces: list[Any] = [(head, 60, 0, 40)]
    at = 40
    for i, t in enumerate(smalls):
        at += 9 * (i % 2)  # a gap before every other piece
        pieces.append((t, 0, at, t.numel()))
        at += t.numel()
    split = torch.zeros(50, dtype=torch.uint8)  # one tensor in two pieces, a gap between
    pieces += [(split, 0, at, 20), (split, 20, at + 25, 30), (tail, 0, at + 55, 30)]
    staging.copy_pieces(torch, host, pieces, "cpu")
    for dst, offset, begin, nbytes in pieces:
        assert torch.equal(dst[offset : offset + nbytes], host[begin : begin + nbytes])
    assert not head[:60].any() and not tail[30:].any()
    assert len(calls) == 1 and calls[0][0] == len(pieces)
    # Every source was a view of one allocation, not of the host buffer.
    assert calls[0][1] != {host.untyped_storage().data_ptr()} and len(calls[0][1]) == 1
    assert staging._FOREACH_COPY[0] is foreach_works
    # Fewer pieces, or no device: straight from the host buffer.
    calls.clear()
    few = [(torch.zeros(20, dtype=torch.uint8), 0, 3000 + 100 * i, 20) for i in range(3)]
    staging.copy_pieces(torch, host, few, "cpu")
    staging.copy_pieces(torch, host, [(t, at, begin + 1, n) for t, at, begin, n in pieces])
    for dst, offset, begin, nbytes in few:
        assert torch.equal(dst[offset : offset + nbytes], host[begin : begin + nbytes])
    for dst, offset, begin, nbytes in pieces:
        begin += 1
        assert torch.equal(dst[offset : offset + nbytes], host[begin : begin + nbytes])
    if foreach_works:
        assert [c[1] for c in calls] == [{host.untyped_storage().data_ptr()}] * 2
    else:
        assert calls == []


def test_a_scratch_allocation_that_does_not_fit_leaves_the_copies_to_the_host_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each worker's scratch holds up to a chunk on the device: where the model nearly fills
    it, an out-of-memory error failed the load, where copies from the host buffer fit."""
    import pysafetensors._cuda_staging as staging

    monkeypatch.setattr(staging, "_FOREACH_COPY", [True])
    real_empty = torch.empty
    tried: list[Any] = []

    def empty(*args: Any, device: Any = None, **kwargs: Any) -> Any:
        if device is not None:
            tried.append(device)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 MiB")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    host = torch.from_numpy(np.frombuffer(bytearray(_data(1000)), np.uint8))
    dsts = [torch.zeros(30, dtype=torch.uint8) for _ in range(staging.SCRATCH_PIECES + 1)]
    pieces = [(t, 0, 40 * i, 30) for i, t in enumerate(dsts)]
    assert staging.copy_pieces(torch, host, pieces, "cpu") is False
    assert tried == ["cpu"] and staging._FOREACH_COPY[0]
    for dst, _, begin, nbytes in pieces:
        assert torch.equal(dst, host[begin : begin + nbytes])

    # The runtime stops asking for the rest of its load: each refusal cost torch a pass of
    # emptying its cache first.
    class Event:
        def record(self, stream: Any) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(staging, "_SCRATCH_REFUSED", {})  # this test's refusals only
    ops = staging.TorchCudaOps("cpu")
    for _ in range(3):
        for dst in dsts:
            dst.zero_()
        ops.copy_async(host, pieces, None)
        assert all(torch.equal(d, host[b : b + n]) for d, _, b, n in pieces)
    assert tried == ["cpu", ops.device]
    # Nor do the next loads to that device (one OOM per load and worker before), until
    # SCRATCH_RETRY_LOADS of them went by; other devices still ask.
    refused = staging._SCRATCH_REFUSED
    assert refused == {ops.device: staging.SCRATCH_RETRY_LOADS}
    for _ in range(staging.SCRATCH_RETRY_LOADS):
        assert staging.TorchCudaOps("cpu")._scratch_on is None
    assert staging.TorchCudaOps("meta")._scratch_on == torch.device("meta")
    assert staging.TorchCudaOps("cpu")._scratch_on == torch.device("cpu")  # asks again


def test_every_device_load_gives_each_tensor_a_storage_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the public API on a (stand-in) CUDA device, every way of loading (get_tensors,
    get_tensor, row and column slices, load_shard, a sharded folder) gives tensors equal to the
    CPU's, each with a storage of exactly its bytes, as the reference's one .to() per tensor:
    save_model takes them as they are, and torch.save of one writes its bytes alone."""
    import io

    from pysafetensors.parallel import load_shard
    from pysafetensors.torch import load_model, save_file, save_model, save_sharded

    staged = stage_on_cuda(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.LayerNorm(48))
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tensors["big"] = torch.randn(300, 200, generator=gen)
    tensors["flag"] = torch.tensor(True)
    tensors["none"] = torch.zeros(0, 3)
    path = tmp_path / "m.safetensors"
    save_file(tensors, path)

    with safe_open(path, "pt") as f:
        loads = {"get_tensors": f.get_tensors()}
        loads["get_tensor"] = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        rows = f.get_slice("big")[10:90]
        cols = f.get_slice("big")[:, 5:50]
    assert torch.equal(rows, tensors["big"][10:90]) and owns_its_storage(rows)
    assert torch.equal(cols, tensors["big"][:, 5:50]) and owns_its_storage(cols)
    for how, got in loads.items():
        assert sorted(got) == sorted(tensors), how
        for name, t in tensors.items():
            assert torch.equal(got[name], t) and owns_its_storage(got[name]), (how, name)
        pointers = [t.untyped_storage().data_ptr() for t in got.values() if t.numel()]
        assert len(set(pointers)) == len(pointers), how
    for along in ("rows", "columns"):

        def rule(name: str, shape: tuple[int, ...], along: str = along) -> str:
            return along if len(shape) == 2 else "replicate"

        part = load_shard(path, 1, 4, rule, framework="pt")
        for name, t in part.items():
            assert owns_its_storage(t), (along, name)
    folder = tmp_path / "sharded"
    save_sharded(tensors, folder, max_shard_size=100_000)
    with safe_open(folder, "pt") as f:
        assert len({f.shard_of(name) for name in tensors}) > 1
        got = f.get_tensors()
    assert all(
        torch.equal(got[name], t) and owns_its_storage(got[name]) for name, t in tensors.items()
    )
    assert len(staged) >= 8

    # What the storages are for: save_model takes the loaded parameters as they are (it
    # refuses tensors sharing a storage), and torch.save of one writes its own bytes.
    loaded = loads["get_tensors"]
    load_model(model, path, strict=False)
    model.load_state_dict({k: loaded[k] for k in model.state_dict()}, assign=True)
    assert model[0].bias.untyped_storage().data_ptr() == loaded["0.bias"].data_ptr()
    save_model(model, tmp_path / "model.safetensors")
    buf = io.BytesIO()
    torch.save(loaded["0.bias"], buf)
    assert len(buf.getvalue()) < 48 * 4 + 2000


@pytest.mark.parametrize("seed", range(12))
def test_random_device_loads_equal_the_cpu(
    seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random files (dtypes, shapes, empty and scalar tensors), random slices and tensor-
    parallel splits through the stand-in device with small chunks (so chunks span tensors and
    tensors span chunks): byte for byte the CPU's, each result in a storage of its own."""
    import pysafetensors._cuda_staging as staging
    from pysafetensors.parallel import load_shard
    from pysafetensors.torch import save_file

    rng = np.random.default_rng(seed)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool]
    tensors: dict[str, Any] = {}
    for i in range(int(rng.integers(1, 25))):
        ndim = int(rng.integers(0, 4))
        shape = tuple(int(rng.integers(0 if rng.random() < 0.1 else 1, 40)) for _ in range(ndim))
        raw = torch.from_numpy(rng.integers(0, 256, max(1, int(np.prod(shape))) * 8, np.uint8))
        dtype = dtypes[int(rng.integers(len(dtypes)))]
        n = int(np.prod(shape))
        t = (raw[:n].bool() if dtype is torch.bool else raw.view(dtype)[:n]).reshape(shape)
        tensors[f"t{i}"] = t.clone()
    path = tmp_path / "r.safetensors"
    save_file(tensors, path)
    with safe_open(path, "pt") as f:
        want = f.get_tensors()
        slices = {}
        for name, t in want.items():
            if t.dim() == 0:
                continue
            index = tuple(
                slice(int(a), int(a) + int(rng.integers(0, s + 1)), int(rng.integers(1, 3)))
                for s, a in (
                    (s, rng.integers(0, s + 1))
                    for s in t.shape[: int(rng.integers(1, t.dim() + 1))]
                )
            )
            slices[name] = (index, f.get_slice(name)[index])
    world = int(rng.integers(1, 5))
    rank = int(rng.integers(world))

    def rule(name: str, shape: tuple[int, ...]) -> str:
        return ("rows", "columns")[len(name) % 2] if len(shape) >= 2 else "replicate"

    want_shard = load_shard(path, rank, world, rule, framework="pt")

    monkeypatch.setattr(staging, "MIN_CHUNK_BYTES", 64)
    monkeypatch.setattr(staging, "CHUNK_BYTES", int(rng.integers(64, 2000)))
    made = stage_on_cuda(monkeypatch)

    def same(a: Any, b: Any) -> bool:
        return bool(
            owns_its_storage(a)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )

    for backend in ("pread", "mmap"):
        with safe_open(path, "pt", backend=backend) as f:
            got = f.get_tensors()
            assert all(same(got[name], t) for name, t in want.items())
            for name, (index, t) in slices.items():
                assert same(f.get_slice(name)[index], t), (backend, name, index)
        got = load_shard(path, rank, world, rule, framework="pt", backend=backend)
        assert all(same(got[name], t) for name, t in want_shard.items()), backend
    if sum(1 for t in want.values() if t.numel()) >= 4:
        assert sum(o.spanning for o in made) > 0  # chunks did span tensors


def test_one_small_tensor_goes_the_direct_way() -> None:
    """One tensor of at most DIRECT_BYTES on a CUDA device goes the direct way (a target);
    a larger one, or one for a given runtime, is staged; other devices neither."""
    from pysafetensors._devices import Device
    from pysafetensors._torch_adapter import DIRECT_BYTES, _direct_target, _staging_ops

    cuda = Device("cuda", 0)
    assert _direct_target(cuda, None, 0) == torch.device("cuda", 0)
    assert _direct_target(cuda, None, DIRECT_BYTES) == torch.device("cuda", 0)
    assert _direct_target(cuda, None, DIRECT_BYTES + 1) is None
    assert _direct_target(Device("cpu", None), None, 10) is None
    given = LateCopyOps()
    assert _direct_target(cuda, given, 10) is None
    assert _staging_ops(cuda, None) is not None
    assert _staging_ops(cuda, given) is given  # a runtime given is always used
    assert _staging_ops(Device("cpu", None), None) is None


@pytest.mark.parametrize("backend", ["pread", "mmap"])
def test_small_tensors_and_slices_move_through_kept_pinned_memory(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a device (the host standing in for it), one tensor or slice of at most DIRECT_BYTES
    is read into pinned memory the thread keeps (a larger one: a pinned buffer for the call)
    and copied to a new allocation: get_tensor by the handle's short path, row and column
    slices; a larger tensor goes to the staging pipeline. Where pinning fails, the pageable
    .to (remembered). Everything equals the CPU load; a read error names the tensor."""
    import pysafetensors._torch_adapter as adapter
    from pysafetensors._devices import Device
    from pysafetensors._torch_adapter import TorchAdapter
    from pysafetensors.torch import load_file, save_file

    monkeypatch.setattr(adapter, "DIRECT_BYTES", 64 << 10)
    monkeypatch.setattr(adapter, "_KEPT_PINNED", 16 << 10)
    monkeypatch.setattr(adapter, "_PINNED_OK", [True])
    monkeypatch.setattr(adapter, "_PINNED", threading.local())
    gen = torch.Generator().manual_seed(9)

    def rand(n: int) -> Any:
        return torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen)

    tensors = {
        "small": rand(1024).view(torch.bfloat16).view(16, 32),
        "small2": rand(4096).view(torch.int32).view(32, 32),
        "edge": rand(64 << 10),  # DIRECT_BYTES, more than the kept buffer
        "large": rand((64 << 10) + 8),
        "mat": rand(8192).view(torch.int16).view(64, 64),
        "wide": rand(32768).view(torch.int16).view(128, 128),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, path)
    want = load_file(path)

    pinned: list[int] = []  # sizes of the pinned allocations asked for
    real_empty = torch.empty
    pin_fails = [False]

    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        if pin_memory:
            if pin_fails[0]:
                raise RuntimeError("cudaHostAlloc failed")
            pinned.append(int(args[0]))
        return real_empty(*args, **kwargs)

    moved: list[Any] = []  # shapes moved by the pageable fallback (from_bytes)
    staged: list[list[str]] = []  # the items of each staging run
    real_from_bytes = TorchAdapter.from_bytes

    def from_bytes(self: Any, buf: Any, dtype: Any, shape: Any, device: Any) -> Any:
        moved.append(shape)
        return real_from_bytes(self, buf, dtype, shape, CPU)  # no GPU here

    def staging_ops(device: Any, ops: Any) -> Any:
        return ops or LateCopyOps()

    real_stage = adapter.TorchAdapter.to_device_many

    def to_device_many(
        self: Any, read: Any, offset: int, items: Any, device: Any, **kwargs: Any
    ) -> Any:
        if len(items) > 1 or items[0][4] - items[0][3] > adapter.DIRECT_BYTES:
            staged.append([item[0] for item in items])
        return real_stage(self, read, offset, items, device, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(TorchAdapter, "check_device", lambda self, d: Device("cuda", 0))
    monkeypatch.setattr(TorchAdapter, "from_bytes", from_bytes)
    monkeypatch.setattr(TorchAdapter, "to_device_many", to_device_many)
    monkeypatch.setattr(adapter, "cuda_target", lambda device: torch.device("cpu"))
    monkeypatch.setattr(adapter, "_staging_ops", staging_ops)

    with safe_open(path, "pt", device="cuda:0", backend=backend) as f:
        got = {name: f.get_tensor(name) for name in ("small", "small2", "edge", "large")}
        rows = f.get_slice("mat")[8:40]
        cols = f.get_slice("mat")[:, 16:48]
        # Larger than the kept buffer: rows read in pieces, columns gathered whole.
        wide_rows = f.get_slice("wide")[10:120]
        wide_cols = f.get_slice("wide")[:, :100]
    for name, t in got.items():
        assert torch.equal(t, want[name]), name
        assert owns_its_storage(t), name
    assert torch.equal(rows, want["mat"][8:40]) and torch.equal(cols, want["mat"][:, 16:48])
    assert torch.equal(wide_rows, want["wide"][10:120])
    assert torch.equal(wide_cols, want["wide"][:, :100])
    assert staged == [["large"]] and moved == []
    # One kept buffer for the small ones and the slices, one for each call larger than it.
    assert pinned == [16 << 10, 64 << 10, 110 * 256, 128 * 200]
    kept = adapter._PINNED.kept[0]
    assert all(t.data_ptr() != kept.data_ptr() for t in [*got.values(), rows, cols])
    for t in (rows, cols, wide_rows, wide_cols):
        assert owns_its_storage(t)

    # A read error names the tensor.
    with safe_open(path, "pt", device="cuda:0", backend=backend) as f:
        with open(path, "r+b") as raw:
            raw.truncate(raw.seek(0, 2) - (64 << 10) - 100)
        with pytest.raises(SafetensorError, match="'edge'"):
            f.get_tensor("edge")

    # No page-locked memory: the pageable .to, and pinning is not tried again.
    save_file(tensors, path)
    adapter._PINNED.__dict__.clear()
    pin_fails[0] = True
    pinned.clear()
    with safe_open(path, "pt", device="cuda:0", backend=backend) as f:
        assert torch.equal(f.get_tensor("small"), want["small"])
        assert torch.equal(f.get_tensor("small2"), want["small2"])
    assert moved == [(16, 32), (32, 32)] and adapter._PINNED_OK == [False] and pinned == []


@pytest.mark.parametrize("producer_fill", [None, 0x22])
def test_bytes_are_staged_into_buffers_the_caller_has(producer_fill: int | None) -> None:
    """``load_model``'s path to a CUDA model: the file's bytes go straight into the model's
    parameters (given buffers, not new allocations), after any write to them still queued on
    the caller's stream (else that write, landing late, would overwrite the loaded bytes)."""
    from pysafetensors._torch_adapter import ADAPTER

    data = _data(300_000)
    ops = LateCopyOps(producer_fill=producer_fill)
    params = [torch.full((n,), 0x11, dtype=torch.uint8) for n in (100_000, 7, 150_000, 1)]
    offsets = [120_000, 5, 100_010, 299_999]
    if producer_fill is not None:
        ops.producer_writes.extend(params)  # kernels queued earlier still write them
    ADAPTER.read_into_device(
        BufferSource(data).readinto, list(zip(offsets, params, strict=True)), ops=ops
    )
    for offset, param in zip(offsets, params, strict=True):
        assert bytes(param.numpy()) == data[offset : offset + param.numel()]
    assert not ops.pending
    assert ops.host_allocs <= 3 + 2


def test_given_buffers_must_match_the_items() -> None:
    from pysafetensors._cuda_staging import stage_items_to_device

    with pytest.raises(ValueError, match="1 buffers for 2 items"):
        stage_items_to_device(
            BufferSource(b"x" * 100).readinto,
            [(0, 10), (20, 10)],
            LateCopyOps(),
            buffers=[torch.zeros(10, dtype=torch.uint8)],
        )


def test_device_loads_read_on_the_threads_the_caller_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handle's ``threads=`` and ``tuning``'s ``read_threads`` cap the staging workers as they
    cap CPU reads (a capped caller on a shared host got 4-16 reading threads on a device)."""
    from pysafetensors import tuning
    from pysafetensors._cuda_staging import MAX_WORKERS, WORKERS, staging_workers
    from pysafetensors._sources import PreadSource
    from pysafetensors.parallel import load_shard
    from pysafetensors.torch import save_file

    path = tmp_path / "big.safetensors"
    value = torch.arange(8 << 20, dtype=torch.int32)  # 32 MiB: four 8 MiB chunks
    save_file({"a": value}, path)
    readers: set[int] = set()
    real = PreadSource.readinto

    def counted(self: Any, offset: int, view: Any) -> Any:
        readers.add(threading.get_ident())
        return real(self, offset, view)

    monkeypatch.setattr(PreadSource, "readinto", counted)
    stage_on_cuda(monkeypatch)
    with safe_open(path, "pt", backend="pread", threads=1) as f:
        assert torch.equal(f.get_tensor("a"), value)
    assert len(readers) == 1
    readers.clear()
    with tuning.configured(read_threads=2):
        assert staging_workers() == 2 and staging_workers(3) == 3
        assert torch.equal(load_shard(path, 0, 1, {}, framework="pt")["a"], value)
    assert 1 <= len(readers) <= 2
    assert staging_workers() == WORKERS
    assert staging_workers(64) == MAX_WORKERS
    # A handle's threads= beyond the staging bound is held to it (a pinned buffer each).
    import pysafetensors._cuda_staging as staging

    asked: list[int] = []
    real_stage = staging.stage_items_to_device

    def recorded(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs["workers"])
        return real_stage(*args, **kwargs)

    monkeypatch.setattr(staging, "stage_items_to_device", recorded)
    with safe_open(path, "pt", backend="pread", threads=64) as f:
        assert torch.equal(f.get_tensor("a"), value)
    assert asked == [MAX_WORKERS]


class CopyFailsAfterQueuing(LateCopyOps):
    """Its second ``copy_async`` queues the chunk's copies, then fails (a piece refused half
    way through a chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def copy_async(self, host: Any, pieces: Any, stream: Any) -> Any:
        event = super().copy_async(host, pieces, stream)
        with self.lock:
            self.calls += 1
            fail = self.calls == 2
        if fail:
            raise RuntimeError("CUDA error: copy failed")
        return event


def test_a_buffer_whose_copies_failed_half_way_is_given_back_once_they_landed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The buffer went back to the ring as idle with its queued copies still pending: another
    # worker could refill it, and those copies then wrote the other chunk's bytes (kept by an
    # in-place load, which leaves what landed).
    from pysafetensors import _cuda_staging as staging

    ops = CopyFailsAfterQueuing()
    real_give = staging._GrowingRing.give
    given_idle_with_pending: list[int] = []

    def give(self: Any, slot: Any) -> None:
        _, host, _, event = slot
        if event is None:
            with ops.lock:
                if any(e["host"] is host for e in ops.pending):
                    given_idle_with_pending.append(1)
        real_give(self, slot)

    monkeypatch.setattr(staging._GrowingRing, "give", give)
    data = _data(64 * 1024)
    with pytest.raises(RuntimeError, match="copy failed"):
        stage_to_device(BufferSource(data).readinto, 0, len(data), ops, chunk_bytes=4096, workers=2)
    assert ops.calls >= 2
    assert not given_idle_with_pending
    assert not ops.pending


def test_no_copy_is_queued_after_the_call_stopped_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A second Ctrl-C returns from run_parallel before its workers: a copy a worker queued
    # after the final synchronize still ran when the caller freed the device buffers (a
    # synchronize of the worker's own stream afterwards came too late to prevent it).
    from pysafetensors import _cuda_staging as staging

    ops = LateCopyOps()
    release = threading.Event()
    workers: list[threading.Thread] = []

    def interrupted_run_parallel(fn: Any, items: Any, threads: int) -> None:
        def late() -> None:
            release.wait(10)
            fn(next(iter(items)))

        worker = threading.Thread(target=late)
        worker.start()
        workers.append(worker)
        raise KeyboardInterrupt

    monkeypatch.setattr(staging, "run_parallel", interrupted_run_parallel)
    data = _data(8192)
    with pytest.raises(KeyboardInterrupt):
        stage_to_device(BufferSource(data).readinto, 0, len(data), ops, chunk_bytes=4096, workers=2)
    release.set()
    workers[0].join(10)
    assert not workers[0].is_alive()
    assert ops.copies == 0  # the late worker read its chunk but queued no copy
    assert not ops.pending


class SlowQueueOps(LateCopyOps):
    """Its ``copy_async`` waits for ``let_go`` once inside (``inside`` set)."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = threading.Event()
        self.let_go = threading.Event()

    def copy_async(self, host: Any, pieces: Any, stream: Any) -> Any:
        self.inside.set()
        self.let_go.wait(10)
        return super().copy_async(host, pieces, stream)


@pytest.mark.parametrize("another_ctrl_c", [False, True])
def test_a_copy_being_queued_when_the_call_stops_waiting_is_waited_for(
    monkeypatch: pytest.MonkeyPatch, another_ctrl_c: bool
) -> None:
    # The call gives up while a worker is inside copy_async: the final synchronize must come
    # after that copy is queued, or it would not wait for it. A further Ctrl-C landing in that
    # wait (another_ctrl_c) escaped before the synchronize.
    import signal

    from pysafetensors import _cuda_staging as staging

    ops = SlowQueueOps()
    workers: list[threading.Thread] = []
    main = threading.main_thread().ident

    def interrupted_run_parallel(fn: Any, items: Any, threads: int) -> None:
        worker = threading.Thread(target=fn, args=(next(iter(items)),))
        worker.start()
        workers.append(worker)
        assert ops.inside.wait(10)
        if another_ctrl_c:
            threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGINT)).start()
        threading.Timer(0.4 if another_ctrl_c else 0.2, ops.let_go.set).start()
        raise KeyboardInterrupt

    monkeypatch.setattr(staging, "run_parallel", interrupted_run_parallel)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        data = _data(8192)
        with pytest.raises(KeyboardInterrupt):
            stage_to_device(
                BufferSource(data).readinto, 0, len(data), ops, chunk_bytes=4096, workers=2
            )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ops.let_go.is_set()  # the call returned only once the copy was queued
    assert ops.copies == 1
    assert not ops.pending  # and its synchronize waited for it
    workers[0].join(10)


def test_side_streams_are_entered_inside_their_devices_guard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch.cuda.stream alone, on a reader thread (current device 0), restored device 0's
    # stream by cudaSetDevice(0) on exit: a CUDA context on device 0 for every process loading
    # to cuda:N. The order is what can be checked without a GPU.
    from pysafetensors._cuda_staging import TorchCudaOps

    entered: list[str] = []

    @contextlib.contextmanager
    def device(dev: Any) -> Any:
        entered.append(f"device {dev}")
        yield
        entered.append("device exit")

    @contextlib.contextmanager
    def stream(s: Any) -> Any:
        entered.append("stream")
        yield
        entered.append("stream exit")

    class Event:
        def record(self, stream: Any) -> None:
            entered.append("record")

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    ops = TorchCudaOps("cuda:1")
    host = torch.arange(16, dtype=torch.uint8)
    dst = torch.zeros(16, dtype=torch.uint8)
    ops.copy_async(host, [(dst, 0, 0, 16)], object())
    assert torch.equal(dst, host)
    expected = ["device cuda:1", "stream", "record", "stream exit", "device exit"]
    assert entered == expected
    entered.clear()
    ops.copy_to_host_async(dst, host, 0, 16, object())
    assert entered == expected
