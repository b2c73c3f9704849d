"""Read-ahead: a get_tensor loop in file order over a URL takes a few requests, not one per
tensor; reads out of order fetch exactly what they ask for; windows stay within budget."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from pysafetensors import safe_open
from pysafetensors._remote import HTTPSource
from pysafetensors._remote_read_ahead import _WINDOWS, BUDGET, MIN_WINDOW, ReadAhead
from pysafetensors.numpy import save_file

from .rangeserver import RangeServer

N = 1000


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RangeServer, dict]]:
    root = tmp_path_factory.mktemp("read-ahead")
    rng = np.random.default_rng(11)
    tensors = {f"t{i:04d}": rng.standard_normal((8, 64)).astype(np.float32) for i in range(N)}
    save_file(tensors, str(root / "lora.safetensors"))
    big = {f"b{i}": rng.standard_normal(1 << 20).astype(np.float32) for i in range(12)}
    save_file(big, str(root / "big.safetensors"))  # 12 tensors of 4 MiB
    server = RangeServer(root)
    yield server, tensors
    server.close()


def _size(server: RangeServer, name: str) -> int:
    return (server.root / name).stat().st_size


def test_a_loop_in_file_order_takes_few_requests(lora: tuple[RangeServer, dict]) -> None:
    server, tensors = lora
    server.reset()
    with safe_open(server.url("lora.safetensors"), "np") as f:
        for name in f.keys():  # noqa: SIM118 - the loaders' idiom; sorted: the file's order
            np.testing.assert_array_equal(f.get_tensor(name), tensors[name])
    # Every byte once, in windows that double: ~10 requests for 2 MiB, not 1,000.
    assert server.bytes_sent() == _size(server, "lora.safetensors")
    assert server.requests() <= 12, server.requests()


def test_a_loop_over_the_file_again_takes_few_requests(lora: tuple[RangeServer, dict]) -> None:
    """A second pass, and one from the middle: their reads fell behind the window still held,
    and were each taken for a thread's left behind, fetched alone (1,174 requests for 2,000
    tensors)."""
    server, tensors = lora
    with safe_open(server.url("lora.safetensors"), "np") as f:
        names = list(f.keys())
        for start in (0, 0, N // 2):
            server.reset()
            for name in names[start:]:
                np.testing.assert_array_equal(f.get_tensor(name), tensors[name])
            assert server.requests() <= 100, server.requests()


def test_reads_out_of_order_fetch_exactly_what_they_ask(lora: tuple[RangeServer, dict]) -> None:
    server, tensors = lora
    names = sorted(tensors)
    random.Random(5).shuffle(names)
    server.reset()
    with safe_open(server.url("lora.safetensors"), "np") as f:
        head = server.bytes_sent()
        for name in names[:300]:
            np.testing.assert_array_equal(f.get_tensor(name), tensors[name])
    # No window was fetched: the bytes are the tensors' own (those past the cached head).
    assert server.bytes_sent() - head <= sum(tensors[n].nbytes for n in names[:300])
    assert server.requests() >= 250


@pytest.mark.parametrize("k", [10, 19, 25, 30, 45, 51, 60])
def test_stopping_early_fetches_a_bounded_amount_ahead(
    lora: tuple[RangeServer, dict], k: int
) -> None:
    """Stopped after k tensors (some stop inside the first window, some as its next one is
    on its way): the bytes cached at open do not count as reads of the loop (they made the
    first windows twice too large)."""
    server, tensors = lora
    names = sorted(tensors)
    server.reset()
    with safe_open(server.url("lora.safetensors"), "np") as f:
        head = server.bytes_sent()
        taken = 0
        for name in names[:k]:
            taken += f.get_tensor(name).nbytes
        ahead = f._source._ahead  # type: ignore[attr-defined]
        pending = ahead._pending if ahead is not None else None
        if pending is not None:  # the worst case: the window on its way is fetched whole
            pending.future.result(timeout=10)
    beyond = server.bytes_sent() - head
    # What was read, plus at most the rest of a window and the next one fetched in the
    # background: about 2.8 times what was read (or two small windows).
    assert beyond <= max(2.8 * taken, taken + 2 * MIN_WINDOW + 8192), beyond / taken


def test_read_ahead_zero_fetches_each_read(lora: tuple[RangeServer, dict]) -> None:
    server, tensors = lora
    server.reset()
    with safe_open(server.url("lora.safetensors"), "np", storage_options={"read_ahead": 0}) as f:
        for name in sorted(tensors)[:100]:
            f.get_tensor(name)
    assert server.requests() >= 90  # one per tensor past the cached head


def test_large_tensors_are_not_copied_through_windows(lora: tuple[RangeServer, dict]) -> None:
    """Reads of a part_size or more go straight into the tensor, in parallel parts."""
    server, _ = lora
    server.reset()
    with safe_open(
        server.url("big.safetensors"), "np", storage_options={"part_size": 1 << 20}
    ) as f:
        for name in f.keys():  # noqa: SIM118 - the loaders' idiom
            f.get_tensor(name)
    assert server.bytes_sent() == _size(server, "big.safetensors")
    assert all(r.nbytes <= 1 << 20 for r in server.records())


def test_threads_reading_one_handle_get_their_own_bytes(lora: tuple[RangeServer, dict]) -> None:
    server, tensors = lora
    names = sorted(tensors)
    errors: list[BaseException] = []
    with safe_open(server.url("lora.safetensors"), "np") as f:

        def loop(part: list[str]) -> None:
            try:
                for name in part:
                    np.testing.assert_array_equal(f.get_tensor(name), tensors[name])
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(exc)

        threads = [threading.Thread(target=loop, args=(names[i::3],)) for i in range(3)]
        threads.append(threading.Thread(target=loop, args=(names,)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors


@pytest.mark.parametrize(("threads", "bound"), [(2, 1.2), (8, 1.3), (16, 1.3), (32, 1.4)])
def test_threads_reading_in_file_order_fetch_each_byte_about_once(
    lora: tuple[RangeServer, dict], threads: int, bound: float
) -> None:
    """A pool's reads in file order: each thread took its read for the next in order and
    fetched a window of its own over the others' (8 threads: 5-7 times the file, and the
    windows past the budget). Then reads of threads left behind were taken for reads out of
    order, and the window on its way was fetched again (16 threads: 1.7-3.6 times the file);
    now 0.97-1.02 times."""
    server, tensors = lora
    size = _size(server, "lora.safetensors")
    for _ in range(3):
        with safe_open(server.url("lora.safetensors"), "np") as f:
            keys = f.offset_keys()
            server.reset()
            with ThreadPoolExecutor(threads) as pool:
                got = list(pool.map(f.get_tensor, keys))
        assert all(np.array_equal(g, tensors[k]) for g, k in zip(got, keys, strict=True))
        assert server.bytes_sent() <= bound * size, server.bytes_sent() / size


def test_a_read_left_behind_by_other_threads_keeps_the_run() -> None:
    """A read in the window before the one held (a thread that fell behind the others) is
    fetched as asked, and the window on its way stays: it was dropped, fetched again, and
    the run started over small."""
    data = random.Random(4).randbytes(1 << 20)
    fetched: list[int] = []
    gate = threading.Event()

    def fetch(at: int, view: memoryview) -> None:
        if threading.current_thread().name.startswith("pysafetensors-read-ahead"):
            gate.wait(10)  # the window after the held one stays on its way
        fetched.append(at)
        view[:] = data[at : at + view.nbytes]

    ahead = ReadAhead(1 << 20, len(data), fetch)
    out = bytearray(2048)
    pos = 0
    try:
        while len(fetched) < 2 or ahead._pending is None or not ahead._pending.future.running():
            gate.set()  # the first windows arrive; the third is held back
            if len(fetched) >= 2:
                gate.clear()
            if ahead.read(pos, memoryview(out)):
                assert out == data[pos : pos + 2048]
            pos += 2048
            time.sleep(0.001)
        on_its_way, behind = ahead._pending, fetched[0] + 4096
        assert behind < ahead._window_bytes[0]  # type: ignore[index]
        assert not ahead.read(behind, memoryview(out))  # the caller fetches it
        assert ahead._pending is on_its_way
        gate.set()
        while pos < on_its_way.end:
            assert ahead.read(pos, memoryview(out))
            assert out == data[pos : pos + 2048]
            pos += 2048
    finally:
        gate.set()
        ahead.close()
    assert len(fetched) == len(set(fetched)), fetched  # no window fetched twice


def test_windows_of_all_sources_stay_within_the_budget(lora: tuple[RangeServer, dict]) -> None:
    server, _ = lora
    url = server.url("big.safetensors")
    sources = [HTTPSource(url, part_size=64 << 20) for _ in range(10)]
    whole = (server.root / "big.safetensors").read_bytes()
    try:
        for src in sources:
            out = bytearray(4 << 20)
            for k in range(8):  # reads in order: windows grow to tens of MiB
                start = 200_000 + k * len(out)
                src.readinto(start, memoryview(out))
                assert out == whole[start : start + len(out)]
            assert _WINDOWS._total <= BUDGET
        windows = [s._ahead._window_bytes for s in sources if s._ahead is not None]
        held = [w[1].size for w in windows if w is not None]
        # Ten sources' windows would be over the budget: the least recently used were dropped.
        assert len(held) < len(sources) and sum(held) <= BUDGET
        assert windows[-1] is not None  # the last one used keeps its window
    finally:
        for src in sources:
            src.close()
    assert _WINDOWS._total == 0


@pytest.mark.parametrize(("value", "error"), [(-1, ValueError), ("64MB", TypeError)])
def test_the_option_is_checked(lora: tuple[RangeServer, dict], value: object, error: type) -> None:
    server, _ = lora
    with pytest.raises(error, match="read_ahead"):
        HTTPSource(server.url("lora.safetensors"), read_ahead=value)  # type: ignore[arg-type]


def test_random_reads_match_the_bytes() -> None:
    """The state machine alone, over a buffer: sequences in order, out of order, across
    windows' ends, after a failed fetch."""
    rng = random.Random(9)
    data = rng.randbytes(3 << 20)
    fetched: list[tuple[int, int]] = []
    fail = [False]

    def fetch(at: int, view: memoryview) -> None:
        if fail[0]:
            fail[0] = False
            raise OSError("injected")
        fetched.append((at, view.nbytes))
        view[:] = data[at : at + view.nbytes]

    ahead = ReadAhead(1 << 20, len(data), fetch)
    pos = 0
    for step in range(20_000):
        if rng.random() < 0.05:
            pos = rng.randrange(len(data))
        n = min(rng.randrange(1, 9000), len(data) - pos)
        if n <= 0:
            pos = 0
            continue
        out = bytearray(n)
        if step % 997 == 0:
            fail[0] = True
        try:
            served = ahead.read(pos, memoryview(out))
        except OSError:
            continue
        if served:
            assert bytes(out) == data[pos : pos + n]
        # else: the caller fetches all of out itself (a window that failed may have left
        # part of it written).
        pos += n + (rng.randrange(0, 100) if rng.random() < 0.1 else 0)
        if pos >= len(data):
            pos = 0
    assert fetched
    ahead.close()


def test_files_read_in_turn_share_the_budget(
    lora: tuple[RangeServer, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several files read in order side by side: each window is a share of the budget, so
    none pushes another's out before it is read (each then refetched a window as large as
    its run: 10 GB fetched for 455 MiB read, five 100 MiB files)."""
    import pysafetensors._remote_read_ahead as ra

    monkeypatch.setattr(ra, "BUDGET", 1 << 20)  # the same at a small scale
    server, _ = lora
    server.reset()
    url = server.url("big.safetensors")
    sources = [HTTPSource(url, part_size=64 << 20) for _ in range(6)]
    try:
        piece = bytearray(32 << 10)
        for k in range(64):  # 2 MiB of each file, in turn
            for src in sources:
                src.readinto(100_000 + k * len(piece), memoryview(piece))
        read = 6 * 64 * len(piece)
        fetched = server.bytes_sent() - 6 * 65536  # less the heads cached at open
        assert fetched <= 1.25 * read, fetched / read
        assert _WINDOWS._total <= 1 << 20
    finally:
        for src in sources:
            src.close()


def test_a_source_dropped_without_close_is_not_kept(lora: tuple[RangeServer, dict]) -> None:
    import gc
    import weakref

    server, tensors = lora
    src = HTTPSource(server.url("lora.safetensors"))
    out = bytearray(2048)
    for k in range(8):
        src.readinto(70_000 + k * 2048, memoryview(out))
    assert src._ahead is not None and src._ahead._window_bytes is not None
    gone = weakref.ref(src)
    del src
    gc.collect()
    assert gone() is None  # the window's account held it alive
    probe = ReadAhead(1 << 20, 1 << 20, lambda at, view: None)
    _WINDOWS.share(probe)  # settles the account
    assert _WINDOWS._total == 0


def test_a_window_arriving_after_close_is_not_kept() -> None:
    data = bytes(range(256)) * 1024
    holder: list[ReadAhead] = []

    def fetch(at: int, view: memoryview) -> None:
        holder[0].close()  # closed while the window is on its way
        view[:] = data[at : at + view.nbytes]

    ahead = ReadAhead(1 << 20, len(data), fetch)
    holder.append(ahead)
    out = bytearray(100)
    for k in range(3):
        ahead.read(k * 100, memoryview(out))
    assert bytes(out) == data[200:300]
    assert ahead._window_bytes is None and id(ahead) not in _WINDOWS._held


def test_read_ahead_is_the_largest_window(lora: tuple[RangeServer, dict]) -> None:
    server, tensors = lora
    server.reset()
    with safe_open(server.url("lora.safetensors"), "np", storage_options={"read_ahead": 1}) as f:
        head = server.bytes_sent()
        for name in sorted(tensors)[:40]:
            f.get_tensor(name)
        asked = sum(tensors[n].nbytes for n in sorted(tensors)[:40])
    assert server.bytes_sent() - head <= asked  # each read as asked, nothing ahead


def test_a_window_is_spread_over_the_connections(lora: tuple[RangeServer, dict]) -> None:
    """A window is read whole before the loop goes on: its parts run side by side, 1 MiB or
    more each (in part_size parts, a 16 MiB window was two requests, six connections idle)."""
    server, _ = lora
    data = (server.root / "big.safetensors").read_bytes()
    with HTTPSource(server.url("big.safetensors")) as src:
        server.reset()
        out = bytearray(16 << 20)
        src.readinto_spread(100_000, memoryview(out))
        assert bytes(out) == data[100_000 : 100_000 + len(out)]
        sizes = sorted(r.nbytes for r in server.records())
        assert len(sizes) == 8 and sum(sizes) == len(out)  # max_connections parts of 2 MiB
        server.reset()
        small = bytearray(1 << 20)
        src.readinto_spread(200_000, memoryview(small))
        assert server.requests() == 1  # not cut below 1 MiB
        assert bytes(small) == data[200_000 : 200_000 + len(small)]


def test_forget_under_the_lock_does_not_block() -> None:
    """A dropped handle closed by the collector while this thread holds the budget's lock
    (the collector runs wherever an allocation triggers it) is queued, not waited for."""
    data = bytes(1 << 20)
    ahead = ReadAhead(
        1 << 20,
        len(data),
        lambda at, view: view.__setitem__(slice(None), data[at : at + view.nbytes]),
    )
    out = bytearray(100)
    for k in range(3):
        assert ahead.read(k * 100, memoryview(out)) is (k == 2)
    assert id(ahead) in _WINDOWS._held
    with _WINDOWS._lock:
        ahead.close()  # blocked for ever before
    probe = ReadAhead(1 << 20, 1 << 20, lambda at, view: None)
    _WINDOWS.share(probe)  # the next call settles it
    assert id(ahead) not in _WINDOWS._held


def test_a_window_dropped_before_its_record_is_not_recorded() -> None:
    ahead = ReadAhead(1 << 20, 1 << 20, lambda at, view: None)
    window = np.zeros(4096, np.uint8)
    ahead._window_bytes = (0, window)
    ahead._dropped()  # another source's eviction, before this one's record
    _WINDOWS.hold(ahead, window)
    assert id(ahead) not in _WINDOWS._held


def test_a_failing_server_is_retried_once_per_read(lora: tuple[RangeServer, dict]) -> None:
    """A window that fails after the source's retries is the read's failure: its own read
    is not tried again (that doubled the requests and the back-off to a failing server)."""
    from pysafetensors import RemoteError

    server, tensors = lora
    names = sorted(tensors)
    with safe_open(
        server.url("lora.safetensors"), "np", storage_options={"retries": 2, "backoff": 0.01}
    ) as f:
        for name in names[200:202]:
            f.get_tensor(name)  # two reads in order: the next one fetches a window
        server.reset()
        server.inject("lora.safetensors", 503, 503, 503, 503, 503, 503)
        with pytest.raises(RemoteError):
            f.get_tensor(names[202])
    assert server.requests() == 3  # the first try and two retries


def _starts(server: RangeServer) -> set[int]:
    """Where the requests logged so far started (their Range's first byte)."""
    return {int(r.range.split("=")[1].split("-")[0]) for r in server.records() if r.range}


def _wait_for(condition: Callable[[], bool], seconds: float = 10) -> bool:
    stop = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > stop:
            return False
        time.sleep(0.002)
    return True


def _running_in(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is inside a call of ``function`` now."""
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def _read_to_half(src: HTTPSource, start: int, piece: int, whole: bytes) -> tuple[int, int]:
    """Read ``piece`` bytes at a time in order from ``start`` until half of a window is
    read; return where the reads stopped and where that window ends."""
    out = bytearray(piece)
    pos = start
    while True:
        src.readinto(pos, memoryview(out))
        assert out == whole[pos : pos + piece]
        pos += piece
        held = src._ahead._window_bytes if src._ahead is not None else None
        if held is not None and 2 * (pos - held[0]) >= held[1].size:
            return pos, held[0] + held[1].size


def test_the_next_window_is_fetched_while_the_loop_works(lora: tuple[RangeServer, dict]) -> None:
    """Half-way through a window the next one is requested in the background, before any
    read reaches it; the reads then take it without a request of their own."""
    server, _ = lora
    whole = (server.root / "lora.safetensors").read_bytes()
    with HTTPSource(server.url("lora.safetensors")) as src:
        server.reset()
        pos, end = _read_to_half(src, 70_000, 2048, whole)
        # Nothing read reaches `end` yet, and the window from there is on its way.
        assert pos < end
        assert _wait_for(lambda: end in _starts(server)), _starts(server)
        assert src._ahead is not None and src._ahead._pending is not None
        assert _wait_for(lambda: src._ahead._pending.future.done())
        before = server.requests()
        out = bytearray(2048)
        for at in range(pos, end + 8192, 2048):  # across the end, into the next window
            src.readinto(at, memoryview(out))
            assert out == whole[at : at + 2048]
        # Served by the window fetched ahead: no request for these bytes; at most the
        # window after it was asked for.
        later = server.records()[before:]
        assert len(later) <= 1 and all(int(r.range[6:].split("-")[0]) >= end for r in later)


def test_a_loop_with_work_between_reads_gets_every_byte_once(
    lora: tuple[RangeServer, dict],
) -> None:
    """A loop that works between its reads (the background fetches then run while it
    works) gets the same bytes and fetches each byte once."""
    server, tensors = lora
    server.reset()
    with safe_open(server.url("lora.safetensors"), "np") as f:
        for name in f.offset_keys():
            np.testing.assert_array_equal(f.get_tensor(name), tensors[name])
            time.sleep(0.0002)
    assert server.bytes_sent() == _size(server, "lora.safetensors")
    assert server.requests() <= 14, server.requests()
    assert _WINDOWS._total == 0


def test_close_waits_for_a_window_on_its_way(lora: tuple[RangeServer, dict]) -> None:
    """close() lets a background fetch finish before the source lets its connections go,
    keeps nothing of it, and leaves nothing in flight."""
    server, _ = lora
    whole = (server.root / "lora.safetensors").read_bytes()
    src = HTTPSource(server.url("slow/lora.safetensors"))
    try:
        server.reset()
        _, end = _read_to_half(src, 70_000, 2048, whole)
        assert src._ahead is not None
        pending = src._ahead._pending
        assert pending is not None
        assert _wait_for(pending.future.running)  # on its way (the server is slow)
    finally:
        src.close()
    assert pending.future.done() and pending.future.exception() is None
    assert src._ahead._pending is None and src._ahead._window_bytes is None
    assert id(src._ahead) not in _WINDOWS._held
    assert end in _starts(server)


def test_a_read_out_of_order_drops_the_window_on_its_way(
    lora: tuple[RangeServer, dict],
) -> None:
    server, _ = lora
    whole = (server.root / "lora.safetensors").read_bytes()
    with HTTPSource(server.url("slow/lora.safetensors")) as src:
        server.reset()
        _read_to_half(src, 70_000, 2048, whole)
        assert src._ahead is not None and src._ahead._pending is not None
        out = bytearray(4096)
        src.readinto(1_500_000, memoryview(out))  # elsewhere: fetched as asked
        assert out == whole[1_500_000 : 1_500_000 + 4096]
        assert src._ahead._pending is None


def test_a_window_that_fails_in_the_background_fails_the_read_that_reaches_it(
    lora: tuple[RangeServer, dict],
) -> None:
    """Its failure (after the source's retries) is the failure of the read that needed it,
    and is not retried again by that read; a loop that stops before it sees nothing."""
    from pysafetensors import RemoteError

    server, _ = lora
    whole = (server.root / "lora.safetensors").read_bytes()
    with HTTPSource(server.url("lora.safetensors"), retries=1, backoff=0.01) as src:
        server.reset()
        out = bytearray(2048)
        pos = 70_000
        for _ in range(3):  # the third read in order fetches the first window
            src.readinto(pos, memoryview(out))
            pos += 2048
        server.inject("lora.safetensors", 503, 503)
        pos, end = _read_to_half(src, pos, 2048, whole)
        assert src._ahead is not None and src._ahead._pending is not None
        assert _wait_for(lambda: src._ahead._pending.future.done())
        requests = server.requests()
        while pos + 2048 <= end:  # the rest of the window still reads
            src.readinto(pos, memoryview(out))
            assert out == whole[pos : pos + 2048]
            pos += 2048
        with pytest.raises(RemoteError, match="503"):
            src.readinto(end, memoryview(out))
        assert server.requests() == requests


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
# The child runs only this library's code and leaves by os._exit: JAX, imported by other
# tests of the run, warns about its own threads, which the child never touches.
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_a_forked_child_reads_on_without_the_parents_window_on_its_way(
    lora: tuple[RangeServer, dict],
) -> None:
    server, _ = lora
    whole = (server.root / "lora.safetensors").read_bytes()
    with HTTPSource(server.url("slow/lora.safetensors")) as src:
        pos, end = _read_to_half(src, 70_000, 2048, whole)
        assert src._ahead is not None and src._ahead._pending is not None
        pid = os.fork()
        if pid == 0:  # the child: the parent's fetch thread is not here
            code = 1
            try:
                out = bytearray(2048)
                for at in range(pos, end + 4096, 2048):
                    src.readinto(at, memoryview(out))
                    if out != whole[at : at + 2048]:
                        break
                else:
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


class _Gated:
    """A fetch over bytes in memory whose background calls wait for ``gate``."""

    def __init__(self, size: int = 1 << 20) -> None:
        self.data = bytes(range(256)) * (size // 256)
        self.gate = threading.Event()
        self.started = threading.Event()
        self.running = 0

    def __call__(self, at: int, view: memoryview) -> None:
        if threading.current_thread().name == "pysafetensors-read-ahead":
            self.running += 1
            self.started.set()
            self.gate.wait(10)
            self.running -= 1
        view[:] = self.data[at : at + view.nbytes]

    def ahead_with_a_window_on_its_way(self) -> tuple[ReadAhead, int]:
        ahead = ReadAhead(1 << 20, len(self.data), self)
        out = bytearray(2048)
        pos = 0
        while ahead._pending is None:
            assert ahead.read(pos, memoryview(out)) or pos < 3 * 2048
            pos += 2048
        assert self.started.wait(5)
        return ahead, pos


def _closes_before_the_fetch_ends(ahead: ReadAhead, fetch: _Gated, name: str = "closer") -> bool:
    closer = threading.Thread(target=ahead.close, name=name)
    closer.start()
    closer.join(0.5)
    early = not closer.is_alive() and fetch.running > 0
    fetch.gate.set()
    closer.join(5)
    assert not closer.is_alive()
    return early


def test_close_waits_for_a_dropped_window_still_on_its_way() -> None:
    """A read out of order drops the window on its way without waiting; close() still waits
    for it (the source lets its connections go next)."""
    fetch = _Gated()
    ahead, _ = fetch.ahead_with_a_window_on_its_way()
    assert ahead.read(900_000, memoryview(bytearray(100))) is False
    assert ahead._pending is None
    assert not _closes_before_the_fetch_ends(ahead, fetch)
    assert id(ahead) not in _WINDOWS._held


def test_close_waits_for_a_window_a_reader_waits_for() -> None:
    fetch = _Gated()
    ahead, _ = fetch.ahead_with_a_window_on_its_way()
    held = ahead._window_bytes
    assert held is not None
    end = held[0] + held[1].size
    reader = threading.Thread(target=ahead.read, args=(end, memoryview(bytearray(2048))))
    reader.start()
    assert _wait_for(lambda: _running_in(reader, "_take"))  # the reader waits for it
    assert not _closes_before_the_fetch_ends(ahead, fetch)
    reader.join(5)


def test_close_on_a_library_thread_does_not_wait() -> None:
    """The collector may close a dropped handle on a remote worker whose part the window on
    its way waits for: waiting there would never end."""
    fetch = _Gated()
    ahead, _ = fetch.ahead_with_a_window_on_its_way()
    assert _closes_before_the_fetch_ends(ahead, fetch, name="pysafetensors-remote_0")
    assert id(ahead) not in _WINDOWS._held


def test_an_interrupted_close_still_leaves_the_budget(
    lora: tuple[RangeServer, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while close() waits for a window: the source leaves the budget's account all
    the same (it halved every other file's share for as long as the handle lived)."""
    import signal

    from . import rangeserver

    monkeypatch.setattr(rangeserver, "SLOW_SECONDS", 1.0)
    server, _ = lora
    whole = (server.root / "lora.safetensors").read_bytes()
    src = HTTPSource(server.url("slow/lora.safetensors"))
    _read_to_half(src, 70_000, 2048, whole)
    ahead = src._ahead
    assert ahead is not None and ahead._pending is not None
    pending = ahead._pending
    assert _wait_for(pending.future.running)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            ahead.close()
        signal.setitimer(signal.ITIMER_REAL, 0)
        assert _wait_for(pending.future.done)
        # Not closed again (a handle's close() is not repeated: it let its source go first).
        _WINDOWS.share(ReadAhead(1 << 20, 1 << 20, lambda at, view: None))  # settles
        assert id(ahead) not in _WINDOWS._held
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        src.close()


def test_a_window_dropped_while_the_next_is_planned_takes_no_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another source's eviction (which runs without this source's lock) landing while the
    next window is being planned: that window is not fetched outside the budget's account."""
    fetch = _Gated()
    fetch.gate.set()
    ahead = ReadAhead(1 << 20, len(fetch.data), fetch)
    real_share = _WINDOWS.share
    dropped: list[bool] = []

    def share(owner: ReadAhead) -> int:
        if owner is ahead and not dropped:
            dropped.append(True)
            ahead._dropped()  # as another source's hold() evicting it, from another thread
        return real_share(owner)

    out = bytearray(2048)
    pos = 0
    while ahead._window_bytes is None:
        ahead.read(pos, memoryview(out))
        pos += 2048
    held = ahead._window_bytes
    monkeypatch.setattr(_WINDOWS, "share", share)
    while not dropped:  # up to the read that plans the next window
        assert ahead.read(pos, memoryview(out))
        pos += 2048
    assert ahead._window_bytes is None and ahead._pending is None
    assert not fetch.started.wait(0.2) or fetch.running == 0
    assert held is not None
    ahead.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
# The child runs only this library's code and leaves by os._exit: JAX, imported by other
# tests of the run, warns about its own threads, which the child never touches.
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_a_forked_child_closes_without_waiting_for_the_parents_window(
    lora: tuple[RangeServer, dict],
) -> None:
    server, _ = lora
    whole = (server.root / "lora.safetensors").read_bytes()
    with HTTPSource(server.url("slow/lora.safetensors")) as src:
        _read_to_half(src, 70_000, 2048, whole)
        assert src._ahead is not None and src._ahead._pending is not None
        assert _wait_for(src._ahead._pending.future.running)
        pid = os.fork()
        if pid == 0:  # the parent's fetch thread is not here: its window never arrives
            import signal

            signal.alarm(10)
            src.close()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


def test_an_interrupted_loop_exits_without_waiting_for_the_next_window(
    lora: tuple[RangeServer, dict],
) -> None:
    """The window on its way is fetched on a daemon thread: a loop stopped by Ctrl-C (the
    source never closed) exits at once, not when a window nobody will read has arrived
    (~7 s at the trickling server's 1 KiB per 50 ms)."""

    server, _ = lora
    child = (
        "import sys, time\n"
        "from pysafetensors._remote import HTTPSource\n"
        "src = HTTPSource(sys.argv[1])\n"
        "out, pos = bytearray(2048), 70_000\n"
        "while True:\n"
        "    src.readinto(pos, memoryview(out)); pos += 2048\n"
        "    w = src._ahead._window_bytes if src._ahead is not None else None\n"
        "    if w is not None and 2 * (pos - w[0]) >= w[1].size: break\n"
        "while src._ahead._pending is None or not src._ahead._pending.future.running():\n"
        "    time.sleep(0.01)\n"
        "print(time.monotonic(), flush=True)\n"
        "raise KeyboardInterrupt\n"
    )
    delay, _ = _exit_delay(child, server.url("trickle/lora.safetensors"), quiet=True)
    assert delay < 3.0


def test_windows_read_past_are_freed_without_the_cyclic_collector() -> None:
    """Nothing of a background window outlives its use but by reference counting (a
    callback naming the window made a cycle: windows piled up until the collector ran,
    479 MiB past the budget in a 512 MiB loop)."""
    import gc
    import weakref

    data = bytes(range(256)) * (8 << 12)

    def fetch(at: int, view: memoryview) -> None:
        if threading.current_thread().name == "pysafetensors-read-ahead":
            time.sleep(0.005)  # still on its way when the reader records it
        view[:] = data[at : at + view.nbytes]

    ahead = ReadAhead(1 << 20, len(data), fetch)
    seen: list[weakref.ref[np.ndarray]] = []
    out = bytearray(16 << 10)
    gc.disable()
    try:
        for pos in range(0, 6 << 20, len(out)):
            ahead.read(pos, memoryview(out))
            pending = ahead._pending
            if pending is not None and not any(r() is pending.data for r in seen):
                seen.append(weakref.ref(pending.data))
            if pending is not None:
                pending.future.result(timeout=10)
        held = ahead._window_bytes
        alive = [r() for r in seen if r() is not None]
        current = [held[1]] if held is not None else []
        if ahead._pending is not None:
            current.append(ahead._pending.data)
        assert len(seen) >= 4
        assert all(any(a is c for c in current) for a in alive), len(alive)
    finally:
        gc.enable()
        ahead.close()


def test_a_close_while_another_thread_holds_the_budget_is_settled() -> None:
    """close() while another source's read is inside the budget's lock only queues the
    entry; the other thread settles it as it lets go (it stayed, and kept the closed source
    alive, until some later remote read of the process)."""
    fetch = _Gated()
    fetch.gate.set()
    ahead = ReadAhead(1 << 20, len(fetch.data), fetch)
    out = bytearray(2048)
    for k in range(4):
        ahead.read(k * 2048, memoryview(out))
    assert id(ahead) in _WINDOWS._held
    inside, leave = threading.Event(), threading.Event()
    real_settle = _WINDOWS._settle

    def settle() -> None:  # the other thread pauses with the lock held
        real_settle()
        if threading.current_thread().name == "other" and not inside.is_set():
            inside.set()
            leave.wait(5)

    probe = ReadAhead(1 << 20, 1 << 20, lambda at, view: None)
    other = threading.Thread(target=_WINDOWS.share, args=(probe,), name="other")
    _WINDOWS._settle = settle  # type: ignore[method-assign]
    try:
        other.start()
        assert inside.wait(5)
        ahead.close()  # queued: the lock is the other thread's
        leave.set()
        other.join(5)
    finally:
        del _WINDOWS._settle
    assert id(ahead) not in _WINDOWS._held and not _WINDOWS._closed


def test_close_in_a_running_event_loop_does_not_wait() -> None:
    """The collector may close a dropped handle on an asynchronous fsspec filesystem's loop
    thread, whose loop the window on its way needs: waiting there would never end."""
    import asyncio

    fetch = _Gated()
    ahead, _ = fetch.ahead_with_a_window_on_its_way()

    async def close_here() -> bool:
        ahead.close()
        return fetch.running > 0  # returned while the fetch still runs

    try:
        assert asyncio.run(close_here())
    finally:
        fetch.gate.set()
    assert id(ahead) not in _WINDOWS._held


def test_an_interrupted_loop_exits_without_waiting_for_a_window_in_parts(
    lora: tuple[RangeServer, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window of several parts (2 MiB or more) runs them on daemon threads too: the
    remote workers' pool is joined at exit, so an unread window delayed it until its parts
    arrived (6 s here: the server holds ranges past 20 MiB that long)."""

    from . import rangeserver

    serve = rangeserver._Handler._serve

    def delayed(handler: Any, fault: Any) -> None:
        spec = handler.headers.get("Range") or "bytes=0-"
        if int(spec.split("=")[1].split("-")[0]) >= 20 << 20:
            time.sleep(6.0)
        serve(handler, fault)

    monkeypatch.setattr(rangeserver._Handler, "_serve", delayed)
    server, _ = lora
    child = (
        "import sys, time\n"
        "from pysafetensors._remote import HTTPSource\n"
        "src = HTTPSource(sys.argv[1])\n"
        "out, pos = bytearray(256 << 10), 100_000\n"
        "while True:\n"
        "    src.readinto(pos, memoryview(out)); pos += len(out)\n"
        "    p = src._ahead._pending if src._ahead is not None else None\n"
        "    if p is not None and p.at >= 20 << 20: break\n"
        "assert p.data.size >= 2 << 20, p.data.size\n"
        "while not p.future.running(): time.sleep(0.01)\n"
        "time.sleep(0.3)\n"
        "print(time.monotonic(), flush=True)\n"
    )
    delay, code = _exit_delay(child, server.url("big.safetensors"))
    assert code == 0, "the child failed before its window was on its way"
    assert delay < 3.0


def _exit_delay(child: str, url: str, *, quiet: bool = False) -> tuple[float, int]:
    """Run ``child`` on ``url``: how long it took to exit after printing the time its last
    line was written (``time.monotonic()``), and its exit code."""
    proc = subprocess.Popen(
        [sys.executable, "-c", child, url],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if quiet else None,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.wait(60)
    assert line, "the child failed before its window was on its way"
    return time.monotonic() - float(line), proc.returncode
