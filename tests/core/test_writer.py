"""Writing rules W1-W6 and the golden vectors of spec §2.1-2.2."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import pysafetensors
from conftest import compact_json
from pysafetensors import SerializeError, TensorSpec, safe_open, serialize
from pysafetensors._dtypes import DTYPES
from pysafetensors._layout import build_layout
from pysafetensors.numpy import load_file, save, save_file


def _split(data: bytes) -> tuple[int, bytes, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return n, data[8 : 8 + n], data[8 + n :]


def _golden(header_json: str, data: bytes) -> bytes:
    text = header_json.encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


# ------------------------------------------------------------------------ golden vectors (§2.1)


def test_empty_dict() -> None:
    assert save({}) == b"\x08" + bytes(7) + b"{}" + b" " * 6


def test_empty_dict_with_metadata() -> None:
    out = save({}, metadata={"framework": "pt"})
    n, header, data = _split(out)
    assert n == 40
    assert header == b'{"__metadata__":{"framework":"pt"}}' + b" " * 5
    assert data == b""


def test_attn_f32() -> None:
    out = save({"attn.0": np.arange(6, dtype=np.float32).reshape(1, 2, 3)})
    n, header, data = _split(out)
    assert n == 64
    assert header == b'{"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}}'
    assert data == np.arange(6, dtype="<f4").tobytes()


def test_attn0_padding() -> None:
    out = save({"attn0": np.arange(6, dtype=np.float32).reshape(1, 1, 2, 3)})
    n, header, _ = _split(out)
    assert n == 72
    assert header.endswith(b"}" + b" " * 7)


def test_f4_one_byte() -> None:
    arr = np.array([[0.5, 1.0]], dtype=ml_dtypes.float4_e2m1fn)
    n, header, data = _split(save({"attn.0": arr}))
    assert n == 64
    assert header == b'{"attn.0":{"dtype":"F4","shape":[1,2],"data_offsets":[0,1]}}' + b" " * 4
    # Codes 0b0001 (0.5) then 0b0010 (1.0); the first element is the low nibble.
    assert data == bytes([0x21])


def test_numpy_zeros_int32() -> None:
    out = save({"test": np.zeros((2, 2), np.int32)})
    assert out == _golden('{"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}', bytes(16))
    assert out[:8] == b"\x40" + bytes(7)


def test_two_tensors() -> None:
    out = save({"test1": np.zeros((2, 2), np.int32), "test2": np.zeros((2, 2), np.float16)})
    n, header, _ = _split(out)
    assert n == 128
    assert header.endswith(b" " * 6) and not header.endswith(b" " * 7)
    parsed = json.loads(header)
    assert parsed["test1"]["data_offsets"] == [0, 16]
    assert parsed["test2"]["data_offsets"] == [16, 24]


def test_metadata_then_tensor() -> None:
    out = save({"test1": np.zeros((2, 2), np.int32)}, metadata={"framework": "pt"})
    n, header, _ = _split(out)
    assert n == 96
    assert header == (
        b'{"__metadata__":{"framework":"pt"},'
        b'"test1":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}} '
    )


def test_big_endian_input_identical() -> None:
    little = np.arange(12, dtype="<i4").reshape(3, 4)
    assert save({"x": little.astype(">i4")}) == save({"x": little})


def test_torch_bf16_bytes() -> None:
    torch = pytest.importorskip("torch")
    from pysafetensors.torch import save as tsave

    t = torch.ones(2, 2, dtype=torch.bfloat16)
    t[0, 0] = 2.25
    assert _split(tsave({"t": t}))[2] == bytes.fromhex("104080 3f803f803f".replace(" ", ""))


def test_c64_bytes() -> None:
    out = save({"c": np.array([-1 + 1j], dtype=np.complex64)})
    assert _split(out)[2] == bytes.fromhex("000080bf0000803f")


def test_worked_example() -> None:
    """Spec §2.2: exact bytes and SHA-256."""
    tensors = {
        "weight": np.arange(6, dtype=np.float32).reshape(2, 3),
        "bias": np.array([1, 2], dtype=np.float16),
        "step": np.array(7, dtype=np.int64),
    }
    out = save(tensors, metadata={"format": "np"})
    n, header, data = _split(out)
    assert n == 208
    assert header == (
        b'{"__metadata__":{"format":"np"},"step":{"dtype":"I64","shape":[],"data_offsets":[0,8]},'
        b'"weight":{"dtype":"F32","shape":[2,3],"data_offsets":[8,32]},'
        b'"bias":{"dtype":"F16","shape":[2],"data_offsets":[32,36]}}  '
    )
    assert data == bytes.fromhex(
        "0700000000000000" + "00000000 0000803f 00000040 00004040 00008040 0000a040" + "003c0040"
    )
    assert len(out) == 252
    assert (
        hashlib.sha256(out).hexdigest()
        == "055e2191acf0595fa24a95b22f93955b74e270209d701be7544e95727cb508dc"
    )


# ----------------------------------------------------------------------------------- W1 - W6


def _example_of(code: str) -> np.ndarray:
    dtype = next(d for d in DTYPES if d.code == code)
    assert dtype.numpy is not None
    npdt = np.dtype(getattr(ml_dtypes, dtype.numpy, None) or dtype.numpy)
    return np.zeros(4, npdt)


def test_w1_dtype_rank_then_name() -> None:
    expected = [
        "U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
        "F8_E5M2FNUZ", "F8_E4M3FNUZ", "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8",
        "F6_E3M2", "F6_E2M3", "F4", "BOOL",
    ]  # fmt: skip
    # Names in the opposite order of the dtypes, two per dtype to check the tie-break.
    tensors = {}
    for i, code in enumerate(expected):
        tensors[f"{99 - i:02d}b"] = _example_of(code)
        tensors[f"{99 - i:02d}a"] = _example_of(code)
    header = json.loads(_split(save(tensors))[1])
    order = [name for name in header if name != "__metadata__"]
    assert [header[name]["dtype"] for name in order] == [c for c in expected for _ in (0, 1)]
    assert order == [f"{99 - i:02d}{s}" for i in range(len(expected)) for s in "ab"]


def test_w1_names_by_code_point() -> None:
    names = ["b", "B", "a", "é", "Z", "_", "aa", "", "\x7f", "😀", "ｚ"]
    out = save({n: np.zeros(1, np.uint8) for n in names})
    header = json.loads(_split(out)[1])
    assert list(header) == sorted(names)


def test_w2_offsets_consecutive() -> None:
    out = save({"a": np.zeros(3, np.uint8), "b": np.zeros(5, np.float64), "c": np.zeros(0)})
    header = json.loads(_split(out)[1])
    spans = [header[k]["data_offsets"] for k in header]
    assert spans[0][0] == 0
    assert all(prev[1] == cur[0] for prev, cur in zip(spans, spans[1:], strict=False))


def test_w3_metadata_order_kept() -> None:
    meta = {"zeta": "1", "alpha": "2", "mid": "3"}
    header = json.loads(_split(save({}, metadata=meta))[1])
    assert list(header["__metadata__"]) == ["zeta", "alpha", "mid"]


def test_w3_empty_metadata_no_tensors() -> None:
    out = save({}, metadata={})
    assert out == struct.pack("<Q", 24) + b'{"__metadata__":{}}' + b" " * 5
    assert pysafetensors.deserialize(out) == []


def test_w3_empty_metadata_reference_bug() -> None:
    """The reference writes invalid JSON here (spec §2.6); we do not copy that."""
    ref = pytest.importorskip("safetensors.numpy")
    assert ref.save({}, metadata={})[8:].startswith(b'{},"__metadata__":{}}')
    assert pysafetensors.deserialize(save({}, metadata={})) == []


def test_w4_compact_and_raw_unicode() -> None:
    name = 'q"\\/\x01\x1f\x7f\u2028é'
    header = _split(save({name: np.zeros(1, np.uint8)}))[1].rstrip(b" ")
    assert header == compact_json({name: {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}})
    assert b"\\u0001" in header and "\u2028".encode() in header and b"\\u2028" not in header


def test_w5_padding_spaces() -> None:
    for k in range(1, 20):
        n, header, _ = _split(save({"x" * k: np.zeros(1, np.uint8)}))
        assert n % 8 == 0
        assert header.rstrip(b" ").endswith(b"}")
        assert set(header[len(header.rstrip(b" ")) :]) <= {0x20}


def test_w6_header_too_large() -> None:
    with pytest.raises(SerializeError) as info:
        build_layout([], {"k": "v" * 100}, max_header_size=64)
    assert info.value.kind == "HeaderTooLarge"
    assert "header too large" in str(info.value)
    # Exactly at the limit is fine.
    assert len(build_layout([], {"k": "v" * 100}, max_header_size=128).header) == 8 + 128


def test_w6_metadata_name_refused() -> None:
    with pytest.raises(SerializeError) as info:
        save({"__metadata__": np.zeros(1)})
    assert info.value.kind == "ReservedName"
    assert str(info.value).startswith("Error while serializing: ")


def test_w6_reference_writes_unreadable_metadata_tensor() -> None:
    ref = pytest.importorskip("safetensors.numpy")
    data = ref.save({"__metadata__": np.zeros(1)})
    with pytest.raises(pysafetensors.HeaderDecodeError):
        pysafetensors.deserialize(data)


def test_non_str_names_and_metadata() -> None:
    with pytest.raises(TypeError):
        save({1: np.zeros(1)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="'int' object is not an instance of 'str'"):
        save({"a": np.zeros(1)}, metadata={"a": 1})  # type: ignore[dict-item]


# ----------------------------------------------------------- input normalisation (§2.6, §8.11)


def _layouts() -> dict[str, np.ndarray]:
    base = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    return {
        "fortran": np.asfortranarray(base),
        "transposed": base.T,
        "strided": base[:, ::2, 1::2],
        "negative-stride": base[::-1, :, ::-1],
        "big-endian": base.astype(">i4"),
        "big-endian-transposed": base.astype(">f8").T,
        "broadcast": np.broadcast_to(np.arange(4, dtype=np.int16), (3, 4)),
        "readonly": np.frombuffer(base.tobytes(), np.int32),
        "scalar-view": base[1:2, 2, 3].reshape(()),
    }


@pytest.mark.parametrize("name", list(_layouts()))
def test_non_contiguous_saved_correctly(name: str, tmp_path: Path) -> None:
    arr = _layouts()[name]
    # (np.ascontiguousarray would turn a 0-d array into shape (1,).)
    expected = np.array(arr, order="C", dtype=arr.dtype.newbyteorder("<"))
    assert save({"x": arr}) == save({"x": expected})
    save_file({"x": arr}, tmp_path / "f.safetensors")
    loaded = load_file(tmp_path / "f.safetensors")["x"]
    np.testing.assert_array_equal(loaded, arr)
    assert loaded.dtype == expected.dtype


def test_non_contiguous_reference_bug() -> None:
    """The reference writes the raw memory of a transposed array (#825); we do not."""
    ref = pytest.importorskip("safetensors.numpy")
    arr = np.arange(6).reshape(2, 3).T
    wrong = ref.load(ref.save({"x": arr}))["x"]
    assert not np.array_equal(wrong, arr)
    assert np.array_equal(pysafetensors.numpy.load(save({"x": arr}))["x"], arr)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_permissions_follow_umask(umask: int, tmp_path: Path) -> None:
    old = os.umask(umask)
    try:
        save_file({"x": np.zeros(2)}, tmp_path / "f.safetensors")
    finally:
        os.umask(old)
    assert (tmp_path / "f.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_atomic_replace_over_mapped_file(tmp_path: Path) -> None:
    path = tmp_path / "f.safetensors"
    save_file({"x": np.arange(1000, dtype=np.float32)}, path)
    with safe_open(path, "np") as f:
        old = f.get_tensor("x")  # a view of the mapping
        # Save new content over the mapped file, from the mapped tensor itself.
        save_file({"x": old * 2, "y": old}, path)
        np.testing.assert_array_equal(old, np.arange(1000, dtype=np.float32))
    new = load_file(path)
    np.testing.assert_array_equal(new["x"], np.arange(1000, dtype=np.float32) * 2)
    np.testing.assert_array_equal(new["y"], np.arange(1000, dtype=np.float32))
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".partial")]


def test_failed_write_leaves_target(tmp_path: Path) -> None:
    path = tmp_path / "f.safetensors"
    save_file({"x": np.zeros(2)}, path)
    before = path.read_bytes()
    with pytest.raises(SerializeError):
        save_file({"__metadata__": np.zeros(1)}, path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["f.safetensors"]


@pytest.mark.parametrize("call", ["writev", "write", "pwrite"])
def test_a_write_call_that_writes_nothing_fails_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """A file system that takes no bytes and reports no error (some FUSE and network ones):
    retried forever before; an I/O error now, the previous file kept."""
    path = tmp_path / "f.safetensors"
    save_file({"x": np.zeros(2)}, path)
    before = path.read_bytes()
    calls = []

    def nothing(*args: Any) -> int:
        calls.append(args)
        if len(calls) > 100:
            raise AssertionError("the write was retried without end")
        return 0

    monkeypatch.setattr(os, call, nothing)
    with pytest.raises(OSError) as caught:
        if call == "writev":
            save_file({"x": np.ones(4)}, path)
        elif call == "write":
            tensors = {"a": np.ones(4), "b": np.ones(4)}
            pysafetensors.save_sharded(tensors, tmp_path / "shards", max_shard_size=40)
        else:
            pysafetensors.edit_metadata(path, {"k": "v"})
    assert caught.value.errno == errno.EIO and len(calls) == 1
    assert isinstance(caught.value, pysafetensors.SafetensorError)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) in (["f.safetensors"], ["f.safetensors", "shards"])
    assert not (tmp_path / "shards").exists() or not os.listdir(tmp_path / "shards")


# ------------------------------------------------------------------------ TensorSpec / serialize


def _spec(module: Any, arr: np.ndarray, dtype: str | None = None) -> Any:
    return module.TensorSpec(
        dtype=dtype or arr.dtype.name,
        shape=list(arr.shape),
        data_ptr=arr.ctypes.data,
        data_len=arr.nbytes,
    )


@pytest.mark.parametrize(
    ("shape", "error"),
    [
        ("12", TypeError),
        ([2.0], TypeError),
        ([2.9], TypeError),
        (None, TypeError),
        ([-1], OverflowError),
    ],
)
def test_the_older_dict_form_checks_its_shape(shape: Any, error: type) -> None:
    """``int()`` of each item made ``"12"`` the shape ``[1, 2]`` and ``[2.9]`` the shape
    ``[2]``, written without a word; as ``TensorSpec`` checks it now, naming the tensor."""
    with pytest.raises(error, match="tensor `a`"):
        serialize({"a": {"dtype": "F32", "shape": shape, "data": bytes(8)}})
    with pytest.raises(TypeError, match="tensor `a`: data must be a bytes-like object"):
        serialize({"a": {"dtype": "F32", "shape": [2], "data": None}})
    with pytest.raises(SerializeError, match="tensor `a`") as info:
        serialize({"a": {"dtype": "Q8", "shape": [2], "data": bytes(8)}})
    assert info.value.tensor == "a"
    good = serialize({"a": {"dtype": "float32", "shape": (np.int64(2),), "data": bytes(8)}})
    assert good == save({"a": np.zeros(2, np.float32)})


def test_tensorspec_properties() -> None:
    arr = np.zeros((2, 6), np.uint8)
    spec = _spec(pysafetensors, arr, "float4_e2m1fn_x2")
    assert spec.dtype == "F4" and spec.shape == [2, 12] and spec.data_len == 12
    assert repr(spec).startswith("TensorSpec(dtype='F4', shape=[2, 12], data_ptr=")
    with pytest.raises(TypeError):
        TensorSpec("float32", [1], 0, 4)  # type: ignore[misc]
    with pytest.raises(SerializeError, match='Unknown dtype "F32"'):
        TensorSpec(dtype="F32", shape=[1], data_ptr=0, data_len=4)


def test_serialize_size_mismatch() -> None:
    arr = np.zeros(3, np.float32)
    spec = TensorSpec(dtype="float32", shape=[4], data_ptr=arr.ctypes.data, data_len=12)
    with pytest.raises(SerializeError) as info:
        serialize({"x": spec})
    assert str(info.value).startswith("Error while serializing: ")
    assert "invalid shape, data type, or offset for tensor" in str(info.value)
    assert info.value.kind == "TensorInvalidInfo"


def test_serialize_f4_odd_count() -> None:
    arr = np.zeros(2, np.uint8)
    spec = TensorSpec(dtype="float4_e2m1fn_x2", shape=[1], data_ptr=arr.ctypes.data, data_len=1)
    assert serialize({"x": spec})  # [1] storage -> [2] logical: fine
    with pytest.raises(SerializeError) as info:
        serialize({"x": TensorSpec(dtype="uint8", shape=[1], data_ptr=0, data_len=0)})
    assert info.value.kind == "TensorInvalidInfo"


def test_serialize_matches_reference_tensorspec() -> None:
    ref = pytest.importorskip("safetensors")
    rng = np.random.default_rng(0)
    arrays = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b": rng.integers(0, 255, 7, dtype=np.uint8),
        "c": rng.standard_normal(4).astype(ml_dtypes.bfloat16),
        "d": np.zeros((0, 3), np.int64),
        "e": rng.integers(0, 255, (2, 3), dtype=np.uint8),
    }
    # ({} metadata with tensors is fine in the reference; its bug needs an empty tensor dict.)
    for meta in (None, {}, {"k": "v"}):
        ours = serialize(
            {k: _spec(pysafetensors, v) for k, v in arrays.items() if k != "e"}
            | {"e": _spec(pysafetensors, arrays["e"], "float4_e2m1fn_x2")},
            metadata=meta,
        )
        theirs = ref.serialize(
            {k: _spec(ref, v) for k, v in arrays.items() if k != "e"}
            | {"e": _spec(ref, arrays["e"], "float4_e2m1fn_x2")},
            metadata=meta,
        )
        assert ours == theirs


def test_saves_read_the_umask_without_changing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # os.umask(0) would make every file other threads create meanwhile world-writable.
    if not os.path.exists("/proc/self/status"):
        pytest.skip("the umask can be read without setting it only where /proc shows it")
    old = os.umask(0o027)
    try:

        def refuse(mask: int) -> int:
            raise AssertionError("a save changed the process's umask")

        monkeypatch.setattr(os, "umask", refuse)
        save_file({"x": np.zeros(2)}, tmp_path / "f.safetensors")
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert (tmp_path / "f.safetensors").stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("length", [233, 234, 255])
def test_names_up_to_the_file_system_s_limit_save(tmp_path: Path, length: int) -> None:
    # The temporary file's name is longer than the target's; it must still fit.
    from pysafetensors import StreamingWriter

    name = "n" * (length - len(".safetensors")) + ".safetensors"
    save_file({"x": np.arange(3)}, tmp_path / name)
    assert load_file(tmp_path / name)["x"].tolist() == [0, 1, 2]
    with StreamingWriter(tmp_path / name, {"y": ("I64", [2])}) as w:
        w.write("y", np.arange(2))
    assert load_file(tmp_path / name)["y"].tolist() == [0, 1]
    assert os.listdir(tmp_path) == [name]


def test_a_replaced_file_keeps_its_permissions(tmp_path: Path) -> None:
    path = tmp_path / "f.safetensors"
    save_file({"x": np.zeros(2)}, path)
    os.chmod(path, 0o600)  # a user keeping their weights private
    save_file({"x": np.ones(2)}, path)
    assert path.stat().st_mode & 0o777 == 0o600
    # A link is replaced by a file of the save's own (as the reference), with umask permissions.
    link = tmp_path / "link.safetensors"
    link.symlink_to(path)
    old = os.umask(0o022)
    try:
        save_file({"x": np.ones(3)}, link)
    finally:
        os.umask(old)
    assert not link.is_symlink() and link.stat().st_mode & 0o777 == 0o644
    assert path.stat().st_mode & 0o777 == 0o600 and load_file(path)["x"].tolist() == [1, 1]


def test_save_to_bytes_holds_the_file_once() -> None:
    """``save`` joins the tensors' bytes straight into the result: filling a bytearray and
    converting it peaked at twice the file (8 GiB more for a 4 GiB save)."""
    import tracemalloc

    tensors = {f"w{i}": np.full(4 << 20, i, np.float32) for i in range(4)}  # 64 MiB
    tracemalloc.start()
    try:
        data = save(tensors)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(data) > 64 << 20
    assert peak < len(data) * 1.25, peak
    assert data == pysafetensors.serialize(
        {
            k: {"dtype": "float32", "shape": list(v.shape), "data": v.tobytes()}
            for k, v in tensors.items()
        }
    )


def test_serialize_copies_chunks_whose_memory_the_producer_reuses() -> None:
    """A producer may reuse a chunk's memory once the next chunk is asked for (device tensors
    come through a ring of pinned buffers), except for a tensor's last chunk and small ones:
    those are copied as they come, the others joined from where they are."""
    from pysafetensors._dtypes import dtype_from_code
    from pysafetensors._writer import WRITEV_BYTES, TensorData, serialize_to_bytes

    piece = WRITEV_BYTES
    ring = bytearray(piece)

    def chunks() -> Any:
        for value in range(3):  # three pieces through one reused buffer
            ring[:] = bytes([value]) * piece
            yield memoryview(ring)

    data = TensorData("w", dtype_from_code("U8"), (3 * piece,), chunks)
    out = serialize_to_bytes([data])
    with safe_open(memoryview(out), "np") as f:
        got = f.get_tensor("w")
    assert [int(got[i * piece]) for i in range(3)] == [0, 1, 2]
    assert bytes(got) == b"".join(bytes([v]) * piece for v in range(3))


def test_many_tensors_of_repeated_shapes_match_the_reference_bytes(tmp_path: Path) -> None:
    """A save works out each shape's dims and size once and hands contiguous arrays to the
    writer as one buffer: a checkpoint of repeated shapes (shared and equal shape objects,
    several dtypes, views that are not contiguous, big-endian arrays, 0-d and empty arrays,
    non-ASCII names) must still be byte for byte the reference's file."""
    ref = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(21)
    arrays: dict[str, np.ndarray] = {}
    for i in range(600):
        kind = i % 7
        if kind == 0:
            arrays[f"experts.{i}.w"] = rng.standard_normal((8, 16)).astype(np.float32)
        elif kind == 1:
            arrays[f"experts.{i}.w"] = rng.standard_normal((16, 8)).astype(np.float32).T
        elif kind == 2:
            arrays[f"experts.{i}.b"] = rng.standard_normal((8, 16)).astype(">f4")
        elif kind == 3:
            arrays[f"experts.{i}.h"] = rng.standard_normal((8, 16)).astype(ml_dtypes.bfloat16)
        elif kind == 4:
            arrays[f"expérts.{i}.s"] = np.array(float(i), np.float64)
        elif kind == 5:
            arrays[f"experts.{i}.e"] = np.zeros((0, 16), np.float32)
        else:
            arrays[f"experts.{i}.u"] = rng.integers(0, 255, (8, 16), dtype=np.uint8)[:, ::2]
    # The reference writes a view that is not contiguous as its memory, not its values (see
    # test_non_contiguous_reference_bug): it is given contiguous copies.
    contiguous = {name: value.copy(order="C") for name, value in arrays.items()}
    for meta in (None, {"format": "np"}):
        ours_path, theirs_path = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
        save_file(arrays, ours_path, metadata=meta)
        ref.save_file(contiguous, str(theirs_path), metadata=meta)
        assert ours_path.read_bytes() == theirs_path.read_bytes()
        assert save(arrays, metadata=meta) == ref.save(contiguous, metadata=meta)
    loaded = load_file(ours_path)
    for name, value in arrays.items():
        assert loaded[name].dtype.newbyteorder("=") == value.dtype.newbyteorder("=")
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)


def test_layout_of_lookalike_shapes_converts_each_as_int() -> None:
    """Shapes equal to one already planned (numpy integers, a list, a bool for 1) are planned
    as int() of each dimension, as before the per-shape memo; unhashable ones too."""
    f32 = next(d for d in DTYPES if d.code == "F32")
    specs: list[tuple[str, Any, Any]] = [
        ("a", f32, (2, 3)),
        ("b", f32, (np.int64(2), np.int64(3))),
        ("c", f32, [2, 3]),
        ("d", f32, (True, 3)),
        ("e", f32, (np.array(2), 3)),  # a 0-d array: unhashable
    ]
    layout = build_layout(specs)
    assert [(t.name, t.shape) for t in layout.tensors] == [
        ("a", (2, 3)),
        ("b", (2, 3)),
        ("c", (2, 3)),
        ("d", (1, 3)),
        ("e", (2, 3)),
    ]
    assert all(type(d) is int for t in layout.tensors for d in t.shape)
    header = json.loads(layout.header[8:])
    assert header["d"] == {"dtype": "F32", "shape": [1, 3], "data_offsets": [72, 84]}
    # A bad shape met again is refused again (the memo keeps only checked shapes).
    with pytest.raises(SerializeError, match="tensor `y` has a negative dimension"):
        build_layout([("x", f32, (2, 3)), ("y", f32, (-1, 3)), ("z", f32, (-1, 3))])


def test_a_tensor_whose_memory_cannot_be_read_is_named(tmp_path: Path) -> None:
    # A memory-mapped array whose file shrank: the kernel's write fails with EFAULT, and the
    # error named only the output. In a child process: touching such memory from Python
    # would be a SIGBUS.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import os
        import numpy as np
        from pysafetensors import WriteError
        from pysafetensors.numpy import save_file
        m = np.memmap({str(tmp_path / "m.bin")!r}, np.float32, "w+", shape=(1 << 20,))
        m[:] = 1
        m.flush()
        os.truncate({str(tmp_path / "m.bin")!r}, 4096)
        try:
            save_file({{"small": np.ones(4, np.float32), "mapped": m}}, {str(tmp_path / "o")!r})
        except WriteError as exc:
            print(exc.errno, exc.__notes__)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.startswith("14 [") and "tensor `mapped` could not be read" in done.stdout
    assert sorted(os.listdir(tmp_path)) == ["m.bin"]
