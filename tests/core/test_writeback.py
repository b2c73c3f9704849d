"""Durable saves start the disk on each ~16 MiB as soon as it is written (``Writeback``).

The hand-overs are observed by wrapping ``sync_file_range`` (the real call still runs and its
result is checked); that the disk then writes is the kernel's business, and the final ``fsync``
still makes the file durable either way (``tests/hardening/test_crash_safety.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import pysafetensors
from pysafetensors import StreamingWriter, _syscalls, _writer
from pysafetensors.numpy import load_file, save, save_file

MiB = 1 << 20


@pytest.fixture
def handovers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int, int]]]:
    """Every ``sync_file_range`` call as ``(offset, nbytes, result)``."""
    real = _syscalls.sync_file_range
    if real is None:
        pytest.skip("no sync_file_range here")
    calls: list[tuple[int, int, int]] = []

    def recording(fd: int, offset: int, nbytes: int, flags: int) -> int:
        result = real(fd, offset, nbytes, flags)
        calls.append((offset, nbytes, result))
        return result

    monkeypatch.setattr(_writer, "sync_file_range", recording)
    yield calls


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    big = {f"w{i}": rng.integers(0, 255, (5 * MiB,), np.uint8) for i in range(8)}  # 40 MiB
    small = {f"s{i}": rng.standard_normal(100).astype(np.float32) for i in range(50)}
    return big | small


def test_durable_save_hands_over_its_bytes_in_order(
    tmp_path: Path, handovers: list[tuple[int, int, int]]
) -> None:
    tensors = _tensors()
    path = tmp_path / "durable.safetensors"
    save_file(tensors, str(path), fsync=True)
    assert path.read_bytes() == save(tensors)
    assert len(handovers) >= 2
    assert all(result == 0 for _, _, result in handovers)
    assert handovers[0][0] == 0
    for (offset, nbytes, _), (following, _, _) in zip(handovers, handovers[1:], strict=False):
        assert nbytes >= _writer.WRITEBACK_STEP
        assert following == offset + nbytes  # contiguous, nothing handed over twice
    # What is left after the last hand-over is less than one step (fsync takes it).
    end = handovers[-1][0] + handovers[-1][1]
    assert path.stat().st_size - end < _writer.WRITEBACK_STEP


def test_page_cache_save_does_not_hand_over(
    tmp_path: Path, handovers: list[tuple[int, int, int]]
) -> None:
    tensors = _tensors()
    path = tmp_path / "fast.safetensors"
    save_file(tensors, str(path))  # large tensors go out whole here
    assert path.read_bytes() == save(tensors)
    assert handovers == []


def test_streaming_writer_in_reverse_order(
    tmp_path: Path, handovers: list[tuple[int, int, int]]
) -> None:
    data = np.random.default_rng(1).integers(0, 255, (48, MiB), np.uint8)
    path = tmp_path / "streamed.safetensors"
    with StreamingWriter(str(path), {"w": ("U8", data.shape)}, fsync=True) as w:
        for row in reversed(range(48)):  # out of order: the envelope still covers every write
            w.write("w", data[row], offset=row * MiB)
    assert np.array_equal(load_file(str(path))["w"], data)
    assert handovers and all(result == 0 for _, _, result in handovers)
    covered = sorted((offset, offset + nbytes) for offset, nbytes, _ in handovers)
    for (_, high), (low, _) in zip(covered, covered[1:], strict=False):
        assert low == high  # no gaps between hand-overs
    # 16 rows make a step, so all 48 MiB of data were handed over, and nothing else.
    size = path.stat().st_size
    assert (covered[0][0], covered[-1][1]) == (size - 48 * MiB, size)


def test_reshard_durable_hands_over(tmp_path: Path, handovers: list[tuple[int, int, int]]) -> None:
    src = tmp_path / "model.safetensors"
    tensors = _tensors()
    save_file(tensors, str(src))
    pysafetensors.reshard(str(src), str(tmp_path / "out"), "25MB", fsync=True)
    assert handovers and all(result == 0 for _, _, result in handovers)
    got: dict[str, np.ndarray] = {}
    for shard in sorted((tmp_path / "out").glob("*.safetensors")):
        got |= load_file(str(shard))
    assert got.keys() == tensors.keys()
    assert all(np.array_equal(got[k], v) for k, v in tensors.items())


def test_refused_hand_over_stops_asking() -> None:
    if _syscalls.sync_file_range is None:
        pytest.skip("no sync_file_range here")
    read_end, write_end = os.pipe()  # ESPIPE: a pipe has no file range
    try:
        writeback = _writer.Writeback(write_end)
        writeback.wrote(0, _writer.WRITEBACK_STEP)  # refused: no exception
        assert writeback._sync is None
        writeback.wrote(0, _writer.WRITEBACK_STEP)  # and not asked again
    finally:
        os.close(read_end)
        os.close(write_end)


def test_durable_save_without_sync_file_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_writer, "sync_file_range", None)  # another OS
    tensors = _tensors()
    path = tmp_path / "plain.safetensors"
    save_file(tensors, str(path), fsync=True)
    assert path.read_bytes() == save(tensors)
