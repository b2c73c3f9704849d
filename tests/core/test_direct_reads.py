"""Large runs of a cold file are read with direct I/O (``O_DIRECT``), exactly and safely.

``read_runs_fresh`` (a tensor-parallel row split, whole tensors read together) reads runs that
are large and not in the page cache straight into its buffer, whole 4 KiB blocks at a time.
These tests lower the size thresholds so that small files take that path, and check the bytes
against the file: runs at unaligned offsets, a run ending at an unaligned end of file, cached
runs left to the page cache, a refused or failing direct read finished through the cache, and
a file cut short while it is read.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import SafetensorError, _range_reads, tuning
from pysafetensors._range_reads import read_runs_fresh
from pysafetensors._sources import PreadSource
from pysafetensors.numpy import save_file
from pysafetensors.parallel import load_shard, shard_range

from .test_partial_reads import _evict

KiB = 1 << 10


@pytest.fixture(autouse=True)
def small_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    if not getattr(os, "O_DIRECT", 0) or not hasattr(os, "posix_fadvise"):
        pytest.skip("needs O_DIRECT and posix_fadvise")
    monkeypatch.setattr(_range_reads, "DIRECT_RUN_MIN", 64 * KiB)
    monkeypatch.setattr(_range_reads, "DIRECT_MIN", 256 * KiB)


@pytest.fixture
def direct_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """``(offset, wanted)`` of every direct read made."""
    calls: list[tuple[int, int]] = []
    real = _range_reads._read_direct

    def spy(fd: int, source: PreadSource, offset: int, out: memoryview, wanted: int) -> None:
        calls.append((offset, wanted))
        real(fd, source, offset, out, wanted)

    monkeypatch.setattr(_range_reads, "_read_direct", spy)
    return calls


@pytest.fixture
def odd_file(tmp_path: Path) -> Iterator[Path]:
    """Tensors of sizes that are no multiple of 4 KiB, after a header of odd length, the last
    one ending the file off a block boundary; dropped from the page cache."""
    rng = np.random.default_rng(7)
    tensors = {
        "a": rng.integers(0, 255, (301, 1031), np.uint8),  # ~303 KiB
        "b": rng.integers(0, 255, (97,), np.uint8),
        "c": rng.integers(0, 255, (517, 613), np.uint8),  # ~309 KiB
        "d": rng.integers(0, 255, (1000, 333), np.uint8),  # ~325 KiB, the end of the file
    }
    path = tmp_path / "odd.safetensors"
    save_file(tensors, str(path), metadata={"pad": "x" * 13})
    assert os.path.getsize(path) % 4096
    if _direct_refused(path):
        pytest.skip("this filesystem refuses O_DIRECT")
    _evict(path)
    yield path


def _direct_refused(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return True
    return False


def _runs(path: Path) -> list[tuple[int, int]]:
    """Byte runs of every tensor, each cut a little on both sides (no run block-aligned), the
    last one up to the very end of the file."""
    from pysafetensors import safe_open

    with safe_open(str(path), "np") as f:
        header = f._header
        base = header.data_start
        runs = [(base + info.begin + 3, info.nbytes - 5) for info in header.tensors.values()]
    last_offset, _ = runs[-1]
    runs[-1] = (last_offset, os.path.getsize(path) - last_offset)
    _evict(path)  # reading the header cached the start of the file
    return runs


@contextlib.contextmanager
def _source(path: Path) -> Iterator[PreadSource]:
    source = PreadSource(os.open(path, os.O_RDONLY), str(path))
    try:
        yield source
    finally:
        source.close()


def _read_checked(path: Path, runs: list[tuple[int, int]]) -> list[int]:
    """``read_runs_fresh`` of the runs, each checked against the file; their offsets."""
    with _source(path) as source:
        buf, offsets = read_runs_fresh(source, runs)
    raw = path.read_bytes()
    for (offset, length), at in zip(runs, offsets, strict=True):
        assert buf[at : at + length].tobytes() == raw[offset : offset + length]
    return offsets


def test_cold_large_runs_are_read_directly_and_exactly(
    odd_file: Path, direct_calls: list[tuple[int, int]]
) -> None:
    runs = _runs(odd_file)
    offsets = _read_checked(odd_file, runs)
    large = [run for run in runs if run[1] >= 64 * KiB]
    assert len(large) == 3
    # Every direct read starts on a block; each large run went that way, placed at its phase.
    assert len(direct_calls) == 3 and all(offset % 4096 == 0 for offset, _ in direct_calls)
    for (offset, length), at in zip(runs, offsets, strict=True):
        if length >= 64 * KiB:
            assert at % 4096 == offset % 4096


def test_cached_runs_keep_the_page_cache(
    odd_file: Path, direct_calls: list[tuple[int, int]]
) -> None:
    runs = _runs(odd_file)
    odd_file.read_bytes()  # cached now
    _read_checked(odd_file, runs)
    assert direct_calls == []


def test_direct_reads_can_be_turned_off(
    odd_file: Path, direct_calls: list[tuple[int, int]]
) -> None:
    runs = _runs(odd_file)
    with tuning.configured(direct_reads=False):
        _read_checked(odd_file, runs)
    assert direct_calls == []
    _evict(odd_file)
    _read_checked(odd_file, runs)  # on again after the block
    assert direct_calls


def test_a_file_that_cannot_be_reopened_for_direct_io_is_read_through_the_cache(
    odd_file: Path, direct_calls: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    refused: Callable[[PreadSource], Any] = lambda self: None  # noqa: E731
    monkeypatch.setattr(PreadSource, "reopen_direct", refused)
    runs = _runs(odd_file)
    _read_checked(odd_file, runs)
    assert direct_calls == []


@pytest.fixture
def refused_direct_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every direct read fails as a device refusing the alignment; the offsets tried."""
    real = os.preadv
    failed: list[int] = []

    def preadv(fd: int, buffers: list[Any], offset: int) -> int:
        if os.O_DIRECT & _flags(fd):
            failed.append(offset)
            raise OSError(22, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    return failed


def test_a_failing_direct_read_is_finished_through_the_cache(
    odd_file: Path, refused_direct_reads: list[int]
) -> None:
    failed = refused_direct_reads
    runs = _runs(odd_file)
    _read_checked(odd_file, runs)
    assert failed


def _flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_a_file_cut_short_raises_a_clear_error(odd_file: Path) -> None:
    runs = _runs(odd_file)
    with _source(odd_file) as source:
        os.truncate(odd_file, runs[-1][0] + 10)  # the last run loses all but 10 bytes
        with pytest.raises(SafetensorError, match="ended early"):
            read_runs_fresh(source, runs)


def test_row_split_of_a_cold_file_reads_directly(
    odd_file: Path, direct_calls: list[tuple[int, int]]
) -> None:
    from pysafetensors.numpy import load_file

    expected = load_file(str(odd_file), backend="pread")
    _evict(odd_file)
    got = load_shard(str(odd_file), 1, 2, {"*": "rows"}, framework="np")
    assert direct_calls
    for name, array in expected.items():
        start, end = shard_range(array.shape[0], 1, 2)
        np.testing.assert_array_equal(got[name], array[start:end])


# ------------------------------------------------------------ reads into the caller's memory


def _into(path: Path, names: list[str], *, offset: int = 0) -> dict[str, np.ndarray]:
    """``safe_open.read_into`` of ``names`` into unaligned arrays, checked against the file."""
    from pysafetensors import safe_open

    with safe_open(str(path), "np", backend="pread") as f:
        sizes = {name: f.header.tensors[name].nbytes for name in names}
        # Every destination starts off any block boundary: direct reads cannot land there.
        outs = {name: np.zeros(n + offset, np.uint8)[offset:] for name, n in sizes.items()}
        _evict(path)  # the open cached the header's page
        f.read_into(outs)
        expected = {name: f.get_tensor(name).reshape(-1).view(np.uint8) for name in names}
    for name in names:
        assert outs[name].tobytes() == expected[name].tobytes(), name
    return outs


def test_read_into_a_cold_file_goes_through_bounce_buffers(
    odd_file: Path, direct_calls: list[tuple[int, int]]
) -> None:
    _into(odd_file, ["a", "b", "c", "d"], offset=3)
    assert direct_calls and all(offset % 4096 == 0 for offset, _ in direct_calls)
    # The last read wants the end of the file, off a block boundary: finished through the cache.
    assert max(offset + wanted for offset, wanted in direct_calls) == os.path.getsize(odd_file)


def test_read_into_skips_the_stretches_between_pieces(
    odd_file: Path, direct_calls: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pysafetensors import safe_open

    monkeypatch.setattr(_range_reads, "_BOUNCE_BYTES", 64 * KiB)
    with safe_open(str(odd_file), "np") as f:
        base = f.header.data_start
        c = f.header.tensors["c"]
        c_start, c_end = base + c.begin, base + c.end
    _into(odd_file, ["a", "b", "d"], offset=1)
    assert len(direct_calls) > 5
    # No bounce read lies wholly inside "c", which was not asked for.
    assert not [o for o, n in direct_calls if c_start + 4096 <= o and o + n <= c_end - 4096]


def test_read_into_a_cached_or_small_selection_uses_the_page_cache(
    odd_file: Path, direct_calls: list[tuple[int, int]]
) -> None:
    odd_file.read_bytes()
    from pysafetensors import safe_open

    with safe_open(str(odd_file), "np", backend="pread") as f:
        outs = {name: np.empty(f.header.tensors[name].nbytes, np.uint8) for name in "abcd"}
        f.read_into(outs)  # cached: no direct read
        assert direct_calls == []
        _evict(odd_file)
        f.read_into({"b": outs["b"]})  # below the size threshold
        assert direct_calls == []
        f.read_into({"a": outs["a"]})  # above it
        assert direct_calls


def test_read_into_finishes_a_refused_direct_read_through_the_cache(
    odd_file: Path, refused_direct_reads: list[int]
) -> None:
    failed = refused_direct_reads
    _into(odd_file, ["a", "b", "c", "d"], offset=5)
    assert failed


def test_read_into_a_file_cut_short_names_the_tensor(odd_file: Path) -> None:
    from pysafetensors import safe_open

    with safe_open(str(odd_file), "np", backend="pread") as f:
        base = f.header.data_start
        d = f.header.tensors["d"]
        outs = {name: np.empty(f.header.tensors[name].nbytes, np.uint8) for name in "abcd"}
        os.truncate(odd_file, base + d.begin + 100)
        _evict(odd_file)
        with pytest.raises(SafetensorError, match="'d'") as caught:
            f.read_into(outs)
    assert caught.value.tensor == "d"


def test_a_sparse_selection_is_not_read_through_bounce_buffers(
    odd_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_range_reads, "DIRECT_MIN", 64 * KiB)
    size = os.path.getsize(odd_file)
    first, last = np.zeros(64 * KiB, np.uint8), np.zeros(64 * KiB, np.uint8)
    pieces = [(0, first.data.cast("B")), (size - 64 * KiB, last.data.cast("B"))]
    with _source(odd_file) as source:
        # 128 KiB wanted of a ~1 MiB span: direct reads would fetch mostly unwanted bytes.
        assert not _range_reads._read_pieces_direct(source, pieces, 128 * KiB, 0, size)
        assert not first.any() and not last.any()
        # One of them alone is dense: read directly.
        assert _range_reads._read_pieces_direct(source, pieces[1:], 64 * KiB, size - 64 * KiB, size)
    assert last.tobytes() == odd_file.read_bytes()[-64 * KiB :]


def test_read_into_many_small_tensors_across_bounce_buffers(
    tmp_path: Path, direct_calls: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hundreds of tensors of odd sizes, many straddling the bounce buffers' edges, some
    skipped: each lands whole, the skipped ones' bytes untouched."""
    monkeypatch.setattr(_range_reads, "_BOUNCE_BYTES", 16 * KiB)
    rng = np.random.default_rng(11)
    tensors = {
        f"t{i:03d}": rng.integers(0, 255, (int(rng.integers(1, 5000)),), np.uint8)
        for i in range(300)
    }
    path = tmp_path / "many.safetensors"
    save_file(tensors, str(path))
    if _direct_refused(path):
        pytest.skip("this filesystem refuses O_DIRECT")
    wanted = [name for i, name in enumerate(sorted(tensors)) if i % 7 != 3]
    from pysafetensors import safe_open

    outs = {name: np.zeros(tensors[name].size + 1, np.uint8)[1:] for name in wanted}
    with safe_open(str(path), "np", backend="pread") as f:
        _evict(path)
        f.read_into(outs)
    assert len(direct_calls) > 10
    for name in wanted:
        assert np.array_equal(outs[name], tensors[name]), name
