"""The process's reader threads: one kept pool that every parallel read shares.

Positioned reads and numpy's copies release the GIL, so threads overlap the kernel's copies
and, for a cold file, keep the device's queue full. :func:`run_parallel` hands items to the
pool's workers in order, so reads sweep a file front to back.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Final, TypeVar

from . import tuning
from ._interrupts import interrupts_deferred
from .tuning import MAX_READ_THREADS

__all__ = [
    "MAX_READ_THREADS",
    "READ_THREADS",
    "default_threads",
    "reader_thread_count",
    "run_parallel",
    "start_beside",
    "wait_all",
    "worker_count",
]

#: Threads used for one large read. Positioned reads release the GIL, so threads overlap the
#: kernel's copies (and, for cold files, the device's queue).
READ_THREADS: Final = max(2, min(8, (os.cpu_count() or 2) * 2))


_T = TypeVar("_T")


# Reader threads live for the whole process, in one pool as large as the largest thread count
# asked for so far (at most MAX_READ_THREADS): starting threads for every read cost more than
# the reads themselves for tensors of a few MiB (a row split of a 2 GiB file took ~1.2x longer
# with a pool per read than with a kept one). A call asking for fewer threads runs that many
# workers in the shared pool. (One pool per thread count kept every count ever asked for.)
_POOL: ThreadPoolExecutor | None = None

_POOL_SIZE = 0

_POOLS_LOCK = threading.Lock()

_WORKER = threading.local()


def _mark_worker() -> None:
    _WORKER.active = True


def _submit(task: Callable[[], None], copies: int, futures: list[Future[None]]) -> None:
    """Run ``copies`` of ``task`` in the shared pool, grown first (replaced by a larger one)
    to at least ``copies`` workers, each one's future appended to ``futures`` as it is
    submitted (so that the caller knows which started when a later one fails). Submitting under
    the lock: a pool being replaced is never handed out, so nothing is submitted to one that
    was shut down. A read started meanwhile on this thread (a signal handler's) runs inline:
    it would wait for the lock for ever. A Ctrl-C is held until every copy is submitted:
    raised inside ``submit`` (in its ``Semaphore``, a lock written in Python) it left that
    lock held, and every later read, and the interpreter's exit, waited for it for ever."""
    global _POOL, _POOL_SIZE
    _WORKER.submitting = True
    try:
        with interrupts_deferred(), _POOLS_LOCK:
            if _POOL is None or copies > _POOL_SIZE:
                old = _POOL
                _POOL = ThreadPoolExecutor(
                    max_workers=copies,
                    thread_name_prefix="pysafetensors-read",
                    initializer=_mark_worker,
                )
                _POOL_SIZE = copies
                if old is not None:
                    old.shutdown(wait=False)  # its threads finish their work, then exit
            for _ in range(copies):
                futures.append(_POOL.submit(task))
    finally:
        _WORKER.submitting = False


def reader_thread_count() -> int:
    """How many reader threads the process may keep now (the shared pool's size)."""
    return _POOL_SIZE


def _forget_pools() -> None:
    # A forked child has the pool object but not its threads.
    global _POOL, _POOL_SIZE, _POOLS_LOCK
    _POOL, _POOL_SIZE = None, 0
    _POOLS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def run_parallel(fn: Callable[[_T], object], items: Iterable[_T], threads: int) -> None:
    """Call ``fn`` on every item using up to ``threads`` kept reader threads.

    Items are taken in order by however many workers run (so reads sweep a file front to
    back). Runs inline when there is one item, one thread, or when called from a reader thread
    itself (a read split inside a read already running in parallel): waiting on the same pool
    from one of its own workers could deadlock. The first exception raised by ``fn``
    propagates, and the workers take no new item after it. If the caller is interrupted
    while it waits (``KeyboardInterrupt``), the workers take no new item either, and the
    interrupt is raised only once every worker has returned: callers clean up after the
    work (free buffers, synchronise a device) and must not do so while it still runs. A
    second interrupt is raised at once (a read that hangs must stay interruptible).
    """
    work = list(items)
    threads = min(threads, MAX_READ_THREADS, len(work))
    if threads <= 1 or getattr(_WORKER, "active", False) or getattr(_WORKER, "submitting", False):
        for item in work:
            fn(item)
        return
    pending = iter(work)
    lock = threading.Lock()
    failed = threading.Event()

    def worker() -> None:
        while not failed.is_set():
            with lock:
                item = next(pending, _DONE)
            if item is _DONE:
                return
            try:
                fn(item)  # type: ignore[arg-type]
            except BaseException:
                failed.set()
                raise

    # Waited for in a function of its own: its frame, which holds the futures (and they the
    # exception), is gone before the raise here. Raised from a frame that holds them, the
    # exception and the frame form a cycle that keeps all the traceback reaches (the caller's
    # destination buffer) until the cyclic collector runs.
    error = _run_workers(worker, threads, failed)
    if error is not None:
        try:
            raise error
        finally:
            del error


def _run_workers(
    worker: Callable[[], None], threads: int, failed: threading.Event
) -> BaseException | None:
    """``threads`` copies of ``worker`` on the shared pool, waited for (:func:`wait_all`).

    Where a worker cannot start (the interpreter shutting down, after the main thread
    returned; a limit on threads or memory), this thread works beside those that did, and
    returns once they all have. An interrupt while submitting stops the workers started and
    waits for them: raised at once, it let them read on into memory the caller then freed
    (and descriptors it closed).
    """
    futures: list[Future[None]] = []
    try:
        _submit(worker, threads, futures)
    except RuntimeError:
        try:
            worker()
        except BaseException as own:  # noqa: BLE001 - raised by the caller, after the wait
            wait_all(futures, failed)
            return own
        return wait_all(futures, failed)
    except BaseException:
        failed.set()
        wait_all(futures, failed)
        raise
    return wait_all(futures, failed)


def wait_all(
    futures: list[Future[None]],
    failed: threading.Event,
    interrupted: BaseException | None = None,
) -> BaseException | None:
    """Wait for every worker of :func:`run_parallel` (or of any pool whose workers stop once
    ``failed`` is set); return what the caller must raise: an interrupt that came while
    waiting (``failed`` set, raised only once every worker has returned), else the first
    worker's exception, else None. A second interrupt (after ``interrupted``, one the caller
    already met, if given) is raised at once."""
    errors = []
    for future in futures:
        while True:
            try:
                errors.append(future.exception())  # waits for this worker
                break
            except CancelledError:
                break
            except BaseException as exc:
                if interrupted is not None:
                    raise  # a second interrupt: the caller insists (a read that hangs)
                failed.set()
                interrupted = exc
    if interrupted is not None:
        return interrupted
    return next((e for e in errors if e is not None), None)


_DONE: Final = object()


def start_beside(task: Callable[[], None]) -> Callable[[], None]:
    """Start ``task`` on a reader thread, beside what this thread does next; return what waits
    for it (raising its exception, or an interrupt that came while waiting, once it returned).

    Runs ``task`` here and now where :func:`run_parallel` would run inline (on a reader thread,
    while submitting) or where no thread can start.
    """
    if getattr(_WORKER, "active", False) or getattr(_WORKER, "submitting", False):
        task()
        return _nothing
    futures: list[Future[None]] = []
    failed = threading.Event()
    try:
        _submit(task, 1, futures)
    except RuntimeError:
        task()
        return _nothing
    except BaseException:
        wait_all(futures, failed)  # an interrupt while submitting: not before it returned
        raise

    def wait() -> None:
        error = wait_all(futures, failed)
        if error is not None:
            try:
                raise error
            finally:
                del error

    return wait


def _nothing() -> None:
    """What :func:`start_beside` returns for a task it ran inline: nothing to wait for."""


def default_threads() -> int:
    """Reader threads for a read whose caller did not say: ``tuning``'s ``read_threads``, else
    :data:`READ_THREADS`."""
    return tuning.settings().read_threads or READ_THREADS


def worker_count(source: object) -> int:
    """Threads to use for parallel reads from ``source`` (its ``threads``, else the default)."""
    threads = getattr(source, "threads", None)
    return max(1, int(threads)) if threads else default_threads()
