"""Read-ahead for a remote file read front to back in small pieces.

``for name in f.keys(): f.get_tensor(name)`` over a URL, the loop most loaders run, made a
request per tensor: a round trip each, 1,000 of them for a LoRA file. When a source's small
reads follow one another (each starting where the previous one ended, or at most
:data:`NEAR` after: tensors tile a file, and a loop's reads in offset order touch), the next
ones are served from a window fetched ahead, as large as what the reads in order have taken
so far (at least :data:`MIN_WINDOW`, at most the source's ``read_ahead``): it doubles while
the reads stay in order, as the kernel's page cache reads ahead a file read in order. Once
the reads have taken half of a window, the next one is fetched in the background, so that a
loop that does work between its reads (converts, hashes, copies to a device) does it while
the network delivers, instead of waiting for each window in turn. Bytes fetched and never
read are at most half a window and the next one (as large as the run), at most about 1.8
times what was read in order before them (or two 64 KiB windows). A read out of
order starts over, fetched as asked, and drops a window on its way (it is not waited for;
``close()`` waits for every fetch still running, as the source lets its connections go
next).

Windows are memory: all the remote sources of a process hold at most :data:`BUDGET` bytes of
them between them, the least recently used dropped first.

Threads reading one source at once (a pool's ``get_tensor`` calls in file order): a read that
falls in a window on its way, fetched by another read or in the background, waits for it
instead of fetching a window of its own over it, and a read of a thread left behind the
window held (in the run's earlier windows) fetches its own bytes and leaves the run as it is
(2 to 32 threads over 2 KiB tensors: 0.97-1.08 times the file, 64: 0.97-1.14); 64 reads in
order there (a loop over the file again) start the run over.
"""

from __future__ import annotations

import collections
import itertools
import os
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from ._errors import SafetensorError

__all__ = [
    "BUDGET",
    "DEFAULT_READ_AHEAD",
    "MIN_WINDOW",
    "NEAR",
    "ReadAhead",
    "fetch_in_background",
    "may_wait_here",
]

#: The largest window by default: what eight connections fetch at once in 8 MiB parts.
DEFAULT_READ_AHEAD: Final = 64 << 20
#: The smallest window (the first one after two small reads in order).
MIN_WINDOW: Final = 64 << 10
#: Bytes of windows all sources of the process hold at most.
BUDGET: Final = 128 << 20
#: Reads in order before the first window is fetched (the third read in a row gets one).
_IN_ORDER: Final = 2
#: How far past the previous read's end a read still counts as the next in order. Small: a
#: read anywhere within ``max_gap`` (1 MiB) counted, and reads in random order over a small
#: file then looked sequential often enough to fetch 57 times the file in windows.
NEAR: Final = 4 << 10
#: The next window is fetched in the background once the reads have taken 1/_NEXT_AT of one.
_NEXT_AT: Final = 2
#: Reads in order behind the window that make a loop over the file again (see _started_over).
_BACK_IN_ORDER: Final = 64


class _Windows:
    """The process-wide account of windows held, least recently used first.

    Owners are held by weak reference: a source dropped without ``close()`` must not be kept
    alive by its window (its entry goes when it is collected). The collector may run that
    callback, or a dropped handle's ``close()`` (which calls :meth:`forget`), inside any method
    here, with the lock held by the same thread: both only queue the entry when the lock is
    taken, and the methods settle the queue under it (blocking there deadlocked).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: collections.OrderedDict[int, tuple[weakref.ref[ReadAhead], int]] = (
            collections.OrderedDict()
        )
        self._total = 0
        self._gone: collections.deque[int] = collections.deque()
        self._closed: collections.deque[ReadAhead] = collections.deque()

    def _settle(self) -> None:
        """Forget the entries of owners collected or closed meanwhile. Called under the lock."""
        while self._gone:
            key = self._gone.popleft()
            entry = self._held.get(key)
            if entry is not None and entry[0]() is None:
                del self._held[key]
                self._total -= entry[1]
        while self._closed:
            owner = self._closed.popleft()
            entry = self._held.get(id(owner))
            if entry is not None and entry[0]() is owner:
                del self._held[id(owner)]
                self._total -= entry[1]

    def _settle_if_free(self) -> None:
        """Settle what was queued while the lock was held (by another thread, or by this one
        further up): called after letting it go, and after queueing."""
        while (self._gone or self._closed) and self._lock.acquire(blocking=False):
            try:
                self._settle()
            finally:
                self._lock.release()

    def share(self, owner: ReadAhead) -> int:
        """The most bytes a new window of ``owner`` may take: the budget split evenly among
        the sources holding windows, ``owner`` counted (several files read in turn then fit
        side by side, instead of each window pushing another's out before it is read)."""
        with self._lock:
            self._settle()
            others = len(self._held) - (id(owner) in self._held)
        self._settle_if_free()
        return BUDGET // (others + 1)

    def hold(self, owner: ReadAhead, window: np.ndarray) -> bool:
        """Record ``owner``'s new window, dropping the least recently used others' past the
        budget (cleared, and their runs restarted, without their lock: the owner's lock is
        taken before this one, never after). Called under the owner's lock; a window another
        source's eviction cleared meanwhile is not recorded."""
        pending = owner._pending
        nbytes = window.size + (pending.data.size if pending is not None else 0)
        try:
            with self._lock:
                self._settle()
                held = owner._window_bytes
                if held is None or held[1] is not window:
                    return False  # dropped by another source's eviction before this lock was had
                key = id(owner)
                before = self._held.pop(key, (None, 0))[1]
                self._total += nbytes - before
                self._held[key] = (weakref.ref(owner, lambda _: self._gone.append(key)), nbytes)
                while self._total > BUDGET and len(self._held) > 1:
                    _, (ref, size) = self._held.popitem(last=False)
                    self._total -= size
                    other = ref()
                    if other is not None:
                        other._dropped()
            return True
        finally:
            self._settle_if_free()

    def touch(self, owner: ReadAhead) -> None:
        """Make ``owner`` the most recently used."""
        with self._lock:
            if id(owner) in self._held:
                self._held.move_to_end(id(owner))
        self._settle_if_free()

    def forget(self, owner: ReadAhead) -> None:
        """``owner`` holds no window any more: settled now, or by the next call that takes
        the lock if it is held (by this thread too: see the class)."""
        self._closed.append(owner)
        self._settle_if_free()

    def reset(self) -> None:
        """After a fork: a lock another thread held would never be released in the child."""
        self._lock = threading.Lock()
        self._held = collections.OrderedDict()
        self._total = 0
        self._gone = collections.deque()
        self._closed = collections.deque()


_WINDOWS: Final = _Windows()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WINDOWS.reset)


def fetch_in_background(
    fetch: Callable[[], None], name: str = "pysafetensors-read-ahead"
) -> Future[None]:
    """Run ``fetch`` on a thread of its own; its outcome is the returned future's.

    A daemon thread per window (or planned block), not a pool: ``concurrent.futures`` joins
    its workers at exit (a window nobody would read delayed exit by its whole fetch) and
    refuses work once the interpreter is shutting down. A fetch only waits for its own parts,
    which run on the remote sources' shared workers (on one of those it would run them one
    after another).

    Raises:
        RuntimeError: No thread can be started (the interpreter is shutting down).
    """
    future: Future[None] = Future()

    def run(future: Future[None]) -> None:
        try:
            if future.set_running_or_notify_cancel():  # False: the reader took it back
                try:
                    fetch()
                except BaseException as exc:  # noqa: BLE001 - the reader's to raise
                    future.set_exception(exc)
                else:
                    future.set_result(None)
        finally:
            # An error's traceback holds this frame: holding the future, which holds the
            # error, it made a cycle that kept a failed fetch's buffer (a window, a planned
            # block of up to 32 MiB) alive until the cyclic collector ran.
            del future

    threading.Thread(target=run, args=(future,), name=name, daemon=True).start()
    return future


def may_wait_here() -> bool:
    """Whether a close() may wait for reads in flight here: not on a thread they may be
    waiting for (the collector can run a dropped handle's close() there): a read-ahead
    fetch's own, a remote worker's, or one running an event loop (an asynchronous fsspec
    filesystem's, which runs the requests)."""
    if threading.current_thread().name.startswith("pysafetensors-"):
        return False
    asyncio = sys.modules.get("asyncio")  # no loop runs where asyncio was never imported
    return asyncio is None or asyncio._get_running_loop() is None


#: Numbers the windows in the order they are made.
_CREATED: Final = itertools.count()


@dataclass(eq=False)
class _Next:
    """A window being fetched in the background: ``data`` holds the bytes at ``at`` once
    ``future`` is done."""

    at: int
    data: np.ndarray
    future: Future[None] = field(init=False)
    #: Order of creation, of all windows (see ReadAhead._keep).
    seq: int = field(init=False, default_factory=lambda: next(_CREATED))

    @property
    def end(self) -> int:
        return self.at + self.data.size


class ReadAhead:
    """One source's read-ahead state (see the module).

    Args:
        limit: The largest window (the ``read_ahead`` option; a read larger than it is still
            fetched whole).
        size: The file's size (windows stop there).
        fetch: Reads ``len(out)`` bytes at an offset into ``out`` from the source, bypassing
            the read-ahead. Called from a background thread for the windows fetched ahead.
    """

    def __init__(self, limit: int, size: int, fetch: Callable[[int, memoryview], None]) -> None:
        self._limit = limit
        self._size = size
        self._fetch = fetch
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False
        self._next = -1  # where the previous read ended
        self._in_order = 0  # reads in a row that followed the one before
        self._run = 0  # bytes those reads took (windows counted when fetched)
        # (file offset, bytes) of the window held; dropped by _Windows past the budget.
        self._window_bytes: tuple[int, np.ndarray] | None = None
        # Where the windows that led to it in order start: reads from there up to it are
        # other threads' left behind (see read; set with the first window).
        self._behind = 0
        self._held_seq = -1  # the held window's _Next.seq
        # Reads behind it that follow one another (see read): where the last ended, how many.
        self._back_next = -1
        self._back_reads = 0
        # The window after it, on its way (see _fetch_next); dropped with it.
        self._pending: _Next | None = None
        # Every background fetch not finished yet, dropped or not: close() waits for them all.
        # Their futures, not the windows: a callback naming the window made a cycle that kept
        # every window fetched ahead alive until the cyclic collector ran.
        self._fetching: set[Future[None]] = set()

    def read(self, offset: int, out: memoryview) -> bool:
        """Fill ``out`` (a 1-D byte view) with the bytes at ``offset`` if the read-ahead serves
        it; False to let the caller fetch it as asked (the caller then fills all of ``out``).

        A window the server refuses as out of range (416) is not an error here: the caller's
        own read follows, and reports a failure in the range it asked for. Other failures
        (retried already by the source) are the read's, also those of a window fetched in
        the background when a read reaches it.
        """
        if self._pid != os.getpid():
            self._after_fork()
        n = out.nbytes
        with self._lock:
            held = self._window_bytes
            if held is not None:
                at, data = held
                end = at + data.size
                if at <= offset < end:
                    k = min(n, end - offset)
                    out[:k] = data.data[offset - at : offset - at + k]
                    if k == n:
                        self._next = offset + n
                        _WINDOWS.touch(self)
                        if self._pending is None and _NEXT_AT * (offset + n - at) >= data.size:
                            self._fetch_next(end, data)
                        return True
                    # Across the window's end: the rest continues the reads in order.
                    offset, out, n = end, out[k:], n - k
                    self._next = offset
                elif self._behind <= offset < at:
                    # A read behind the window in the run that led to it: another thread's left
                    # behind (threads reading in order do not finish in order), or a look
                    # back. Fetched as asked, and the run goes on: taken for a read out of
                    # order, it dropped the window on its way (fetched again next) and started
                    # the run over small (16 threads fetched 2.3-3.6 times the file).
                    if not self._started_over(offset, n):
                        return False
                    # Many in order there: a loop over the file again, which took every read
                    # for one left behind (1,174 requests for 2,000 tensors). The run starts
                    # over from here, as for any read out of order.
                    self._behind = at
            in_order = 0 <= self._next <= offset <= self._next + NEAR
            pending = self._pending
            if pending is not None and not pending.at <= offset < pending.end:
                self._pending = None
                pending.future.cancel()  # not wanted now; one already running is let finish
                pending = None
            if pending is None:
                if not in_order:
                    self._next = offset + n
                    self._in_order = 0
                    self._run = n
                    return False
                self._next = offset + n
                self._in_order += 1
                if self._in_order < _IN_ORDER and held is None:
                    self._run += n
                    return False
                wanted = max(MIN_WINDOW, self._run)
                length = min(max(n, min(wanted, self._limit)), self._size - offset)
                # (The budget's lock is taken after this one, never before: see _Windows.hold.)
                length = max(n, min(length, _WINDOWS.share(self)))
                # Fetched by this thread, and in the slot meanwhile: other threads' reads that
                # fall in it wait for it, instead of each fetching a window over it (eight
                # threads reading one file in order fetched it four times over).
                window = _Next(offset, np.empty(length, np.uint8))
                window.future = Future()
                window.future.set_running_or_notify_cancel()  # not to be cancelled
                self._pending = window
        if pending is not None:
            return self._take(pending, offset, out)
        # Outside the lock: a read of another thread need not wait for the network.
        try:
            self._fetch(offset, window.data.data)
        except BaseException as exc:
            window.future.set_exception(exc)
            with self._lock:
                if self._pending is window:
                    self._pending = None
            if not isinstance(exc, SafetensorError) or exc.kind != "RangeNotSatisfiable":
                raise  # the server's failure, retried already: the read's own would be too
            # A window past what the server will serve (a file shorter than it said): the
            # caller's own read follows, and reports the range it asked for.
            with self._lock:
                self._run = 0
            return False
        out[:] = window.data.data[:n]
        self._keep(window)
        window.future.set_result(None)  # after _keep: the readers waiting find it held
        return True

    def _keep(self, window: _Next) -> bool:
        """Make ``window``, fetched, the one held (once: each of the threads that waited for
        it keeps it too); False if it is not held: closed meanwhile, or a window made after it
        is held already (threads that waited for this one would take the reads in order
        back to it, and every read in the newer one would start the run over)."""
        with self._lock:
            if self._pending is window:
                self._pending = None
            if self._closed:
                return False  # closed meanwhile: nothing kept
            held = self._window_bytes
            if held is not None and held[1] is window.data:
                return True
            if held is not None and self._held_seq > window.seq:
                return False  # made before the one held: threads waited for it meanwhile
            self._held_seq = window.seq
            # The run's windows so far, if it goes on from the one held (see read).
            if held is not None and held[0] + held[1].size >= window.at:
                self._behind = min(self._behind, held[0])
            else:
                self._behind = window.at
            self._window_bytes = (window.at, window.data)
            self._run += window.data.size
            # Recorded under this lock: a close() cannot fall between the store and the
            # record (the record would outlive the window).
            _WINDOWS.hold(self, window.data)
            return True

    def _started_over(self, offset: int, n: int) -> bool:
        """Count a read behind the window (lock held): whether it is the
        :data:`_BACK_IN_ORDER`-th in a row that follow one another there. Threads left behind
        make short rows (4 in a row restarted runs under 32 threads, 16 under 64, which then
        fetched up to 2.8 and 4.4 times the file); a loop over the file again makes one as long
        as it reads (its first 64 reads are fetched alone)."""
        again = 0 <= self._back_next <= offset <= self._back_next + NEAR
        self._back_next = offset + n
        self._back_reads = self._back_reads + 1 if again else 1
        return self._back_reads >= _BACK_IN_ORDER

    def _fetch_next(self, at: int, current: np.ndarray) -> None:
        """Start fetching the window after ``current`` (which ends at ``at``) in the
        background, as large as one fetched there now would be (the run's, ``current``
        counted whole: sized by what was read alone, windows grew by half each time, and the
        LoRA loop took 6% longer), within what the budget leaves this source besides
        ``current``. Called under the lock."""
        if self._closed or at >= self._size:
            return
        length = min(max(MIN_WINDOW, self._run), self._limit, self._size - at)
        length = min(length, _WINDOWS.share(self) - current.size)
        if length < min(MIN_WINDOW, self._size - at):
            return  # no room (or read_ahead below a window): the next read fetches as now
        pending = _Next(at, np.empty(length, np.uint8))

        try:
            pending.future = fetch_in_background(lambda: self._fetch(pending.at, pending.data.data))
        except RuntimeError:  # no new thread now (interpreter shutting down): read as before
            return
        self._fetching.add(pending.future)
        pending.future.add_done_callback(self._fetching.discard)
        self._pending = pending
        if not _WINDOWS.hold(self, current):  # both windows count from now on
            self._pending = None  # the budget dropped current meanwhile: not this one either
            pending.future.cancel()

    def _take(self, pending: _Next, offset: int, out: memoryview) -> bool:
        """Serve a read that falls in a window on its way (fetched in the background, or by
        another thread's read): wait for it (or fetch it here if no thread has started it),
        then make it the window."""
        try:
            if pending.future.cancel():
                self._fetch(pending.at, pending.data.data)
            else:
                pending.future.result()
        except CancelledError:  # dropped by the budget meanwhile
            return False
        except SafetensorError as exc:
            if exc.kind != "RangeNotSatisfiable":
                raise  # as a window fetched by the read itself (see read())
            return False
        if self._keep(pending):
            return self.read(offset, out)
        # Closed meanwhile, or a newer window is held now: served from this one.
        if offset + out.nbytes > pending.end:
            return False
        out[:] = pending.data.data[offset - pending.at : offset - pending.at + out.nbytes]
        return True

    def _dropped(self) -> None:
        """The budget took the window: the run starts over small, or its next window (as
        large as the run) would push another's out, and so on round the files."""
        self._window_bytes = None
        self._run = 0
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.future.cancel()

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._pending = None  # its thread is the parent's
        self._fetching = set()

    def close(self) -> None:
        """Drop the windows; one being fetched is not kept, but waited for (the source
        releases its connections next)."""
        if self._pid != os.getpid():
            self._after_fork()  # the parent's fetches are not in this process
        with self._lock:
            self._closed = True
            self._window_bytes = None
            self._pending = None
            fetching = list(self._fetching)
        try:
            if may_wait_here():
                wait_for_futures([f for f in fetching if not f.cancel()])
        finally:
            _WINDOWS.forget(self)
