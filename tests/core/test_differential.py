"""Differential tests against the reference (``pip install safetensors``): identical bytes on
random dicts, and each library reads the other's files to equal tensors.

The reference is imported only here (and in the other tests' reference checks), never by the
library. Metadata has 0 or 1 key: with more, the reference's order is random (spec §2.6).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import pysafetensors
import pysafetensors.numpy as ours_np

from .malformed import kind_of_reference_message

ref = pytest.importorskip("safetensors")
ref_np = pytest.importorskip("safetensors.numpy")

# 550 random tensor dicts in all, each saved by both libraries and compared byte for byte.
N_NUMPY = 300
N_TORCH = 250

# Every numpy dtype the reference's numpy.save can express (it rejects ml_dtypes' float4/6).
NUMPY_DTYPES = [
    np.dtype(t)
    for t in (
        np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.float16, np.int32, np.uint32,
        np.float32, np.float64, np.int64, np.uint64, np.complex64, ml_dtypes.bfloat16,
        ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu,
        ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz,
    )
]  # fmt: skip

NAME_POOL = ["a", "b", "weight", "bias", "layer.0.w", "é", "", "z" * 40, '"q"', "\\", "\x01", "😀"]


def _random_shape(rng: np.random.Generator) -> tuple[int, ...]:
    ndim = int(rng.integers(0, 4))
    return tuple(int(x) for x in rng.integers(0, 5, ndim))


def _random_numpy(rng: np.random.Generator, dtype: np.dtype[Any]) -> np.ndarray:
    shape = _random_shape(rng)
    count = int(np.prod(shape, dtype=np.int64))
    raw = rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8)
    if dtype == np.bool_:
        raw &= 1
    arr = raw.view(dtype).reshape(shape)
    if rng.random() < 0.2 and arr.ndim >= 2:
        arr = np.ascontiguousarray(arr.T)  # the reference mis-writes non-contiguous input
    return arr


def _random_case(rng: np.random.Generator, make: Any, pool: list[Any]) -> tuple[dict, Any]:
    count = int(rng.integers(0, 6))
    names = list(rng.choice(NAME_POOL, size=count, replace=False)) if count else []
    tensors = {str(n): make(rng, pool[int(rng.integers(0, len(pool)))]) for n in names}
    metadata = [None, {"format": "pt"}, {"k\u00e9y": 'v"\\'}][int(rng.integers(0, 3))]
    return tensors, metadata


def _deserialized(module: Any, data: bytes) -> dict[str, tuple[str, list[int], bytes]]:
    return {
        n: (v["dtype"], list(v["shape"]), bytes(v["data"])) for n, v in module.deserialize(data)
    }


def test_numpy_identical_bytes(tmp_path: Path) -> None:
    rng = np.random.default_rng(20260501)
    seen_codes: set[str] = set()
    for i in range(N_NUMPY):
        tensors, metadata = _random_case(rng, _random_numpy, NUMPY_DTYPES)
        ours = ours_np.save(tensors, metadata=metadata)
        theirs = ref_np.save(tensors, metadata=metadata)
        assert ours == theirs, (i, tensors, metadata)
        # Each reads the other's output to the same tensors.
        assert _deserialized(ref, ours) == _deserialized(pysafetensors, theirs)
        for name, arr in ours_np.load(theirs).items():
            assert arr.dtype == tensors[name].dtype and arr.shape == tensors[name].shape
            assert arr.tobytes() == tensors[name].tobytes()
        seen_codes |= {v[0] for v in _deserialized(pysafetensors, ours).values()}
        if i % 20 == 0:
            ours_path, ref_path = tmp_path / "ours.st", tmp_path / "ref.st"
            ours_np.save_file(tensors, ours_path, metadata=metadata)
            ref_np.save_file(tensors, ref_path, metadata=metadata)
            assert ours_path.read_bytes() == ref_path.read_bytes() == ours
            with ref.safe_open(str(ours_path), "np") as f:
                assert f.metadata() == metadata
                assert f.offset_keys() == list(ours_np.load_file(ref_path))
    assert len(seen_codes) == len(NUMPY_DTYPES)


# --------------------------------------------------------------------------------------- torch

torch = pytest.importorskip("torch")
ref_pt = pytest.importorskip("safetensors.torch")
import pysafetensors.torch as ours_pt  # noqa: E402 - only when torch is installed

TORCH_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.float16,
    torch.bfloat16, torch.int32, torch.uint32, torch.float32, torch.float64, torch.int64,
    torch.uint64, torch.complex64, torch.float8_e5m2, torch.float8_e4m3fn,
    torch.float8_e8m0fnu, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.float4_e2m1fn_x2,
]  # fmt: skip


def _random_torch(rng: np.random.Generator, dtype: Any) -> Any:
    shape = _random_shape(rng)
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    size = torch.empty((), dtype=dtype).element_size()
    raw = rng.integers(0, 256, count * size, dtype=np.uint8)
    if dtype is torch.bool:
        raw &= 1
    return torch.from_numpy(raw.copy()).view(dtype).reshape(shape)


def _bytes_of(t: Any) -> Any:
    return t.reshape(-1).view(torch.uint8)


def test_torch_identical_bytes(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    refusals = 0
    for i in range(N_TORCH):
        tensors, metadata = _random_case(rng, _random_torch, TORCH_DTYPES)
        try:
            theirs = ref_pt.save(tensors, metadata=metadata)
        except ref.SafetensorError as exc:
            # e.g. a 0-d float4_e2m1fn_x2 (4 bits): both refuse, with the same variant.
            with pytest.raises(pysafetensors.SafetensorError) as info:
                ours_pt.save(tensors, metadata=metadata)
            assert info.value.kind == kind_of_reference_message(str(exc))
            refusals += 1
            continue
        ours = ours_pt.save(tensors, metadata=metadata)
        assert ours == theirs, (i, {k: (v.dtype, v.shape) for k, v in tensors.items()})
        assert _deserialized(ref, ours) == _deserialized(pysafetensors, theirs)
        for name, t in ours_pt.load(theirs).items():
            assert t.dtype == tensors[name].dtype and t.shape == tensors[name].shape
            assert torch.equal(_bytes_of(t), _bytes_of(tensors[name]))
        if i % 25 == 0:
            path = tmp_path / "ours.st"
            ours_pt.save_file(tensors, path, metadata=metadata)
            assert path.read_bytes() == ours
            back = ref_pt.load_file(str(path))
            for name, t in back.items():
                assert torch.equal(_bytes_of(t), _bytes_of(tensors[name]))
    assert refusals < N_TORCH // 10
