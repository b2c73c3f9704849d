"""Round trips over every dtype, shape and name, through every way of reading (hypothesis)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pysafetensors import safe_open
from pysafetensors._dtypes import DTYPES
from pysafetensors.numpy import load, load_file, save, save_file

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def numpy_dtype_of(code: str) -> np.dtype[Any]:
    d = next(d for d in DTYPES if d.code == code)
    assert d.numpy is not None
    return np.dtype(getattr(ml_dtypes, d.numpy, None) or d.numpy)


CODES = [d.code for d in DTYPES]
# Names: anything encodable (lone surrogates cannot be UTF-8), the reserved name excluded.
names = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12).filter(
    lambda s: s != "__metadata__"
) | st.sampled_from(["", '"', "\\", "\x00\x01\n\t", "a/b.c", "\u2028", "😀", "\x7f"])
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@st.composite
def numpy_tensors(draw: Any) -> np.ndarray:
    code = draw(st.sampled_from(CODES))
    shape = draw(shapes)
    d = next(d for d in DTYPES if d.code == code)
    count = int(np.prod(shape, dtype=np.int64))
    if d.packed:
        # F4 needs an even count, F6 a multiple of 4: grow the last dimension until it fits.
        multiple = 2 if d.bits == 4 else 4
        if count % multiple:
            shape = (*shape[:-1], shape[-1] * multiple) if shape else (multiple,)
            count = int(np.prod(shape, dtype=np.int64))
        codes = draw(st.binary(min_size=count, max_size=count))
        mask = (1 << d.bits) - 1
        raw = np.frombuffer(bytes(b & mask for b in codes), np.uint8)
        return raw.view(numpy_dtype_of(code)).reshape(shape)
    npdt = numpy_dtype_of(code)
    raw = draw(st.binary(min_size=count * npdt.itemsize, max_size=count * npdt.itemsize))
    # Raw random bytes: NaNs, infinities, BOOL bytes other than 0/1 all travel unchanged.
    return np.frombuffer(raw, np.uint8).view(npdt).reshape(shape)


tensor_dicts = st.dictionaries(names, numpy_tensors(), max_size=5)
metadatas = st.none() | st.dictionaries(names, names, max_size=3)


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def _same_dict(expected: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    assert set(got) == set(expected)
    for name, arr in expected.items():
        _same(arr, got[name])


@SETTINGS
@given(tensors=tensor_dicts, metadata=metadatas)
def test_numpy_round_trip(tensors: dict[str, np.ndarray], metadata: Any, tmp_path: Path) -> None:
    data = save(tensors, metadata=metadata)
    _same_dict(tensors, load(data))
    _same_dict(tensors, load(bytearray(data)))
    path = tmp_path / "f.safetensors"
    save_file(tensors, path, metadata=metadata)
    assert path.read_bytes() == data
    for backend in ("mmap", "pread"):
        _same_dict(tensors, load_file(path, backend=backend))
        with safe_open(path, "np", backend=backend) as f:
            assert f.metadata() == metadata
            assert f.keys() == sorted(tensors)
            for name in tensors:
                _same(tensors[name], f.get_tensor(name))
    with open(path, "rb") as fh, safe_open(fh, "np") as f:
        _same_dict(tensors, f.get_tensors())
    with safe_open(io.BytesIO(data), "np") as f:
        _same_dict(tensors, f.get_tensors())
        assert f.metadata() == metadata


# --------------------------------------------------------------------------------------- torch

torch = pytest.importorskip("torch")

TORCH_DTYPES = [
    getattr(torch, d.torch) for d in DTYPES if d.torch is not None and hasattr(torch, d.torch)
]


@st.composite
def torch_tensors(draw: Any) -> Any:
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(shapes)
    if dtype is torch.float4_e2m1fn_x2 and not shape:
        shape = (1,)  # a 0-d float4 pair is 4 bits of F4 []: refused by both libraries
    count = int(np.prod(shape, dtype=np.int64))
    size = torch.empty((), dtype=dtype).element_size()
    if dtype is torch.bool:
        raw = draw(st.lists(st.integers(0, 1), min_size=count, max_size=count))
        return torch.tensor(raw, dtype=torch.bool).reshape(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    raw = bytearray(draw(st.binary(min_size=count * size, max_size=count * size)))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()


def _same_torch(a: Any, b: Any) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@SETTINGS
@given(tensors=st.dictionaries(names, torch_tensors(), max_size=5), metadata=metadatas)
def test_torch_round_trip(tensors: dict[str, Any], metadata: Any, tmp_path: Path) -> None:
    from pysafetensors.torch import load as tload
    from pysafetensors.torch import load_file as tload_file
    from pysafetensors.torch import save as tsave
    from pysafetensors.torch import save_file as tsave_file

    data = tsave(tensors, metadata=metadata)
    got = tload(data)
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        _same_torch(t, got[name])
    path = tmp_path / "t.safetensors"
    tsave_file(tensors, path, metadata=metadata)
    assert path.read_bytes() == data
    for backend in ("mmap", "pread"):
        got = tload_file(path, backend=backend)
        for name, t in tensors.items():
            _same_torch(t, got[name])
    with safe_open(io.BytesIO(data), "pt") as f:
        for name, t in tensors.items():
            _same_torch(t, f.get_tensor(name))


def test_torch_f4_logical_shape() -> None:
    """float4_e2m1fn_x2 [2, 3] (storage) is F4 [2, 6] (logical) in the header."""
    from pysafetensors.torch import load, save

    t = torch.arange(6, dtype=torch.uint8).view(torch.float4_e2m1fn_x2).reshape(2, 3)
    data = save({"x": t})
    assert b'"shape":[2,6]' in data
    with safe_open(io.BytesIO(data), "np") as f:
        unpacked = f.get_tensor("x")
    assert unpacked.shape == (2, 6)
    # Low nibble first (see docs/differences.md): byte 0x01 -> codes 1, 0.
    assert unpacked.view(np.uint8).reshape(-1)[:4].tolist() == [0, 0, 1, 0]
    _same_torch(t, load(data)["x"])


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_load_of_bytes_is_a_private_copy_made_in_parallel(framework: str) -> None:
    """``load(data)`` copies the data into memory of its own (by the reader threads, for
    bodies over a few MiB): the tensors equal the input's, are writable, and neither an edit
    of the input afterwards nor one of a tensor shows in the other."""
    from pysafetensors import numpy as st_numpy

    rng = np.random.default_rng(31)
    tensors = {
        "big": rng.standard_normal((3000, 1024)).astype(np.float32),  # 12 MiB: parallel copy
        "odd": rng.integers(0, 255, 4099).astype(np.uint8),
        "tail": rng.standard_normal(7).astype(np.float64),
    }
    data = bytearray(st_numpy.save(tensors))
    if framework == "pt":
        torch = pytest.importorskip("torch")
        from pysafetensors import torch as st_torch

        loaded = {k: v.numpy() for k, v in st_torch.load(data).items()}
        assert all(isinstance(v, torch.Tensor) for v in st_torch.load(bytes(data)).values())
    else:
        loaded = st_numpy.load(data)
    for name, value in tensors.items():
        np.testing.assert_array_equal(loaded[name], value)
        assert loaded[name].flags.writeable
    data[-8:] = bytes(8)  # the input edited: the loaded tensors keep their values
    data[len(data) // 2] ^= 0xFF
    for name, value in tensors.items():
        np.testing.assert_array_equal(loaded[name], value)
    before = bytes(data)
    loaded["big"][0, 0] = 123.0  # a tensor edited: the input is unchanged
    assert bytes(data) == before
