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
import importlib
import signal
import threading
from typing import Any, Final

__all__ = ["ClosedWhenDropped", "interrupts_deferred", "redeliver_interrupt"]


# The C module under ``signal``: the latter's Python wrappers (handlers converted to and from
# enums) cost ~2-3 us a call, and a deferral takes three (a file's close, every finalizer of a
# handle or source: ~55-80 us more per open and close of a small file).
try:
    _raw_signal: Any = importlib.import_module("_signal")
except ImportError:  # pragma: no cover - an interpreter without it
    _raw_signal = signal

_SIGINT: Final = int(signal.SIGINT)
_DEFAULT_HANDLER: Final = signal.default_int_handler


class _Deferred:
    """The context manager :func:`interrupts_deferred` returns (a class: entered on every
    close, a generator's frame would cost more than the rest)."""

    __slots__ = ("_pending", "_previous")

    def __enter__(self) -> None:
        self._previous: Any = None
        try:
            if (
                threading.get_ident() != threading.main_thread().ident
                or _raw_signal.getsignal(_SIGINT) is not _DEFAULT_HANDLER
            ):
                return
        except Exception:  # noqa: BLE001 - at interpreter exit (modules torn down): no deferral
            return
        pending: list[int] = []
        self._pending = pending
        self._previous = _raw_signal.signal(_SIGINT, lambda signum, _frame: pending.append(signum))

    def __exit__(self, *exc: object) -> None:
        previous = self._previous
        if previous is None:
            return
        self._previous = None
        # signal.signal runs the handlers of signals that arrived meanwhile first, and when
        # one of them raises (another signal's, say SIGALRM's), it raises before setting the
        # handler: retried until it is set, so that Python's handler is back for good, and
        # that exception raised after.
        error: BaseException | None = None
        while True:
            try:
                _raw_signal.signal(_SIGINT, previous)
                break
            except BaseException as caught:  # noqa: BLE001 - re-raised below
                error = caught
        if error is not None:
            raise error
        if self._pending:
            raise KeyboardInterrupt


def interrupts_deferred() -> _Deferred:
    """Hold a Ctrl-C (SIGINT) that comes during the ``with`` block until its end, then raise
    it.

    A save's clean-up (closing and deleting its temporary file) runs after a first Ctrl-C;
    a second one landing in it raised KeyboardInterrupt between two of its steps and left
    the file behind. Only in the main thread (the only one KeyboardInterrupt reaches, and
    the only one that may set a handler), and only over Python's own handler: a program's
    handler of its own is left alone.
    """
    return _Deferred()


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
