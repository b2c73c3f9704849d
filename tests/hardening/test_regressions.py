"""One test per bug the fuzzers found (see fuzz/RESULTS.md), with the minimised input."""

from __future__ import annotations

import importlib
import json
import struct
from pathlib import Path
from typing import Any

import _harness  # noqa: I001 - lives in fuzz/, put on sys.path by conftest
import numpy as np
import pytest

from pysafetensors import SafetensorError, TensorInfoError, safe_open, serialize


def _file(header: Any, body: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


# Found by fuzz_safe_open: a zero-size tensor may declare any dimensions, and numpy/torch then
# raised ValueError ("array is too big", "maximum supported dimension") or RuntimeError
# ("Stride calculation overflowed") from get_tensor/get_tensors/get_slice.
UNREPRESENTABLE = [
    ([0, 2**62], "F32", "ShapeTooLarge"),  # torch holds it: its strides count elements
    ([0, 2**63, 2], "F32", "ShapeTooLarge"),
    ([0, 2**64 - 1], "U8", "ShapeTooLarge"),
    ([0] + [2] * 100, "U8", "TooManyDimensions"),
]


@pytest.mark.parametrize(("shape", "dtype", "kind"), UNREPRESENTABLE)
@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("framework", ["np", "pt"])
def test_zero_size_tensor_with_unrepresentable_shape(
    tmp_path: Path, shape: list[int], dtype: str, kind: str, backend: str, framework: str
) -> None:
    if framework == "pt":
        pytest.importorskip("torch")
    path = tmp_path / "f.safetensors"
    path.write_bytes(_file({"t": {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}}))
    if framework == "pt" and shape == [0, 2**62]:
        return  # test_torch_holds_what_its_strides_can_count
    # Whole-file loads from bytes refuse the same way (not numpy's or torch's own errors).
    load_bytes = importlib.import_module(
        "pysafetensors.torch" if framework == "pt" else "pysafetensors.numpy"
    ).load
    with pytest.raises(TensorInfoError) as refused:
        load_bytes(path.read_bytes())
    assert refused.value.kind == kind and refused.value.tensor == "t"
    with safe_open(path, framework, backend=backend) as f:
        assert f.keys() == ["t"]  # the header is valid; only materialising is refused
        for call in (lambda: f.get_tensor("t"), f.get_tensors):
            with pytest.raises(TensorInfoError) as info:
                call()
            assert info.value.kind == kind
            assert info.value.tensor == "t"


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_torch_holds_what_its_strides_can_count(tmp_path: Path, backend: str) -> None:
    """torch's strides count elements, numpy's bytes: a float32 ``[0, 2**62]`` fits torch's
    63 bits (the reference's torch loads it), not numpy's. It was refused for torch too, so
    a file ``convert`` wrote from a checkpoint torch.load reads did not load back."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as reference_load_file

    from pysafetensors.parallel import load_shard
    from pysafetensors.torch import load, load_file

    path = tmp_path / "f.safetensors"
    shape = [0, 2**62]
    path.write_bytes(_file({"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}))
    want = reference_load_file(path)["t"]
    assert list(want.shape) == shape
    loaded = [load_file(path, backend=backend)["t"], load(path.read_bytes())["t"]]
    with safe_open(path, "pt", backend=backend) as f:
        loaded += [f.get_tensor("t"), f.get_tensors()["t"]]
        for tensor in loaded:
            assert tensor.shape == want.shape and tensor.dtype == torch.float32
        # Slices, basic and advanced, as torch's own indexing of the tensor gives them (found
        # by fuzz_safe_open_torch once whole loads worked: slices were still refused).
        sl = f.get_slice("t")
        for index in [
            slice(None),
            slice(1, 1),
            (slice(None), slice(None, 3)),
            (slice(None), slice(None, None, 2)),
            (slice(None), slice(5, None)),
            [],
            None,
            (None, slice(1, -1)),
            torch.zeros(0, dtype=torch.bool),
            torch.zeros(0, dtype=torch.int64),
        ]:
            assert sl[index].shape == want[index].shape, index
    parts = load_shard(path, 0, 2, {"t": "columns"}, framework="pt", backend=backend)
    assert list(parts["t"].shape) == [0, 2**61]


def test_zero_size_tensor_with_huge_dims_can_still_be_sliced_to_something_small(
    tmp_path: Path,
) -> None:
    path = tmp_path / "f.safetensors"
    path.write_bytes(_file({"t": {"dtype": "F32", "shape": [0, 2**62], "data_offsets": [0, 0]}}))
    with safe_open(path, "np") as f:
        assert f.get_slice("t")[:, :5].shape == (0, 5)
        with pytest.raises(TensorInfoError):
            f.get_slice("t")[...]


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_one_byte_tensor_with_10000_dimensions(tmp_path: Path, backend: str) -> None:
    """Refused at a 64-dimension cap, in constant time."""
    path = tmp_path / "f.safetensors"
    path.write_bytes(
        _file({"t": {"dtype": "U8", "shape": [1] * 10_000, "data_offsets": [0, 1]}}, b"x")
    )
    with safe_open(path, "np", backend=backend) as f:
        for call in (lambda: f.get_tensor("t"), lambda: f.get_slice("t")[0]):
            with pytest.raises(TensorInfoError, match="10000 dimensions"):
                call()


def test_64_dimensions_still_load(tmp_path: Path) -> None:
    path = tmp_path / "f.safetensors"
    path.write_bytes(_file({"t": {"dtype": "U8", "shape": [1] * 64, "data_offsets": [0, 1]}}, b"x"))
    with safe_open(path, "np") as f:
        assert f.get_tensor("t").ndim == 64


# Found by fuzz_streaming: a declared zero-size tensor with a dimension >= 2^64 passed the
# writer's size checks (the product is 0) and produced a file no reader accepts.
def test_writer_refuses_dimensions_of_2_pow_64(tmp_path: Path) -> None:
    # The older dict form checks its shape as TensorSpec does (the reference's binding words).
    with pytest.raises(OverflowError, match="int too big to convert \\(tensor `t`\\)"):
        serialize({"t": {"dtype": "float32", "shape": [0, 2**64], "data": b""}})
    from pysafetensors._streaming import StreamingWriter

    target = tmp_path / "s.safetensors"
    with pytest.raises(SafetensorError):
        StreamingWriter(target, {"t": ("F32", (2, 1, 0, 10**30))})
    assert list(tmp_path.iterdir()) == []


def test_writer_accepts_the_largest_u64_dimension(tmp_path: Path) -> None:
    data = serialize({"t": {"dtype": "float32", "shape": [0, 2**64 - 1], "data": b""}})
    assert _harness.differential(data) is None


# Found by fuzz_differential (fixed in _format by its owner before this suite landed): with a
# repeated tensor name the reference validates every occurrence, not only the last.
def test_repeated_name_with_an_invalid_earlier_entry() -> None:
    from pysafetensors import deserialize

    header = (
        b'{"t":{"dtype":"U8","shape":[4],"drejectfsets":[0,4]},'
        b'"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    )
    data = _harness.frame(header, bytes(4))
    assert _harness.differential(data) is None
    with pytest.raises(SafetensorError):
        deserialize(data)


def test_numpy_bool_normalisation_is_not_a_slice_bug(tmp_path: Path) -> None:
    """A harness false positive, kept as a test: BOOL bytes other than 0/1 survive slicing."""
    path = tmp_path / "b.safetensors"
    path.write_bytes(_file({"t": {"dtype": "BOOL", "shape": [], "data_offsets": [0, 1]}}, b"\x03"))
    with safe_open(path, "np") as f:
        assert f.get_slice("t")[()].view(np.uint8) == 3
        assert f.get_tensor("t").view(np.uint8) == 3


def _path_calls(ok: Path) -> dict[str, Any]:
    """Every entry point taking a path, as ``name: (call taking the path, writes?)``."""
    import pysafetensors as ps
    from pysafetensors.convert import convert_file, convert_folder
    from pysafetensors.scan import scan_file

    one = {"a": np.ones(2, np.float32)}
    spec = {"a": ("F32", [2])}
    return {
        "save_sharded": (lambda p: ps.save_sharded(one, p), True),
        "ShardedStreamingWriter": (lambda p: ps.ShardedStreamingWriter(p, spec), True),
        "StreamingWriter": (lambda p: ps.StreamingWriter(p, spec), True),
        "reshard output": (lambda p: ps.reshard(ok, p), True),
        "merge output": (lambda p: ps.merge(ok, p), True),
        "extract output": (lambda p: ps.extract(ok, p, ["a"]), True),
        "convert_file dst": (lambda p: convert_file(ok.parent / "ck.pt", p), True),
        "reshard source": (lambda p: ps.reshard(p, ok.parent / "out"), False),
        "edit_metadata": (lambda p: ps.edit_metadata(p, {"k": "v"}), False),
        "convert_file src": (lambda p: convert_file(p, ok.parent / "out.safetensors"), False),
        "convert_folder src": (lambda p: convert_folder(p, ok.parent / "outdir"), False),
        "scan_file": (lambda p: scan_file(p), False),
    }


@pytest.mark.parametrize("entry", list(_path_calls(Path("x"))))
def test_every_path_argument_is_checked_as_a_path(tmp_path: Path, entry: str) -> None:
    # A NUL in a path was a bare ValueError ("embedded null byte") that neither
    # `except OSError` nor `except SafetensorError` catches; a value that is no path, the
    # os.fspath TypeError without the argument's name.
    from pysafetensors import WriteError
    from pysafetensors.numpy import save_file

    torch = pytest.importorskip("torch")
    ok = tmp_path / "ok.safetensors"
    save_file({"a": np.ones(2, np.float32)}, ok)
    torch.save({"a": torch.ones(2)}, tmp_path / "ck.pt")
    call, writes = _path_calls(ok)[entry]
    bad = str(tmp_path / "a\x00b")
    expected: type[Exception] = WriteError if writes else FileNotFoundError
    with pytest.raises(expected, match="NUL|Invalid argument"):
        call(bad)
    with pytest.raises(TypeError, match=r"argument '\w+': expected str, bytes or os.PathLike"):
        call(12)
