"""pysafetensors.paddle against Paddle (CPU build) and the reference's safetensors.paddle."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

if "tensorflow" in sys.modules:  # pragma: no cover - depends on test order
    # Importing paddle 3.3 after TensorFlow 2.21 crashes the interpreter (SIGSEGV).
    pytest.skip("paddle cannot be imported after tensorflow", allow_module_level=True)
paddle = pytest.importorskip("paddle")
pytest.importorskip("safetensors.paddle")

import pysafetensors.numpy as pnp  # noqa: E402
import pysafetensors.paddle as ppaddle  # noqa: E402
from pysafetensors import SafetensorError  # noqa: E402

from .cases import same_bits, sample  # noqa: E402
from .suite import FrameworkSuite  # noqa: E402

_CODES = "BOOL U8 I8 F8_E5M2 F8_E4M3 I16 F16 BF16 I32 U32 F32 C64 F64 I64 U64"
_CARRIER = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


class TestPaddle(FrameworkSuite):
    module = "paddle"
    aliases = ("paddle",)
    supported = frozenset(_CODES.split())
    # The reference's Paddle tables have no U32/U64 (and its numpy-based load has no C64).
    ref_load_file = supported - {"U32", "U64"}
    ref_load = supported - {"U32", "U64", "C64"}
    ref_save = supported - {"U32", "U64"}

    def to_fw(self, arr: np.ndarray) -> Any:
        # Built from raw bits with Paddle's own view, not through our adapter.
        bits = paddle.to_tensor(arr.view(_CARRIER[arr.dtype.itemsize]))
        return bits.view(getattr(paddle, arr.dtype.name))

    def to_np(self, tensor: Any) -> np.ndarray:
        assert isinstance(tensor, paddle.Tensor)
        from pysafetensors._adapter import numpy_dtype
        from pysafetensors._dtypes import dtype_from_name

        npdt = numpy_dtype(dtype_from_name(str(tensor.dtype).rpartition(".")[2]))
        raw = np.frombuffer(ppaddle.save({"t": tensor}), np.uint8)
        # Read the bytes back with the numpy loader: independent of Paddle's numpy() quirks.
        return pnp.load(raw.tobytes())["t"].view(npdt)


def test_u16_refused_instead_of_loaded_as_bfloat16(tmp_path: Any) -> None:
    import safetensors.paddle as ref

    path = tmp_path / "u16.safetensors"
    pnp.save_file({"x": np.arange(4, dtype=np.uint16)}, path)
    with pytest.raises(TypeError, match="U16"):
        ppaddle.load_file(path)
    # The reference's quirk (format-and-api.md §3): its mmap path loads U16 as bfloat16.
    assert ref.load_file(str(path))["x"].dtype == paddle.bfloat16


def test_non_contiguous_refused_like_the_reference() -> None:
    t = paddle.transpose(paddle.arange(6, dtype="float32").reshape([2, 3]), [1, 0])
    if t.is_contiguous():
        pytest.skip("this Paddle materializes transposes")
    with pytest.raises(ValueError, match="non contiguous"):
        ppaddle.save({"t": t})


def test_not_a_dict_or_not_a_tensor() -> None:
    with pytest.raises(ValueError, match="Expected a dict"):
        ppaddle.save([paddle.ones([1])])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected paddle.Tensor"):
        ppaddle.save({"a": np.ones(1)})


def test_devices() -> None:
    data = pnp.save({"x": sample("BF16")})
    assert ppaddle.load(data, device="cpu")["x"].place.is_cpu_place()
    if not paddle.device.is_compiled_with_cuda():
        with pytest.raises(SafetensorError, match="CUDA"):
            ppaddle.load(data, device="gpu:0")


def test_bf16_and_fp8_values() -> None:
    x = paddle.to_tensor([1.5, -2.0, 3.25], dtype="float32")
    tensors = {"bf": x.astype("bfloat16"), "e4": x.astype("float8_e4m3fn")}
    loaded = ppaddle.load(ppaddle.save(tensors))
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype
        assert loaded[name].astype("float32").tolist() == value.astype("float32").tolist()
    assert same_bits(
        np.asarray(loaded["bf"].view(paddle.int16).numpy()),
        np.asarray(tensors["bf"].view(paddle.int16).numpy()),
    )
