"""Fragmented slices (runs of a few bytes) read by positioned reads or from a file object: as
blocks of their covering rows, not a read per run, unless the runs lie far apart."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pysafetensors
from pysafetensors import _reader
from pysafetensors._sources import FileObjSource, PreadSource
from pysafetensors.numpy import save_file


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every read a slice makes, by positioned reads or from a file object."""
    monkeypatch.setattr(_reader, "_SMALL_PART", 0)  # small tensors are not read whole
    lengths: list[int] = []

    def counted(real: Callable[..., None]) -> Callable[..., None]:
        def read(self: Any, offset: int, view: memoryview) -> None:
            lengths.append(len(view))
            real(self, offset, view)

        return read

    for cls, name in [
        (PreadSource, "pread_exact"),
        (PreadSource, "readinto"),
        (FileObjSource, "readinto"),
    ]:
        monkeypatch.setattr(cls, name, counted(getattr(cls, name)))
    return lengths


def _opened(path: Path, how: str) -> Any:
    if how == "pread":
        return pysafetensors.safe_open(path, "np", backend="pread")
    return pysafetensors.safe_open(io.BytesIO(path.read_bytes()), "np")


@pytest.mark.parametrize("how", ["pread", "file object"])
@pytest.mark.parametrize(
    ("shape", "index"),
    [
        ((100_000,), (slice(None, None, 3),)),  # a vector: one read per element before
        ((100_000,), (slice(7, -5, 2),)),
        ((64, 64, 128), (slice(None), slice(None), 0)),  # 4 bytes every 512: all pages needed
        ((64, 64, 128), (slice(None), slice(2, 60, 5), slice(3, 4))),
        ((300, 333), (slice(None), slice(None, None, 2))),
    ],
)
def test_tiny_close_runs_are_read_as_blocks(
    tmp_path: Path, reads: list[int], how: str, shape: tuple[int, ...], index: tuple[Any, ...]
) -> None:
    value = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    path = tmp_path / "t.safetensors"
    save_file({"t": value}, path)
    with _opened(path, how) as f:
        sliced = f.get_slice("t")
        reads.clear()  # the header's
        part = sliced[index]
    np.testing.assert_array_equal(part, value[index])
    assert 0 < len(reads) <= 8, f"{len(reads)} reads"


@pytest.mark.parametrize("how", ["pread", "file object"])
def test_tiny_runs_far_apart_are_read_alone(tmp_path: Path, reads: list[int], how: str) -> None:
    # One byte every 64 KiB: reading the covering rows would be 65,536 times the bytes.
    value = np.random.default_rng(1).integers(0, 255, (64, 1 << 16), np.uint8)
    path = tmp_path / "t.safetensors"
    save_file({"t": value}, path)
    with _opened(path, how) as f:
        sliced = f.get_slice("t")
        reads.clear()
        part = sliced[:, 5]
    np.testing.assert_array_equal(part, value[:, 5])
    assert sum(reads) == 64


def test_exact_reads_take_only_the_selected_bytes(tmp_path: Path, reads: list[int]) -> None:
    value = np.arange(1000, dtype=np.int32)
    path = tmp_path / "t.safetensors"
    save_file({"t": value}, path)
    with pysafetensors.safe_open(path, "np", backend="pread", slice_reads="exact") as f:
        sliced = f.get_slice("t")
        reads.clear()
        part = sliced[::10]
    np.testing.assert_array_equal(part, value[::10])
    assert sum(reads) == 400


@pytest.mark.parametrize("framework", ["np", "pt"])
@pytest.mark.parametrize(
    "index",
    [
        (np.arange(0, 500, 7),),
        (np.arange(500) % 3 == 0,),
        (slice(None), [1, 5, 30]),
        (None, slice(2, 9), [0, 63]),
        (True, Ellipsis),
    ],
    ids=["rows", "mask", "columns", "new-axis", "true"],
)
def test_index_arrays_pick_straight_from_a_mapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, framework: str, index: tuple[Any, ...]
) -> None:
    if framework == "pt":
        pytest.importorskip("torch")
    value = np.random.default_rng(2).standard_normal((500, 64)).astype(np.float32)
    path = tmp_path / "t.safetensors"
    save_file({"t": value}, path)

    def no_copy(*args: object, **kwargs: object) -> None:
        raise AssertionError("the box was copied before picking")

    with pysafetensors.safe_open(path, framework) as f:
        sliced = f.get_slice("t")
        monkeypatch.setattr(pysafetensors.safe_open, "_read_plan", no_copy)
        part = sliced[index]
    np.testing.assert_array_equal(np.asarray(part), value[index])


def test_index_arrays_of_a_read_only_buffer_in_torch(tmp_path: Path) -> None:
    # torch cannot view a read-only buffer: the box is copied, then picked, as before.
    torch = pytest.importorskip("torch")
    value = np.arange(600, dtype=np.int16).reshape(20, 30)
    data = memoryview(pysafetensors.numpy.save({"t": value}))
    assert data.readonly
    with pysafetensors.safe_open(data, "pt") as f:
        part = f.get_slice("t")[[1, 3, 19]]
    assert torch.equal(part, torch.from_numpy(value[[1, 3, 19]]))


@pytest.mark.parametrize("framework", ["np", "pt"])
@pytest.mark.parametrize("index", [(True, Ellipsis), None, (None, None), False])
def test_index_arrays_of_a_0_d_tensor_from_a_mapping(
    tmp_path: Path, framework: str, index: Any
) -> None:
    # The box of a 0-d tensor is (): picked from an array, never from numpy's scalar.
    if framework == "pt":
        pytest.importorskip("torch")
    value = np.array(-7, np.int8)
    path = tmp_path / "t.safetensors"
    save_file({"t": value}, path)
    with pysafetensors.safe_open(path, framework) as f:
        part = f.get_slice("t")[index]
    np.testing.assert_array_equal(np.asarray(part), value[index])
    assert np.asarray(part).shape == value[index].shape


@pytest.mark.parametrize("framework", ["np", "pt"])
@pytest.mark.parametrize("source", ["mmap", "bytearray", "read-only"])
@pytest.mark.parametrize(
    "index", [None, (Ellipsis, None), (slice(None), None), (None, slice(1, 3)), ([0, 2],)]
)
def test_picks_from_a_mapping_are_private(
    tmp_path: Path, framework: str, source: str, index: Any
) -> None:
    # A pick with no index array is a view of what it picks from: copied, so that writes to
    # it change neither later reads nor the caller's buffer, and it is always writable.
    if framework == "pt":
        pytest.importorskip("torch")
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = tmp_path / "t.safetensors"
    save_file({"t": value}, path)
    data = bytearray(path.read_bytes())
    opened: Any = {"mmap": path, "bytearray": data, "read-only": memoryview(bytes(data))}[source]
    with pysafetensors.safe_open(opened, framework) as f:
        part = np.asarray(f.get_slice("t")[index])
        np.testing.assert_array_equal(part, value[index])
        if source == "read-only" and framework == "pt":
            return  # torch's tensors of a read-only buffer: as the reference's, not ours to write
        assert part.flags.writeable
        part[...] = 99
        np.testing.assert_array_equal(np.asarray(f.get_slice("t")[index]), value[index])
        np.testing.assert_array_equal(np.asarray(f.get_tensor("t")), value)
    assert bytes(data) == path.read_bytes()
