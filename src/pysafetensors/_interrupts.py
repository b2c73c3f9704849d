"""Ctrl-C (SIGINT) where Python code must not be cut short: held over a block, or handed on
from a finalizer, which Python would otherwise swallow.

``KeyboardInterrupt`` is raised between any two bytecodes of the main thread. Inside the
standard library's locks written in Python (``threading.Condition``, ``Semaphore``, which a
``ThreadPoolExecutor.submit`` takes) it can leave a lock held for good; inside a finalizer or a
``__del__`` Python prints it as "Exception ignored" and drops it, and the program goes on as if
no Ctrl-C had come.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["ClosedWhenDropped", "interrupts_deferred", "redeliver_interrupt"]


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that comes during the block until its end, then raise it.

    A save's clean-up (closing and deleting its temporary file) runs after a first Ctrl-C;
    a second one landing in it raised KeyboardInterrupt between two of its steps and left
    the file behind. Only in the main thread (the only one KeyboardInterrupt reaches, and
    the only one that may set a handler), and only over Python's own handler: a program's
    handler of its own is left alone.
    """
    try:
        deferring = (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
    except Exception:  # noqa: BLE001 - at interpreter exit (modules torn down): no deferral
        deferring = False
    if not deferring:
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: pending.append(signum))
    try:
        yield
    finally:
        # signal.signal runs the handlers of signals that arrived meanwhile first, and when
        # one of them raises (another signal's, say SIGALRM's), it raises before setting the
        # handler: retried until it is set, so that Python's handler is back for good, and
        # that exception raised after.
        error: BaseException | None = None
        while True:
            try:
                signal.signal(signal.SIGINT, previous)
                break
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                error = exc
        if error is not None:
            raise error
        if pending:
            raise KeyboardInterrupt


def redeliver_interrupt() -> None:
    """Send the main thread the Ctrl-C a finalizer caught, once the finalizer has returned.

    A ``KeyboardInterrupt`` raised in a finalizer (a tensor's pages handed back, a dropped
    source's descriptor closed) is printed and dropped by Python: the user's Ctrl-C did not
    stop the program. Raising it again from the finalizer is dropped the same way, so a short
    helper thread sends SIGINT again a moment later, when the main thread is back in the code
    that was running (a finalizer runs in microseconds). Should it land in another finalizer of
    this library, that one hands it on again.
    """
    main = threading.main_thread()
    # At interpreter exit no thread starts: nothing to do then.
    with contextlib.suppress(Exception):
        threading.Timer(0.002, signal.pthread_kill, (main.ident, signal.SIGINT)).start()


class ClosedWhenDropped:
    """A ``__del__`` that runs :meth:`_on_drop`, by default ``self.close()``: a handle or
    source dropped unclosed (or never handed over, a ``KeyboardInterrupt`` coming between its
    creation and the hand-off) still closes its descriptor; a streaming writer dropped
    unclosed is discarded (its own ``_on_drop``: never a commit from a finalizer).

    It never raises (Python would print it and drop it). A Ctrl-C that comes during it is held
    until :meth:`_on_drop` has returned (a close cut short between its steps, its flags set
    and its descriptor still open, could not be finished by running it again), then goes to
    the main thread again (:func:`redeliver_interrupt`); one that came before the hold began
    may have cut :meth:`_on_drop` short before it started, so it is run again: it must be
    safe to run twice.
    """

    __slots__ = ()

    def close(self) -> None:  # pragma: no cover - each class has its own
        raise NotImplementedError

    def _on_drop(self) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            held: contextlib.AbstractContextManager[None] | None = interrupts_deferred()
        except Exception:  # noqa: BLE001 - at interpreter exit, module globals may be gone
            held = None
        try:
            if held is None:
                self._on_drop()
            else:
                with held:
                    self._on_drop()
        except KeyboardInterrupt:
            try:
                redeliver_interrupt()
                self._on_drop()
            except Exception:  # noqa: BLE001, S110
                pass
        except Exception:  # noqa: BLE001, S110
            pass
