"""The library's pauses of the garbage collector leave the program's own choices alone, a
collection that runs a finalizer inside the library cannot deadlock it, and a child forked
while another thread held one of the library's process-wide locks does not wait for it."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path

import numpy as np
import pytest

from pysafetensors import _fresh_memory, tuning
from pysafetensors._format import gc_paused
from pysafetensors.numpy import save_file


@pytest.fixture(autouse=True)
def collector_restored() -> Iterator[None]:
    enabled, thresholds = gc.isenabled(), gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)
    if enabled:
        gc.enable()


def _paused_in_a_thread(inside: threading.Event, leave: threading.Event) -> threading.Thread:
    def run() -> None:
        with gc_paused():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=run)
    thread.start()
    assert inside.wait(10)
    return thread


def test_a_program_disabling_the_collector_during_a_load_keeps_it_disabled() -> None:
    # gc.disable()/gc.enable() in the pause turned the collector back on behind the program.
    gc.enable()
    inside, leave = threading.Event(), threading.Event()
    thread = _paused_in_a_thread(inside, leave)
    gc.disable()  # the program's choice, while another thread's load is paused
    leave.set()
    thread.join()
    assert not gc.isenabled()


def test_a_program_setting_thresholds_during_a_load_keeps_them() -> None:
    start = gc.get_threshold()
    inside, leave = threading.Event(), threading.Event()
    thread = _paused_in_a_thread(inside, leave)
    gc.set_threshold(1234, 5, 6)
    leave.set()
    thread.join()
    assert gc.get_threshold() == (1234, 5, 6) != start


def test_pauses_nest_and_put_the_threshold_back() -> None:
    start = gc.get_threshold()
    with gc_paused():
        paused = gc.get_threshold()
        with gc_paused():
            assert gc.get_threshold() == paused
        assert gc.get_threshold() == paused  # the inner one leaves the outer's pause
        assert paused[0] > 1_000_000 and paused[1:] == start[1:]
    assert gc.get_threshold() == start
    assert gc.isenabled()


def test_a_finalizer_run_by_a_collection_in_a_closed_handle_does_not_deadlock(
    tmp_path: Path,
) -> None:
    # Raising ClosedFileError inside the source's lock allocated the exception there; the
    # collection it set off ran a garbage slice's finalizer, which took the same lock on the
    # same thread: a hang, every time at this threshold.
    path = tmp_path / "a.safetensors"
    save_file({"tiny": np.arange(4, dtype=np.float32)}, str(path))
    code = textwrap.dedent(
        f"""
        import gc
        from pysafetensors import ClosedFileError, safe_open

        class Node:
            pass

        refused = 0
        for threshold in range(1, 80):  # where the collection falls depends on the counts
            f = safe_open({str(path)!r}, "np", backend="pread")
            gc.collect()
            gc.disable()
            n = Node()
            n.me = n
            n.piece = f.get_slice("tiny")  # the slice is garbage in a reference cycle
            del n
            f.close()  # the file stays open for the slice's hold
            gc.set_threshold(threshold)
            gc.enable()
            try:
                f.get_tensor("tiny")
            except ClosedFileError:
                refused += 1
            gc.set_threshold(700, 10, 10)
        print("refused", refused)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == "refused 79", proc.stderr


def _forked_while_held(
    locks: Callable[[], ContextManager[object]], child: Callable[[], bool]
) -> int:
    """Fork while another thread holds ``locks()``; the child runs ``child()`` (a hang ends it
    with SIGALRM) and exits 0 if it returned True. The child's wait status."""
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with locks():
            held.set()
            done.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: the holding thread is not here
        code = 1
        try:
            signal.alarm(10)
            code = 0 if child() else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    done.set()
    thread.join()
    return status


def _exited_cleanly(status: int) -> bool:
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
# JAX, imported by other tests of the same run, warns at every fork; the child runs no JAX.
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called")
@pytest.mark.parametrize("where", ["huge pages", "tuning"])
def test_a_child_forked_while_a_thread_held_a_lock_does_not_wait_for_it(where: str) -> None:
    def child() -> bool:
        if where == "huge pages":
            _fresh_memory.numpy_empty(1 << 20, False)
        else:
            tuning.configure(prefetch=tuning.settings().prefetch)
        return True

    lock = _fresh_memory._HUGEPAGE_LOCK if where == "huge pages" else tuning._CONFIGURE_LOCK
    status = _forked_while_held(lambda: lock, child)
    assert _exited_cleanly(status), status


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called")
def test_a_child_reads_a_sharded_handle_another_thread_was_opening_a_shard_of(
    tmp_path: Path,
) -> None:
    from pysafetensors import safe_open, save_sharded

    tensors = {f"t{i}": np.full(100, i, np.float32) for i in range(3)}
    save_sharded(tensors, tmp_path, max_shard_size=500)
    handle = safe_open(tmp_path, "np")
    shard = handle.shard_of("t2")

    @contextlib.contextmanager
    def opening() -> Iterator[None]:
        # What a thread opening the shard holds, for as long as the open takes.
        with handle._lock, handle._opening.setdefault(shard, threading.Lock()):
            yield

    status = _forked_while_held(opening, lambda: handle.get_tensor("t2").tolist() == [2.0] * 100)
    handle.close()
    assert _exited_cleanly(status), status
