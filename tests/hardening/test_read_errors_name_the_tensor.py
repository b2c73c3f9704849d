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
