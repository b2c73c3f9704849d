"""Read-ahead: a get_tensor loop in file order over a URL takes a few requests, not one per
tensor; reads out of order fetch exactly what they ask for; windows stay within budget."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator

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


def test_stopping_early_fetches_a_bounded_amount_ahead(lora: tuple[RangeServer, dict]) -> None:
    server, tensors = lora
    names = sorted(tensors)
    server.reset()
    with safe_open(server.url("lora.safetensors"), "np") as f:
        head = server.bytes_sent()
        taken = 0
        for name in names[:60]:
            taken += f.get_tensor(name).nbytes
    beyond = server.bytes_sent() - head
    # What was read, plus at most the rest of a window and the next one fetched in the
    # background: about 2.7 times what was read (or two small windows).
    assert beyond <= max(2.7 * taken, taken + 2 * MIN_WINDOW + 8192), beyond / taken


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
        assert _wait_for(lambda: pending.thread is not None)  # on its way (the server is slow)
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
