"""The kept reader threads: nested use, errors, forked children, and correct bytes."""

from __future__ import annotations

import errno
import gc
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import (
    _fresh_memory,
    _range_reads,
    _reader_pool,
    _sources,
    safe_open,
    tuning,
)
from pysafetensors._reader_pool import run_parallel, start_beside
from pysafetensors._sources import PreadSource
from pysafetensors.numpy import save_file


@pytest.fixture(autouse=True)
def _memory_not_marked_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as if no destination had met slow huge pages (process-wide state)."""
    monkeypatch.setattr(_fresh_memory._HugeRegion, "slow_until", 0.0)


def test_items_run_on_reader_threads_and_nested_calls_run_inline() -> None:
    seen: list[str] = []
    lock = threading.Lock()

    def inner(i: int) -> None:
        with lock:
            seen.append(threading.current_thread().name)

    def outer(i: int) -> None:
        # A split inside a split: must not wait on its own pool (that could deadlock).
        run_parallel(inner, range(4), 2)

    done = threading.Event()

    def main() -> None:
        run_parallel(outer, range(8), 2)
        done.set()

    t = threading.Thread(target=main, daemon=True)
    t.start()
    assert done.wait(30), "nested run_parallel deadlocked"
    assert len(seen) == 32
    assert all(name.startswith("pysafetensors-read") for name in seen)


def test_first_exception_propagates() -> None:
    def fail(i: int) -> None:
        if i == 3:
            raise ValueError("boom at 3")

    with pytest.raises(ValueError, match="boom at 3"):
        run_parallel(fail, range(6), 2)


def test_a_task_started_beside_runs_on_a_reader_thread_and_is_waited_for() -> None:
    started = threading.Event()
    release = threading.Event()
    seen: list[str] = []

    def task() -> None:
        started.set()
        release.wait(10)
        seen.append(threading.current_thread().name)

    wait = start_beside(task)
    assert started.wait(10) and not seen  # running while this thread goes on
    release.set()
    wait()
    assert seen and seen[0].startswith("pysafetensors-read")

    def failing() -> None:
        raise OSError(5, "disk on fire")

    wait = start_beside(failing)
    with pytest.raises(OSError, match="disk on fire"):
        wait()


def test_a_task_started_beside_from_a_reader_thread_runs_inline() -> None:
    """On a reader thread (a read inside a parallel read) the task runs at once: waiting on the
    pool from one of its own workers could wait for ever."""
    where: list[tuple[str, str]] = []

    def outer(_: int) -> None:
        here = threading.current_thread().name
        start_beside(lambda: where.append((here, threading.current_thread().name)))()

    run_parallel(outer, range(4), 2)
    assert len(where) == 4 and all(a == b for a, b in where)


def test_one_item_or_one_thread_runs_inline() -> None:
    names: list[str] = []
    run_parallel(lambda i: names.append(threading.current_thread().name), [1], 4)
    run_parallel(lambda i: names.append(threading.current_thread().name), [1, 2], 1)
    assert names == [threading.current_thread().name] * 3


def _read_in_child(path: str, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    fd = os.open(path, os.O_RDONLY)
    src = PreadSource(fd, path, threads=4, chunk_size=1 << 20)
    out = np.empty(src.size, np.uint8)
    src.readinto(0, out.data)
    queue.put(out.tobytes() == Path(path).read_bytes())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_gets_fresh_threads(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 9 << 20, np.uint8).tobytes())
    # Start the parent's pool first, so the child inherits a pool object without threads.
    run_parallel(lambda i: None, range(4), 4)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_read_in_child, args=(str(path), queue))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert queue.get(timeout=5) is True


@pytest.mark.parametrize("size", [1, (2 << 20) + 7, (4 << 20) + 4095, 37 << 20])
def test_split_reads_give_the_file_bytes(tmp_path: Path, size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size + 100, np.uint8)
    path = tmp_path / "data.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    src = PreadSource(fd, str(path), threads=4)
    try:
        out = np.empty(size, np.uint8)
        src.readinto(50, out.data)
        assert np.array_equal(out, data[50 : 50 + size])
    finally:
        src.close()
    if size >= 4 << 20:
        assert _reader_pool.reader_thread_count() >= 4  # threads kept for the next read


@pytest.mark.parametrize(
    "index",
    [
        (slice(None), slice(0, 256)),  # a column split: a piece of every row
        (slice(3, 1500), slice(100, 1900, 3)),
        (slice(0, 700),),  # one contiguous run
        (slice(None, None, 2), 5),
    ],
)
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_large_slices_copied_in_parallel_match_numpy(
    tmp_path: Path, index: tuple[object, ...], backend: str
) -> None:
    import pysafetensors
    from pysafetensors.numpy import save_file

    data = np.random.default_rng(7).standard_normal((2048, 2048)).astype(np.float32)  # 16 MiB
    path = tmp_path / "big.safetensors"
    save_file({"w": data}, str(path))
    with pysafetensors.safe_open(str(path), "np", backend=backend) as f:
        got = f.get_slice("w")[index]
    want = data[index]
    assert got.shape == want.shape
    assert np.array_equal(got, want)


# ------------------------------------------------------------------ read destinations


def _check_destination(buf: np.ndarray, nbytes: int) -> None:
    assert buf.dtype == np.uint8 and buf.shape == (nbytes,)
    assert buf.flags.writeable and buf.flags.c_contiguous
    buf[:: 1 << 20] = 7
    buf[-1] = 9
    assert buf[0] == 7 and buf[-1] == 9


@pytest.mark.parametrize("mode", ["auto", True, False])
def test_large_destinations_in_every_mode(monkeypatch: pytest.MonkeyPatch, mode: object) -> None:
    monkeypatch.setattr(tuning, "_current", tuning.Settings(hugepage_destinations=mode))
    nbytes = (80 << 20) + 123
    _check_destination(_fresh_memory.empty_bytes(nbytes), nbytes)


def test_slow_huge_pages_fall_back_after_a_few_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    if _fresh_memory._probed_hugepages(_fresh_memory._HUGEPAGE_MIN) is None:
        pytest.skip("no MADV_POPULATE_WRITE here")
    steps: list[int] = []
    real = _fresh_memory.advise_range

    def counting(mapping: object, address: int, start: int, length: int, advice: int) -> None:
        if advice == _fresh_memory._MADV_POPULATE_WRITE:
            steps.append(start)
        real(mapping, address, start, length, advice)  # type: ignore[arg-type]

    monkeypatch.setattr(_fresh_memory, "advise_range", counting)
    monkeypatch.setattr(_fresh_memory, "_HUGEPAGE_MIN_RATE", 1e30)  # every step counts as slow
    nbytes = 256 << 20
    buf = _fresh_memory._probed_hugepages(nbytes)
    assert buf is not None
    _check_destination(buf, nbytes)
    # The first step, then at most a few more per thread before the switch to 4 KiB pages.
    assert 1 <= len(steps) < 3 + 2 * os.cpu_count()  # type: ignore[operator]
    assert len(steps) < nbytes // _fresh_memory.POPULATE_STEP


@pytest.mark.parametrize("libc_madvise", [True, False])
def test_populate_through_libc_or_the_mmap_module(
    monkeypatch: pytest.MonkeyPatch, libc_madvise: bool
) -> None:
    # libc's madvise (the GIL released while the kernel zeroes pages) where there is one, the
    # mmap module's otherwise: the same pages either way.
    if not libc_madvise:
        monkeypatch.setattr(_fresh_memory, "madvise", None)
    elif _fresh_memory.madvise is None:
        pytest.skip("no libc madvise here")
    nbytes = 24 << 20
    buf = _fresh_memory._probed_hugepages(nbytes)
    if buf is None:
        pytest.skip("no MADV_POPULATE_WRITE here")
    _check_destination(buf, nbytes)


def test_refused_advice_raises_with_the_errno() -> None:
    region = _sources.mmap.mmap(-1, 1 << 20)
    try:
        address = _fresh_memory.address_of(region)
        with pytest.raises(OSError) as info:
            _fresh_memory.advise_range(region, address, 0, 1 << 20, -12345)
        assert info.value.errno == errno.EINVAL
    finally:
        region.close()


def test_destination_without_populate_support_uses_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fresh_memory, "_MADV_POPULATE_WRITE", -12345)  # refused by the kernel
    assert _fresh_memory._probed_hugepages(_fresh_memory._HUGEPAGE_MIN) is None
    nbytes = _fresh_memory._HUGEPAGE_MIN + 1
    buf = _fresh_memory.empty_bytes(nbytes)
    _check_destination(buf, nbytes)
    assert buf.base is None or not isinstance(buf.base, memoryview)


def test_load_into_probed_destination_matches(tmp_path: Path) -> None:
    import pysafetensors.numpy as st_np

    data = {
        "a": np.random.default_rng(1).standard_normal((3000, 3000)).astype(np.float32),
        "b": np.arange(10, dtype=np.int64),
    }
    path = tmp_path / "m.safetensors"
    st_np.save_file(data, str(path))
    got = st_np.load_file(str(path), backend="pread")
    for k, v in data.items():
        assert np.array_equal(got[k], v)
    del got  # the tensors keep the mapping alive until here


@pytest.mark.parametrize("setting", ["auto", "auto-slow", False])
def test_fresh_reads_fault_in_as_they_go_and_match(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str | bool
) -> None:
    if setting == "auto-slow":
        monkeypatch.setattr(_fresh_memory, "_HUGEPAGE_MIN_RATE", 1e30)  # every step counts as slow
        setting = "auto"
    monkeypatch.setattr(tuning, "_current", tuning.Settings(hugepage_destinations=setting))
    monkeypatch.setattr(_sources, "ONE_READ_MAX", 0)  # this size is read in one piece else
    size = _fresh_memory._HUGEPAGE_MIN + (5 << 20) + 17
    data = np.random.default_rng(3).integers(0, 256, size + 4096, np.uint8)
    path = tmp_path / "d.bin"
    path.write_bytes(data.tobytes())
    src = PreadSource(os.open(path, os.O_RDONLY), str(path), threads=3)
    try:
        got = _sources.read_fresh(src, 100, size)
    finally:
        src.close()
    assert got.flags.writeable
    assert np.array_equal(got, data[100 : 100 + size])


@pytest.mark.parametrize("threads", [1, 3, 8, 13])
def test_fresh_reads_with_odd_sizes_and_thread_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    # Chunk sizes from nbytes / threads are not page multiples; chunks must still start on
    # page boundaries (an unaligned madvise is refused, which would cost the huge pages).
    starts: list[int] = []
    real = _fresh_memory._HugeRegion.populate

    def recording(self: object, start: int, length: int, **kw: bool) -> None:
        starts.append(start)
        real(self, start, length, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(_fresh_memory._HugeRegion, "populate", recording)
    monkeypatch.setattr(_sources, "ONE_READ_MAX", 0)  # this size is read in one piece else
    size = _fresh_memory._HUGEPAGE_MIN + 12345
    data = np.random.default_rng(threads).integers(0, 256, size + 10, np.uint8)
    path = tmp_path / "d.bin"
    path.write_bytes(data.tobytes())
    src = PreadSource(os.open(path, os.O_RDONLY), str(path), threads=threads, chunk_size=9 << 20)
    try:
        got = _sources.read_fresh(src, 3, size)
    finally:
        src.close()
    assert np.array_equal(got, data[3 : 3 + size])
    assert starts and all(start % 4096 == 0 for start in starts)


def test_fresh_reads_up_to_the_limit_are_one_read_on_the_calling_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = 1 << 20  # the same decision as at the real limit, on a smaller file
    monkeypatch.setattr(_sources, "ONE_READ_MAX", limit)
    monkeypatch.setattr(_sources, "MIN_PARALLEL_CHUNK", 64 << 10)
    calls: list[int] = []
    real = _reader_pool.run_parallel

    def recording(fn: object, items: object, threads: int) -> None:
        calls.append(threads)
        real(fn, items, threads)  # type: ignore[arg-type]

    monkeypatch.setattr(_sources, "run_parallel", recording)
    data = np.random.default_rng(7).integers(0, 256, 2 * limit, np.uint8)
    path = tmp_path / "d.bin"
    path.write_bytes(data.tobytes())
    src = PreadSource(os.open(path, os.O_RDONLY), str(path), threads=4, chunk_size=64 << 10)
    try:
        small = _sources.read_fresh(src, 5, limit)
        assert calls == [] and np.array_equal(small, data[5 : 5 + limit])
        large = _sources.read_fresh(src, 5, limit + 1)
        assert calls and np.array_equal(large, data[5 : 6 + limit])
    finally:
        src.close()


def test_unaligned_populate_and_failing_steps_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    region = _fresh_memory._HugeRegion.create(_fresh_memory._SELF_PROBED_MIN)
    if region is None:
        pytest.skip("no MADV_POPULATE_WRITE here")
    region.populate(4097, 5 << 20, strict=True)  # an unaligned start is rounded down
    monkeypatch.setattr(_fresh_memory, "_MADV_POPULATE_WRITE", -12345)  # every further step fails
    region.populate(8 << 20, 8 << 20)  # gives up quietly: the reads fault pages in instead
    assert region._slow.is_set()
    _check_destination(region.array(), _fresh_memory._SELF_PROBED_MIN)


def _is_region(buf: np.ndarray) -> bool:
    """Whether a destination is a huge-page region (an anonymous mapping), not numpy memory."""
    return isinstance(buf.base, _sources.mmap.mmap) or (
        buf.base is not None and isinstance(getattr(buf.base, "obj", None), _sources.mmap.mmap)
    )


def test_slice_sized_destinations_start_in_huge_pages() -> None:
    """Tensor-parallel slices are mostly 4-32 MiB: they get huge-page regions too."""
    if _fresh_memory._probed_hugepages(_fresh_memory._HUGEPAGE_MIN) is None:
        pytest.skip("no MADV_POPULATE_WRITE here")
    nbytes = (8 << 20) + 5
    buf = _fresh_memory.empty_bytes(nbytes)
    _check_destination(buf, nbytes)
    assert _is_region(buf)
    assert not _is_region(_fresh_memory.empty_bytes((4 << 20) - 1))  # below the floor: numpy


def test_after_slow_huge_pages_small_destinations_use_small_pages_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A small region cannot tell slow memory by its own steps; one that met a slow step makes
    the next small destinations skip huge pages for a few seconds. Large ones still probe."""
    if _fresh_memory._probed_hugepages(_fresh_memory._HUGEPAGE_MIN) is None:
        pytest.skip("no MADV_POPULATE_WRITE here")
    monkeypatch.setattr(_fresh_memory, "_HUGEPAGE_MIN_RATE", 1e30)  # every step counts as slow
    first = _fresh_memory.empty_bytes(8 << 20)
    _check_destination(first, 8 << 20)
    assert _is_region(first)  # it did not know yet
    second = _fresh_memory.empty_bytes(8 << 20)
    _check_destination(second, 8 << 20)
    assert not _is_region(second)
    large = _fresh_memory.empty_bytes(_fresh_memory._SELF_PROBED_MIN)
    assert _is_region(large)  # probes, and falls back by itself
    monkeypatch.setattr(_fresh_memory._HugeRegion, "slow_until", 0.0)  # the hold has passed
    assert _is_region(_fresh_memory.empty_bytes(8 << 20))


def test_one_pool_whatever_thread_counts_are_asked_for() -> None:
    """Each distinct ``threads=`` used to keep a pool of its own for the life of the process."""
    for threads in (2, 3, 5, 7, 9, 3, 2):
        run_parallel(lambda i: None, range(16), threads)
    size = _reader_pool.reader_thread_count()
    assert size >= 9
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # replaced pools' threads exit once idle
        alive = [t for t in threading.enumerate() if t.name.startswith("pysafetensors-read")]
        if len(alive) <= size:
            break
        time.sleep(0.05)
    assert len(alive) <= size


def test_fewer_threads_than_the_pool_limit_concurrency() -> None:
    run_parallel(lambda i: None, range(16), 8)  # the pool has at least 8 workers now
    running = 0
    most = 0
    lock = threading.Lock()

    def item(i: int) -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.01)
        with lock:
            running -= 1

    run_parallel(item, range(12), 2)
    assert most == 2


def test_huge_thread_counts_are_capped() -> None:
    seen: set[str] = set()
    lock = threading.Lock()

    def item(i: int) -> None:
        with lock:
            seen.add(threading.current_thread().name)
        time.sleep(0.002)

    run_parallel(item, range(500), 10**6)
    assert len(seen) <= _reader_pool.MAX_READ_THREADS
    assert _reader_pool.reader_thread_count() <= _reader_pool.MAX_READ_THREADS


@pytest.mark.parametrize("threads", [1, 2, 17])
def test_threads_reach_the_partial_read_source(tmp_path: Path, threads: int) -> None:
    """Split slices read through a second descriptor (readahead off), made while the header
    was read, before threads= was applied: it kept the default count."""
    save_file({"w": np.zeros((100, 60), np.int32)}, str(tmp_path / "m.safetensors"))
    with safe_open(tmp_path / "m.safetensors", "np", backend="pread", threads=threads) as f:
        source = f._source
        assert source.threads == source.without_readahead().threads == threads
        assert f.get_slice("w")[:, :30].shape == (100, 30)


def test_hugepage_destinations_true_reaches_batched_part_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pysafetensors.parallel import load_shard

    save_file({"w": np.ones((64, 1024), np.float32)}, str(tmp_path / "m.safetensors"))
    asked: list[bool] = []
    real = _fresh_memory.numpy_empty

    def spy(nbytes: int, hugepages: bool) -> np.ndarray:
        asked.append(hugepages)
        return real(nbytes, hugepages)

    monkeypatch.setattr(_range_reads, "numpy_empty", spy)  # where the part reads take it
    monkeypatch.setattr(tuning, "_current", tuning.Settings(hugepage_destinations=True))
    part = load_shard(tmp_path / "m.safetensors", 0, 2, {"w": "rows"}, framework="np")
    assert part["w"].shape == (32, 1024) and asked and all(asked)


@pytest.fixture
def _sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt, as in a terminal: a test run started in the background
    by a non-interactive shell inherits SIGINT ignored, and Python then leaves it ignored."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("_sigint_raises")
def test_an_interrupt_while_waiting_returns_only_after_the_workers() -> None:
    # Ctrl-C in the waiting caller left the workers reading and issuing device copies while
    # the caller's cleanup (freeing buffers, synchronising the device) ran: the interrupt is
    # now raised once every worker has returned, and they take no new item after it.
    import signal

    running = 0
    done: list[int] = []
    lock = threading.Lock()

    def work(item: int) -> None:
        nonlocal running
        with lock:
            running += 1
        time.sleep(0.05)
        with lock:
            running -= 1
            done.append(item)

    # A real signal: it interrupts the caller's blocking wait, as Ctrl-C does.
    timer = threading.Timer(0.12, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_parallel(work, range(200), 4)
        with lock:
            assert running == 0  # nobody still at work when the interrupt arrives
            finished = len(done)
        time.sleep(0.2)
        assert len(done) == finished < 200  # and nobody started anything afterwards
    finally:
        timer.cancel()


def _pool_failing_at(
    monkeypatch: pytest.MonkeyPatch, call: int, error: BaseException, before: Any = None
) -> None:
    """A fresh shared pool whose ``call``-th submit raises ``error`` (after ``before()``)."""
    from concurrent.futures import ThreadPoolExecutor

    calls = [0]

    class Failing(ThreadPoolExecutor):
        def submit(self, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == call:
                if before is not None:
                    before()
                raise error
            return super().submit(*args, **kwargs)

    monkeypatch.setattr(_reader_pool, "ThreadPoolExecutor", Failing)
    monkeypatch.setattr(_reader_pool, "_POOL", None)
    monkeypatch.setattr(_reader_pool, "_POOL_SIZE", 0)


def _slow_first(done: list[int], error: BaseException | None = None) -> Any:
    def work(item: int) -> None:
        if item == 0:
            time.sleep(0.3)
            if error is not None:
                raise error
        done.append(item)

    return work


def test_a_thread_that_cannot_start_leaves_no_worker_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread start failing after the first (a limit on threads or memory): the caller did
    the work itself and returned while the worker that had started still wrote into its
    buffer, and that worker's error was lost."""
    _pool_failing_at(monkeypatch, 2, RuntimeError("can't start new thread"))
    done: list[int] = []
    run_parallel(_slow_first(done), range(4), 4)
    assert sorted(done) == [0, 1, 2, 3]
    _pool_failing_at(monkeypatch, 2, RuntimeError("can't start new thread"))
    done = []
    with pytest.raises(OSError, match="EIO"):
        run_parallel(_slow_first(done, OSError(errno.EIO, "EIO")), range(4), 4)
    time.sleep(0.4)
    assert sorted(done) == [1, 2, 3]


def test_an_interrupt_while_submitting_waits_for_the_workers_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C between two submits was raised at once: the workers started read on, into
    buffers the caller freed and descriptors it closed."""
    done: list[int] = []
    _pool_failing_at(monkeypatch, 2, KeyboardInterrupt(), before=lambda: time.sleep(0.05))
    with pytest.raises(KeyboardInterrupt):
        run_parallel(_slow_first(done), range(100), 4)
    finished = sorted(done)
    assert 0 in finished  # the item at work when the interrupt came was finished first
    time.sleep(0.4)
    assert sorted(done) == finished and len(finished) < 100  # and nothing was taken after


def test_a_read_started_on_a_thread_that_is_submitting_runs_inline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A signal handler's load while its thread submitted workers (under the pool's lock)
    waited for that lock for ever."""
    nested: list[int] = []

    def handler_load() -> None:
        run_parallel(nested.append, range(8), 4)

    _pool_failing_at(monkeypatch, 2, RuntimeError("stop here"), before=handler_load)
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            run_parallel(lambda item: None, range(8), 4)
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the nested load waited for the pool's lock"
    assert nested == list(range(8)) and not outcome


@pytest.mark.usefixtures("_sigint_raises")
def test_a_second_interrupt_is_raised_at_once() -> None:
    # The first Ctrl-C waits for the workers to finish their current item; a read that hangs
    # must still be interruptible, so a second one is raised without waiting.
    import signal

    release = threading.Event()

    def work(item: int) -> None:
        release.wait(10)  # a read that does not return

    timers = [threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)) for delay in (0.1, 0.3)]
    for timer in timers:
        timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_parallel(work, range(8), 4)
        assert time.monotonic() - started < 5
    finally:
        release.set()
        for timer in timers:
            timer.cancel()


def test_runs_read_into_one_buffer_small_ones_by_span(tmp_path: Path) -> None:
    """read_runs_fresh: every run lands at its aligned offset with the file's bytes, whether
    read alone (large, far apart, empty, out of order, overlapping) or as part of a span of
    small runs less than a page apart (a rank's rows of many small tensors)."""
    from pysafetensors._range_reads import _group_small_runs, read_runs_fresh

    data = np.random.default_rng(3).integers(0, 256, 24 << 20, np.uint8)
    path = tmp_path / "data.bin"
    path.write_bytes(data.tobytes())
    rng = np.random.default_rng(4)
    runs: list[tuple[int, int]] = []
    at = 5
    for _ in range(3000):  # small runs with small gaps: grouped into spans
        length = int(rng.integers(1, 300))
        runs.append((at, length))
        at += length + int(rng.integers(0, 5000))
    runs += [(at + 10, 70_000), (at + 70_010, 3), (at + 80_000, 0), (at + 80_000, 5)]
    runs += [(1 << 20, 5 << 20), (7 << 20, 100), (7 << 20, 100), (6 << 20, 10), (9 << 20, 1)]
    groups, alone = _group_small_runs(runs)
    assert len(groups) > 10 and max(map(len, groups)) > 20
    grouped = sorted(i for g in groups for i in g)
    assert sorted(grouped + alone) == list(range(len(runs)))
    for group in groups:  # consecutive, in file order, less than a page apart, small
        for a, b in zip(group, group[1:], strict=False):
            assert b == a + 1 and 0 <= runs[b][0] - sum(runs[a]) < 4096
    src = PreadSource(os.open(path, os.O_RDONLY), str(path), threads=4)
    try:
        buf, offsets = read_runs_fresh(src, runs)
    finally:
        src.close()
    assert all(o % 64 == 0 for o in offsets)
    for (offset, length), dest in zip(runs, offsets, strict=True):
        assert np.array_equal(buf[dest : dest + length], data[offset : offset + length])


def test_a_step_timed_across_a_collection_does_not_count_as_slow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A garbage collection holds the GIL that a populate step needs back to time itself (a
    full one takes ~80 ms with torch imported): such a step says nothing about the memory, and
    three of them in a row made a load give up huge pages."""
    region = _fresh_memory._HugeRegion.create(_fresh_memory._SELF_PROBED_MIN)
    if region is None:
        pytest.skip("no MADV_POPULATE_WRITE here")
    monkeypatch.setattr(_fresh_memory, "_HUGEPAGE_MIN_RATE", 1e30)  # every timed step is slow...
    real = _fresh_memory.advise_range

    def collecting(*args: object) -> None:
        real(*args)  # type: ignore[arg-type]
        gc.collect()  # ...but a collection ran during each of them

    monkeypatch.setattr(_fresh_memory, "advise_range", collecting)
    region.populate(4 << 20, 16 << 20)
    assert not region._slow.is_set()
    monkeypatch.setattr(_fresh_memory, "advise_range", real)  # slow steps without collections count
    region.populate(20 << 20, 16 << 20)
    assert region._slow.is_set()
    _check_destination(region.array(), _fresh_memory._SELF_PROBED_MIN)


def test_numpy_loads_of_a_mapped_file_are_read_in_parallel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numpy's arrays are copies: under backend="mmap" they were one read on the calling
    thread, though documented as made in parallel."""
    from pysafetensors import SafetensorError
    from pysafetensors.numpy import load_file

    path = tmp_path / "m.safetensors"
    rng = np.random.default_rng(5)
    tensors = {"a": rng.integers(0, 255, 40 << 20, dtype=np.uint8), "b": np.arange(3.0)}
    save_file(tensors, str(path))
    runs: list[int] = []
    real = _sources.run_parallel

    def counted(fn: Any, items: Any, threads: int) -> None:
        work = list(items)
        runs.append(len(work))
        real(fn, work, threads)

    monkeypatch.setattr(_sources, "run_parallel", counted)
    got = load_file(str(path), backend="mmap")
    assert all(np.array_equal(got[k], v) for k, v in tensors.items())
    assert runs and max(runs) > 1  # the data region in pieces, on the reader threads
    with safe_open(path, "np", backend="mmap") as f:
        os.truncate(path, 1 << 20)  # cut short after the open: named as a mapped file's is
        with pytest.raises(SafetensorError, match="was truncated") as info:
            f.get_tensors()
    assert info.value.kind == "FileTruncated"


@pytest.mark.usefixtures("_sigint_raises")
def test_a_ctrl_c_inside_submit_is_raised_once_every_worker_is_submitted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C raised inside ThreadPoolExecutor.submit (its Semaphore, a lock written in
    Python) could leave that lock held: every later read of the shared pool, and the
    interpreter's exit, then waited for ever. It is now held until the submits are done."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    submitted: list[Any] = []

    class Signalling(ThreadPoolExecutor):
        def submit(self, *args: Any, **kwargs: Any) -> Any:
            if not submitted:
                signal.raise_signal(signal.SIGINT)  # arrives inside submit, as Ctrl-C may
            future = super().submit(*args, **kwargs)
            submitted.append(future)
            return future

    monkeypatch.setattr(_reader_pool, "ThreadPoolExecutor", Signalling)
    monkeypatch.setattr(_reader_pool, "_POOL", None)
    monkeypatch.setattr(_reader_pool, "_POOL_SIZE", 0)
    done: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        run_parallel(done.append, range(100), 4)
    assert len(submitted) == 4
    again: list[int] = []
    run_parallel(again.append, range(10), 4)  # the pool still works
    assert sorted(again) == list(range(10))


@pytest.mark.usefixtures("_sigint_raises")
def test_a_ctrl_c_while_a_dropped_source_closes_reaches_the_program(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python drops what a finalizer raises: a Ctrl-C during a dropped source's close was
    lost (the program went on) and could leave its descriptor open."""
    import signal

    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(4, np.float32)}, str(path))
    # Earlier tests' garbage first: the Ctrl-C handed on must not land in another library's
    # finalizer run by the collection below (one Python drops, which this cannot prevent).
    gc.collect()
    source = PreadSource(os.open(path, os.O_RDONLY), str(path))
    fd = source.fd
    real_close = PreadSource.close
    target = id(source)
    calls: list[int] = []

    def interrupted_close(self: PreadSource) -> None:
        if id(self) == target:
            calls.append(1)
            if len(calls) == 1:
                signal.raise_signal(signal.SIGINT)  # lands in the finalizer
        real_close(self)

    monkeypatch.setattr(PreadSource, "close", interrupted_close)
    with pytest.raises(KeyboardInterrupt):
        del source
        gc.collect()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.01)
    assert calls == [1, 1]
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
