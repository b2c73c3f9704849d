"""Reads into memory the caller already has: ``safe_open.read_into`` (numpy, sharded
checkpoints, errors) and ``torch.load_model``, which reads a model's parameters in place."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from pysafetensors import ClosedFileError, SafetensorError, TensorNotFoundError, safe_open
from pysafetensors.numpy import save_file

from .test_partial_reads import _evict


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        # 12 MiB, more than one reader-thread part, so the parallel path runs.
        "big": rng.integers(0, 2**31, (3 << 20,), np.int32),
        "mid": rng.standard_normal((300, 70)).astype(np.float32),
        "half": rng.standard_normal((33,)).astype(ml_dtypes.bfloat16),
        "flag": rng.integers(0, 2, (17,)).astype(bool),
        "scalar": np.full((), -5, np.int64),
        "empty": np.zeros((0, 4), np.float32),
    }


@pytest.fixture
def path(tmp_path: Path) -> Path:
    p = tmp_path / "m.safetensors"
    save_file(_tensors(), p)
    return p


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("cold", [False, True])
def test_read_into_fills_arrays_of_every_kind(path: Path, backend: str, cold: bool) -> None:
    if cold:
        if not hasattr(os, "posix_fadvise"):
            pytest.skip("needs posix_fadvise")
        _evict(path)
    expected = _tensors()
    outs = {name: np.full_like(value, 1) for name, value in expected.items()}
    with safe_open(path, "np", backend=backend) as f:
        f.read_into(outs)
    for name, value in expected.items():
        assert outs[name].tobytes() == value.tobytes(), name


def test_read_into_takes_any_writable_buffer(path: Path) -> None:
    expected = _tensors()
    raw = bytearray(expected["mid"].nbytes)
    view = memoryview(bytearray(expected["big"].nbytes))
    with safe_open(path, "np") as f:
        f.read_into({"mid": raw, "big": view})
    assert bytes(raw) == expected["mid"].tobytes()
    assert view.tobytes() == expected["big"].tobytes()


def test_read_into_a_subset_leaves_the_rest(path: Path) -> None:
    out = np.zeros((300, 70), np.float32)
    with safe_open(path, "np", backend="pread") as f:
        f.read_into({"mid": out})
        assert np.array_equal(out, f.get_tensor("mid"))


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (bytearray(3), "holds 3 bytes; the tensor's data is 84000 bytes \\(F32 \\[300, 70\\]\\)"),
        (b"x" * 84000, "is read-only"),
        (np.zeros((300, 140), np.float32)[:, ::2], "is not C-contiguous"),
        (np.zeros((300, 70), np.float32).view(np.uint8)[::-1], "is not C-contiguous"),
        (object(), "is of type object, which does not expose its memory"),
        # numpy's own TypeError for these named no tensor.
        (np.empty(21000, object), "holds Python objects \\(object\\), not raw memory"),
        (np.zeros(5250, [("o", "O"), ("f", "f8")]), "holds Python objects"),
    ],
)
def test_read_into_refuses_unfit_buffers(path: Path, target: Any, message: str) -> None:
    readonly = np.zeros((300, 70), np.float32)
    readonly.flags.writeable = False
    with safe_open(path, "np") as f:
        with pytest.raises(ValueError, match=f"buffer for tensor 'mid' {message}"):
            f.read_into({"mid": target})
        with pytest.raises(ValueError, match="buffer for tensor 'mid' is read-only"):
            f.read_into({"mid": readonly})
        # Nothing was read: the checks run before any read.
        good = np.zeros(3 << 20, np.int32)
        with pytest.raises(ValueError):
            f.read_into({"big": good, "mid": target})
        assert not good.any()


def test_read_into_unknown_name_and_closed_handle(path: Path) -> None:
    f = safe_open(path, "np")
    with pytest.raises(TensorNotFoundError, match="File does not contain tensor nope"):
        f.read_into({"nope": bytearray(4)})
    f.close()
    with pytest.raises(ClosedFileError):
        f.read_into({"mid": np.zeros((300, 70), np.float32)})


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_read_into_a_file_cut_short_names_the_tensor(path: Path, backend: str) -> None:
    with safe_open(path, "np", backend=backend) as f:
        start = f.header.data_start
        info = f.header.tensors["big"]
        # Cut inside "big" after the open: the header was fine, the bytes are gone.
        os.truncate(path, start + info.begin + 1000)
        with pytest.raises(SafetensorError, match="big") as caught:
            f.read_into({"big": np.zeros(3 << 20, np.int32)})
    assert caught.value.tensor == "big"


def test_read_into_a_sharded_checkpoint(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from pysafetensors.torch import save_sharded

    rng = np.random.default_rng(3)
    arrays = {f"layer{i}.w": rng.standard_normal((256, 256)).astype(np.float32) for i in range(6)}
    save_sharded({k: torch.from_numpy(v) for k, v in arrays.items()}, tmp_path, "600KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    outs = {name: np.empty_like(value) for name, value in arrays.items()}
    with safe_open(tmp_path, "np") as f:
        f.read_into(outs)
        with pytest.raises(TensorNotFoundError):
            f.read_into({"missing": bytearray(1)})
        # Every buffer is checked before any is filled, as in one file: read shard by shard,
        # the first shard's buffers were overwritten before a later one was refused.
        first, last = np.zeros_like(arrays["layer0.w"]), bytearray(3)
        with pytest.raises(ValueError, match="buffer for tensor 'layer5.w' holds 3 bytes"):
            f.read_into({"layer0.w": first, "layer5.w": last})
        assert not first.any()
    for name, value in arrays.items():
        assert np.array_equal(outs[name], value)


def test_read_into_torch_tensors(path: Path) -> None:
    torch = pytest.importorskip("torch")
    expected = _tensors()
    big = torch.zeros(3 << 20, dtype=torch.int32)
    # Any dtype and shape of the right size: the file's bytes as they are.
    half = torch.zeros(66, dtype=torch.uint8)
    grad = torch.zeros(300, 70, requires_grad=True)
    with safe_open(path, "pt") as f:
        f.read_into({"big": big, "half": half, "mid": grad})
        with pytest.raises(ValueError, match="buffer for tensor 'mid' is not C-contiguous"):
            f.read_into({"mid": torch.zeros(70, 300).t()})
        with pytest.raises(ValueError, match="buffer for tensor 'mid' is a lazy conjugate"):
            f.read_into({"mid": torch.zeros(300, 35, dtype=torch.complex64).conj()})
    assert big.numpy().tobytes() == expected["big"].tobytes()
    assert half.numpy().tobytes() == expected["half"].tobytes()
    assert grad.detach().numpy().tobytes() == expected["mid"].tobytes()


def test_read_into_takes_a_mapping_only(path: Path) -> None:
    with safe_open(path, "np") as f:
        for wrong in ([("a", np.empty(1))], None):
            with pytest.raises(TypeError, match=r"read_into\(\) takes a mapping of tensor names"):
                f.read_into(wrong)  # type: ignore[arg-type]
