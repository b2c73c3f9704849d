"""Closing a pread handle while other threads read from it.

A descriptor closed under a read in flight could be reused at once by a file opened on another
thread, and the read would then return that file's bytes without any error. Reads now hold the
descriptor: ``close`` lets them finish (the last one closes it), and later reads raise
``ClosedFileError``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import ClosedFileError, SafetensorError, safe_open
from pysafetensors._sources import PreadSource
from pysafetensors.numpy import save_file


def test_a_read_in_flight_keeps_the_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 16)
    source = PreadSource(os.open(path, os.O_RDONLY), str(path))
    fd = source._acquire()  # a read in flight
    source.close()
    os.fstat(fd)  # still open: nothing else can get this number yet
    with pytest.raises(ClosedFileError):
        source.pread_exact(0, memoryview(bytearray(4)))  # new reads are refused
    source._release()  # the last reader closes it
    with pytest.raises(OSError):
        os.fstat(fd)


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_close_racing_readers_never_returns_another_files_bytes(
    tmp_path: Path, framework: str
) -> None:
    if framework == "pt":
        pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.integers(1, 100, size=(256, 1024), dtype=np.int32) for i in range(4)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, path)
    decoy = tmp_path / "decoy.bin"
    decoy.write_bytes(b"\x00" * path.stat().st_size)  # zeros: no tensor holds a 0
    outcomes = {"ok": 0, "closed": 0}
    wrong: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def churn() -> None:  # takes any descriptor number freed by close()
        while not stop.is_set():
            fds = [os.open(decoy, os.O_RDONLY) for _ in range(4)]
            for fd in fds:
                os.close(fd)

    def reader(f: safe_open, name: str) -> None:
        try:
            got = np.asarray(f.get_tensor(name))
        except ClosedFileError:
            with lock:
                outcomes["closed"] += 1
            return
        except SafetensorError as exc:  # anything else of ours must not happen either
            wrong.append(f"{type(exc).__name__}: {exc}")
            return
        with lock:
            if np.array_equal(got, tensors[name]):
                outcomes["ok"] += 1
            else:
                wrong.append(name)

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        for _ in range(40):
            f = safe_open(path, framework, backend="pread")
            readers = [threading.Thread(target=reader, args=(f, f"t{i % 4}")) for i in range(6)]
            for t in readers:
                t.start()
            f.close()
            for t in readers:
                t.join()
    finally:
        stop.set()
        churner.join()
    assert wrong == []
    assert outcomes["ok"] + outcomes["closed"] == 40 * 6


@pytest.mark.parametrize("rows", [512, 2048])
@pytest.mark.parametrize("framework", ["pt", "np"])
def test_close_during_a_mapped_get_tensor_waits_for_it(
    tmp_path: Path, framework: str, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() from another thread emptied the mapping under a get_tensor in progress, which
    then returned uninitialised memory (torch) or zeros (numpy, >= 1 MiB) instead of the data.
    1 MiB takes get_tensor's short path for small tensors (in numpy, its positioned read into
    a fresh array; in torch, ``_small``), 4 MiB the general one (``_raw``)."""
    if framework == "pt":
        pytest.importorskip("torch")
    from pysafetensors import _reader

    values = np.arange(rows * 512, dtype=np.float32).reshape(rows, 512) + 1
    path = tmp_path / "m.safetensors"
    save_file({"w": values}, str(path))
    entered = threading.Event()
    if values.nbytes > _reader.MIN_PARALLEL_CHUNK or framework == "pt":
        step = "_small" if values.nbytes <= _reader.MIN_PARALLEL_CHUNK else "_raw"
        original = getattr(_reader.safe_open, step)

        def slow_read(self: Any, source: Any, info: Any) -> Any:
            entered.set()
            time.sleep(0.2)
            return original(self, source, info)

        monkeypatch.setattr(_reader.safe_open, step, slow_read)
    else:
        preadv = os.preadv

        def slow_preadv(fd: int, buffers: Any, offset: int) -> int:
            entered.set()
            time.sleep(0.2)
            return preadv(fd, buffers, offset)

        monkeypatch.setattr(_reader.os, "preadv", slow_preadv)
    f = safe_open(path, framework, backend="mmap")
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(f.get_tensor("w")))
    reader.start()
    assert entered.wait(10)
    f.close()
    reader.join()
    assert np.array_equal(np.asarray(got[0]), values)
    with pytest.raises(ClosedFileError):
        f.get_tensor("w")


def test_a_closed_mapping_refuses_views_instead_of_handing_out_nothing(tmp_path: Path) -> None:
    save_file({"w": np.ones((512, 512), np.float32)}, str(tmp_path / "m.safetensors"))
    f = safe_open(tmp_path / "m.safetensors", "np", backend="mmap")
    source = f._source
    f.close()
    with pytest.raises(ClosedFileError):
        source.view(8, 1024)


def test_numpy_arrays_hold_no_file_descriptors(tmp_path: Path) -> None:
    """A private mapping per numpy get_tensor kept a duplicated descriptor per array alive (mmap
    dups it): a dict of 1,000 large tensors exhausted the process's descriptors."""
    save_file({f"t{i}": np.full(1 << 18, i, np.float32) for i in range(40)}, str(tmp_path / "m.st"))
    before = len(os.listdir("/proc/self/fd"))
    with safe_open(tmp_path / "m.st", "np") as f:
        kept = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert len(os.listdir("/proc/self/fd")) <= before + 1
    assert all(kept[f"t{i}"][0] == i for i in range(40))
