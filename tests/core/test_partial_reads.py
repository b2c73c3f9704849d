"""Partial reads on a cold file fetch the selected bytes, not the kernel's readahead window.

Bytes fetched from storage are read from ``/proc/self/io`` (``read_bytes``) after dropping the
file from the page cache with ``POSIX_FADV_DONTNEED``; where either is unavailable (tmpfs,
another OS) the test skips rather than pass without measuring.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import pysafetensors
from pysafetensors._sources import PreadSource
from pysafetensors.numpy import save_file

MiB = 1 << 20


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise OSError("no read_bytes")


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def cold_file(tmp_path: Path) -> Path:
    if not os.path.exists("/proc/self/io") or not hasattr(os, "posix_fadvise"):
        pytest.skip("needs /proc/self/io and posix_fadvise")
    rng = np.random.default_rng(0)
    tensors = {f"w{i}": rng.integers(0, 255, (512, 8192), np.uint8) for i in range(8)}  # 4 MiB
    path = tmp_path / "cold.safetensors"
    save_file(tensors, str(path))
    _evict(path)
    before = _read_bytes()
    with open(path, "rb") as f:
        f.read(MiB)
    if _read_bytes() - before < MiB // 2:
        pytest.skip("storage reads are not counted here (tmpfs or no eviction)")
    _evict(path)
    return path


def test_row_slices_of_a_cold_file_read_only_their_bytes(cold_file: Path) -> None:
    before = _read_bytes()
    with pysafetensors.safe_open(str(cold_file), "np", backend="pread") as f:
        got = {k: f.get_slice(k)[0:64] for k in f.keys()}  # noqa: SIM118
    fetched = _read_bytes() - before
    wanted = 8 * 64 * 8192  # 4 MiB of the 32 MiB file
    # The header page and page rounding: a few KiB more, never the 8 MiB readahead windows.
    assert wanted <= fetched <= wanted + 256 * 1024, fetched
    with pysafetensors.safe_open(str(cold_file), "np") as f:
        for k, v in got.items():
            assert np.array_equal(v, f.get_tensor(k)[0:64])


def test_reopened_descriptor_is_the_same_file(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(bytes(range(256)) * 64)
    fd = os.open(path, os.O_RDONLY)
    src = PreadSource(fd, str(path))
    exact = src.without_readahead()
    assert src.without_readahead() is exact  # made once
    out = np.empty(100, np.uint8)
    exact.readinto(300, out.data)
    assert out.tobytes() == path.read_bytes()[300:400]
    # Replacing the path does not redirect the reopened descriptor (it is the open inode).
    src2 = PreadSource(os.open(path, os.O_RDONLY), str(path))
    os.replace(tmp_path / "x.bin", tmp_path / "moved.bin")
    (tmp_path / "x.bin").write_bytes(b"\0" * 16384)
    exact2 = src2.without_readahead()
    exact2.readinto(300, out.data)
    assert out.tobytes() == (tmp_path / "moved.bin").read_bytes()[300:400]
    src.close()
    src2.close()
    assert exact._fd == -1 and exact2._fd == -1
