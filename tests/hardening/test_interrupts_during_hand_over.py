"""A Ctrl-C held while work is handed to a pool must still reach the clean-up that cancels and
waits for that work; one landing as a close or an abort begins must not leave that close or
abort half done for good (a second run of it returned at once)."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import ShardedStreamingWriter
from pysafetensors._sources import PreadSource
from pysafetensors.numpy import save_file
from pysafetensors.parallel import map_files


@pytest.fixture(autouse=True)
def _sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt, as in a terminal (a test run started in the background
    by a non-interactive shell inherits SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def _no_gc_callbacks() -> Iterator[None]:
    """Other libraries' collection callbacks (hypothesis times every collection) set aside:
    a Ctrl-C handed on from a finalizer that lands in one of them is dropped by Python, which
    nothing here can prevent (the README says so)."""
    saved = gc.callbacks[:]
    gc.callbacks.clear()
    try:
        yield
    finally:
        gc.callbacks[:] = saved


class CtrlCOnFirstSubmit(ThreadPoolExecutor):
    """A pool whose first ``submit`` gets a Ctrl-C, as a user's may land there."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.sent = False

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        if not self.sent:
            self.sent = True
            signal.raise_signal(signal.SIGINT)
        return super().submit(fn, *args, **kwargs)


@contextlib.contextmanager
def _sigint_on_entering(function_name: str, filename_end: str) -> Iterator[None]:
    """Over the block, SIGINT sent once, as the Python function named is entered (where a real
    Ctrl-C is delivered to it), by a tracing hook."""
    fired: list[int] = []

    def tracer(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if (
            event == "call"
            and not fired
            and code.co_name == function_name
            and code.co_filename.endswith(filename_end)
        ):
            fired.append(1)
            signal.raise_signal(signal.SIGINT)

    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(None)


def _pread_source(tmp_path: Path) -> tuple[PreadSource, int]:
    """A source of a small file, and its descriptor."""
    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(4, np.float32)}, str(path))
    source = PreadSource(os.open(path, os.O_RDONLY), str(path))
    return source, source.fd


def _wait_for_redelivery() -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.01)


def test_map_files_cancels_the_items_not_started_after_a_ctrl_c_while_handing_them_over() -> None:
    ran: list[int] = []

    def work(i: int) -> int:
        time.sleep(0.02)
        ran.append(i)
        return i

    pool = CtrlCOnFirstSubmit(1)
    try:
        with pytest.raises(KeyboardInterrupt):
            map_files(work, range(20), executor=pool)
    finally:
        pool.shutdown(wait=True)
    assert len(ran) <= 2  # the one running (and one the worker had taken), not all 20


def test_convert_folder_waits_for_its_conversions_after_a_ctrl_c_while_handing_them_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    import pysafetensors.convert as convert

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    for i in range(6):
        torch.save({"w": torch.ones(64, 64) * i}, src / f"c{i}.bin")
    returned = threading.Event()
    started_after: list[str] = []
    real = convert.convert_file

    def spy(s: Any, d: Any, **kwargs: Any) -> Any:
        if returned.is_set():
            started_after.append(os.path.basename(s))
        time.sleep(0.02)
        return real(s, d, **kwargs)

    monkeypatch.setattr(convert, "convert_file", spy)
    pool = CtrlCOnFirstSubmit(1)
    try:
        with pytest.raises(KeyboardInterrupt):
            convert.convert_folder(src, dst, executor=pool)
        returned.set()
    finally:
        pool.shutdown(wait=True)
    assert started_after == []  # none began after the call had cleaned up and returned
    assert not dst.exists() or list(dst.iterdir()) == []


def test_a_remote_read_interrupted_while_handing_parts_over_returns_after_its_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its workers wrote into the caller's buffer after the read had raised."""
    fsspec = pytest.importorskip("fsspec")
    from pysafetensors import _remote_source
    from pysafetensors._remote_fsspec import FsspecSource

    size = 16 << 20
    with fsspec.open("memory://interrupted/big.bin", "wb") as f:
        f.write(b"\x01" * size)
    source = FsspecSource("memory://interrupted/big.bin")
    fs = source._fs
    real_cat = fs.cat_file
    raised = threading.Event()
    late: list[Any] = []

    def slow_cat(path: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        time.sleep(0.05)
        if raised.is_set():
            late.append((start, end))
        return real_cat(path, start=start, end=end, **kwargs)

    monkeypatch.setattr(fs, "cat_file", slow_cat)
    pool = CtrlCOnFirstSubmit(8)
    monkeypatch.setattr(_remote_source._WORKERS, "_executor", lambda: pool)
    out = bytearray(size)
    try:
        with pytest.raises(KeyboardInterrupt):
            source.readinto(0, memoryview(out))
        raised.set()
        filled = out.count(1)
        pool.shutdown(wait=True)
        assert late == [] and out.count(1) == filled  # nothing written after the raise
    finally:
        source.close()
        fs.rm("/interrupted", recursive=True)


@pytest.mark.skipif(sys.gettrace() is not None, reason="needs the tracing hook")
@pytest.mark.usefixtures("_no_gc_callbacks")
def test_a_ctrl_c_as_a_dropped_source_begins_closing_its_descriptor_leaves_it_closed(
    tmp_path: Path,
) -> None:
    source, fd = _pread_source(tmp_path)
    gc.collect()  # earlier tests' garbage: the Ctrl-C must land in this source's finalizer
    with _sigint_on_entering("_close_fd", "_sources.py"), pytest.raises(KeyboardInterrupt):
        del source  # handed on to the program
        gc.collect()
        _wait_for_redelivery()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed, not left open with the source marked closing


def test_a_ctrl_c_met_as_the_last_release_begins_closing_still_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Entering the deferral runs the handlers of signals that came meanwhile: a Ctrl-C raised
    there, before the close, left the resource open with nothing left to close it."""
    from pysafetensors import _interrupts
    from pysafetensors._sources import Shared

    closed: list[str] = []
    shared = Shared("resource", closed.append)
    shared.acquire()
    shared.close()  # held: closed by the last release
    raw = _interrupts._raw_signal
    raised: list[int] = []

    class PendingCtrlC:
        getsignal = staticmethod(raw.getsignal)

        @staticmethod
        def signal(signum: int, handler: object) -> object:
            if not raised:
                raised.append(1)
                raise KeyboardInterrupt  # as the pending SIGINT's handler would
            return raw.signal(signum, handler)

    monkeypatch.setattr(_interrupts, "_raw_signal", PendingCtrlC)
    with pytest.raises(KeyboardInterrupt):
        shared.release()
    assert closed == ["resource"]


@pytest.mark.skipif(sys.gettrace() is not None, reason="needs the tracing hook")
@pytest.mark.usefixtures("_no_gc_callbacks")
def test_a_ctrl_c_as_an_explicit_close_begins_leaves_the_descriptor_closed(
    tmp_path: Path,
) -> None:
    source, fd = _pread_source(tmp_path)
    with _sigint_on_entering("_close_fd", "_sources.py"), pytest.raises(KeyboardInterrupt):
        source.close()
    with pytest.raises(OSError):
        os.fstat(fd)


@pytest.mark.skipif(sys.gettrace() is not None, reason="needs the tracing hook")
@pytest.mark.usefixtures("_no_gc_callbacks")
def test_a_ctrl_c_as_a_dropped_sharded_writer_discards_its_shards_leaves_none(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "out"
    writer = ShardedStreamingWriter(
        folder, {"a": ("F32", [1024]), "b": ("F32", [1024])}, max_shard_size="4KB"
    )
    writer.write("a", np.ones(1024, np.float32).tobytes())  # shard 1 finished, waiting
    assert any(name.endswith(".partial") for name in os.listdir(folder))
    gc.collect()
    with _sigint_on_entering("discard", "_writer.py"), pytest.raises(KeyboardInterrupt):
        del writer
        gc.collect()
        _wait_for_redelivery()
    gc.collect()
    assert not folder.exists() or os.listdir(folder) == []
