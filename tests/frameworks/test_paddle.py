"""pysafetensors.paddle against Paddle (CPU build) and the reference's safetensors.paddle."""

from __future__ import annotations

import io
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
from pysafetensors import SafetensorError, safe_open  # noqa: E402

from .cases import same_bits, sample  # noqa: E402
from .suite import FrameworkSuite  # noqa: E402

_CODES = "BOOL U8 I8 F8_E5M2 F8_E4M3 I16 U16 F16 BF16 I32 U32 F32 C64 F64 I64 U64"
_CARRIER = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


class TestPaddle(FrameworkSuite):
    module = "paddle"
    aliases = ("paddle",)
    supported = frozenset(_CODES.split())
    # The reference's Paddle tables have no U32/U64 (and its numpy-based load has no C64); it
    # loads U16 as bfloat16 (load_file) or not at all (load), and cannot save paddle.uint16.
    ref_load_file = supported - {"U16", "U32", "U64"}
    ref_load = supported - {"U16", "U32", "U64", "C64"}
    ref_save = supported - {"U16", "U32", "U64"}

    def to_fw(self, arr: np.ndarray) -> Any:
        # Built from raw bits with Paddle's own view, not through our adapter.
        bits = paddle.to_tensor(arr.view(_CARRIER[arr.dtype.itemsize]))
        return bits.view(getattr(paddle, arr.dtype.name))

    def to_np(self, tensor: Any) -> np.ndarray:
        assert isinstance(tensor, paddle.Tensor)
        from pysafetensors._adapter import numpy_dtype
        from pysafetensors._dtypes import dtype_from_name

        # By the dtype's name: str(paddle.uint16) is "paddle.bfloat16".
        npdt = numpy_dtype(dtype_from_name(tensor.dtype.name.lower()))
        raw = np.frombuffer(ppaddle.save({"t": tensor}), np.uint8)
        # Read the bytes back with the numpy loader: independent of Paddle's numpy() quirks.
        return pnp.load(raw.tobytes())["t"].view(npdt)


def test_u16_is_paddle_uint16_not_bfloat16(tmp_path: Any) -> None:
    import safetensors.paddle as ref

    path = tmp_path / "u16.safetensors"
    values = np.array([1, 2, 300, 65535], dtype=np.uint16)
    pnp.save_file({"x": values}, path)
    x = ppaddle.load_file(path)["x"]
    assert x.dtype == paddle.uint16 and x.dtype != paddle.bfloat16
    np.testing.assert_array_equal(x.numpy(), values)
    # The reference's quirk: its mmap path loads U16 as bfloat16.
    assert ref.load_file(str(path))["x"].dtype == paddle.bfloat16
    # A paddle.uint16 tensor (whose str() says paddle.bfloat16) is saved as U16, not as BF16
    # with its integer bits (the reference raises KeyError).
    data = ppaddle.save({"x": paddle.cast(paddle.to_tensor([1, 2, 300]), paddle.uint16)})
    assert b'"dtype":"U16"' in data
    np.testing.assert_array_equal(pnp.load(data)["x"], [1, 2, 300])


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


def test_type_errors_come_before_contiguity_as_in_the_reference() -> None:
    import safetensors.paddle as ref

    t = paddle.transpose(paddle.arange(6, dtype="float32").reshape([2, 3]), [1, 0])
    if t.is_contiguous():
        pytest.skip("this Paddle materializes transposes")
    tensors = {"a": t, "b": 1.0}
    with pytest.raises(ValueError, match="Key `b` is invalid"):
        ref.save(dict(tensors))
    with pytest.raises(ValueError, match="Key `b` is invalid"):
        ppaddle.save(tensors)


def test_place_objects_and_unavailable_devices() -> None:
    from pysafetensors import DeviceError

    data = pnp.save({"x": np.arange(3, dtype=np.float32)})
    x = ppaddle.load(data, device=paddle.CPUPlace())["x"]
    assert x.place.is_cpu_place()
    if not paddle.device.is_compiled_with_cuda():
        # A ValueError, as Paddle's own refusal (and the reference's) is.
        with pytest.raises(ValueError, match="without CUDA") as caught:
            ppaddle.load(data, device="gpu:0")
        assert isinstance(caught.value, DeviceError)


def test_places_paddle_cannot_use_are_device_errors_as_in_paddle() -> None:
    """mps, an unbuilt XPU, a custom device not installed: Paddle (so the reference) refuses
    them with a ValueError; ours is a DeviceError, which is one, naming the device given."""
    from pysafetensors import DeviceError

    data = pnp.save({"x": np.arange(3, dtype=np.float32)})
    for device in ("mps", "mps:0", "xpu:0", "npu:0"):
        if device.startswith("xpu") and paddle.device.is_compiled_with_xpu():
            continue
        for load in (
            lambda d=device: ppaddle.load(data, device=d),
            lambda d=device: safe_open(io.BytesIO(data), "paddle", device=d),
        ):
            with pytest.raises(ValueError, match=f"device '{device}' is not a place") as caught:
                load()
            assert isinstance(caught.value, DeviceError)


def test_flatten_is_the_reference_s_helper() -> None:
    """``_flatten(tensors, keep_alive_buffer)`` gives ``TensorSpec``s that ``serialize`` writes
    as the reference's own ``_flatten`` + ``serialize`` do, and keeps their memory alive."""
    import safetensors.paddle as ref

    from pysafetensors.paddle import _flatten, serialize

    tensors = {
        "f": paddle.arange(6, dtype="float32").reshape([2, 3]),
        "b": paddle.to_tensor([1.5, -2.0]).astype("bfloat16"),
        "i": paddle.to_tensor([[7]], dtype="int64"),
    }
    kept: list[Any] = []
    specs = _flatten(tensors, kept)
    assert set(specs) == set(tensors) and len(kept) == len(tensors)
    theirs_kept: list[Any] = []
    theirs = ref.serialize(ref._flatten(tensors, theirs_kept))
    assert bytes(serialize(specs)) == bytes(theirs) == ref.save(tensors)
    with pytest.raises(ValueError, match="Key `x` is invalid"):
        _flatten({"x": 1.0}, [])


def test_place_strings_are_read_as_paddle_reads_them() -> None:
    """In any case ("CPU" works in Paddle, so in the reference's load); an unknown one is a
    ValueError, as Paddle's refusal that the reference lets through, and a SafetensorError."""
    from pysafetensors import DeviceError

    data = pnp.save({"x": np.arange(3, dtype=np.float32)})
    for device in ("CPU", "Cpu"):
        assert ppaddle.load(data, device=device)["x"].place.is_cpu_place()
        with safe_open(io.BytesIO(data), "paddle", device=device) as f:
            assert f.get_tensor("x").place.is_cpu_place()
    for device in ("foo", "cuda:0:0", "cpu:x"):
        with pytest.raises(ValueError, match=f"device {device} is invalid") as caught:
            ppaddle.load(data, device=device)
        assert isinstance(caught.value, DeviceError)


def test_the_reference_modules_names() -> None:
    import pysafetensors
    from pysafetensors.paddle import (
        _SIZE,
        _TYPES,
        NPDTYPES,
        TensorSpec,
        _getdtype,
        _np2paddle,
        _paddle2np,
        _to_ndarray,
        _view2paddle,
        deserialize,
        numpy,
        safe_open,
        serialize,
        serialize_file,
    )

    assert safe_open is pysafetensors.safe_open and numpy is pnp
    assert serialize is pysafetensors.serialize and deserialize is pysafetensors.deserialize
    assert serialize_file is pysafetensors.serialize_file and TensorSpec is pysafetensors.TensorSpec
    assert _getdtype("BF16") == paddle.bfloat16 and _TYPES["U16"] == paddle.uint16
    assert _SIZE[paddle.float32] == 4 and NPDTYPES[paddle.bfloat16] is np.float16
    t = paddle.to_tensor([1.0, 2.0], dtype="float32")
    raw, same = _to_ndarray(t, "t")
    assert same is t and raw.tobytes() == np.array([1.0, 2.0], np.float32).tobytes()
    back = _view2paddle(deserialize(ppaddle.save({"t": t})), "cpu")
    np.testing.assert_array_equal(back["t"].numpy(), [1.0, 2.0])
    arrays = _paddle2np({"t": t})
    assert isinstance(arrays["t"], np.ndarray)
    assert isinstance(_np2paddle(arrays)["t"], paddle.Tensor)


def test_vartype_dtypes_are_named_by_their_text() -> None:
    # The VarType dtypes of static graphs (and older Paddles) are named FP32, BF16...: taking
    # .name for them refused every float; their str() is right.
    from pysafetensors._paddle_adapter import _type_name

    var_type = paddle.base.core.VarDesc.VarType
    assert _type_name(var_type.FP32) == "float32"
    assert _type_name(var_type.BF16) == "bfloat16"
    assert _type_name(paddle.uint16) == "uint16"  # whose str() says paddle.bfloat16


def test_a_dtype_safetensors_cannot_store_is_also_the_reference_s_key_error() -> None:
    import safetensors.paddle as ref_paddle

    from pysafetensors import SerializeError

    tensor = paddle.zeros([2], dtype="complex128")
    with pytest.raises(KeyError):
        ref_paddle.save({"c": tensor})
    with pytest.raises(KeyError) as info:
        ppaddle.save({"c": tensor})
    assert isinstance(info.value, SerializeError) and info.value.kind == "UnknownDtype"
    assert str(info.value) == (
        "Error while serializing: tensor `c` has dtype paddle.complex128, which safetensors "
        "cannot store"
    )


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_tensors_are_refused_naming_the_tensor(tmp_path: Any, layout: str) -> None:
    """A sparse tensor has no memory of its own (``data_ptr()`` is None): the reference fails
    inside ctypes (``ValueError: NULL pointer access``), ours was a bare ``TypeError: integer
    expected``; now a SerializeError (a ValueError too) naming it, before anything is written."""
    import safetensors.paddle as ref

    from pysafetensors import SerializeError
    from pysafetensors.paddle import _flatten

    if layout == "coo":
        sparse = paddle.sparse.sparse_coo_tensor([[0, 1], [1, 0]], [1.5, 2.0], [2, 2])
    else:
        sparse = paddle.sparse.sparse_csr_tensor([0, 1, 2], [1, 0], [1.5, 2.0], [2, 2])
    with pytest.raises(ValueError, match="NULL pointer access"):
        ref.save({"s": sparse})
    path = tmp_path / "s.safetensors"
    for save in (
        lambda: ppaddle.save({"d": paddle.ones([2]), "s": sparse}),
        lambda: ppaddle.save_file({"d": paddle.ones([2]), "s": sparse}, path),
        lambda: _flatten({"s": sparse}, []),
    ):
        with pytest.raises(SerializeError, match=r"tensor `s` is sparse; .*\.to_dense\(\)") as info:
            save()
        assert isinstance(info.value, ValueError)
        assert info.value.kind == "SparseTensor" and info.value.tensor == "s"
    assert list(tmp_path.iterdir()) == []
    dense = ppaddle.load(ppaddle.save({"s": sparse.to_dense()}))["s"]
    np.testing.assert_array_equal(dense.numpy(), [[0.0, 1.5], [2.0, 0.0]])


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_more_dimensions_than_paddle_holds_are_refused_naming_the_tensor(
    tmp_path: Any, backend: str
) -> None:
    # Paddle holds at most 9 dimensions: a tenth raised Paddle's own OSError ("Invalid
    # dimension to be accessed"), naming no tensor, from get_tensor, load_file and load.
    from pysafetensors import TensorInfoError

    path = tmp_path / "deep.safetensors"
    pnp.save_file({"deep": np.arange(6, dtype=np.float32).reshape([1] * 9 + [6])}, path)
    with safe_open(path, "paddle", backend=backend) as f:
        with pytest.raises(
            TensorInfoError, match="tensor `deep` has 10 dimensions; paddle"
        ) as info:
            f.get_tensor("deep")
        assert info.value.kind == "TooManyDimensions"
        # A slice of fewer dimensions is a tensor Paddle holds.
        assert f.get_slice("deep")[0].tolist() == [[[[[[[[[0, 1, 2, 3, 4, 5]]]]]]]]]
        # An index with None adding a dimension back (Paddle's OSError too).
        with pytest.raises(TensorInfoError, match="tensor `deep` has 10 dimensions; paddle"):
            f.get_slice("deep")[0, None]
        # Slices keeping all ten: the short paths of row slices and boxes of small tensors.
        for index in (slice(0, 1), (slice(None), slice(0, 2)), (slice(None),) * 10):
            with pytest.raises(TensorInfoError, match="tensor `deep` has 10 dimensions; paddle"):
                f.get_slice("deep")[index]
    with pytest.raises(TensorInfoError, match="tensor `deep` has 10 dimensions"):
        ppaddle.load_file(path, backend=backend)
    # Tensor-parallel loads read their parts in batches: whole, by rows, by columns.
    from pysafetensors.parallel import load_shard

    for rule in ("replicate", "rows", "columns", 8):
        with pytest.raises(TensorInfoError, match="tensor `deep` has 10 dimensions; paddle"):
            load_shard(path, 0, 2, {"deep": rule}, framework="paddle", backend=backend)
    with pytest.raises(TensorInfoError, match="tensor `deep` has 10 dimensions"):
        ppaddle.load(path.read_bytes())
