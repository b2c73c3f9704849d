"""Drop-in details checked against the reference, side by side: slices outliving their handle,
advanced slice indices, save I/O errors, ``TensorSpec`` argument checks, constructor and
keyword names, device checks, ndarray subclasses, and exact message texts."""

from __future__ import annotations

import os
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pysafetensors
import pysafetensors.numpy as ours_np
from pysafetensors import SafetensorError, SliceError, safe_open
from pysafetensors._errors import WriteError

ref = pytest.importorskip("safetensors")
import safetensors.numpy as ref_np  # noqa: E402 - after the importorskip

torch = pytest.importorskip("torch")
import safetensors.torch as ref_torch  # noqa: E402

import pysafetensors.torch as ours_torch  # noqa: E402


def _outcome(call: Any) -> Any:
    try:
        return ("ok", call())
    except BaseException as exc:  # noqa: BLE001 - comparing outcomes, whatever they are
        return ("error", type(exc), str(exc))


def _open_fds_on(path: Path) -> int:
    count = 0
    for entry in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{entry}") == str(path):
                count += 1
        except OSError:
            continue
    return count


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "m.safetensors"
    ref_torch.save_file(
        {
            "a": torch.arange(60, dtype=torch.float32).reshape(3, 4, 5),
            "b": torch.arange(60, dtype=torch.float32).reshape(3, 4, 5).to(torch.bfloat16),
        },
        path,
    )
    return path


# ------------------------------------------------------------------- slices outlive the handle


@pytest.mark.parametrize("framework", ["np", "pt"])
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_slice_outlives_its_handle_and_then_lets_the_file_go(
    model: Path, framework: str, backend: str
) -> None:
    with ref.safe_open(str(model), framework) as f:
        ref_slice = f.get_slice("a")
    before = _open_fds_on(model)  # the reference's slice may hold the file too
    with safe_open(model, framework, backend=backend) as g:
        ours_slice = g.get_slice("a")
        assert ours_slice.get_shape() == [3, 4, 5]
    expected = ref_slice[1:, 2]
    got = ours_slice[1:, 2]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    if backend == "pread" and sys.platform.startswith("linux"):
        # The slice holds the file (partial reads use a second descriptor, readahead off).
        assert _open_fds_on(model) > before
        del ours_slice
        assert _open_fds_on(model) == before  # the last user closed it
    # A slice of a handle that was dropped without close() reads too.
    lone = safe_open(model, framework, backend=backend).get_slice("a")
    np.testing.assert_array_equal(np.asarray(lone[0, 0]), np.arange(5, dtype=np.float32))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts descriptors in /proc")
def test_the_file_closes_with_the_last_of_several_slices_or_at_close(model: Path) -> None:
    before = _open_fds_on(model)
    with safe_open(model, "np", backend="pread") as g:
        first, second = g.get_slice("a"), g.get_slice("a")
        g.get_slice("a")  # gone at once: holds nothing after
    assert _open_fds_on(model) > before
    del first
    assert _open_fds_on(model) > before and second[0, 0, 0] == 0  # one slice still reads
    del second
    assert _open_fds_on(model) == before
    with safe_open(model, "np", backend="pread") as h:
        h.get_slice("a")[0]
        assert _open_fds_on(model) > before
    assert _open_fds_on(model) == before  # no slice left: closed by close() itself


def test_closed_handle_still_refuses_new_slices(model: Path) -> None:
    f = safe_open(model, "np")
    f.close()
    with pytest.raises(pysafetensors.ClosedFileError, match="^File is closed$"):
        f.get_slice("a")


# ----------------------------------------------------------------------- advanced indices

ADVANCED: list[Any] = [
    None,
    (None,),
    (0, None),
    True,
    False,
    (True, 1),
    [0, 2],
    ([0, 2],),
    ([0, 2], slice(None), [1, 1]),
    (slice(None), [3, 0, -1]),
    (0, slice(None), [1, 4]),  # numpy and torch place the result's dimensions differently
    (np.array([[0, 1], [2, 0]]),),
    (..., [0, 4]),
    (..., None),
    (None, ..., None, 1),
    (slice(1, 3), None, [0, 3], slice(None, None, 2)),
    ([],),
    (np.array([], dtype=np.int64), 0),
    (np.int64(1), None),
    # An ellipsis between index arrays separates them even when it stands for no dimension.
    (slice(None), (1,), True, Ellipsis, [0]),
    (slice(None, 0, 3), -1, Ellipsis, True, 0),
]


@pytest.mark.parametrize(
    ("backend", "slice_reads"), [("mmap", "coalesce"), ("pread", "coalesce"), ("pread", "exact")]
)
def test_torch_advanced_indices_match_torch(model: Path, backend: str, slice_reads: str) -> None:
    full = ref_torch.load_file(model)
    masks = [full["a"][:, :, 0] > 20, full["a"] > 30, full["a"][:, :, 0] > 1000]
    with safe_open(model, "pt", backend=backend, slice_reads=slice_reads) as f:
        for name in ("a", "b"):
            s = f.get_slice(name)
            for index in [*ADVANCED, *((m,) for m in masks), (torch.tensor([2, 0]),)]:
                expected = full[name][index]
                got = s[index]
                assert got.dtype == expected.dtype and torch.equal(got, expected), index


@pytest.mark.parametrize(
    ("backend", "slice_reads"), [("mmap", "coalesce"), ("pread", "coalesce"), ("pread", "exact")]
)
def test_numpy_advanced_indices_match_numpy(model: Path, backend: str, slice_reads: str) -> None:
    full = ours_np.load_file(model)
    masks = [full["a"][:, :, 0] > 20, full["a"] > 30]
    with safe_open(model, "np", backend=backend, slice_reads=slice_reads) as f:
        for name in ("a", "b"):
            s = f.get_slice(name)
            for index in [*ADVANCED, *((m,) for m in masks)]:
                expected = full[name][index]
                got = s[index]
                assert got.shape == expected.shape and got.dtype == expected.dtype, index
                assert got.tobytes() == expected.tobytes(), index


def test_advanced_index_errors_are_slice_errors(model: Path) -> None:
    with safe_open(model, "pt") as f:
        s = f.get_slice("a")
        with pytest.raises(SliceError, match="index 3 out of bounds for tensor dimension #0"):
            s[[0, 3]]
        with pytest.raises(SliceError, match="does not match dimensions"):
            s[np.ones((2, 2), bool)]
        with pytest.raises(SliceError, match="integer or boolean type"):
            s[np.array([0.5])]
        with pytest.raises(IndexError):  # SliceError is an IndexError, as torch's own error
            s[[5]]
        # Out-of-range values never wrap around inside the box that is read.
        with pytest.raises(SliceError, match="index -4 out of bounds for tensor dimension #0"):
            s[[1, -4]]
        with pytest.raises(SliceError, match="index 9 out of bounds for tensor dimension #1"):
            s[0, [1, 9]]


def test_empty_broadcast_selects_nothing_like_numpy(tmp_path: Path) -> None:
    # numpy checks index values only when the index arrays broadcast to a non-empty selection.
    path = tmp_path / "e.safetensors"
    ours_np.save_file({"e": np.zeros((0, 8)), "a": np.arange(6.0).reshape(2, 3)}, path)
    with safe_open(path, "np") as f:
        assert f.get_slice("e")[[0], []].shape == np.zeros((0, 8))[[0], []].shape
        assert f.get_slice("a")[[5], []].shape == (0,)
        with pytest.raises(SliceError, match="index 5 out of bounds"):
            f.get_slice("a")[[5], [0]]


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_empty_mask_axes_match_any_dimension_as_numpy_not_torch(model: Path, backend: str) -> None:
    # numpy checks a boolean mask's axis against its dimension only when it is not empty; torch
    # always does. Each framework's slices follow their own.
    full = ours_np.load_file(model)["a"]
    with safe_open(model, "np", backend=backend) as f:
        s = f.get_slice("a")
        for index in [
            np.array([], bool),
            (..., np.array([], bool)),
            np.zeros((0, 0), bool),
            (None, np.array([], bool), 1),
            (slice(1, 2), np.zeros(0, bool), 0),
        ]:
            expected = full[index]
            got = s[index]
            assert got.shape == expected.shape and got.dtype == expected.dtype, index
        with pytest.raises(SliceError, match="does not match dimensions"):
            s[np.zeros((0, 2), bool)]  # the second axis is not empty: checked, as numpy does
    with (
        safe_open(model, "pt", backend=backend) as f,
        pytest.raises(SliceError, match="does not match dimensions"),
    ):
        f.get_slice("a")[torch.tensor([], dtype=torch.bool)]


_BYTE_MASK_WARNING = "indexing with dtype torch.uint8 is now deprecated"


def _torch_index_items() -> dict[str, Any]:
    return {
        "uint8 tensor": torch.tensor([1, 0, 1], dtype=torch.uint8),
        "uint8 array": np.array([0, 0, 2], np.uint8),
        "0-d uint8 tensor": torch.tensor(2, dtype=torch.uint8),
        "0-d uint8 zero": torch.tensor(0, dtype=torch.uint8),
        "0-d uint8 array": np.array(3, np.uint8),
        "uint8 scalar": np.uint8(2),
        "2-d uint8 mask": (torch.arange(12).reshape(3, 4) % 3 == 0).to(torch.uint8),
        "row, uint8 mask": (0, torch.tensor([1, 0, 0, 1], dtype=torch.uint8)),
        "int16 array": np.array([0, 2], np.int16),
        "uint64 array": np.array([2, 1], np.uint64),
        "int32 tensor": torch.tensor([2, 0], dtype=torch.int32),
        "0-d int16 tensor": torch.tensor(1, dtype=torch.int16),
        "int8 tensor": torch.tensor([0, 2], dtype=torch.int8),
        "uint16 tensor": torch.tensor([0, 2], dtype=torch.uint16),
        "uint64 tensor": torch.tensor([0, 2], dtype=torch.uint64),
        "range": range(2),
        "range, reversed": (slice(None), range(3, 0, -1)),
        # torch checks index values only where it picks an element.
        "out of range, no rows": (slice(3, 1), [7]),
        "out of range range, no rows": (slice(2, 2), range(4, 6)),
        "range longer than its dimension, no rows": (slice(3, 1), range(9)),
        "out of range rows, no columns": ([5, -9], slice(4, 2)),
    }


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("case", list(_torch_index_items()))
def test_torch_index_tensors_are_read_as_torch_reads_them(
    model: Path, backend: str, case: str
) -> None:
    """torch reads a uint8 tensor or array (0-d included) as a boolean mask, and refuses
    integer tensors of other widths than 32 and 64 bits; these were read as numpy reads them
    (rows 1, 0, 1), unlike the reference's torch slices. ``range`` is a list to both."""
    index = _torch_index_items()[case]
    with ref.safe_open(str(model), "pt") as r, safe_open(model, "pt", backend=backend) as o:
        with warnings.catch_warnings(record=True) as theirs_warned:
            warnings.simplefilter("always")
            theirs = _outcome(lambda: r.get_slice("a")[index])
        with warnings.catch_warnings(record=True) as ours_warned:
            warnings.simplefilter("always")
            mine = _outcome(lambda: o.get_slice("a")[index])
    assert mine[0] == theirs[0], (mine, theirs)
    if mine[0] == "ok":
        assert mine[1].shape == theirs[1].shape and torch.equal(mine[1], theirs[1])
    else:
        assert issubclass(mine[1], IndexError) and issubclass(mine[1], SafetensorError)
        assert mine[2].startswith(theirs[2])
    # torch's own words, which it follows with where in its sources it said them.
    for warned in (theirs_warned, ours_warned):
        said = any(str(w.message).startswith(_BYTE_MASK_WARNING) for w in warned)
        assert said == ("uint8" in case and not case.startswith(("0-d", "uint8 scalar"))), warned


def test_numpy_slices_take_a_range_as_numpy_does(model: Path) -> None:
    full = ours_np.load_file(model)["a"]
    with safe_open(model, "np") as f:
        for index in (range(2), (0, range(3, 0, -1)), range(0)):
            assert np.array_equal(f.get_slice("a")[index], full[index]), index


def test_bool_is_an_axis_not_an_integer(model: Path) -> None:
    # Python bools are ints; indexing with one must not silently select row 1.
    with safe_open(model, "pt") as f:
        assert tuple(f.get_slice("a")[True].shape) == (1, 3, 4, 5)
        assert tuple(f.get_slice("a")[False].shape) == (0, 3, 4, 5)


def test_numpy_bool_scalars_follow_each_frameworks_rules(model: Path) -> None:
    # torch (and the reference's torch slices) refuse a numpy bool item; numpy takes it as a
    # bool. It was served as numpy does for "pt" too.
    t = ours_torch.load_file(model)["a"]
    with ref.safe_open(str(model), "pt") as r, safe_open(model, "pt") as o:
        for index in [np.True_, (0, np.False_), (slice(None), np.True_, 1)]:
            with pytest.raises(IndexError) as torch_said:
                t[index]
            with pytest.raises(IndexError, match="got numpy.bool"):
                r.get_slice("a")[index]
            with pytest.raises(SliceError) as ours_said:
                o.get_slice("a")[index]
            assert str(torch_said.value) in str(ours_said.value)
        # Python bools and 0-d bool arrays are taken by torch, and so by both.
        for index in [True, np.array(True), (0, np.array(False))]:
            assert tuple(o.get_slice("a")[index].shape) == tuple(t[index].shape)
    full = ours_np.load_file(model)["a"]
    with safe_open(model, "np") as f:
        for index in [np.True_, (0, np.False_), (slice(None), np.True_, 1)]:
            assert f.get_slice("a")[index].shape == full[index].shape


# ---------------------------------------------------------------------- slice error texts


def test_slice_error_texts_match_the_reference(model: Path) -> None:
    cases: list[Any] = [(-4,), (3,), (slice(None), 5), (..., 7), (np.int64(1), 9), (0, 0, 0, 0)]
    # The ellipsis spelled out in messages, and every item's type and step checked (at its
    # position once spelled out) before their number.
    cases += [(..., 5, 5), (0, ..., 9), (5, ...), (slice(0, 1), ..., 1, 1, 1), (..., "a")]
    cases += [(0, 1.5), (slice(None, None, 0),), (..., slice(None, None, -1)), (0, 0, 0, "a")]
    # Negative indices first, then those past the end from the last dimension back.
    cases += [(5, 5, 0), (5, 5, 5), (2, 7, 0), (-9, 9, 9), (9, -9), (1, -5, 9)]
    # ... a negative one in item order, before a later item's type or step is looked at.
    cases += [(-4, slice(None, None, 0)), (-4, "x"), (4, -5, 1.0)]
    # Shown as the slicer read them: bounds as integers, no step of 1, negatives wrapped.
    cases += [(slice(2, 1, 1), 9), (slice(np.int64(1), None), 9), (-1, 9), (slice(None), -1, 9)]
    cases += [(slice(torch.tensor(1), None), 9), (0, 0, 0, -1)]
    with ref.safe_open(str(model), "np") as r, safe_open(model, "np") as o:
        for index in cases:
            theirs = _outcome(lambda i=index: r.get_slice("a")[i])
            mine = _outcome(lambda i=index: o.get_slice("a")[i])
            assert theirs[0] == mine[0] == "error"
            assert mine[2].startswith(theirs[2]), (index, theirs[2], mine[2])


def test_slice_error_texts_of_a_0_d_tensor_match_the_reference(tmp_path: Path) -> None:
    path = tmp_path / "scalar.safetensors"
    ref_np.save_file({"c": np.array(1.0, np.float32), "b": np.zeros(7, np.float32)}, str(path))
    cases: list[tuple[str, Any]] = [
        ("c", "a"), ("c", 1.0), ("c", slice(None, None, -1)), ("c", (..., 0)), ("c", []),
        ("b", (1, ..., 2)), ("b", (slice(None), -1)), ("c", -1),
    ]  # fmt: skip
    with ref.safe_open(str(path), "np") as r, safe_open(path, "np") as o:
        for name, index in cases:
            theirs = _outcome(lambda n=name, i=index: r.get_slice(n)[i])
            mine = _outcome(lambda n=name, i=index: o.get_slice(n)[i])
            assert theirs[0] == mine[0] == "error"
            # The reference's words, then the tensor the index was for.
            assert mine[2] == f"{theirs[2]} (tensor {name!r})", (name, index, theirs[2], mine[2])
    with safe_open(path, "np") as o, pytest.raises(SliceError) as out_of_range:
        o.get_slice("b")[[10]]  # index arrays are ours (the reference refuses lists)
    assert str(out_of_range.value).startswith("Error during slicing [[10]] with shape [7]: ")


# ----------------------------------------------------------------------------- save errors


@pytest.mark.parametrize("kind", ["missing folder", "target is a folder"])
def test_save_io_errors_are_safetensor_errors(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "nope" / "x.st" if kind == "missing folder" else tmp_path
    with pytest.raises(ref.SafetensorError, match="Error while serializing: I/O error: "):
        ref_np.save_file({"a": np.zeros(3)}, str(target))
    expected_os = FileNotFoundError if kind == "missing folder" else IsADirectoryError
    for save in (
        lambda: ours_np.save_file({"a": np.zeros(3)}, target),
        lambda: ours_torch.save_file({"a": torch.zeros(3)}, target),
    ):
        with pytest.raises(SafetensorError) as info:
            save()
        err = info.value
        assert isinstance(err, WriteError) and isinstance(err, expected_os)
        assert str(err).startswith("Error while serializing: I/O error: ")
        assert f'at path "{target}"' in str(err)  # the target, not the temporary file
        assert err.errno is not None and err.filename == str(target)
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and back.errno == err.errno and str(back) == str(err)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []


@pytest.mark.parametrize("existing", [True, False])
def test_a_file_name_ending_in_a_separator_is_not_a_directory(
    tmp_path: Path, existing: bool
) -> None:
    """As the reference: ENOTDIR, whether or not a folder of that name exists."""
    target = str(tmp_path) + "/" if existing else str(tmp_path / "new.safetensors") + "/"
    with pytest.raises(ref.SafetensorError) as theirs:
        ref_np.save_file({"a": np.zeros(3)}, target)
    for save in (
        lambda: ours_np.save_file({"a": np.zeros(3)}, target),
        lambda: ours_torch.save_file({"a": torch.zeros(3)}, target),
        lambda: pysafetensors.serialize_file({}, target),
    ):
        with pytest.raises(NotADirectoryError) as mine:
            save()
        assert isinstance(mine.value, WriteError)
        assert str(mine.value).startswith(str(theirs.value))  # then: at path "<target>"
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    folder = tmp_path / "out"
    pysafetensors.save_sharded({"a": np.zeros(3)}, str(folder) + "/")  # a folder may end so
    assert [p.name for p in folder.iterdir()] == ["model.safetensors"]


# --------------------------------------------------------------------- TensorSpec arguments


@pytest.mark.parametrize(
    "change",
    [
        {"shape": [-1]},
        {"shape": [1 << 64]},
        {"shape": [1.5]},
        {"shape": [-1, -1]},
        {"data_ptr": -1},
        {"data_ptr": 1 << 64},
        {"data_len": -1},
        {"shape": [True, 1]},
        {"shape": np.array([1])},
        {"shape": "ab"},
        {"shape": None},
        {"shape": 3},
        {"shape": {"a": 1}},
        {"dtype": None},
        {"dtype": 5},
    ],
)
def test_tensor_spec_checks_arguments_like_the_reference(change: dict[str, Any]) -> None:
    data = np.zeros(1, np.float32)
    args = {"dtype": "float32", "shape": [1], "data_ptr": data.ctypes.data, "data_len": 4}
    args.update(change)
    theirs = _outcome(lambda: ref.serialize({"x": ref.TensorSpec(**args)}))
    mine = _outcome(lambda: pysafetensors.serialize({"x": pysafetensors.TensorSpec(**args)}))
    if theirs[0] == "ok":
        assert mine == theirs
    else:
        assert mine[0] == "error" and mine[1] is theirs[1] and mine[2] == theirs[2]


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((1,), {}),
        (("float32", [1], 0, 0), {}),
        ((1,), {"x": 1}),
        ((), {}),
        ((), {"dtype": "float32"}),
        ((), {"dtype": "float32", "shape": [1]}),
        ((), {"dtype": "float32", "shape": [1], "data_ptr": 0}),
        ((), {"dtype": "float32", "x": 1}),
        ((), {"dtype": "float32", "shape": [1], "data_ptr": 0, "data_len": 0, "size": 0}),
    ],
)
def test_tensor_spec_refuses_wrong_arguments_in_the_reference_s_words(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    # Python's words were its own (``__init__() takes 1 positional argument but 2 were
    # given``, ``keyword-only arguments``); the reference's bindings word it from __new__.
    theirs = _outcome(lambda: ref.TensorSpec(*args, **kwargs))
    mine = _outcome(lambda: pysafetensors.TensorSpec(*args, **kwargs))
    assert theirs[0] == "error" and mine == theirs


def test_tensor_spec_copies_as_itself_and_does_not_pickle() -> None:
    import copy

    spec = pysafetensors.TensorSpec(dtype="float32", shape=[0], data_ptr=0, data_len=0)
    assert copy.copy(spec) is spec and copy.deepcopy(spec) is spec
    with pytest.raises(TypeError, match="cannot pickle 'TensorSpec' object"):
        pickle.dumps(spec)  # a memory address means nothing in another process


def test_tensor_spec_refuses_a_null_pointer_instead_of_crashing() -> None:
    # The reference dereferences it (the interpreter dies); we refuse.
    with pytest.raises(pysafetensors.SerializeError, match="data_ptr is null"):
        pysafetensors.TensorSpec(dtype="float32", shape=[1], data_ptr=0, data_len=4)
    empty = pysafetensors.TensorSpec(dtype="float32", shape=[0], data_ptr=0, data_len=0)
    assert pysafetensors.serialize({"x": empty}) == ref.serialize(
        {"x": ref.TensorSpec(dtype="float32", shape=[0], data_ptr=0, data_len=0)}
    )


# -------------------------------------------------------------- names, keywords, constructors


def test_safetensor_error_takes_any_arguments() -> None:
    for args in [(), ("a", 1), ("only",)]:
        mine, theirs = SafetensorError(*args), ref.SafetensorError(*args)
        assert mine.args == theirs.args and str(mine) == str(theirs)
        back = pickle.loads(pickle.dumps(mine))
        assert back.args == mine.args


def test_deserialize_bytes_keyword() -> None:
    blob = ref_np.save({"a": np.arange(3, dtype=np.int16)})
    assert pysafetensors.deserialize(bytes=blob) == [
        (name, {**info, "data": bytearray(info["data"])}) for name, info in ref.deserialize(blob)
    ]


@pytest.mark.parametrize("value", ["text", 5, None, [1, 2], np.zeros(4)[::2]])
def test_bytes_arguments_that_are_no_buffer_are_refused_in_the_reference_s_words(
    value: Any,
) -> None:
    # deserialize quoted memoryview's words ("a bytes-like object is required, not 'str'").
    for ours, theirs in [
        (pysafetensors.deserialize, ref.deserialize),
        (ours_np.load, ref_np.load),
        (ours_torch.load, ref_torch.load),
    ]:
        mine, expected = _outcome(lambda f=ours: f(value)), _outcome(lambda f=theirs: f(value))
        assert expected[:2] == ("error", TypeError) and mine[:2] == expected[:2]
        assert mine[2].startswith(expected[2])


def test_every_load_takes_any_contiguous_buffer() -> None:
    # numpy.load and torch.load refused a numpy buffer that deserialize took.
    blob = ref_np.save({"a": np.arange(3, dtype=np.int16)})
    for data in (bytearray(blob), memoryview(blob), np.frombuffer(blob, np.uint8)):
        assert ours_np.load(data)["a"].tolist() == [0, 1, 2]
        assert ours_torch.load(data)["a"].tolist() == [0, 1, 2]
        assert pysafetensors.deserialize(data)[0][1]["shape"] == [3]


@pytest.mark.parametrize(
    "device",
    [1 << 64, 1 << 70, "cuda:", "cuda:x", "cuda:18446744073709551616", "mps:1", "cuda:²"]
    # More than one ':' (SafetensorError, not the index parser's ValueError), and "cpu:..."
    # that is no "cpu:N" (which we take, as torch does).
    + ["cuda:0:0", "cuda::", "cuda:0:", "mps:0:1", "npu:0:0", "xla:x:1"]
    + ["cpu:x", "cpu:", "cpu:+1", "cpu:01", "cpu:1:0"],
)
def test_device_texts_match_the_reference(model: Path, device: Any) -> None:
    theirs = _outcome(lambda: ref.safe_open(str(model), "pt", device=device))
    mine = _outcome(lambda: safe_open(model, "pt", device=device))
    assert theirs[0] == mine[0] == "error"
    assert mine[2] == theirs[2]
    assert issubclass(mine[1], ValueError) == issubclass(theirs[1], ValueError)


@pytest.mark.filterwarnings("ignore:Using a non-tuple sequence")  # torch's, in the reference
def test_slice_errors_are_of_the_reference_s_builtin_classes(model: Path) -> None:
    """Whatever the reference's paths raise for a bad index (a TypeError for a float bound, a
    ValueError for a step torch refuses, ...), ours is an instance of that class too."""
    cases: list[Any] = [slice(1.0, 2), slice(None, 2.5), slice(None, None, "x"), "0", b"0", 1.5]
    cases += [slice(None, None, 0), slice(None, None, -1), (0, "x"), (slice(2.5, None), "x")]
    cases += [object(), {1: 2}, (0, 0, 0, 0), (9,), (0, slice(None), 1.5)]
    for framework in ("np", "pt"):
        for backend in ("mmap", "pread"):
            with (
                ref.safe_open(str(model), framework, backend=backend) as r,
                safe_open(model, framework, backend=backend) as o,
            ):
                for index in cases:
                    theirs = _outcome(lambda i=index: r.get_slice("a")[i])
                    mine = _outcome(lambda i=index: o.get_slice("a")[i])
                    assert theirs[0] == mine[0] == "error", (framework, backend, index)
                    assert issubclass(mine[1], SliceError)
                    for builtin in (TypeError, ValueError, IndexError):
                        if issubclass(theirs[1], builtin):
                            assert issubclass(mine[1], builtin), (framework, backend, index)
                    if isinstance(index, slice) and theirs[1] is TypeError and framework == "np":
                        assert mine[2] == f"{theirs[2]} (tensor 'a')"  # the slicer's words


def test_torch_reads_a_list_of_sequences_as_a_tuple_like_the_reference(model: Path) -> None:
    """torch (so the reference's mmap torch slices) reads ``t[[[0, 1], [1, 0]]]`` as
    ``t[[0, 1], [1, 0]]``, with its deprecation warning; numpy 2 as one index array."""
    whole = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    cases: list[Any] = [[[0, 1], [1, 0]], [[0, 1]], [[]], [torch.tensor(0), torch.tensor(1)]]
    cases += [[0, slice(None)], [slice(None), 0], [None, 0], [0, ...], [np.array([0, 2]), 1]]
    plain: list[Any] = [[0, 1], [np.int64(2), 0]]  # integers only: one index array in torch
    with ref.safe_open(str(model), "pt") as r, safe_open(model, "pt") as o:
        for index, as_tuple in [(i, True) for i in cases] + [(i, False) for i in plain]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                mine = o.get_slice("a")[index]
                theirs = r.get_slice("a")[index]
                expected = whole[index]
            said = [str(w.message) for w in caught if w.category is UserWarning]
            assert len(said) == (3 if as_tuple else 0), index
            # torch adds where it was triggered: "(Triggered internally at ...)".
            assert all(text.startswith(said[0]) for text in said), said
            assert caught[0].filename == __file__ if as_tuple else True  # the caller's line
            assert mine.shape == theirs.shape == expected.shape, index
            assert torch.equal(mine, theirs.contiguous()), index
    with safe_open(model, "np") as o:
        assert o.get_slice("a")[[[0, 1], [1, 0]]].shape == (2, 2, 4, 5)  # numpy's rule


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_handles_and_slices_refuse_pickle_and_copy_like_the_reference_s(
    tmp_path: Path, backend: str
) -> None:
    """A copy shared the original's file and released it again when collected (a copied slice
    closed the file under the original)."""
    import copy

    path = tmp_path / "t.safetensors"
    ref_np.save_file({"w": np.arange(3, dtype=np.float32)}, path)
    with (
        ref.safe_open(str(path), "np", backend=backend) as r,
        safe_open(path, "np", backend=backend) as o,
    ):
        for action in (pickle.dumps, copy.copy, copy.deepcopy):
            for theirs_obj, mine_obj in ((r, o), (r.get_slice("w"), o.get_slice("w"))):
                theirs = _outcome(lambda a=action, x=theirs_obj: a(x))
                mine = _outcome(lambda a=action, x=mine_obj: a(x))
                assert mine == theirs and mine[1] is TypeError, (action, mine, theirs)
        sliced = o.get_slice("w")
        assert sliced[1:].tolist() == [1.0, 2.0]
    assert sliced[:].tolist() == [0.0, 1.0, 2.0]  # outlives the handle, as before
    folder = tmp_path / "sharded"
    folder.mkdir()
    pysafetensors.save_sharded({"w": np.zeros(2, np.float32)}, folder, max_shard_size=4)
    with safe_open(folder, "np") as sharded:
        for action in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(TypeError, match="cannot pickle 'builtins.safe_open' object"):
                action(sharded)


class _RefusesNumpy:
    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        raise TypeError("cannot convert _RefusesNumpy")


@pytest.mark.parametrize("module", ["flax", "mlx", "tensorflow"])
def test_a_value_the_framework_cannot_convert_raises_its_own_error(module: str) -> None:
    """As the reference: the conversion's own exception (``except RuntimeError`` around a save
    of a tensor that requires grad keeps working), with a note naming the tensor."""
    import importlib

    if module == "tensorflow":
        pytest.importorskip("paddle")  # paddle must be imported before tensorflow
    pytest.importorskip({"flax": "jax", "mlx": "mlx.core", "tensorflow": "tensorflow"}[module])
    theirs_module = importlib.import_module(f"safetensors.{module}")
    mine_module = importlib.import_module(f"pysafetensors.{module}")
    values: list[Any] = [torch.ones(2, requires_grad=True)]
    if module != "tensorflow":  # its save calls .numpy(), which these have not
        values += [_RefusesNumpy(), [[1.0], [1.0, 2.0]]]
    for value in values:
        theirs = _outcome(lambda v=value: theirs_module.save({"x": v}))
        with pytest.raises(Exception) as mine:  # noqa: PT011 - compared with the reference's
            mine_module.save({"x": value})
        assert theirs[0] == "error"
        assert (type(mine.value), str(mine.value)) == theirs[1:]
        if sys.version_info >= (3, 11):
            assert any("tensor `x`" in note for note in mine.value.__notes__)


def test_arguments_are_checked_in_the_reference_s_order(tmp_path: Path) -> None:
    """With several bad arguments, the same one is reported: the path's type, the framework,
    the device, the backend; a name's type before the handle's state."""
    import functools
    import io
    import itertools

    path = _write(tmp_path)
    folder = tmp_path / "sharded"
    folder.mkdir()
    pysafetensors.save_sharded({"w": np.zeros(2, np.float32)}, folder)
    files: list[Any] = [str(path), 5]
    frameworks: list[Any] = ["np", "bogus", 3]
    devices: list[Any] = ["cpu", "bogus", -1]
    backends: list[Any] = ["mmap", "bogus", 2]
    for file, framework, device, backend in itertools.product(files, frameworks, devices, backends):
        if (framework, device, backend) == ("np", "cpu", "mmap"):
            continue
        args = (framework,)
        options = {"device": device, "backend": backend}
        theirs = _outcome(functools.partial(ref.safe_open, file, *args, **options))
        mine = _outcome(functools.partial(safe_open, file, *args, **options))
        assert mine[0] == theirs[0] == "error"
        assert (mine[1].__name__, mine[2]) == (theirs[1].__name__, theirs[2])
        if file != 5:  # a folder opens as a sharded checkpoint, checked alike
            sharded = _outcome(functools.partial(safe_open, folder, *args, **options))
            assert sharded[1:] == mine[1:], (framework, device, backend)
        stream = io.BytesIO()
        handle = _outcome(
            functools.partial(pysafetensors._safe_open_handle, stream, *args, **options)
        )
        theirs_handle = _outcome(functools.partial(ref._safe_open_handle, stream, *args, **options))
        assert (handle[1].__name__, handle[2]) == (theirs_handle[1].__name__, theirs_handle[2])
    for target in (path, folder):
        closed = safe_open(target, "np")
        closed.close()
        for method in ("get_tensor", "get_slice"):
            with pytest.raises(TypeError, match="argument 'name': 'int' object is not an instance"):
                getattr(closed, method)(1)


def test_handles_and_slices_are_always_true_like_the_reference_s(tmp_path: Path) -> None:
    """They have a length (ours only), which must not make them false or raise in ``if``."""
    path = tmp_path / "t.safetensors"
    ref_np.save_file({"c": np.array(1.0, np.float32), "e": np.zeros((0, 3), np.float32)}, path)
    empty = tmp_path / "empty.safetensors"
    ref_np.save_file({}, empty)
    for lib in (ref, pysafetensors):
        with lib.safe_open(str(path), "np") as f:
            assert bool(f.get_slice("c")) and bool(f.get_slice("e"))
        assert bool(f)  # closed
        with lib.safe_open(str(empty), "np") as f:
            assert bool(f)


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_negative_device_refused_at_open(model: Path, framework: str) -> None:
    with pytest.raises(ref.SafetensorError) as theirs:
        ref.safe_open(str(model), framework, device=-1)
    with pytest.raises(SafetensorError) as mine:
        safe_open(model, framework, device=-1)
    assert str(mine.value) == str(theirs.value) == "device -1 is invalid"


def test_ndarray_subclasses_save_their_data_like_the_reference() -> None:
    values: list[np.ndarray] = [
        np.ma.array([1, 2, 3], dtype=np.float32, mask=[0, 1, 0]),
        np.asarray([[1, 2], [3, 4]], dtype=np.int16).view(np.memmap),
    ]
    for value in values:
        assert ours_np.save({"a": value}) == ref_np.save({"a": value})


def test_shared_tensor_message_is_the_reference_text() -> None:
    a = torch.arange(6.0)
    with pytest.raises(RuntimeError) as theirs:
        ref_torch.save({"a": a, "b": a})
    with pytest.raises(RuntimeError) as mine:
        ours_torch.save({"a": a, "b": a})
    # The group is a set: its order follows string hashing, the same in one process.
    assert str(mine.value) == str(theirs.value)


def test_torch_module_helper_names() -> None:
    assert set(ref_torch._TYPES.items()) <= set(ours_torch._TYPES.items())
    assert set(ref_torch._SIZE.items()) <= set(ours_torch._SIZE.items())
    assert ours_torch._getdtype("BF16") is torch.bfloat16
    blob = ref_torch.save({"a": torch.arange(6).reshape(2, 3), "e": torch.zeros(0, 2)})
    mine = ours_torch._view2torch(ref.deserialize(blob))
    theirs = ref_torch._view2torch(ref.deserialize(blob))
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert ours_torch.safe_open is pysafetensors.safe_open
    for name in ("serialize", "serialize_file", "deserialize"):
        assert getattr(ours_torch, name) is getattr(pysafetensors, name)


@pytest.mark.parametrize("module", ["flax", "mlx"])
def test_python_numbers_and_lists_save_like_the_reference(module: str) -> None:
    pytest.importorskip("jax" if module == "flax" else "mlx.core")
    import importlib

    mine = importlib.import_module(f"pysafetensors.{module}")
    theirs = importlib.import_module(f"safetensors.{module}")
    for value in [1.0, 3, True, [1, 2], [[1.5]]]:
        assert mine.save({"a": value}) == theirs.save({"a": value}), value
    # A string is an array of str for numpy: the reference's "Unknown dtype" text.
    with pytest.raises(pysafetensors.SerializeError, match='Unknown dtype "str128"'):
        mine.save({"a": "text"})


def test_argument_type_errors_have_the_reference_texts() -> None:
    calls = [
        ("save", lambda m: m.save({"a": np.zeros(1)}, metadata=[1])),
        ("save", lambda m: m.save({"a": np.zeros(1)}, metadata={"a": 1})),
        ("save", lambda m: m.save({"a": np.zeros(1)}, metadata={1: "a"})),
        ("save", lambda m: m.save({1: np.zeros(1)})),
        ("serialize", lambda m: m.serialize([1])),
    ]
    for kind, call in calls:
        theirs_module, mine_module = (ref_np, ours_np) if kind == "save" else (ref, pysafetensors)
        theirs = _outcome(lambda c=call, m=theirs_module: c(m))
        mine = _outcome(lambda c=call, m=mine_module: c(m))
        assert theirs[0] == mine[0] == "error" and mine[1] is theirs[1] is TypeError
        assert mine[2].startswith(theirs[2]), (mine[2], theirs[2])


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_edits_to_a_loaded_tensor_show_where_the_reference_s_do(
    model: Path, framework: str
) -> None:
    """numpy arrays are the reference's copies, so an edit never shows in a later read of the
    same handle; torch tensors view the handle's one mapping in both libraries, so it does
    (and never in the file, nor in another handle)."""

    def reads_after_an_edit(lib: Any) -> tuple[list[float], list[float], list[float]]:
        with lib.safe_open(model, framework) as f:
            first = f.get_tensor("a")
            first *= 10
            again = f.get_tensor("a").reshape(-1)[:3].tolist()
            every = {k: f.get_tensor(k) for k in f.keys()}["a"].reshape(-1)[:3].tolist()  # noqa: SIM118 - the reference is not iterable
        with lib.safe_open(model, framework) as f:
            fresh = f.get_tensor("a").reshape(-1)[:3].tolist()
        return again, every, fresh

    assert reads_after_an_edit(pysafetensors) == reads_after_an_edit(ref)
    if framework == "np":
        with safe_open(model, "np") as f:
            all_at_once = f.get_tensors()
            all_at_once["a"][:] = 7
            assert f.get_tensors()["a"].reshape(-1)[:3].tolist() == [0.0, 1.0, 2.0]
            assert all_at_once["a"].flags.writeable


@pytest.mark.parametrize("method", ["get_tensor", "get_slice"])
def test_a_name_that_is_not_a_str_is_the_reference_s_type_error(
    model: Path, method: str, tmp_path: Path
) -> None:
    from pysafetensors import save_sharded

    with ref.safe_open(model, "pt") as f:
        theirs = _outcome(lambda: getattr(f, method)(1))
    assert theirs[0] == "error" and theirs[1] is TypeError
    with ours_torch.safe_open(model, "pt") as f:
        assert _outcome(lambda: getattr(f, method)(1)) == theirs
    save_sharded({"a": np.zeros(3)}, tmp_path / "folder", 10)
    with safe_open(tmp_path / "folder", "np") as f:
        assert _outcome(lambda: getattr(f, method)(1)) == theirs


def test_numpy_module_names_and_helpers_match_the_reference(tmp_path: Path) -> None:
    public = {k for k in dir(ref_np) if not k.startswith("__")}
    ours_names = set(dir(ours_np))
    helpers = {"_TYPES", "_getdtype", "_view2np", "_is_little_endian", "_flatten"}
    reexports = {"safe_open", "serialize", "serialize_file", "deserialize"}
    assert helpers | reexports <= ours_names
    assert helpers | reexports <= public
    # The reference's table, entry for entry (ours adds BF16 and the FP8 types).
    assert all(ours_np._TYPES[k] is v for k, v in ref_np._TYPES.items())
    arrays = {"x": np.arange(6, dtype=">f4").reshape(2, 3), "y": np.ones(2, np.int16)}
    keep: list[Any] = []
    assert pysafetensors.serialize(ours_np._flatten(arrays, keep)) == ref.serialize(
        ref_np._flatten(arrays, [])
    )
    assert len(keep) == 1  # the byte-swapped copy of the big-endian array
    data = ours_np.serialize(ours_np._flatten(arrays, []))
    got = ours_np._view2np(ours_np.deserialize(data))
    assert all(np.array_equal(got[k], v) for k, v in arrays.items())
    assert ours_np._is_little_endian(np.zeros(1, "<f4"))
    assert not ours_np._is_little_endian(np.zeros(1, ">f4"))
    with ours_np.safe_open(_write(tmp_path), "np") as f:
        assert f.keys() == ["w"]


def _write(tmp_path: Path) -> Path:
    path = tmp_path / "w.safetensors"
    ref_np.save_file({"w": np.ones(3)}, path)
    return path


def test_safe_open_handle_behaves_as_the_reference_s(tmp_path: Path) -> None:
    import io

    path = _write(tmp_path)
    with open(path, "rb") as fh, pysafetensors._safe_open_handle(fh, "np") as f:
        assert f.get_tensor("w").tolist() == [1.0, 1.0, 1.0]
    for bad in (io.BytesIO(b"x"), object()):
        theirs = _outcome(lambda b=bad: ref._safe_open_handle(b, "np"))
        mine = _outcome(lambda b=bad: pysafetensors._safe_open_handle(b, "np"))
        assert mine == theirs and mine[1] is AttributeError


def test_framework_and_f4_spec_errors_match_the_reference(model: Path) -> None:
    for framework in (None, 1):
        theirs = _outcome(lambda fw=framework: ref.safe_open(model, fw))
        mine = _outcome(lambda fw=framework: safe_open(model, fw))
        assert mine == theirs and mine[1] is TypeError
    spec = {"dtype": "float4_e2m1fn_x2", "shape": [2**63], "data_ptr": 1, "data_len": 6}
    theirs = _outcome(lambda: ref.TensorSpec(**spec))
    mine = _outcome(lambda: pysafetensors.TensorSpec(**spec))
    assert theirs[0] == mine[0] == "error" and mine[2] == theirs[2]
    assert issubclass(mine[1], SafetensorError)


def test_lazy_conjugate_and_negative_views_are_saved_with_their_values(tmp_path: Path) -> None:
    """A view whose memory holds the values before ``conj()``/negation: written as it is (the
    reference does) the file holds the wrong values; here the view is resolved first."""
    conj = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    neg = torch.tensor([1.0, 2.0])._neg_view()
    assert conj.is_conj() and neg.is_neg()
    loaded = ours_torch.load(ours_torch.save({"c": conj, "n": neg}))
    assert torch.equal(loaded["c"], conj.resolve_conj())
    assert loaded["n"].tolist() == [-1.0, -2.0]
    ours_torch.save_file({"c": conj}, tmp_path / "c.safetensors")
    assert torch.equal(ref_torch.load_file(tmp_path / "c.safetensors")["c"], conj.resolve_conj())


def _freed() -> Any:
    t = torch.ones(4)
    t.untyped_storage().resize_(0)  # as FSDP frees a sharded parameter: a null pointer
    return t


def _fake() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.ones(2)


def _shrunk() -> Any:
    t = torch.ones(4)
    t.untyped_storage().resize_(4)  # 4 bytes under a 16-byte tensor
    return t


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
@pytest.mark.parametrize("make", [_freed, _fake, _shrunk])
def test_a_tensor_without_memory_is_refused_not_read(tmp_path: Path, make: Any) -> None:
    """Reading it would read address 0 (the interpreter died) or past the storage (the
    reference saves whatever lies there when the storage was shrunk)."""
    tensor = make()
    target = tmp_path / "m.safetensors"
    ours_torch.save_file({"ok": torch.zeros(1)}, target)
    before = target.read_bytes()
    calls = [
        lambda: ours_torch.save({"x": tensor}),
        lambda: ours_torch.save_file({"x": tensor}, target),
    ]
    for call in calls:
        with pytest.raises(pysafetensors.SerializeError) as info:
            call()
        assert str(info.value).startswith(
            "Error while serializing: invalid shape, data type, or offset for tensor `x`"
        )
        assert info.value.tensor == "x"
    assert target.read_bytes() == before
    if make is not _shrunk:
        with pytest.raises(ref.SafetensorError, match="invalid shape, data type, or offset"):
            ref_torch.save({"x": tensor})


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_strided_nested_tensor_is_refused_by_name(tmp_path: Path) -> None:
    """Its layout is strided but it has no shape: torch's RuntimeError escaped, naming no
    tensor (the reference's too)."""
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    assert nested.layout is torch.strided and nested.is_nested
    for save in (
        lambda: ours_torch.save({"layer.weight": nested}),
        lambda: ours_torch.save_file({"layer.weight": nested}, tmp_path / "n.safetensors"),
    ):
        with pytest.raises(pysafetensors.SerializeError, match="is a nested tensor") as info:
            save()
        assert info.value.tensor == "layer.weight"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize(
    "case",
    ["meta", "complex128", "quantized", "nested", "meta_model"],
)
def test_tensors_that_cannot_be_saved_raise_the_reference_s_class_too(
    tmp_path: Path, case: str
) -> None:
    """The reference does not check for these: its dtype table's KeyError or torch's own
    error comes out. Ours names the tensor and is a SerializeError, and also of the class the
    reference raises, so that an ``except`` written for it still catches ours."""
    if case == "meta":
        tensor = torch.ones(2, device="meta")
    elif case == "complex128":
        tensor = torch.ones(2, dtype=torch.complex128)
    elif case == "quantized":
        tensor = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    elif case == "nested":
        tensor = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    calls: list[tuple[Any, Any]] = []
    if case == "meta_model":
        with torch.device("meta"):
            model = torch.nn.Linear(2, 2)
        calls.append(
            (
                lambda: ref_torch.save_model(model, tmp_path / "r.safetensors"),
                lambda: ours_torch.save_model(model, tmp_path / "o.safetensors"),
            )
        )
    else:
        calls.append(
            (lambda: ref_torch.save({"w": tensor}), lambda: ours_torch.save({"w": tensor}))
        )
        calls.append(
            (
                lambda: ref_torch.save_file({"w": tensor}, tmp_path / "r.safetensors"),
                lambda: ours_torch.save_file({"w": tensor}, tmp_path / "o.safetensors"),
            )
        )
    for theirs, mine in calls:
        with pytest.raises(Exception) as ref_info:
            theirs()
        with pytest.raises(type(ref_info.value)) as info:
            mine()
        assert isinstance(info.value, pysafetensors.SerializeError)
        assert info.value.tensor in ("w", "weight")
    assert list(tmp_path.iterdir()) == []


def test_shared_tensor_groups_come_in_the_reference_s_order() -> None:
    u, v = torch.ones(2), torch.zeros(2)
    shared = {"z1": u, "z2": u, "a1": v, "a2": v}
    assert ours_torch._find_shared_tensors(shared) == ref_torch._find_shared_tensors(shared)
    theirs = _outcome(lambda: ref_torch.save(shared))
    mine = _outcome(lambda: ours_torch.save(shared))
    assert mine[2] == theirs[2]
    w, x = torch.zeros(4), torch.ones(4)
    partial = {"z1": w[:2], "z2": w[1:], "a": x[:2]}
    theirs = _outcome(lambda: ref_torch._remove_duplicate_names(partial))
    mine = _outcome(lambda: ours_torch._remove_duplicate_names(partial))
    assert mine[2] == theirs[2]


def test_transposed_and_expanded_views_of_a_shared_storage_are_found_not_crashed_on(
    tmp_path: Path,
) -> None:
    """The reference measures a shared tensor's extent by ``view(-1)``, which raises torch's
    ``view size is not compatible`` for a transposed or expanded view: neither the
    shared-tensor error nor ``save_model`` was reached (docs/differences.md)."""
    base = torch.arange(16.0).reshape(4, 4)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        ref_torch.save({"x": base, "y": base.t()})
    with pytest.raises(RuntimeError, match="Some tensors share memory") as info:
        ours_torch.save({"x": base, "y": base.t()})
    assert isinstance(info.value, SafetensorError)
    row = torch.arange(4.0).reshape(1, 4)
    assert ours_torch._find_shared_tensors({"r": row, "e": row.expand(3, 4)}) == [{"r", "e"}]
    # Disjoint halves stay apart, whether the second is transposed or not.
    halves = {"top": base[:2], "bottom": base[2:].t()}
    assert ours_torch._find_shared_tensors(halves) == [{"top"}, {"bottom"}]

    class Tied(torch.nn.Module):
        def __init__(self, weight: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("w", weight)
            self.register_buffer("w_t", weight.t())

    path = tmp_path / "tied.safetensors"
    ours_torch.save_model(Tied(base.clone()), path)
    with safe_open(path, "pt") as f:
        assert f.keys() == ["w"] and f.metadata() == {"w_t": "w"}
    loaded = Tied(torch.zeros(4, 4))
    assert ours_torch.load_model(loaded, path) == (set(), [])
    assert torch.equal(loaded.w, base) and torch.equal(loaded.w_t, base.t())


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")  # inside the reference
def test_save_model_hints_at_force_contiguous_only_where_it_helps(tmp_path: Path) -> None:
    with torch.device("meta"):
        meta_model = torch.nn.Linear(2, 2)
    with pytest.raises(SafetensorError) as info:
        ours_torch.save_model(meta_model, tmp_path / "m.safetensors")
    assert "force_contiguous" not in str(info.value) and info.value.kind == "MetaTensor"
    sparse = torch.nn.Module()
    sparse.register_buffer("s", torch.ones(2).to_sparse())
    theirs = _outcome(
        lambda: ref_torch.save_model(sparse, tmp_path / "r.safetensors", force_contiguous=False)
    )
    mine = _outcome(
        lambda: ours_torch.save_model(sparse, tmp_path / "s.safetensors", force_contiguous=False)
    )
    assert "force_contiguous=True" in mine[2] and mine[2] == theirs[2]
    # With the option given (the default), the hint told the user to pass it: left out. (The
    # reference crashes in torch's own `.contiguous()` of the sparse tensor instead.)
    with pytest.raises(SafetensorError, match="sparse tensors: `\\['s'\\]`") as info:
        ours_torch.save_model(sparse, tmp_path / "t.safetensors")
    assert "force_contiguous" not in str(info.value) and info.value.kind == "SparseTensor"
    with pytest.raises(RuntimeError, match="unsupported memory format"):
        ref_torch.save_model(sparse, tmp_path / "u.safetensors")


def test_none_arguments_have_the_reference_s_type_errors(model: Path) -> None:
    calls = [
        (lambda m: m.load_file(model, backend=None), "load_file"),
        (lambda m: m.save({"a": torch.ones(1)}, metadata={"k": None}), "save"),
        (lambda m: m.save({"a": torch.ones(1)}, metadata={"k": 1}), "save"),
    ]
    for call, _ in calls:
        theirs = _outcome(lambda c=call: c(ref_torch))
        mine = _outcome(lambda c=call: c(ours_torch))
        assert mine == theirs and mine[1] is TypeError


def test_unknown_numpy_dtypes_have_the_reference_s_text() -> None:
    # numpy's dtype name and the reference's list of supported dtypes, in its order (ours ends
    # with the two F6 types, which only we can write), then the tensor.
    for value in (np.array("abc"), np.array(None), np.array([1 + 2j])):
        theirs = _outcome(lambda v=value: ref_np.save({"a": v}))
        ours = _outcome(lambda v=value: ours_np.save({"a": v}))
        assert theirs[0] == ours[0] == "error"
        their_text = theirs[2]
        assert ours[2] == (their_text + ", float6_e2m3fn, float6_e3m2fn (tensor `a`)"), (
            f"{ours[2]!r} vs {their_text!r}"
        )


def test_load_of_something_not_bytes_has_the_reference_s_text() -> None:
    for value in ("abc", 5, None):
        theirs = _outcome(lambda v=value: ref_np.load(v))
        ours = _outcome(lambda v=value: ours_np.load(v))
        assert theirs == ours and ours[1] is TypeError


def test_mps_device_is_named_without_an_index(model: Path) -> None:
    # Reads "Device mps is not supported ...", as the reference's, for "mps" and "mps:0".
    for device in ("mps", "mps:0"):
        theirs = _outcome(lambda d=device: ref.safe_open(str(model), "flax", device=d))
        ours = _outcome(lambda d=device: safe_open(model, "flax", device=d))
        assert theirs[0] == ours[0] == "error"
        assert ours[2].startswith(theirs[2]), (ours, theirs)


def test_torch_module_has_the_reference_s_dtype_names() -> None:
    from pysafetensors.torch import (
        TensorSpec,
        _float4_e2m1_x2,
        _float8_e4m3fn,
        _float8_e8m0,
        _to_ndarray,
    )

    assert TensorSpec is pysafetensors.TensorSpec
    assert _float8_e4m3fn is ref_torch._float8_e4m3fn is torch.float8_e4m3fn
    assert _float8_e8m0 is ref_torch._float8_e8m0 and _float4_e2m1_x2 is ref_torch._float4_e2m1_x2
    t = torch.arange(4, dtype=torch.int16).reshape(2, 2).t()  # not contiguous: row-major bytes
    raw, same = _to_ndarray(t)  # (bytes, the tensor), as the reference's
    assert raw.tobytes() == t.contiguous().numpy().tobytes() and same is t


def test_torch_module_has_the_reference_s_save_helpers() -> None:
    """``_flatten_as_ptr`` and ``_evaluate_tensors_for_save`` take what the reference's take
    and give what ``serialize`` writes as the reference's own helpers do."""
    from pysafetensors.torch import _evaluate_tensors_for_save, _flatten_as_ptr, serialize

    tensors = {
        "f": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "e": torch.zeros(4, dtype=torch.float8_e4m3fn),
        "s": torch.tensor(3, dtype=torch.int64),
    }
    kept: list[Any] = []
    specs = _flatten_as_ptr(tensors, kept)
    assert list(specs) == list(tensors) and len(kept) == len(tensors)
    theirs = ref_torch.serialize(ref_torch._flatten_as_ptr(tensors, []))
    assert bytes(serialize(specs)) == bytes(theirs) == ref_torch.save(tensors)
    assert _evaluate_tensors_for_save(tensors) is None
    shared = {"a": tensors["f"], "b": tensors["f"]}
    for check in (_evaluate_tensors_for_save, ref_torch._evaluate_tensors_for_save):
        with pytest.raises(RuntimeError, match="Some tensors share memory"):
            check(shared)
        with pytest.raises(ValueError, match="Key `x` is invalid"):
            check({"x": 1.0})


def test_handles_left_open_at_exit_print_nothing(tmp_path: Path) -> None:
    # A handle still referenced by a module global is finalized while the interpreter tears
    # modules down; its __del__ printed "Exception ignored in ... 'NoneType' object is not
    # callable" (contextlib was already gone; seen with jax imported, which changes the
    # order of teardown). A streaming writer left open is aborted: no temporary file stays.
    import subprocess

    path = tmp_path / "m.safetensors"
    ours_np.save_file({"a": np.zeros(2)}, path)
    script = (
        "import contextlib, numpy, pysafetensors\n"
        "with contextlib.suppress(ImportError):\n"
        "    import jax\n"
        "from pysafetensors import safe_open, StreamingWriter\n"
        f"f = safe_open({str(path)!r}, 'np'); t = f.get_tensor('a'); s = f.get_slice('a')\n"
        f"g = safe_open({str(path)!r}, 'np', backend='pread')\n"
        f"w = StreamingWriter({str(tmp_path / 'w.safetensors')!r}, {{'a': ('F32', (2,))}})\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_loaded_tensors_have_storages_of_their_own(tmp_path: Path, backend: str) -> None:
    # As the reference's: saving what was just loaded must not see shared tensors, and the
    # hub's shard sizing and torch.save see each tensor alone.
    state = {f"t{i}": torch.full((1000,), float(i)) for i in range(4)}
    state["h"] = torch.ones(3, dtype=torch.float16)  # an odd offset for the next tensor
    state["i"] = torch.arange(5, dtype=torch.int64)
    path = tmp_path / "m.safetensors"
    ref_torch.save_file(state, str(path))
    for loaded in (ours_torch.load_file(path, backend=backend), ref_torch.load_file(str(path))):
        for name, tensor in loaded.items():
            assert tensor.untyped_storage().nbytes() == tensor.nbytes, name
            assert torch.equal(tensor, state[name])
    loaded = ours_torch.load_file(path, backend=backend)
    module = torch.nn.Module()
    for name, tensor in loaded.items():
        module.register_buffer(name, tensor)
    ours_torch.save_model(module, tmp_path / "again.safetensors")
    pysafetensors.save_sharded(loaded, tmp_path / "sharded", max_shard_size="5KB")
    again = ours_torch.load_file(tmp_path / "sharded")
    assert all(torch.equal(again[k], v) for k, v in state.items())


@pytest.mark.parametrize("metadata", ["text", [("k", "v")], (), []])
def test_save_model_checks_its_metadata_as_the_reference(tmp_path: Path, metadata: Any) -> None:
    net = torch.nn.Linear(2, 2)
    theirs = _outcome(lambda: ref_torch.save_model(net, str(tmp_path / "r.safetensors"), metadata))
    mine = _outcome(lambda: ours_torch.save_model(net, str(tmp_path / "o.safetensors"), metadata))
    assert mine == theirs and mine[1] is TypeError
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("filename", [None, 5, 1.5, ["m.safetensors"]])
def test_a_filename_that_is_no_path_is_the_reference_s_type_error(filename: Any) -> None:
    calls = [
        lambda m: m.load_file(filename),
        lambda m: m.save_file({"a": torch.ones(1)}, filename),
        lambda m: m.load_model(torch.nn.Linear(1, 1), filename),
        lambda m: m.save_model(torch.nn.Linear(1, 1), filename),
    ]
    for call in calls:
        theirs = _outcome(lambda c=call: c(ref_torch))
        mine = _outcome(lambda c=call: c(ours_torch))
        assert mine == theirs and mine[1] is TypeError, (mine, theirs)
    theirs = _outcome(lambda: ref.safe_open(filename, "np"))
    mine = _outcome(lambda: safe_open(filename, "np"))
    assert mine == theirs


def test_a_nul_in_a_filename_is_an_os_error_as_there(tmp_path: Path) -> None:
    path = str(tmp_path / "a\x00b.safetensors")
    for load in (ref_np.load_file, lambda p: ref.safe_open(p, "np")):
        with pytest.raises(FileNotFoundError):
            load(path)
    for load in (ours_np.load_file, lambda p: safe_open(p, "np")):
        with pytest.raises(FileNotFoundError, match="NUL"):
            load(path)
    with pytest.raises(ref.SafetensorError, match=r"Invalid argument \(os error 22\)"):
        ref_np.save_file({"a": np.ones(1)}, path)
    with pytest.raises(WriteError, match=r"Invalid argument \(os error 22\)") as info:
        ours_np.save_file({"a": np.ones(1)}, path)
    assert info.value.errno == 22 and isinstance(info.value, OSError)
    assert os.listdir(tmp_path) == []


def test_a_file_s_bytes_given_as_its_name_are_a_short_type_error(model: Path) -> None:
    """bytes name a file here, and a file's bytes hold NULs: the not-found error quoted all
    of them (16 MB of message for a 4 MB file). The reference refuses bytes as TypeError."""
    from pysafetensors.parallel import load_shard

    data = model.read_bytes()
    assert _outcome(lambda: ref.safe_open(data, "np"))[1] is TypeError
    for call in (lambda: safe_open(data, "np"), lambda: load_shard(data, 0, 2, {}, "np")):
        with pytest.raises(TypeError, match=r"bytes with a NUL byte") as info:
            call()
        assert len(str(info.value)) < 200 and "bytearray, memoryview or file object" in str(
            info.value
        )


@pytest.mark.parametrize(
    "device", [np.int64(0), np.int32(1), np.uint8(0), np.int64(-1), np.True_, np.float64(0)]
)
def test_numpy_scalars_as_devices_behave_as_there(model: Path, device: Any) -> None:
    theirs = _outcome(lambda: ref_torch.load_file(str(model), device=device))
    mine = _outcome(lambda: ours_torch.load_file(model, device=device))
    assert mine[0] == theirs[0] == "error"  # no accelerator here, or an invalid device
    assert mine[2] == theirs[2]


def test_a_lone_surrogate_in_metadata_is_placed_in_its_string() -> None:
    for metadata in ({"k": "ab\ud800"}, {"k\udc00": "v"}):
        theirs = _outcome(lambda m=metadata: ref_np.save({"a": np.ones(1)}, metadata=m))
        mine = _outcome(lambda m=metadata: ours_np.save({"a": np.ones(1)}, metadata=m))
        assert mine == theirs and mine[1] is UnicodeEncodeError


@pytest.mark.parametrize("metadata", [{"a": 1}, {1: "a"}, "text", {"k": "\udc00"}])
@pytest.mark.parametrize("save", [ours_np.save, ours_torch.save], ids=["numpy", "torch"])
def test_a_lone_surrogate_in_a_name_comes_before_bad_metadata(metadata: Any, save: Any) -> None:
    # The reference reads the names before the metadata: such a name is its first error (our
    # SerializeError for it, docs/differences.md), not the metadata's TypeError.
    array = np.ones(1) if save is ours_np.save else torch.ones(1)
    with pytest.raises(pysafetensors.SerializeError) as info:
        save({"\ud800": array}, metadata=metadata)
    assert info.value.kind == "InvalidName"
    theirs = _outcome(lambda: ref_np.save({"\ud800": np.ones(1)}, metadata=metadata))
    assert theirs[1] is UnicodeEncodeError and "'\\ud800'" in theirs[2]


def test_a_lone_surrogate_in_a_name_comes_before_the_reserved_name() -> None:
    # Whichever comes first in the dict: the reference reads every name before it looks for
    # __metadata__.
    for tensors in (
        {"__metadata__": np.ones(1), "\ud800": np.ones(1)},
        {"\ud800": np.ones(1), "__metadata__": np.ones(1)},
    ):
        with pytest.raises(pysafetensors.SerializeError) as info:
            ours_np.save(tensors)
        assert info.value.kind == "InvalidName"
        assert _outcome(lambda t=tensors: ref_np.save(t))[1] is UnicodeEncodeError


@pytest.mark.parametrize(
    ("value", "shown"),
    [([1.0], "list"), (None, "NoneType"), (torch.ones(1), "torch.Tensor"), (b"ab", "bytes")],
)
def test_numpy_save_names_the_type_of_a_value_that_is_no_array(value: Any, shown: str) -> None:
    # The reference fails with an AttributeError from deep inside; ours says what it got.
    with pytest.raises(SafetensorError, match=rf"tensor `a` is of type {shown}, expected a numpy"):
        ours_np.save({"a": value})


def test_f4_with_an_odd_last_dimension_in_torch_says_what_the_reference_says(
    tmp_path: Path,
) -> None:
    # torch holds F4 as pairs along the last dimension; an odd one cannot be loaded there. Our
    # message was all our own: code matching on the reference's words missed it.
    import struct

    header = b'{"t":{"dtype":"F4","shape":[2,1],"data_offsets":[0,1]}}'
    header += b" " * (-len(header) % 8)
    path = tmp_path / "f4.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"a")
    with ref.safe_open(str(path), "pt") as f, pytest.raises(Exception) as theirs:
        f.get_tensor("t")
    with safe_open(path, "pt") as f, pytest.raises(SafetensorError) as ours:
        f.get_tensor("t")
    assert str(ours.value).startswith(str(theirs.value))
    assert "framework='numpy'" in str(ours.value)


def _spec_cases() -> list[tuple[str, Any]]:
    ptr = np.zeros(2, np.float32).ctypes.data  # only checked, never read
    return [
        (
            "shape None, bad dtype",
            lambda m: m.TensorSpec(dtype="bogus", shape=None, data_ptr=ptr, data_len=8),
        ),
        (
            "shape int, bad dtype",
            lambda m: m.TensorSpec(dtype="x", shape=3, data_ptr=ptr, data_len=8),
        ),
        (
            "data_ptr -1, bad dtype",
            lambda m: m.TensorSpec(dtype="x", shape=[2], data_ptr=-1, data_len=8),
        ),
        ("serialize int value", lambda m: m.serialize({"t": 3})),
        ("serialize None name", lambda m: m.serialize({None: 3})),
        (
            "numpy save None name",
            lambda m: (ref_np if m is ref else ours_np).save({None: np.zeros(2)}),
        ),
    ]


@pytest.mark.parametrize("case", _spec_cases(), ids=[c[0] for c in _spec_cases()])
def test_argument_errors_of_writes_start_with_the_reference_s_words(case: Any) -> None:
    # Found by differential fuzzing of writes: TensorSpec checked the dtype's name before the
    # other arguments' types, and three messages were worded our own way.
    _, call = case
    with pytest.raises(Exception) as theirs:
        call(ref)
    with pytest.raises(Exception) as ours:
        call(pysafetensors)
    assert type(ours.value).__name__ == type(theirs.value).__name__
    assert str(ours.value).startswith(str(theirs.value))


@pytest.mark.parametrize("name", ["safe_open", "TensorSpec"])
def test_signatures_show_the_parameters_the_reference_shows(name: str) -> None:
    # Both classes define __new__(cls, *args, **kwargs): help() and IDEs showed only that.
    import inspect

    ours = inspect.signature(getattr(pysafetensors, name)).parameters
    theirs = inspect.signature(getattr(ref, name)).parameters
    for param in theirs.values():
        assert param.name in ours and ours[param.name].kind == param.kind, param


def test_subclasses_keep_their_own_signature_and_arguments() -> None:
    # The reference's classes cannot be subclassed; ours could, and the signature set on the
    # class (and TensorSpec's argument check) overrode a subclass's own.
    import inspect

    class Named(pysafetensors.safe_open):
        def __init__(self, path: str) -> None:
            super().__init__(path, "np")

    class Tagged(pysafetensors.TensorSpec):
        __slots__ = ("tag",)

        def __init__(self, *, tag: str, **spec: Any) -> None:
            super().__init__(**spec)
            self.tag = tag

    assert list(inspect.signature(Named).parameters) == ["path"]
    spec = Tagged(tag="t", dtype="float32", shape=[0], data_ptr=0, data_len=0)
    assert spec.tag == "t" and spec.shape == [0]
    assert list(inspect.signature(Tagged).parameters) == ["tag", "spec"]


def test_exit_takes_the_reference_s_three_arguments(tmp_path: Path) -> None:
    path = _write(tmp_path)
    for lib in (ref, pysafetensors):
        handle = lib.safe_open(str(path), "np")
        with pytest.raises(TypeError, match="missing 3 required positional arguments"):
            handle.__exit__()
        handle.__exit__(None, None, None)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((), {}),
        (("x",), {}),
        (("x", "np"), {"foo": 1}),
        (("x", "np", "cpu", "mmap"), {}),
        (("x", "np"), {"filename": "y"}),
        ((), {"framework": "np"}),
        (("x",), {"device": "cpu", "backend": "mmap"}),
    ],
)
def test_safe_open_refuses_wrong_arguments_in_the_reference_s_words(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    # Worded from __init__, the messages named it and counted `self` among the positional
    # arguments ("takes from 3 to 4 positional arguments but 5 were given").
    theirs = _outcome(lambda: ref.safe_open(*args, **kwargs))
    mine = _outcome(lambda: pysafetensors.safe_open(*args, **kwargs))
    assert theirs[0] == "error" and mine == theirs


def test_reversed_bounds_are_empty_where_the_reference_wraps_around(tmp_path: Path) -> None:
    """docs/differences.md: start > stop selects nothing. The reference's slicer computes the
    length as an unsigned difference: with a step it wraps around 2^64 (a reshape error, or
    a made-up dimension on a tensor with no elements)."""
    ref = pytest.importorskip("safetensors")
    from pysafetensors.numpy import save_file

    path = tmp_path / "r.safetensors"
    save_file({"e": np.zeros((3, 0), np.float32), "m": np.ones((4, 5), np.float32)}, path)
    for backend in ("mmap", "pread"):
        with pysafetensors.safe_open(path, "np", backend=backend) as f:
            assert f.get_slice("m")[3:1:2].shape == (0, 5)
            assert f.get_slice("e")[2 : 0 : 10**9].shape == (0, 0)
        with ref.safe_open(str(path), "numpy", backend=backend) as theirs:
            with pytest.raises(ValueError, match="cannot reshape"):
                theirs.get_slice("m")[3:1:2]
            assert theirs.get_slice("e")[2 : 0 : 10**9].shape == (18446744074, 0)
