"""Partial reads on a cold file fetch the selected bytes, not the kernel's readahead window.

Bytes fetched from storage are read from ``/proc/self/io`` (``read_bytes``) after dropping the
file from the page cache with ``POSIX_FADV_DONTNEED``; where either is unavailable (tmpfs,
another OS) the test skips rather than pass without measuring.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pysafetensors
from pysafetensors import _fresh_memory, _residency, _sources, tuning
from pysafetensors._sources import MmapSource, PreadSource
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


def test_a_shard_of_a_cold_file_reads_only_its_bytes(cold_file: Path) -> None:
    """load_shard reads every part into one destination at once; still only those bytes."""
    from pysafetensors.parallel import load_shard

    before = _read_bytes()
    got = load_shard(str(cold_file), 1, 8, {"*": "rows"}, framework="np")
    fetched = _read_bytes() - before
    wanted = 8 * 64 * 8192
    assert wanted <= fetched <= wanted + 256 * 1024, fetched
    with pysafetensors.safe_open(str(cold_file), "np") as f:
        for k, v in got.items():
            assert np.array_equal(v, f.get_tensor(k)[64:128])


def test_row_slices_of_a_cold_mapping_read_only_their_bytes(
    cold_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copied out of the mapping, a part's pages came in readahead windows that ran past it:
    4-5 times its bytes off the disk. A part not in the page cache is read by positioned
    reads with readahead off instead, under backend="mmap" too (get_slice and load_shard)."""
    from pysafetensors import _reader
    from pysafetensors.parallel import load_shard

    monkeypatch.setattr(_reader, "PREFETCH_MIN", 256 * 1024)  # the parts here are 512 KiB
    wanted = 8 * 64 * 8192  # 4 MiB of the 32 MiB file
    with pysafetensors.safe_open(str(cold_file), "np") as f:
        whole = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    for rows in (slice(64, 128), slice(448, 512)):
        _evict(cold_file)
        before = _read_bytes()
        with pysafetensors.safe_open(str(cold_file), "np", backend="mmap") as f:
            got = {k: f.get_slice(k)[rows] for k in f.keys()}  # noqa: SIM118
        fetched = _read_bytes() - before
        # The header's pages and page rounding: a few hundred KiB more, not the windows.
        assert wanted <= fetched <= wanted + 512 * 1024, (rows, fetched)
        assert all(np.array_equal(v, whole[k][rows]) for k, v in got.items())
    _evict(cold_file)
    before = _read_bytes()
    parts = load_shard(str(cold_file), 1, 8, {"*": "rows"}, framework="np", backend="mmap")
    fetched = _read_bytes() - before
    assert wanted <= fetched <= wanted + 512 * 1024, fetched
    assert all(np.array_equal(v, whole[k][64:128]) for k, v in parts.items())


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


# Copies out of a cold mapping: the span is read into the page cache first, on all reader
# threads (MmapSource.prefetch), when most of its pages are needed and few are cached.


def _mapped_residency(path: Path) -> float:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = np.frombuffer(mm, np.uint8)
        try:
            fraction = _residency.resident_fraction(view.ctypes.data, len(view))
        finally:
            del view
    if fraction is None:
        pytest.skip("no mincore here")
    return fraction


@pytest.fixture
def cold_matrix(cold_file: Path, tmp_path: Path) -> tuple[Path, np.ndarray]:
    """A cold file holding one 16 MiB matrix of 8 KiB rows (the fixture above proved that
    eviction works on this file system)."""
    matrix = np.random.default_rng(1).integers(0, 255, (2048, 8192), np.uint8)
    path = tmp_path / "matrix.safetensors"
    save_file({"w": matrix}, str(path))
    _evict(path)
    if _mapped_residency(path) > 0.1:
        pytest.skip("the file stayed cached")
    return path, matrix


@pytest.fixture
def prefetch_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Record every MmapSource.prefetch call (length, whether it populated); the real method
    runs."""
    calls: list[tuple[int, bool]] = []
    real = MmapSource.prefetch

    def recording(self: MmapSource, offset: int, length: int) -> bool:
        done = real(self, offset, length)
        calls.append((length, done))
        return done

    monkeypatch.setattr(MmapSource, "prefetch", recording)
    return calls


@pytest.mark.parametrize("libc_madvise", [True, False])
def test_cold_column_split_of_a_mapping_is_read_in_first(
    cold_matrix: tuple[Path, np.ndarray],
    prefetch_calls: list[tuple[int, bool]],
    monkeypatch: pytest.MonkeyPatch,
    libc_madvise: bool,
) -> None:
    if not _sources.PrefetchSupport.enabled:
        pytest.skip("no MADV_POPULATE_READ or mincore here")
    if not libc_madvise:  # the mmap module's madvise, where libc's cannot be called
        monkeypatch.setattr(_fresh_memory, "madvise", None)
    path, matrix = cold_matrix
    with pysafetensors.safe_open(str(path), "np") as f:
        got = f.get_slice("w")[:, :1024]  # 1 KiB of every 8 KiB row: every other page
    assert np.array_equal(got, matrix[:, :1024])
    span = 2047 * 8192 + 1024
    assert prefetch_calls == [(span, True)]
    assert _mapped_residency(path) > 0.9  # the whole span, not only the selected pages


def test_prefetch_can_be_turned_off(
    cold_matrix: tuple[Path, np.ndarray], prefetch_calls: list[tuple[int, bool]]
) -> None:
    path, matrix = cold_matrix
    with tuning.configured(prefetch=False), pysafetensors.safe_open(str(path), "np") as f:
        got = f.get_slice("w")[:, :1024]
    assert np.array_equal(got, matrix[:, :1024])
    assert prefetch_calls == [(2047 * 8192 + 1024, False)]  # asked, and declined


def test_sparse_selection_of_a_cold_mapping_is_not_read_in(
    cold_matrix: tuple[Path, np.ndarray], prefetch_calls: list[tuple[int, bool]]
) -> None:
    path, matrix = cold_matrix
    with pysafetensors.safe_open(str(path), "np") as f:
        got = f.get_slice("w")[::64, :64]  # 32 rows: the span would be 4,000x the bytes
    assert np.array_equal(got, matrix[::64, :64])
    assert prefetch_calls == []


def test_prefetch_leaves_cached_and_small_ranges_alone(tmp_path: Path) -> None:
    path = tmp_path / "warm.bin"
    path.write_bytes(os.urandom(8 * MiB))
    path.read_bytes()  # cached
    fd = os.open(path, os.O_RDONLY)
    try:
        source = MmapSource(fd, str(path))
    finally:
        os.close(fd)
    try:
        assert not source.prefetch(0, 8 * MiB)  # cached already
        assert not source.prefetch(0, _sources.PREFETCH_MIN - 1)  # too small to matter
        with pytest.raises(pysafetensors.SafetensorError):
            source.prefetch(4 * MiB, 8 * MiB)  # past the end: refused like any read
    finally:
        source.close()


def test_kernel_refusing_the_prefetch_turns_it_off(
    cold_matrix: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    if not _sources.PrefetchSupport.enabled:
        pytest.skip("no MADV_POPULATE_READ or mincore here")
    monkeypatch.setattr(_sources.PrefetchSupport, "enabled", True)  # restored afterwards
    monkeypatch.setattr(_sources, "MADV_POPULATE_READ", -12345)  # EINVAL, as before 5.14
    path, matrix = cold_matrix
    with pysafetensors.safe_open(str(path), "np") as f:
        got = f.get_slice("w")[:, 1024:2048]
    assert np.array_equal(got, matrix[:, 1024:2048])  # the copy faulted the pages in itself
    assert _sources.PrefetchSupport.enabled is False


# Large reads of a cold file: a read-ahead thread keeps the disk busy ahead of the readers
# (read_ahead, POSIX_FADV_WILLNEED in 2 MiB windows). Exercised here on a 32 MiB file with the
# size threshold lowered.


@pytest.fixture
def willneed_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every POSIX_FADV_WILLNEED as ``(offset, length)``; the real call runs."""
    calls: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def recording(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            calls.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    monkeypatch.setattr(_residency, "READ_AHEAD_MIN", 8 * MiB)
    return calls


def _read_ahead_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name == "pysafetensors-read-ahead"]


def test_cold_eager_load_reads_ahead(
    cold_file: Path, willneed_calls: list[tuple[int, int]]
) -> None:
    fd = os.open(cold_file, os.O_RDONLY)
    try:
        assert _residency.mostly_uncached(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    with pysafetensors.safe_open(str(cold_file), "np", backend="pread") as f:
        got = f.get_tensors()
    assert willneed_calls, "no read-ahead on a cold file"
    first = willneed_calls[0][0]
    for i, (offset, length) in enumerate(willneed_calls):
        assert offset == first + i * 2 * MiB and 0 < length <= 2 * MiB  # front to back
    assert _read_ahead_threads() == []  # stopped with the read
    with pysafetensors.safe_open(str(cold_file), "np") as f:
        for k, v in got.items():
            assert np.array_equal(v, f.get_tensor(k))


def test_warm_load_does_not_read_ahead(
    cold_file: Path, willneed_calls: list[tuple[int, int]]
) -> None:
    cold_file.read_bytes()  # now cached
    fd = os.open(cold_file, os.O_RDONLY)
    try:
        assert not _residency.mostly_uncached(fd, 0, os.fstat(fd).st_size)
        assert not _residency.mostly_uncached(fd, 0, os.fstat(fd).st_size + MiB)  # past the end
    finally:
        os.close(fd)
    with pysafetensors.safe_open(str(cold_file), "np", backend="pread") as f:
        f.get_tensors()
    assert willneed_calls == []


def test_read_ahead_stops_when_the_read_fails(
    cold_file: Path, willneed_calls: list[tuple[int, int]]
) -> None:
    fd = os.open(cold_file, os.O_RDONLY)
    try:
        with pytest.raises(RuntimeError), _residency.read_ahead(fd, 0, 32 * MiB):
            raise RuntimeError("read failed")
    finally:
        os.close(fd)
    assert _read_ahead_threads() == []


# --- MmapSource.readinto copies by positioned reads, not out of the mapping


def test_mapped_source_reads_into_memory_by_pread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy out of the mapping would hold the GIL and fault page by page; readinto goes
    through ``preadv`` on the source's own descriptor and returns the file's bytes."""
    data = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    calls: list[int] = []
    real = os.preadv

    def spy(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(fd)
        return real(fd, buffers, offset)

    fd = os.open(path, os.O_RDONLY)
    try:
        source = MmapSource(fd, str(path))
    finally:
        os.close(fd)  # the source keeps a descriptor of its own
    monkeypatch.setattr(os, "preadv", spy)
    out = bytearray(2 << 20)
    source.readinto(12345, memoryview(out))
    assert bytes(out) == data[12345 : 12345 + len(out)]
    assert calls and all(c == source._fd for c in calls)
    # A file cut short after opening is still refused with the same error (checked once a
    # read comes short, not by an fstat before every read).
    os.truncate(path, 1 << 20)
    with pytest.raises(pysafetensors.SafetensorError) as info:
        source.readinto(12345, memoryview(out))
    assert info.value.kind == "FileTruncated"
    source.close()


@pytest.mark.parametrize(
    "index",
    [
        (slice(None), slice(None), slice(8, 16)),  # a column split of a fused-experts weight
        (slice(1, 3), slice(2, 30, 3), slice(0, 24, 5)),
        (slice(None, None, 2), slice(5, 6), slice(20, 24)),
        (slice(None), 7, slice(0, 8)),  # an int in the second dimension: run by run
        (2, slice(None), slice(3, 9)),
    ],
)
def test_slices_of_rows_too_large_to_buffer_read_their_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, index: tuple[object, ...]
) -> None:
    # With rows over the gather block, each reader thread held a whole row (a 112 MiB row of
    # an (8, 14336, 4096) BF16 weight for a 14 MiB share of it); they are now gathered in
    # blocks of their second dimension. A small block makes these rows "too large".
    from pysafetensors import _reader, _slice_gather

    monkeypatch.setattr(_slice_gather, "_GATHER_BLOCK", 1024)
    monkeypatch.setattr(_reader, "_SMALL_PART", 0)  # not read whole as a small tensor
    rng = np.random.default_rng(5)
    value = rng.standard_normal((4, 40, 32)).astype(np.float32)  # rows of 5 KiB
    path = tmp_path / "w.safetensors"
    save_file({"w": value}, path)
    reads: list[int] = []

    def counted(real: Any) -> Any:
        def read(self: PreadSource, offset: int, view: memoryview) -> None:
            reads.append(len(view))
            real(self, offset, view)

        return read

    with pysafetensors.safe_open(path, "np", backend="pread") as f:
        # Both ways a slice reads (one row alone was read whole by readinto).
        monkeypatch.setattr(PreadSource, "pread_exact", counted(PreadSource.pread_exact))
        monkeypatch.setattr(PreadSource, "readinto", counted(PreadSource.readinto))
        part = f.get_slice("w")[index]
    np.testing.assert_array_equal(part, value[index])
    assert reads and max(reads) <= 1024, "no read buffers a whole 5 KiB row"
