"""numpy arrays in checkpoints: decoded from their bytes (numeric dtypes) in both modes.

The oracle is ``torch.load(weights_only=False)`` of checkpoints the real ``torch.save`` wrote:
the arrays the converter's own pickle machine decodes must equal the ones numpy's unpickling
gives (values, dtype with its byte order, memory order), and their JSON rendering in the
metadata must be the nested lists of those arrays. Hostile pickles are built by hand.
"""

from __future__ import annotations

import json
import math
import random
import struct
import subprocess
import sys
import tracemalloc
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import CheckpointError, UnsafePickleError, safe_open
from pysafetensors._pickle_vm import Limits
from pysafetensors._torch_pickle import load_checkpoint
from pysafetensors._torch_policy import TorchPolicy, policy_machine
from pysafetensors.convert import convert_file
from pysafetensors.numpy import load_file
from pysafetensors.scan import grade_global, scan_file

from .corpus import F32x4, P, make_zip, state_dict, tensor

torch = pytest.importorskip("torch")

#: Every dtype code the converter decodes.
CODES = ("b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16")


def _arrays() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    out: dict[str, Any] = {}
    for code in CODES:
        dtype = np.dtype(code)
        if dtype.kind == "b":
            values = rng.integers(0, 2, (3, 4)).astype(dtype)
        elif dtype.kind in "iu":
            info = np.iinfo(dtype)
            values = rng.integers(info.min, info.max, (3, 4), dtype=dtype, endpoint=True)
        elif dtype.kind == "f":
            values = rng.standard_normal((3, 4)).astype(dtype)
            values[0, :3] = [np.inf, -np.inf, np.nan]
        else:
            values = (rng.standard_normal((3, 4)) + 1j * rng.standard_normal((3, 4))).astype(dtype)
        out[code] = values
        out[f"{code}_be"] = values.astype(dtype.newbyteorder(">"))
    out["fortran"] = np.asfortranarray(np.arange(24, dtype=np.float64).reshape(2, 3, 4))
    out["fortran_i2"] = np.asfortranarray(np.arange(6, dtype=">i2").reshape(3, 2))
    out["scalar0d"] = np.array(2.5, dtype=np.float32)
    out["scalar0d_c"] = np.array(1 - 2j)
    out["empty"] = np.zeros((0,), dtype=np.int64)
    out["empty2d"] = np.zeros((3, 0, 2), dtype=np.float16)
    out["big"] = np.arange(5000, dtype=np.uint32)  # over 1000 items: abbreviated
    out["strided"] = np.arange(20, dtype=np.int32)[::3]  # pickled as a copy
    return out


def _rendered(value: Any) -> Any:
    """What a value of ``torch.load`` renders to as metadata: numbers as JSON numbers,
    complex numbers and non-finite floats as their ``str``, lists abbreviated after 1000."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, (list, tuple)):
        items = [_rendered(v) for v in value[:1000]]
        return [*items, "..."] if len(value) > 1000 else items
    if isinstance(value, complex):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _decoded(path: Path) -> Any:
    """The state dict as the converter's pickle machine builds it (arrays not yet rendered)."""
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
        data = zf.read(name)
    return policy_machine(data, TorchPolicy(), None).run(0).value


def _same_array(ours: Any, theirs: np.ndarray[Any, Any]) -> None:
    assert type(ours) is np.ndarray
    assert ours.dtype == theirs.dtype and ours.dtype.str == theirs.dtype.str
    assert ours.shape == theirs.shape
    assert ours.flags.f_contiguous == theirs.flags.f_contiguous
    assert ours.flags.c_contiguous == theirs.flags.c_contiguous
    np.testing.assert_array_equal(ours, theirs)
    assert ours.tobytes(order="A") == theirs.tobytes(order="A")


@pytest.mark.parametrize("protocol", [1, 2, 4])
def test_arrays_of_every_dtype_decode_as_numpy_unpickles_them(
    tmp_path: Path, protocol: int
) -> None:
    src = tmp_path / "a.pt"
    torch.save({"w": torch.ones(2), **_arrays()}, src, pickle_protocol=protocol)
    loaded = torch.load(src, weights_only=False)
    ours = _decoded(src)
    for name, theirs in loaded.items():
        if name != "w":
            _same_array(ours[name], theirs)
    dst = tmp_path / "a.safetensors"
    report = convert_file(src, dst, keep_non_tensors=True)
    assert report.tensors == ["w"] and report.unknown_globals == []
    with safe_open(dst, "np") as f:
        assert list(f.keys()) == ["w"]  # arrays are values, not tensors of the file
        meta = f.metadata()
    for name, theirs in loaded.items():
        if name == "w":
            continue
        assert json.loads(meta[name]) == _rendered(theirs), name
        assert report.non_tensors[name] == _rendered(theirs), name
    assert json.loads(meta["big"])[-1] == "..." and len(json.loads(meta["big"])) == 1001


def test_numpy_random_state_in_a_legacy_checkpoint(tmp_path: Path) -> None:
    src = tmp_path / "legacy.pt"
    state = np.random.RandomState(3).get_state()
    torch.save(
        {"w": torch.ones(2), "numpy": state, "shared": [state[1], state[1]]},
        src,
        _use_new_zipfile_serialization=False,
    )
    report = convert_file(src, tmp_path / "l.safetensors", keep_non_tensors=True, verify=True)
    assert report.non_tensors["numpy"] == _rendered(state)
    assert report.non_tensors["shared"] == _rendered([state[1], state[1]])
    with load_checkpoint(src) as ck:
        assert ck.format == "legacy"
        assert ck.non_tensors["numpy"][0] == "MT19937"
        assert ck.non_tensors["numpy"][1] == state[1].tolist()


def _rng_state(path: Path) -> dict[str, Any]:
    """A Trainer's ``rng_state.pth`` (without CUDA): Python's, numpy's and torch's RNG states."""
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    states = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    torch.save(states, path)
    return states


def test_trainer_rng_state_converts_without_skipping_and_verifies_with_torch(
    tmp_path: Path,
) -> None:
    src, dst = tmp_path / "rng_state.pth", tmp_path / "rng_state.safetensors"
    _rng_state(src)
    report = convert_file(src, dst, verify=True, keep_non_tensors=True)
    assert report.verified == "torch"  # torch's own loader, allowed numpy's arrays
    assert report.tensors == ["cpu"] and report.skipped_objects == {}
    loaded = torch.load(src, weights_only=False)
    assert load_file(dst)["cpu"].tobytes() == loaded["cpu"].numpy().tobytes()
    with safe_open(dst, "np") as f:
        meta = f.metadata()
    for name in ("python", "numpy"):
        assert json.loads(meta[name]) == _rendered(loaded[name])
    assert len(json.loads(meta["numpy"])[1]) == 624
    res = subprocess.run(
        [sys.executable, "-m", "pysafetensors", "convert", "--verify", "--keep-non-tensors"]
        + [str(src), str(tmp_path / "cli.safetensors")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    with safe_open(tmp_path / "cli.safetensors", "np") as f:
        assert f.metadata() == meta
    assert scan_file(src).grade == "safe"


def test_arrays_of_undecoded_dtypes_stay_unknown(tmp_path: Path) -> None:
    obj = np.array([1, "a", None], dtype=object)
    src = tmp_path / "o.pt"
    torch.save(
        {
            "w": torch.ones(2),
            "objects": obj,
            "strings": np.array(["ab", "c"]),
            "records": np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]),
            "pair": (obj, 1, np.arange(2, dtype=np.int8)),
            "again": [obj, {"deep": (obj,)}],
            "fine": np.arange(3, dtype=np.int16),
        },
        src,
    )
    with pytest.raises(UnsafePickleError, match="numpy.dtype 'O8'") as exc:
        convert_file(src, tmp_path / "o.safetensors")
    assert exc.value.skippable
    report = convert_file(src, tmp_path / "o.safetensors", unknown="skip", keep_non_tensors=True)
    skipped = "<skipped numpy.ndarray>"
    values = report.non_tensors
    assert values["objects"] == values["strings"] == values["records"] == skipped
    # The same array wherever the pickle referred to it (memo), inside tuples too.
    assert values["pair"] == [skipped, 1, [0, 1]]
    assert values["again"] == [skipped, {"deep": [skipped]}]
    assert values["fine"] == [0, 1, 2]
    assert report.skipped_objects == {
        "objects": "numpy.ndarray",
        "strings": "numpy.ndarray",
        "records": "numpy.ndarray",
        "pair.0": "numpy.ndarray",
        "again.0": "numpy.ndarray",
        "again.1.deep.0": "numpy.ndarray",
    }
    assert report.unknown_globals == ["numpy.dtype", "numpy.ndarray"]
    assert load_file(tmp_path / "o.safetensors")["w"].tolist() == [1.0, 1.0]


def test_scanner_grades_what_the_converter_reads_safe() -> None:
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        assert grade_global(module, "_reconstruct") == "safe"
    assert grade_global("numpy", "ndarray") == "safe"
    assert grade_global("builtins", "bytes") == "safe"  # protocol 2's b"" (an empty array)
    assert grade_global("numpy", "core.multiarray._reconstruct") == "dangerous"


# --------------------------------------------------------------------------------------------
# Hand-built pickles.
# --------------------------------------------------------------------------------------------

NDARRAY = P.g("numpy", "ndarray")
RECONSTRUCT = P.g("numpy._core.multiarray", "_reconstruct")


def _bytes_op(raw: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(raw)) + raw  # BINBYTES


def _dtype(code: str = "f4", order: str = "<") -> bytes:
    """``numpy.dtype(code, False, True)`` then BUILD with numpy's state for it."""
    return (
        P.g("numpy", "dtype")
        + P.u(code)
        + b"\x89\x88\x87R"
        + b"(K\x03"
        + P.u(order)
        + b"NNN"
        + P.i(-1)
        + P.i(-1)
        + P.i(0)
        + b"tb"
    )


def _array(
    shape: tuple[int, ...] = (4,),
    raw: bytes = F32x4,
    *,
    dtype: bytes | None = None,
    args: bytes | None = None,
    state: bytes | None = None,
) -> bytes:
    """``_reconstruct(*args)`` then BUILD with ``(1, shape, dtype, False, raw)``."""
    args = NDARRAY + P.tup((0,)) + b"C\x01b" if args is None else args
    if state is None:
        state = b"(" + P.i(1) + P.tup(shape) + (dtype or _dtype()) + b"\x89" + _bytes_op(raw) + b"t"
    return RECONSTRUCT + b"(" + args + b"tR" + state + b"b"


def _convert(tmp_path: Path, value: bytes, unknown: str = "error") -> Any:
    make_zip(tmp_path / "h.pt", state_dict([("w", tensor()), ("x", value)]))
    return convert_file(
        tmp_path / "h.pt",
        tmp_path / "h.safetensors",
        unknown=unknown,  # type: ignore[arg-type]
        keep_non_tensors=True,
    )


def test_hand_built_array_decodes(tmp_path: Path) -> None:
    report = _convert(tmp_path, _array())
    assert report.non_tensors["x"] == [1.0, 2.0, 3.0, 4.0]
    big = struct.pack(">3H", 1, 2, 258)
    report = _convert(tmp_path, _array((3,), big, dtype=_dtype("u2", ">")))
    assert report.non_tensors["x"] == [1, 2, 258]


HOSTILE = {
    "short data": (_array((4,), F32x4[:-1]), "needs 16 bytes of data, the pickle holds 15"),
    "long data": (_array((2,), F32x4), "needs 8 bytes of data, the pickle holds 16"),
    "huge shape": (_array((1 << 40,), F32x4), "needs 4398046511104 bytes"),
    "huge shape, many dims": (_array((1 << 62,) * 3, F32x4), "is too large"),
    "zero with huge dims": (_array((0, 1 << 62, 1 << 62), b""), "is too large"),
    "negative dim": (_array((-4,), F32x4), "negative dimension"),
    "65 dims": (_array((1,) * 65, b"\0" * 4), "65 dimensions, over the 64 limit"),
    "not a shape": (
        _array(state=b"(" + P.i(1) + P.u("4") + _dtype() + b"\x89" + _bytes_op(F32x4) + b"t"),
        "is not a tuple of ints",
    ),
    "version 2": (
        _array(state=b"(" + P.i(2) + P.tup((4,)) + _dtype() + b"\x89" + _bytes_op(F32x4) + b"t"),
        "state version 2",
    ),
    "order flag an int": (
        _array(state=b"(" + P.i(1) + P.tup((4,)) + _dtype() + P.i(1) + _bytes_op(F32x4) + b"t"),
        "order flag 1 is not a bool",
    ),
    "data a list": (
        _array(state=b"(" + P.i(1) + P.tup((1,)) + _dtype() + b"\x89" + b"]" + P.i(1) + b"at"),
        "data is a list, not bytes",
    ),
    "dtype a string": (
        _array(state=b"(" + P.i(1) + P.tup((4,)) + P.u("<f4") + b"\x89" + _bytes_op(F32x4) + b"t"),
        "with the dtype '<f4'",
    ),
    "state of 4": (
        _array(state=b"(" + P.tup((4,)) + _dtype() + b"\x89" + _bytes_op(F32x4) + b"t"),
        "is not (version, shape, dtype, is_fortran, data)",
    ),
    "state a dict": (_array(state=b"}"), "is not (version, shape, dtype, is_fortran, data)"),
    "other shape": (_array(args=NDARRAY + P.tup((4,)) + b"C\x01b"), "only (numpy.ndarray"),
    "other code": (_array(args=NDARRAY + P.tup((0,)) + b"C\x01f"), "only (numpy.ndarray"),
    "code as text": (_array(args=NDARRAY + P.tup((0,)) + P.u("b")), "only (numpy.ndarray"),
    "other class": (
        _array(args=P.g("collections", "OrderedDict") + P.tup((0,)) + b"C\x01b"),
        "only (numpy.ndarray",
    ),
    "two args": (_array(args=NDARRAY + P.tup((0,))), "only (numpy.ndarray"),
    "built twice": (
        _array() + b"(" + P.i(1) + P.tup((4,)) + _dtype() + b"\x89" + _bytes_op(F32x4) + b"tb",
        "already has its state",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_arrays_are_clear_errors(tmp_path: Path, case: str) -> None:
    value, message = HOSTILE[case]
    for unknown in ("error", "skip"):
        tracemalloc.start()
        try:
            with pytest.raises(CheckpointError) as exc:
                _convert(tmp_path, value, unknown)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert message in str(exc.value)
        assert not isinstance(exc.value, UnsafePickleError)
        assert exc.value.offset is not None and f"at byte {exc.value.offset}" in str(exc.value)
        assert peak < 32 << 20, peak  # nothing the declared shape asked for was allocated
        assert not (tmp_path / "h.safetensors").exists()


def test_object_dtype_and_subclasses_by_hand(tmp_path: Path) -> None:
    objects = _array((1,), dtype=_dtype("O8", "|"))
    matrix = _array(args=P.g("numpy", "matrix") + P.tup((0,)) + b"C\x01b")
    for value, name in ((objects, "numpy.dtype"), (matrix, "numpy.matrix")):
        with pytest.raises(UnsafePickleError) as exc:
            _convert(tmp_path, value)
        assert exc.value.global_name == name and exc.value.skippable
        # Skipped: the array (of that dtype, of that class) is a placeholder.
        report = _convert(tmp_path, value, "skip")
        placeholder = "numpy.ndarray" if name == "numpy.dtype" else name
        assert report.non_tensors["x"] == f"<skipped {placeholder}>"
        assert report.skipped_objects == {"x": placeholder}
    # numpy.ndarray itself is never called: only _reconstruct makes an array.
    with pytest.raises(UnsafePickleError, match="numpy.ndarray is not callable"):
        _convert(tmp_path, NDARRAY + P.tup((4,)) + b"\x85R", "skip")


def test_arrays_count_toward_the_pickle_budget(tmp_path: Path) -> None:
    # One 1 MiB bytes object of the memo, made into 300 arrays: a few bytes of stream each,
    # charged as copies (the first use is not), over the 256 MiB cap.
    raw = b"\0" * (1 << 20)
    first = (
        RECONSTRUCT
        + b"("
        + NDARRAY
        + P.tup((0,))
        + b"C\x01bt"
        + b"q\x01R"  # the arguments, memo 1
        + b"("
        + P.i(1)
        + P.tup((1 << 18,))
        + _dtype()
        + b"\x89"
        + _bytes_op(raw)
        + b"tq\x02b"  # the state, memo 2
    )
    again = RECONSTRUCT + b"h\x01Rh\x02b"
    make_zip(tmp_path / "m.pt", state_dict([("w", tensor()), ("x", b"]" + first + b"a")]))
    assert convert_file(tmp_path / "m.pt", tmp_path / "m.safetensors").tensors == ["w"]
    many = b"](" + first + again * 299 + b"e"
    make_zip(tmp_path / "m.pt", state_dict([("w", tensor()), ("x", many)]))
    with pytest.raises(CheckpointError, match="copy over 268435456 bytes"):
        convert_file(tmp_path / "m.pt", tmp_path / "m.safetensors")


def test_array_data_of_the_stream_is_not_charged_as_a_copy(tmp_path: Path) -> None:
    # Protocol 2 pickles an array's data as _codecs.encode(text, "latin1"): the first encoding
    # of a text is bounded by the stream that holds it (arrays of hundreds of MB were refused
    # at the 256 MiB cap on copies); encoding the same text of the memo again is charged.
    src = tmp_path / "p2.pt"
    values = np.arange(4000, dtype=np.float32)
    torch.save({"w": torch.ones(2), "a": values, "b": values + 1}, src, pickle_protocol=2)
    with load_checkpoint(src, limits=Limits(max_copied_bytes=1000)) as ck:
        assert ck.non_tensors["b"] == _rendered(values + 1)
    text = P.u("\x00" * 16)
    encode = P.g("_codecs", "encode") + b"q\x05" + text + b"q\x06" + P.u("latin1") + b"\x86R"
    again = b"h\x05h\x06" + P.u("latin1") + b"\x86R"
    value = b"](" + encode + again * 100 + b"e"
    make_zip(tmp_path / "e.pt", state_dict([("w", tensor()), ("x", value)]))
    with load_checkpoint(tmp_path / "e.pt", limits=Limits(max_copied_bytes=1600)) as ck:
        assert ck.non_tensors["x"] == ["<16 bytes>"] * 101
    with pytest.raises(CheckpointError, match="copy over 1000 bytes"):
        load_checkpoint(tmp_path / "e.pt", limits=Limits(max_copied_bytes=1000))
