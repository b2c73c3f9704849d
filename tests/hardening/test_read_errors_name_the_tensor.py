"""A read that fails below the format layer (file cut short, server error) names the tensor."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from pysafetensors import SafetensorError, safe_open
from pysafetensors.numpy import save_file


def test_a_file_cut_short_after_open_names_the_tensor_being_read(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(1000, np.float32), "b": np.ones(1000, np.float32)}, path)
    with safe_open(path, "np", backend="pread") as f:
        with open(path, "r+b") as fh:
            fh.truncate(os.path.getsize(path) - 100)  # into the last tensor
        last = f.offset_keys()[-1]
        with pytest.raises(SafetensorError) as info:
            f.get_tensor(last)
        assert info.value.tensor == last
        assert f"reading tensor {last!r}" in str(info.value)
        with pytest.raises(SafetensorError) as info:
            f.get_slice(last)[10:]
        assert info.value.tensor == last
        with pytest.raises(SafetensorError) as info:
            f.get_tensors()
        # The whole-buffer read names the tensor holding the offset where it stopped.
        assert info.value.tensor == last


@pytest.mark.parametrize("backend", ["pread", "mmap"])
def test_an_io_error_names_the_file_the_bytes_and_the_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    # A disk or network file system failing a read (EIO) gave a bare OSError naming nothing.
    import errno
    import pickle

    from pysafetensors import ReadError

    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(1000, np.float32), "b": np.ones(3 << 20, np.float32)}, path)
    real = os.preadv

    def failing(fd: int, buffers: list[memoryview], offset: int, *args: int) -> int:
        if offset >= 8 + 128:  # past the header: every tensor read fails
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset, *args)

    with safe_open(path, "np", backend=backend) as f:
        monkeypatch.setattr(os, "preadv", failing)
        for name in ("a", "b"):
            with pytest.raises(ReadError) as info:
                f.get_tensor(name)
            error = info.value
            assert isinstance(error, SafetensorError) and isinstance(error, OSError)
            assert error.errno == errno.EIO and error.filename == str(path)
            assert error.tensor == name and error.kind == "IoError"
            assert str(path) in str(error) and f"reading tensor {name!r}" in str(error)
        if backend == "pread":  # (under mmap, slices are copied out of the mapping)
            with pytest.raises(ReadError) as info:
                f.get_slice("b")[10:20]
            assert info.value.tensor == "b"
        with pytest.raises(ReadError) as info:
            f.get_tensors()
        copy = pickle.loads(pickle.dumps(info.value))
        assert type(copy) is ReadError and copy.errno == errno.EIO and str(copy) == str(info.value)
        assert (copy.tensor, copy.offset) == (info.value.tensor, info.value.offset)
        assert copy.tensor is not None and copy.offset is not None
