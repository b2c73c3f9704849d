"""``hash`` and ``validate --strict`` read a file one chunk at a time through one buffer, and
look at values in ~1 MiB pieces: memory stays near one chunk whatever the file's size."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import peak_growth_kib
from pysafetensors.numpy import save_file

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("memory") / "model.safetensors"
    # 160 MiB: F32 tensors of several 24 MiB chunks (one with a NaN, so that its chunks take
    # the exact count), a BF16 one, small ones.
    tensors = {f"w{i}": np.ones((2048, 4096 + i), np.float32) for i in range(4)}
    tensors["w0"][1000, 7] = np.nan
    tensors["h"] = np.ones((4096, 4096), np.float16)
    tensors.update({f"b{i}": np.ones(100 + i, np.float32) for i in range(20)})
    save_file(tensors, path)
    return path


@pytest.mark.parametrize("command", [["hash"], ["validate", "--strict"]])
def test_one_chunk_at_a_time(model: Path, command: list[str]) -> None:
    setup = """
        import contextlib, os
        from pysafetensors._cli import main
    """
    action = f"""
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            main(["-q", *{command!r}, sys.argv[1]])
    """
    grew = peak_growth_kib(setup, action, str(model))
    # One 24 MiB read buffer and ~1 MiB masks: 24-27 MiB measured. A buffer per tensor (the
    # previous tensor's still held while the next was made) and masks of whole chunks: 49 MiB
    # (hash) and 87 MiB (validate --strict).
    assert grew < 36 * 1024, f"grew by {grew} KiB"
