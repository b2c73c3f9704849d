"""Closing a pread handle while other threads read from it.

A descriptor closed under a read in flight could be reused at once by a file opened on another
thread, and the read would then return that file's bytes without any error. Reads now hold the
descriptor: ``close`` lets them finish (the last one closes it), and later reads raise
``ClosedFileError``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

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
