"""``get_tensor``'s short path for small tensors.

A whole-byte tensor of up to ``MIN_PARALLEL_CHUNK`` bytes read on the CPU from a file skips the
general dispatch (``safe_open._get_tensor``): one positioned read into fresh memory, or a view
of the mapping for frameworks that share it (torch under mmap). It must hand out what the
general path hands out, with the same memory semantics and the same errors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import SafetensorError, safe_open
from pysafetensors._reader import safe_open as reader_safe_open
from pysafetensors._sources import MIN_PARALLEL_CHUNK
from pysafetensors.numpy import save_file


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    per_row = 1000 * 4  # float32 rows of 1000
    return {
        "scalar": np.array(3.5, np.float32),
        "bool": rng.integers(0, 2, (7, 3)).astype(np.bool_),
        "u8": rng.integers(0, 256, 33).astype(np.uint8),
        "i64": rng.integers(-(2**62), 2**62, (4, 5)),
        "f16": rng.standard_normal((2, 3, 4)).astype(np.float16),
        "c64": (rng.standard_normal(6) + 1j * rng.standard_normal(6)).astype(np.complex64),
        # Right at the bound (short path) and one row past it (general path).
        "at_bound": rng.standard_normal((MIN_PARALLEL_CHUNK // per_row, 1000)).astype(np.float32),
        "past_bound": rng.standard_normal((MIN_PARALLEL_CHUNK // per_row + 1, 1000)).astype(
            np.float32
        ),
        "empty": np.zeros((0, 4), np.float32),
        "deep": np.arange(2, dtype=np.int8).reshape((1,) * 40 + (2,)),
    }


def _as_numpy(value: Any) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else value.numpy()


@pytest.mark.parametrize("backend", ["pread", "mmap"])
@pytest.mark.parametrize("framework", ["np", "pt"])
def test_small_tensors_by_the_short_path_equal_the_general_one(
    tmp_path: Path, backend: str, framework: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if framework == "pt":
        pytest.importorskip("torch")
    tensors = _tensors()
    path = tmp_path / "small.safetensors"
    save_file(tensors, path)
    general: list[str] = []
    real = reader_safe_open._get_tensor

    def spy(self: reader_safe_open, source: Any, name: str) -> Any:
        general.append(name)
        return real(self, source, name)

    monkeypatch.setattr(reader_safe_open, "_get_tensor", spy)
    with safe_open(path, framework, backend=backend) as f:
        everything = f.get_tensors()  # another path altogether (one read or one mapping)
        for name, value in tensors.items():
            got = f.get_tensor(name)
            array = _as_numpy(got)
            assert array.dtype == value.dtype and array.shape == value.shape, name
            np.testing.assert_array_equal(array, value)
            np.testing.assert_array_equal(_as_numpy(everything[name]), value)
            if framework == "pt":
                assert got.dtype == everything[name].dtype and got.shape == everything[name].shape
            if array.size and (framework == "np" or backend == "pread"):
                # Fresh memory of this call's own: an edit does not show in the next read.
                array.reshape(-1)[0] = array.reshape(-1)[-1] + 1 if array.dtype != bool else 1
                np.testing.assert_array_equal(_as_numpy(f.get_tensor(name)), value)
    # Only what the short path leaves: more than MIN_PARALLEL_CHUNK bytes, or no bytes.
    assert sorted(set(general)) == ["empty", "past_bound"]


def test_torch_tensors_under_mmap_view_the_mapping_as_before(tmp_path: Path) -> None:
    """torch shares the handle's mapping (as the reference does): a small tensor too."""
    torch = pytest.importorskip("torch")
    path = tmp_path / "small.safetensors"
    save_file({"a": np.arange(8, dtype=np.float32), "b": np.arange(3, dtype=np.int16)}, path)
    with safe_open(path, "pt") as f:
        first = f.get_tensor("a")
        second = f.get_tensor("a")
        assert first.data_ptr() == second.data_ptr()  # the same mapped bytes, no copy
        assert torch.equal(first, torch.arange(8, dtype=torch.float32))


def test_bf16_and_fp8_small_tensors(tmp_path: Path) -> None:
    """ml_dtypes element types through the short path, both frameworks."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    torch = pytest.importorskip("torch")
    values = {
        "bf16": np.arange(12, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(3, 4),
        "f8": np.linspace(-2, 2, 10).astype(ml_dtypes.float8_e4m3fn),
    }
    path = tmp_path / "ml.safetensors"
    save_file(values, path)
    for backend in ("pread", "mmap"):
        with safe_open(path, "np", backend=backend) as f:
            for name, value in values.items():
                got = f.get_tensor(name)
                assert got.dtype == value.dtype
                np.testing.assert_array_equal(got.view(np.uint8), value.view(np.uint8))
        with safe_open(path, "pt", backend=backend) as f:
            assert f.get_tensor("bf16").dtype == torch.bfloat16
            assert f.get_tensor("f8").dtype == torch.float8_e4m3fn
            np.testing.assert_array_equal(
                f.get_tensor("bf16").view(torch.int16).numpy(), values["bf16"].view(np.int16)
            )


@pytest.mark.parametrize("backend", ["pread", "mmap"])
@pytest.mark.parametrize("framework", ["np", "pt"])
def test_small_tensor_of_a_truncated_file_names_the_tensor(
    tmp_path: Path, backend: str, framework: str
) -> None:
    """A file cut short after the open: the error is the general path's (ShortRead by pread,
    FileTruncated for a mapped file, which a view of it would crash on), naming the tensor."""
    if framework == "pt":
        pytest.importorskip("torch")
    path = tmp_path / "cut.safetensors"
    save_file(
        {"first": np.arange(16, dtype=np.int64), "last": np.arange(100, dtype=np.float32)}, path
    )
    with safe_open(path, framework, backend=backend) as f:
        start = f.header.data_start + f.header.tensors["last"].begin
        os.truncate(path, start + 40)
        with pytest.raises(SafetensorError) as info:
            f.get_tensor("last")
        assert info.value.kind == ("ShortRead" if backend == "pread" else "FileTruncated")
        assert info.value.tensor == "last"
        assert info.value.offset == start + 40
        assert "last" in str(info.value)
        np.testing.assert_array_equal(_as_numpy(f.get_tensor("first")), np.arange(16))


@pytest.mark.parametrize("backend", ["pread", "mmap"])
def test_short_path_keeps_the_handles_checks(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "s.safetensors"
    save_file({"a": np.arange(4, dtype=np.int32)}, path)
    f = safe_open(path, "np", backend=backend)
    with pytest.raises(SafetensorError, match="File does not contain tensor b"):
        f.get_tensor("b")
    with pytest.raises(TypeError):
        f.get_tensor(1)  # type: ignore[arg-type]
    f.close()
    with pytest.raises(SafetensorError, match="File is closed"):
        f.get_tensor("a")


def _every_whole_byte_dtype(path: Path) -> dict[str, str]:
    """A file of one small tensor of each whole-byte dtype, random bytes (written as a header
    and bytes: numpy has no type for some of them). Returns name -> dtype code."""
    from pysafetensors._dtypes import DTYPES

    rng = np.random.default_rng(11)
    header: dict[str, Any] = {}
    data = bytearray()
    for dtype in DTYPES:
        if dtype.packed:
            continue
        size = dtype.bits // 8
        shape = [3, 5, 2]
        raw = rng.integers(0, 256, 30 * size, dtype=np.uint8)
        if dtype.code == "BOOL":
            raw %= 2
        header[dtype.code.lower()] = {
            "dtype": dtype.code,
            "shape": shape,
            "data_offsets": [len(data), len(data) + raw.nbytes],
        }
        data += raw.tobytes()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(data))
    return {name: entry["dtype"] for name, entry in header.items()}


@pytest.mark.parametrize("backend", ["pread", "mmap"])
@pytest.mark.parametrize("framework", ["np", "pt"])
def test_fresh_array_reads_of_every_dtype_match_the_file(
    tmp_path: Path, backend: str, framework: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read straight into a fresh array of the tensor's shape (numpy; torch by pread)
    hands out the file's bytes as the general path types and shapes them, in memory of its
    own: C-contiguous, writable, a torch storage of exactly the tensor's bytes."""
    if framework == "pt":
        torch = pytest.importorskip("torch")
    path = tmp_path / "dtypes.safetensors"
    codes = _every_whole_byte_dtype(path)
    file_bytes = path.read_bytes()
    other_reads: list[str] = []
    real = reader_safe_open._small

    def spy(self: reader_safe_open, source: Any, info: Any) -> Any:
        other_reads.append(info.name)
        return real(self, source, info)

    monkeypatch.setattr(reader_safe_open, "_small", spy)
    with safe_open(path, framework, backend=backend) as f:
        start = f.header.data_start
        for name in codes:
            try:
                general = f.get_slice(name)[...]  # the general path's dtype and shape
            except SafetensorError as exc:  # a dtype this framework or ml_dtypes lacks
                with pytest.raises(SafetensorError) as same:
                    f.get_tensor(name)
                assert same.value.kind == exc.kind
                continue
            got = f.get_tensor(name)
            info = f.header.tensors[name]
            want = file_bytes[start + info.begin : start + info.end]
            if framework == "pt":
                assert got.dtype == general.dtype and got.shape == general.shape, name
                assert got.is_contiguous()
                assert got.untyped_storage().nbytes() == len(want), name
                raw = got.view(torch.uint8).numpy() if got.dtype != torch.bool else got.numpy()
            else:
                assert got.dtype == general.dtype and got.shape == general.shape, name
                assert got.flags.c_contiguous and got.flags.writeable and got.flags.owndata
                raw = got
            assert raw.tobytes() == want, name
    fresh = framework == "np" or backend == "pread"
    assert other_reads == ([] if fresh else list(codes))
