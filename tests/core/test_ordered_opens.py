"""in_order: work a window ahead on threads, outcomes handed over in order, leftovers closed."""

from __future__ import annotations

import threading
import time

import pytest

from pysafetensors._ordered_opens import in_order


class Opener:
    """Opens "files" (ints) after a delay, counting how many run at once; fails on request."""

    def __init__(self, delay: float = 0.01, fail: frozenset[int] = frozenset()) -> None:
        self.delay = delay
        self.fail = fail
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.opened: list[int] = []

    def __call__(self, item: int) -> list[int]:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(self.delay * (1 + item % 3))  # finishing out of order
            if item in self.fail:
                raise FileNotFoundError(f"no file {item}")
            with self.lock:
                self.opened.append(item)
            return [item]  # a "handle": closed by emptying it
        finally:
            with self.lock:
                self.running -= 1


def test_outcomes_come_in_order_with_their_errors() -> None:
    opener = Opener(fail=frozenset({3, 7}))
    got = []
    items = []
    for item, future in in_order(opener, list(range(12)), discard=lambda _, h: h.clear(), ahead=4):
        items.append(item)
        try:
            got.append(future.result())
        except FileNotFoundError as exc:
            got.append(str(exc))
    assert got == [[i] if i not in (3, 7) else f"no file {i}" for i in range(12)]
    assert items == list(range(12))
    assert 2 <= opener.most <= 4


@pytest.mark.parametrize("ahead", [1, 4])
def test_what_is_not_handed_over_is_discarded(ahead: int) -> None:
    opener = Opener()
    handed: list[list[int]] = []
    discarded: list[list[int]] = []
    done = threading.Event()

    def discard(item: int, handle: list[int]) -> None:
        assert handle == [item]  # each result with the item it was opened for
        discarded.append(list(handle))
        handle.clear()
        if len(handed) + len(discarded) == len(opener.opened):
            done.set()

    opens = in_order(opener, list(range(10)), discard=discard, ahead=ahead)
    for _, future in opens:
        handed.append(future.result())
        if len(handed) == 2:
            break
    opens.close()
    time.sleep(0.2)  # those still running finish, and are discarded as they do
    assert [h[0] for h in handed] == [0, 1]
    # Every handle opened is either the caller's or discarded; none is left open.
    assert sorted([h[0] for h in handed] + [d[0] for d in discarded]) == sorted(opener.opened)
    assert len(opener.opened) <= 2 + ahead
    if ahead == 1:
        assert opener.opened == [0, 1] and discarded == []


def test_one_item_or_ahead_one_runs_here() -> None:
    here = threading.get_ident()
    seen: list[int] = []
    for _, future in in_order(lambda i: seen.append(threading.get_ident()), [1], discard=print):
        future.result()
    for _, future in in_order(
        lambda i: seen.append(threading.get_ident()), [1, 2], discard=print, ahead=1
    ):
        future.result()
    assert seen == [here, here, here]


def test_an_interrupt_while_waiting_loses_nothing(python_sigint_handler: None) -> None:
    """Ctrl-C while the caller waits for the next outcome: that one, still running, is
    closed when it arrives (it was taken off the queue before the wait, and lost)."""
    import _thread

    lock = threading.Lock()
    open_now: set[int] = set()

    class Handle:
        def __init__(self, i: int) -> None:
            self.i = i

        def close(self) -> None:
            with lock:
                open_now.discard(self.i)

    interrupted = threading.Event()

    def open_one(i: int) -> Handle:
        # Item 0 ends only after the interrupt (a fixed sleep let a loaded machine finish the
        # loop before the timer's thread ran, and nothing was interrupted).
        if i == 0:
            interrupted.wait(10)
        else:
            time.sleep(0.05)
        with lock:
            open_now.add(i)
        return Handle(i)

    def interrupt() -> None:
        _thread.interrupt_main()  # while item 0 is awaited
        time.sleep(0.1)
        interrupted.set()

    timer = threading.Timer(0.1, interrupt)
    opens = in_order(open_one, list(range(12)), discard=lambda _, h: h.close(), ahead=4)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        for _, future in opens:
            future.result().close()
    opens.close()
    deadline = time.monotonic() + 5
    while open_now and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not open_now
