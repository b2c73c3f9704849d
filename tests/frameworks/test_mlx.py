"""pysafetensors.mlx against MLX (CPU build) and the reference's safetensors.mlx."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("safetensors.mlx")

import pysafetensors.mlx as pmlx  # noqa: E402
import pysafetensors.numpy as pnp  # noqa: E402

from .cases import same_bits, sample  # noqa: E402
from .suite import FrameworkSuite  # noqa: E402

_CODES = "BOOL U8 I8 I16 U16 F16 BF16 I32 U32 F32 C64 F64 I64 U64"

#: Unsigned carriers by width: the tests read MLX bits without going through our adapter.
_UINT = {1: ("uint8", np.uint8), 2: ("uint16", np.uint16), 4: ("uint32", np.uint32)}
_UINT[8] = ("uint64", np.uint64)


class TestMlx(FrameworkSuite):
    module = "mlx"
    aliases = ("mlx",)
    supported = frozenset(_CODES.split())
    # The reference narrows F64 to float32 when loading into MLX.
    ref_load_file = supported - {"F64"}
    ref_load = supported - {"F64", "BF16"}
    # The reference converts with np.asarray, which fails for MLX bfloat16.
    ref_save = supported - {"BF16"}

    def to_fw(self, arr: np.ndarray) -> Any:
        mx_name, np_uint = _UINT[arr.dtype.itemsize]
        bits = mx.array(arr.view(np_uint))
        target = getattr(mx, arr.dtype.name, None) or getattr(mx, arr.dtype.name + "_")
        return bits.view(target)

    def to_np(self, tensor: Any) -> np.ndarray:
        assert isinstance(tensor, mx.array)
        from pysafetensors._adapter import numpy_dtype
        from pysafetensors._dtypes import dtype_from_name

        name = str(tensor.dtype).rpartition(".")[2].rstrip("_")
        npdt = numpy_dtype(dtype_from_name(name))
        mx_name, np_uint = _UINT[npdt.itemsize]
        return np.asarray(tensor.view(getattr(mx, mx_name))).view(npdt)


def test_f64_kept_where_the_reference_narrows(tmp_path: Any) -> None:
    import safetensors.mlx as ref

    arr = np.array([1e300, 1 / 3], np.float64)
    path = tmp_path / "t.safetensors"
    pnp.save_file({"x": arr}, path)
    assert pmlx.load_file(path)["x"].dtype == mx.float64
    assert ref.load_file(str(path))["x"].dtype == mx.float32


def test_float8_refused_with_a_pointer_to_numpy() -> None:
    with pytest.raises(TypeError, match="framework='numpy'"):
        pmlx.load(pnp.save({"x": sample("F8_E4M3")}))


def test_bf16_values() -> None:
    x = mx.array([1.5, -2.0, 3.25], dtype=mx.bfloat16)
    y = pmlx.load(pmlx.save({"x": x}))["x"]
    assert y.dtype == mx.bfloat16
    assert mx.array_equal(x, y).item()
    assert same_bits(np.asarray(y.view(mx.uint16)), np.asarray(x.view(mx.uint16)))


def test_readable_by_mx_load(tmp_path: Any) -> None:
    path = tmp_path / "t.safetensors"
    x = {"a": mx.arange(6).reshape(2, 3), "b": mx.ones((2,), dtype=mx.bfloat16)}
    pmlx.save_file(x, path)
    got = mx.load(str(path))
    assert mx.array_equal(got["a"], x["a"]).item()
    assert got["b"].dtype == mx.bfloat16


def test_save_takes_other_frameworks_arrays_as_the_reference() -> None:
    import safetensors.mlx as ref

    torch = pytest.importorskip("torch")
    for make in (lambda: torch.arange(3, dtype=torch.float32), lambda: range(4), lambda: 2.5):
        assert pmlx.save({"a": make()}) == ref.save({"a": make()})


def test_the_reference_modules_names() -> None:
    import pysafetensors
    from pysafetensors.mlx import _mx2np, _np2mx, numpy, safe_open

    assert safe_open is pysafetensors.safe_open and numpy is pnp
    arrays = _np2mx({"a": np.ones(2, np.float32)})
    assert isinstance(arrays["a"], mx.array)
    assert isinstance(_mx2np(arrays)["a"], np.ndarray)


def test_views_are_saved_in_row_major_order() -> None:
    # The reference writes an mx.array's raw memory: a transpose comes out in the wrong order,
    # a broadcast or reversed array with heap bytes past it.
    base = mx.arange(12, dtype=mx.float32).reshape(3, 4)
    views = {
        "transposed": base.T,
        "strided": base[:, ::2],
        "reversed": base[::-1],
        "broadcast": mx.broadcast_to(mx.array([1.0, 2.0]), (3, 2)),
    }
    loaded = pnp.load(pmlx.save(views))
    for name, view in views.items():
        np.testing.assert_array_equal(loaded[name], np.asarray(view), err_msg=name)
