"""Open many remote files at once, handing them over in order.

Opening a remote shard is a round trip or two (its first bytes, then the header if longer):
a sharded model on a server 50 ms away took 50 ms a shard before the first tensor was read,
five seconds for the hundred shards of a large model's ``inspect``. :func:`in_order` runs the
opens a window ahead on a few threads and hands each outcome over in the order asked for, so
callers keep their sequential logic (the first failure in order is the one reported).
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Final, TypeVar

from ._interrupts import interrupts_deferred

__all__ = ["OPEN_AHEAD", "ahead_for", "in_order", "submit_or_run"]

_T = TypeVar("_T")
_R = TypeVar("_R")

#: Opens in flight at once: as many as one file's default parallel requests.
OPEN_AHEAD: Final = 8


def ahead_for(paths: Iterable[str]) -> int:
    """How many opens to run ahead for these files: :data:`OPEN_AHEAD` when all are URLs (a
    round trip each), else 1 (local files open at once, one by one, within the process's
    descriptor budget, which only the calling thread keeps)."""
    paths = list(paths)
    return OPEN_AHEAD if paths and all("://" in path for path in paths) else 1


def _done(fn: Callable[[_T], _R], item: _T) -> Future[_R]:
    """``fn(item)`` run here, as a finished future (its exception kept, not raised)."""
    future: Future[_R] = Future()
    try:
        future.set_result(fn(item))
    except Exception as exc:  # noqa: BLE001 - handed over with the future, as a thread's would be
        future.set_exception(exc)
    return future


def in_order(
    fn: Callable[[_T], _R],
    items: Sequence[_T],
    *,
    discard: Callable[[_T, _R], object],
    ahead: int = OPEN_AHEAD,
) -> Generator[tuple[_T, Future[_R]], None, None]:
    """``(item, finished future of fn(item))`` for each item, in order, up to ``ahead`` of
    them running at once on threads of their own.

    A future handed over is the caller's: its result (an open file) is theirs to close. The
    results of those never handed over (the caller stopped early, failed, or was
    interrupted) are passed to ``discard(item, result)`` as they finish, also those still
    running when the caller stops: the caller does not wait for them (the process, exiting,
    still waits for opens in flight, within their own timeouts).
    """
    if ahead <= 1 or len(items) <= 1:
        for item in items:
            yield item, _done(fn, item)
        return
    pool = ThreadPoolExecutor(min(ahead, len(items)), thread_name_prefix="pysafetensors-open")
    pending: deque[tuple[_T, Future[_R]]] = deque()
    rest = iter(items)
    try:
        for item in rest:
            submit_or_run(pool, fn, item, pending)
            if len(pending) >= ahead:
                break
        while pending:
            item, future = pending[0]
            # Waited for while still pending: an interrupt here (KeyboardInterrupt) leaves it
            # to the clean-up below, which closes what it opens.
            with contextlib.suppress(Exception):
                future.exception()
            for nxt in rest:  # the next one, if any, to keep the window full
                submit_or_run(pool, fn, nxt, pending)
                break
            pending.popleft()
            yield item, future  # the caller's from here
    finally:
        for item, future in pending:
            if not future.cancel():
                future.add_done_callback(functools.partial(_discard, item, discard))
        pool.shutdown(wait=False, cancel_futures=True)


def submit_or_run(
    pool: ThreadPoolExecutor,
    fn: Callable[[_T], _R],
    item: _T,
    into: deque[tuple[_T, Future[_R]]],
) -> None:
    """Append ``(item, future of fn(item))`` to ``into``: ``fn`` runs on ``pool``, or here and
    now once the interpreter is shutting down (a thread still loading after the main thread
    returned), when pools take no more work. A Ctrl-C is held over the submit (see
    ``_reader_pool._submit``) and raised once the future is in ``into``, whose owner's
    clean-up then sees it (an open it would otherwise never close)."""
    try:
        with interrupts_deferred():
            into.append((item, pool.submit(fn, item)))
    except RuntimeError:
        into.append((item, _done(fn, item)))


def _discard(item: _T, discard: Callable[[_T, _R], object], future: Future[_R]) -> None:
    """Hand a finished future's result to ``discard``; failures were nobody's to report."""
    if future.cancelled() or future.exception() is not None:
        return
    with contextlib.suppress(Exception):
        discard(item, future.result())
