"""Slicing (spec §4.4, ``_slicing``): numpy and torch, mmap and pread, agree with numpy indexing
of the full tensor on every dtype; errors are the same everywhere; pread reads only what it must.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import raw_file
from pysafetensors import SafetensorError, SliceError, safe_open
from pysafetensors._adapter import pack_subbyte
from pysafetensors._dtypes import DTYPES, dtype_from_code
from pysafetensors._reader import safe_open as reader_safe_open
from pysafetensors._slicing import plan_slice, render_index

SHAPE = (4, 6)

INDICES: list[Any] = [
    (),
    Ellipsis,
    0,
    -1,
    3,
    -4,
    slice(None),
    slice(1, 3),
    slice(0, 4, 2),
    slice(1, None, 3),
    (slice(None), 2),
    (slice(None), -1),
    (1, slice(2, 6)),
    (1, slice(0, 6, 2)),
    (slice(None), slice(0, 2)),
    (slice(None), slice(1, 3)),
    (slice(1, 3), slice(2, 6)),
    (Ellipsis, 1),
    (0, Ellipsis),
    (Ellipsis, slice(0, 4)),
    (0, Ellipsis, 5),
    [],
    # Out of range: clamped like numpy (the reference's Rust slicer raises; docs/differences.md).
    slice(0, 20),
    slice(10, None),
    slice(-2, None),
    slice(None, -1),
    slice(3, 1),
    (slice(None), slice(4, 100, 2)),
]


def _numpy_dtype(d: Any) -> np.dtype[Any]:
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, d.numpy, None) or d.numpy)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: Any) -> tuple[Path, dict[str, np.ndarray]]:
    """One tensor of shape (4, 6) per dtype, random bytes, written with our writer."""
    from pysafetensors.numpy import save_file

    rng = np.random.default_rng(3)
    tensors = {}
    for d in DTYPES:
        npdt = _numpy_dtype(d)
        count = SHAPE[0] * SHAPE[1]
        if d.packed:
            codes = rng.integers(0, 1 << d.bits, count, dtype=np.uint8)
            tensors[d.code] = codes.view(npdt).reshape(SHAPE)
        else:
            raw = rng.integers(0, 256, count * npdt.itemsize, dtype=np.uint8)
            if d.code == "BOOL":
                raw &= 1
            tensors[d.code] = raw.view(npdt).reshape(SHAPE)
    path = tmp_path_factory.mktemp("slices") / "all.safetensors"
    save_file(tensors, path)
    return path, tensors


def _expected_or_error(full: np.ndarray, code: str, index: Any) -> np.ndarray | str:
    d = next(d for d in DTYPES if d.code == code)
    try:
        plan_slice(SHAPE, d, index)
    except SliceError as exc:
        return exc.kind
    return full[index]


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("index", INDICES, ids=[render_index(i) for i in INDICES])
def test_numpy_and_torch_agree_with_numpy_indexing(
    sample: tuple[Path, dict[str, np.ndarray]], index: Any, backend: str
) -> None:
    torch = pytest.importorskip("torch")
    path, tensors = sample
    with safe_open(path, "np", backend=backend) as f, safe_open(path, "pt", backend=backend) as g:
        for code, full in tensors.items():
            d = next(d for d in DTYPES if d.code == code)
            expected = _expected_or_error(full, code, index)
            if isinstance(expected, str):
                # Sub-byte alignment errors: the same error from both frameworks.
                assert expected == "MisalignedSlice" and d.packed
                with pytest.raises(SliceError) as info:
                    f.get_slice(code)[index]
                assert info.value.kind == expected
                if d.torch is not None:
                    with pytest.raises(SliceError) as info:
                        g.get_slice(code)[index]
                    assert info.value.kind == expected
                continue
            got = f.get_slice(code)[index]
            assert got.dtype == expected.dtype and got.shape == expected.shape, code
            assert got.tobytes() == expected.tobytes(), code
            if d.torch is None:
                continue  # F6: torch has no such dtype
            t = g.get_slice(code)[index]
            if d.packed:
                want = pack_subbyte(np.ascontiguousarray(expected), d).tobytes()
                # torch holds F4 as pairs: the logical last dimension is halved.
                if expected.ndim:
                    assert tuple(t.shape) == (*expected.shape[:-1], expected.shape[-1] // 2)
            else:
                want = expected.tobytes()
                assert tuple(t.shape) == expected.shape
            assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == want, code


@pytest.mark.parametrize(
    ("index", "kind", "text"),
    [
        ((0, 0, 0), "TooManySlices", "more slicing indexes than dimensions in tensor"),
        ((Ellipsis, Ellipsis), "InvalidSlice", "Only one ellipsis (...) is allowed"),
        ((0, 1.5), "InvalidSlice", "Unsupported slice index at position 1"),
        ("a", "InvalidSlice", "expected slice, int, or ellipsis"),
        ([0, 9], "SliceOutOfRange", "index 9 out of bounds for tensor dimension #0 of size 4"),
        (np.array([0.5]), "InvalidSlice", "must be of integer or boolean type"),
        (slice(0, 2, 0), "InvalidSlice", "Slice step must be a positive integer, got 0"),
        (slice(None, None, -1), "InvalidSlice", "Slice step must be a positive integer, got -1"),
        (4, "SliceOutOfRange", "index 4 out of bounds for tensor dimension #0 of size 4"),
        (-5, "SliceOutOfRange", "Invalid index -5 for dimension 0 of size 4"),
        ((0, 6), "SliceOutOfRange", "index 6 out of bounds for tensor dimension #1 of size 6"),
        (slice(0, "x"), "InvalidSlice", "'str' object cannot be interpreted as an integer"),
    ],
)
@pytest.mark.parametrize("framework", ["np", "pt"])
def test_slice_errors(
    sample: tuple[Path, dict[str, np.ndarray]], index: Any, kind: str, text: str, framework: str
) -> None:
    if framework == "pt":
        pytest.importorskip("torch")
    path, _ = sample
    with safe_open(path, framework) as f, pytest.raises(SliceError) as info:
        f.get_slice("F32")[index]
    assert info.value.kind == kind
    assert text in str(info.value)
    assert isinstance(info.value, IndexError)


def test_error_renders_index(sample: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, _ = sample
    with safe_open(path, "np") as f, pytest.raises(SliceError) as info:
        f.get_slice("F32")[2:, 20]
    assert "[2:, 20]" in str(info.value)


def test_scalar_and_zero_size(tmp_path: Path) -> None:
    from pysafetensors.numpy import save_file

    path = tmp_path / "s.safetensors"
    save_file({"s": np.array(5, np.int32), "z": np.zeros((0, 3), np.float32)}, path)
    with safe_open(path, "np") as f:
        assert f.get_slice("s")[()] == 5
        assert f.get_slice("s")[...] == 5
        with pytest.raises(SliceError):
            f.get_slice("s")[0]
        with pytest.raises(SliceError):
            f.get_slice("s")[[]]
        assert f.get_slice("z")[:, 1:].shape == (0, 2)
        assert f.get_slice("z")[:5].shape == (0, 3)


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_slices_of_a_dimension_past_63_bits_are_named_errors(
    tmp_path: Path, framework: str
) -> None:
    """A zero-size tensor may declare a dimension of 2^63 or more: its slices raised Python's
    OverflowError (``len`` of the range), no SafetensorError."""
    if framework == "pt":
        pytest.importorskip("torch")
    huge = 2**63 + 5
    header = {"a": {"dtype": "F32", "shape": [huge, 0], "data_offsets": [0, 0]}}
    path = tmp_path / "huge.safetensors"
    path.write_bytes(raw_file(header))
    with safe_open(path, framework) as f:
        s = f.get_slice("a")
        for index, rows in ((..., huge), (slice(1, None), huge - 1)):
            with pytest.raises(SafetensorError, match=rf"tensor `a` \(F32 \[{rows}, 0\]\)"):
                s[index]
        assert tuple(s[:5].shape) == (5, 0)
        assert tuple(s[huge - 2 :].shape) == (2, 0)


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_a_range_index_is_bounded_by_its_dimension_before_it_is_built(
    tmp_path: Path, framework: str
) -> None:
    """A range is an index list of any length for a few bytes: ``range(2**40)`` was expanded
    value by value (hours, 8 TiB) before its bounds were checked, and a range past 2^63
    raised numpy's OverflowError. A short one is checked as any index array: only where the
    selection is not empty (numpy), or where an element is picked (torch)."""
    if framework == "pt":
        pytest.importorskip("torch")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    header = {
        "a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
        "e": {"dtype": "F32", "shape": [0, 2**40], "data_offsets": [48, 48]},
    }
    path = tmp_path / "r.safetensors"
    path.write_bytes(raw_file(header, a.tobytes()))
    with safe_open(path, framework) as f:
        s = f.get_slice("a")
        cases = [
            ((slice(None), range(2**40)), r"has 1099511627776 entries, so some are out of"),
            (range(2**63, 2**63 + 1), r"index range\(9223372036854775808, .* out of bounds"),
            (range(-4, 0), r"index -4 out of bounds for tensor dimension #0 of size 3"),
        ]
        for index, message in cases:
            with pytest.raises(SliceError, match=message) as info:
                s[index]
            assert info.value.kind == "SliceOutOfRange"
        if framework == "pt":
            assert tuple(s[3:1, range(9)].shape) == (0, 9)
        else:
            with pytest.raises(SliceError, match="index 4 out of bounds for tensor dimension #1"):
                s[3:1, range(9)]
        # -size .. size - 1 is every value a dimension takes: twice its length, not refused.
        got = np.asarray(s[range(-3, 3), range(3, -3, -1)])
        assert np.array_equal(got, a[range(-3, 3), range(3, -3, -1)])
        e = f.get_slice("e")
        assert tuple(e[:, range(5, 0, -2)].shape) == (0, 3)
        with pytest.raises(SliceError, match=r"more than 16777216 on a tensor of no elements"):
            e[:, range(2**25)]


def test_same_as_reference_for_in_range(sample: tuple[Path, dict[str, np.ndarray]]) -> None:
    """Where the reference's Rust slicer accepts an index, the results are equal."""
    ref = pytest.importorskip("safetensors")
    path, tensors = sample
    codes = ["F32", "I8", "F64", "BOOL", "U16", "C64"]
    with ref.safe_open(str(path), "np") as r, safe_open(path, "np") as f:
        for index in INDICES:
            for code in codes:
                try:
                    theirs = r.get_slice(code)[index]
                except Exception:  # noqa: BLE001 - out-of-range bounds: a documented difference
                    continue
                ours = f.get_slice(code)[index]
                assert ours.shape == theirs.shape and ours.tobytes() == theirs.tobytes()


# ------------------------------------------------------------ pread reads only the needed bytes


BIG = (64, 4096)  # F32: 16 KiB rows


@pytest.fixture(scope="module")
def big(tmp_path_factory: Any) -> tuple[Path, np.ndarray]:
    from pysafetensors.numpy import save_file

    arr = np.arange(BIG[0] * BIG[1], dtype=np.float32).reshape(BIG)
    path = tmp_path_factory.mktemp("big") / "big.safetensors"
    save_file({"pad": np.zeros(3, np.uint8), "x": arr}, path)
    return path, arr


def _count_preads(
    path: Path, index: Any, monkeypatch: pytest.MonkeyPatch, slice_reads: str | None = None
) -> tuple[Any, list[int]]:
    """``get_slice("x")[index]`` with the pread backend (``slice_reads`` None: the default),
    and the bytes of every positioned read it made."""
    import pysafetensors._sources as sources

    calls: list[int] = []
    real_preadv = os.preadv

    def counting_preadv(fd: int, buffers: list[Any], offset: int) -> int:
        n = real_preadv(fd, buffers, offset)
        calls.append(n)
        return n

    options = {} if slice_reads is None else {"slice_reads": slice_reads}
    with safe_open(path, "np", backend="pread", **options) as f:
        # Only the slice's reads are counted, not the header's.
        monkeypatch.setattr(sources.os, "preadv", counting_preadv)
        got = f.get_slice("x")[index]
        monkeypatch.undo()
    return got, calls


@pytest.mark.parametrize(
    ("index", "expected_bytes", "expected_reads"),
    [
        (slice(1, 3), 2 * BIG[1] * 4, 1),  # whole rows: one run, one read
        ((5, slice(10, 20)), 10 * 4, 1),
        ((7, 9), 4, 1),
        (slice(64, 99), 0, 0),  # clamped to nothing: no read at all
        # Sparse selections (density < 1/64 of the covering rows) whose runs lie more than 16
        # KiB apart: one read per run, exactly.
        ((slice(0, 64, 8), slice(100, 110)), 8 * 10 * 4, 8),
        ((slice(0, 64, 2), 7), 32 * 4, 32),
        # As sparse, but a run every 16 KiB (every row): the covering rows in one read, which
        # on a cold file is a read per run's page against one sweep.
        ((slice(None), slice(0, 16)), 64 * BIG[1] * 4, 1),
        ((Ellipsis, 4095), 64 * BIG[1] * 4, 1),
    ],
)
def test_pread_reads_exact_bytes(
    big: tuple[Path, np.ndarray],
    index: Any,
    expected_bytes: int,
    expected_reads: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, arr = big
    got, calls = _count_preads(path, index, monkeypatch)
    np.testing.assert_array_equal(got, arr[index])
    assert sum(calls) == expected_bytes
    assert len(calls) == expected_reads


#: Fragmented but dense selections of ``big`` and the rows each one covers.
DENSE_FRAGMENTS: list[tuple[Any, int]] = [
    ((slice(None), slice(0, 1024)), 64),
    ((slice(2, 6), slice(1, 3000, 2)), 4),
    ((3, slice(0, 2000, 3)), 1),
    ((slice(None), slice(None, None, 8)), 64),  # 32,768 runs of one element each
]


@pytest.mark.parametrize(("index", "rows"), DENSE_FRAGMENTS)
def test_pread_dense_fragments_read_exact_bytes_when_asked(
    big: tuple[Path, np.ndarray], index: Any, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``slice_reads="exact"`` even dense fragmented selections read exactly the selected
    bytes."""
    path, arr = big
    got, calls = _count_preads(path, index, monkeypatch, slice_reads="exact")
    np.testing.assert_array_equal(got, arr[index])
    assert sum(calls) == arr[index].nbytes


@pytest.mark.parametrize(
    ("index", "elements"),
    [
        (([1, 5, 60], slice(0, 16)), 3 * 16),
        (([40, 3, 40], None, slice(None, None, 1000)), 2 * 5),  # a repeated row read once
        (([2, 63], [4095, 0]), 2 * 4096),  # the rows' parts; their columns' box whole
        ((np.arange(0, 64, 2), 5), 32),
        ((np.array([[63, 0], [0, 63]]), slice(10, 12)), 2 * 2),
        # Along a later dimension, parts would be a read per row: the box is one read.
        ((slice(None), [0, 4095]), 64 * 4096),
        ((3, [0, 4095]), 2),  # ... unless the dimensions before it are one row
    ],
)
def test_pread_index_arrays_read_exact_bytes_when_asked(
    big: tuple[Path, np.ndarray], index: Any, elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index array's box was read whole even with ``slice_reads="exact"``: ``[[1, 5, 60],
    :16]`` read 60 rows for 3. Its box is now read in parts, the selected rows only."""
    path, arr = big
    got, calls = _count_preads(path, index, monkeypatch, slice_reads="exact")
    np.testing.assert_array_equal(got, arr[index])
    assert sum(calls) == elements * 4, index


def test_a_sparse_index_array_reads_its_box_in_parts() -> None:
    """Gaps wider than SPARSE_GAP split the box (where no gap is, it stays whole), at most
    SPARSE_PARTS parts, and the pick addresses the joined parts. Read from a file, only along
    the first dimension the box spans; mapped, along any."""
    from pysafetensors._slicing import SPARSE_GAP, SPARSE_PARTS, compact_box, split_advanced

    shape = (2048, 4096)
    columns = split_advanced((slice(None), [4095, 0, 4095]), shape)
    assert compact_box(columns, shape, 2, SPARSE_GAP, mapped=False) is None
    boxes, pick, axis = compact_box(columns, shape, 2, SPARSE_GAP, mapped=True) or ((), (), -1)
    assert axis == 1 and boxes == [(slice(None), slice(0, 1)), (slice(None), slice(4095, 4096))]
    assert pick[1].tolist() == [1, 0, 1]
    rows = split_advanced(([2000, 1, 1],), shape)
    boxes, pick, axis = compact_box(rows, shape, 2, SPARSE_GAP, mapped=False) or ((), (), -1)
    assert axis == 0 and [b[0] for b in boxes] == [slice(1, 2), slice(2000, 2001)]
    assert pick[0].tolist() == [1, 0, 0]
    near = split_advanced(([0, 9],), shape)  # 8 rows of 8 KiB between: read through
    assert compact_box(near, shape, 2, SPARSE_GAP, mapped=False) is None
    assert compact_box(near, shape, 2, 0, mapped=False) is not None  # exact: every gap
    assert compact_box(split_advanced(([0, 1, 2],), shape), shape, 2, 0, mapped=False) is None
    many = split_advanced((np.arange(0, 4096 * 2, 2) % 4096,), (4096, 4096))
    boxes, pick, axis = compact_box(many, (4096, 4096), 1, 0, mapped=False) or ((), (), -1)
    assert len(boxes) <= SPARSE_PARTS and axis == 0
    joined = np.concatenate([np.arange(4096)[b[0]] for b in boxes])
    np.testing.assert_array_equal(joined[pick[0]], np.arange(0, 4096 * 2, 2) % 4096)


@pytest.mark.parametrize(("index", "rows"), DENSE_FRAGMENTS)
@pytest.mark.parametrize("slice_reads", ["coalesce", None])
def test_pread_coalesce_reads_covering_rows(
    big: tuple[Path, np.ndarray],
    index: Any,
    rows: int,
    slice_reads: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By default (``slice_reads="coalesce"``) dense fragmented selections are read as their
    covering rows, in a few large reads, never more than those rows (rows of 64 KiB or less
    from the first selected byte to the last)."""
    path, arr = big
    got, calls = _count_preads(path, index, monkeypatch, slice_reads=slice_reads)
    np.testing.assert_array_equal(got, arr[index])
    covering = rows * BIG[1] * 4
    assert sum(calls) == covering or (covering <= 64 << 10 and sum(calls) < covering)
    assert len(calls) <= max(1, rows * BIG[1] * 4 // (1 << 20)) + 1  # 8 MiB blocks, not runs


def test_invalid_slice_reads_is_refused(big: tuple[Path, np.ndarray]) -> None:
    with pytest.raises(SafetensorError, match='slice_reads "fast" is invalid'):
        safe_open(big[0], "np", backend="pread", slice_reads="fast")


def test_subbyte_slice_alignment_rules(tmp_path: Path) -> None:
    """F4 [2, 4]: ``[:, 0:2]`` is byte-aligned, ``[:, 0:1]`` is not (spec §4.4)."""
    path = tmp_path / "f4.safetensors"
    header = b'{"x":{"dtype":"F4","shape":[2,4],"data_offsets":[0,4]}}'
    path.write_bytes(raw_file(header, bytes([0x21, 0x43, 0x65, 0x07])))
    with safe_open(path, "np") as f:
        codes = f.get_slice("x")[:, 0:2].view(np.uint8)
        assert codes.tolist() == [[1, 2], [5, 6]]
        with pytest.raises(SliceError) as info:
            f.get_slice("x")[:, 0:1]
        assert info.value.kind == "MisalignedSlice"
        assert "slicing for subbytes dtypes" in str(info.value)


@pytest.mark.parametrize(
    "index",
    [
        (slice(None), slice(0, 512)),  # a TP column split: a strided copy
        (slice(128, 640),),  # a row split: one contiguous run
        (slice(1, None, 3), slice(100, 4000, 7)),  # steps in both dimensions
        (slice(5, 5),),  # empty
    ],
)
def test_large_mapped_slices_through_each_copy_kernel(tmp_path: Path, index: Any) -> None:
    """The mmap backend copies with torch's kernel for "pt" and, above 4 MiB, with numpy on the
    reader threads for "np"; both agree with numpy indexing and with the pread backend."""
    torch = pytest.importorskip("torch")
    from pysafetensors.numpy import save_file

    matrix = np.random.default_rng(3).standard_normal((1024, 4096)).astype(np.float32)  # 16 MiB
    path = tmp_path / "big.safetensors"
    save_file({"w": matrix}, path)
    want = matrix[index]
    for backend in ("mmap", "pread"):
        with safe_open(path, "np", backend=backend) as f:
            assert np.array_equal(f.get_slice("w")[index], want), backend
        with safe_open(path, "pt", backend=backend) as f:
            got = f.get_slice("w")[index]
            assert got.dtype == torch.float32 and got.is_contiguous()
            assert np.array_equal(got.numpy(), want), backend


def _byte_positions(plan: Any) -> np.ndarray:
    """Every byte ``plan`` selects, in order."""
    return np.concatenate(
        [np.arange(off, off + length) for off, length in plan.coalesced()] or [np.zeros(0)]
    ).astype(np.int64)


@pytest.mark.parametrize(
    ("shape", "index"),
    [
        ((4, 1), (slice(None), 0)),
        ((4, 1), (Ellipsis, 0)),
        ((4, 1), (slice(0, 2), 0)),
        ((2, 1, 2), (slice(None), 0)),
        ((2, 2, 1), (0, slice(None), 0)),
        ((3, 1, 1, 4), (slice(1, 3), 0, slice(None, None, 5))),
    ],
)
def test_a_dimension_of_size_one_is_taken_whole(tmp_path: Path, shape: tuple, index: tuple) -> None:
    """Whatever selects the one element of a size-1 dimension, the tail stays one run: [:, 0]
    of an (N, 1) tensor was N runs of one element (3 s instead of 0.1 s for 2**25 rows), and
    an F4 one was refused as splitting bytes (the reference's slicer takes it)."""
    import ml_dtypes

    from pysafetensors.numpy import save_file

    plan = plan_slice((1 << 20, 1), dtype_from_code("U8"), (slice(None), 0))
    assert len(plan.starts) == 1 and plan.nbytes == 1 << 20
    n = math.prod(shape)
    values = (np.arange(n) % 16).astype(np.uint8).view(ml_dtypes.float4_e2m1fn).reshape(shape)
    path = tmp_path / "f4.safetensors"
    save_file({"t": values}, path)
    with safe_open(path, "np") as f:
        got = f.get_slice("t")[index]
    assert got.dtype == values.dtype and np.array_equal(
        got.view(np.uint8), values[index].view(np.uint8)
    )


@pytest.mark.parametrize("code", ["F4", "F6_E2M3", "F6_E3M2"])
def test_sub_byte_plans_as_whole_bytes_select_the_same_bytes(code: str) -> None:
    """``as_whole_bytes`` turns a sub-byte slice into a slice of a byte tensor with the very
    same bytes in the same order, for random aligned basic indices of random shapes. It
    declines only for rows that are not whole bytes (7 F4 values), which are read run by run."""
    from pysafetensors._dtypes import dtype_from_code
    from pysafetensors._slicing import as_whole_bytes

    dtype = dtype_from_code(code)
    rng = np.random.default_rng(11)
    folded = declined = 0
    for _ in range(10000):
        shape = tuple(int(n) for n in rng.integers(1, 9, rng.integers(1, 5)))
        index = []
        for n in shape:
            kind = rng.integers(0, 4)
            if kind == 0:
                index.append(int(rng.integers(-n, n)))
            elif kind == 1:
                index.append(slice(None))
            else:
                a, b = sorted(int(v) for v in rng.integers(0, n + 1, 2))
                index.append(slice(a, b, int(rng.integers(1, 3)) if kind == 3 else None))
        try:
            plan = plan_slice(shape, dtype, tuple(index))
        except SliceError:
            continue
        if len(plan.starts) < 2:
            continue  # one run: nothing to fold
        whole = as_whole_bytes(shape, dtype, plan)
        if whole is None:
            declined += 1
            continue
        folded += 1
        byte_shape, byte_plan = whole
        assert math.prod(byte_shape) * 8 == math.prod(shape) * dtype.bits
        assert byte_plan.nbytes == plan.nbytes
        assert np.array_equal(_byte_positions(byte_plan), _byte_positions(plan)), (shape, index)
    assert folded > 100 and declined * 10 < folded


@pytest.mark.parametrize("code", ["F4", "F6_E2M3", "F6_E3M2"])
@pytest.mark.parametrize(
    ("backend", "slice_reads"),
    [("mmap", None), ("pread", "coalesce"), ("pread", "exact")],
)
def test_sub_byte_slices_of_many_runs_through_every_read_path(
    tmp_path: Path, code: str, backend: str, slice_reads: str | None
) -> None:
    """Column splits and strided selections of F4/F6 tensors (thousands of runs, read by the
    byte dtypes' strided copies and block reads) equal numpy indexing of the whole tensor, and
    so does a selection whose rows are not whole bytes (read run by run)."""
    import ml_dtypes

    from pysafetensors.numpy import save_file

    npdt = {
        "F4": ml_dtypes.float4_e2m1fn,
        "F6_E2M3": ml_dtypes.float6_e2m3fn,
        "F6_E3M2": ml_dtypes.float6_e3m2fn,
    }[code]
    bits = 4 if code == "F4" else 6
    rng = np.random.default_rng(5)
    tensors = {
        "wide": rng.integers(0, 1 << bits, (2048, 256), dtype=np.uint8).view(npdt),
        "cube": rng.integers(0, 1 << bits, (16, 24, 8), dtype=np.uint8).view(npdt),
        # Rows of 7 (F4) or 6 (F6) values are not whole bytes, though the runs selected are.
        "odd": rng.integers(0, 1 << bits, (5, 6, 7) if bits == 4 else (3, 6, 6), np.uint8).view(
            npdt
        ),
    }
    path = tmp_path / "sub.safetensors"
    save_file(tensors, path)
    cases = [
        ("wide", (slice(None), slice(0, 32))),  # rank 0 of 8, by columns
        ("wide", (slice(None), slice(224, 256))),  # the last rank
        ("wide", (slice(3, None, 5), slice(64, 128))),
        ("wide", (7, slice(8, 16))),
        ("cube", (slice(None), slice(4, 12), slice(None))),
        ("cube", (slice(1, None, 3), 5, slice(None))),
        ("cube", (Ellipsis, slice(0, 4))),
        ("odd", (slice(0, 4), 1, slice(5, 7)) if bits == 4 else (slice(None), 1, slice(2, 6))),
    ]
    options = {} if slice_reads is None else {"slice_reads": slice_reads}
    with safe_open(path, "np", backend=backend, **options) as f:
        for name, index in cases:
            want = tensors[name][index]
            got = f.get_slice(name)[index]
            assert got.dtype == want.dtype and got.shape == want.shape, (name, index)
            assert got.tobytes() == want.tobytes(), (name, index)


def _general(piece: Any, index: Any) -> Any:
    """What ``piece[index]`` gives by the general path (``safe_open._read_slice``, which plans
    the selection's byte runs): the short paths of ``SafeSlice.__getitem__`` take a subset of
    the indices it takes, and must give the same tensors and raise the same errors."""
    handle = piece._handle
    with handle._reading(piece._info):
        return handle._read_slice(piece._info, index, source=piece._source)


def _agrees_with_general(piece: Any, index: Any, short: Any, want: Any) -> np.ndarray:
    """``short``, what a short path gave for ``piece[index]``, as a numpy array, checked: the
    values, shape and dtype numpy gives (``want``), and what the general path gives."""
    got = short if isinstance(short, np.ndarray) else short.numpy()
    np.testing.assert_array_equal(got, want, err_msg=f"{piece._info.name} {index}")
    assert got.shape == np.shape(want) and got.dtype == np.asarray(want).dtype, index
    general = _general(piece, index)
    np.testing.assert_array_equal(
        general if isinstance(general, np.ndarray) else general.numpy(), got
    )
    return got


def _contiguous_slice_cases(seed: int) -> list[tuple[tuple[int, ...], Any]]:
    """Shapes with indices of the forms the fast planner takes, and near misses of them."""
    rng = np.random.default_rng(seed)
    cases: list[tuple[tuple[int, ...], Any]] = []
    for _ in range(3000):
        ndim = int(rng.integers(0, 5))
        shape = tuple(int(rng.choice([0, 1, 2, 3, 5, 8])) for _ in range(ndim))
        items: list[Any] = []
        for size in shape[: int(rng.integers(0, ndim + 1))]:
            kind = rng.integers(0, 8)
            if kind == 0:
                items.append(slice(None))
            elif kind == 1:
                items.append(slice(0, size, 1))
            elif kind == 2:
                items.append(int(rng.integers(-size, size)) if size else 0)
            elif kind == 3:
                items.append(slice(None, None, 2))
            else:
                lo, hi = sorted(int(x) for x in rng.integers(-size - 2, size + 3, 2))
                items.append(slice(lo, hi))
        form = rng.integers(0, 4)
        if form == 0 and len(items) == 1:
            cases.append((shape, items[0]))
        elif form == 1 and not items:
            cases.append((shape, Ellipsis))
        else:
            cases.append((shape, tuple(items)))
    return cases


@pytest.mark.parametrize("code", ["BF16", "F32", "U8", "BOOL", "F64", "F8_E4M3"])
def test_fast_plans_equal_the_general_planner(code: str) -> None:
    """The fast planner of plain step-1 slices (load_shard's indices) gives exactly the
    general planner's plan: shape, runs, sizes and normalized selection."""
    from pysafetensors._dtypes import dtype_from_code
    from pysafetensors._slicing import _plan_contiguous_slices, _plan_general

    dtype = dtype_from_code(code)
    taken = 0
    for shape, index in _contiguous_slice_cases(len(code)):
        fast = _plan_contiguous_slices(shape, dtype, index)
        try:
            general = _plan_general(shape, dtype, index)
        except SafetensorError:
            assert fast is None, (shape, index)
            continue
        if fast is None:
            continue
        taken += 1
        assert fast.shape == general.shape, (shape, index)
        assert fast.starts.dtype == general.starts.dtype
        assert fast.starts.tolist() == general.starts.tolist(), (shape, index)
        assert (fast.run_bytes, fast.nbytes) == (general.run_bytes, general.nbytes)
        assert fast.selection == general.selection, (shape, index)
        assert fast.coalesced() == general.coalesced()
    assert taken > 500  # the cases exercise the fast path, not only its refusals


@pytest.mark.parametrize("code", ["BF16", "F32", "U8", "F4", "F6_E2M3"])
def test_part_runs_equal_the_planned_slice(code: str) -> None:
    """A tensor-parallel part's byte run, computed without an index (load_shard's route), is
    the planned slice of its index wherever that is one run; anything else is left to it."""
    from pysafetensors._dtypes import dtype_from_code
    from pysafetensors._slicing import Part, part_run

    dtype = dtype_from_code(code)
    rng = np.random.default_rng(7)
    taken = 0
    for _ in range(3000):
        shape = tuple(int(rng.choice([0, 1, 2, 3, 4, 8])) for _ in range(int(rng.integers(0, 5))))
        if not shape or rng.integers(0, 6) == 0:
            part = Part(None, 0, shape[0] if shape else 0)
        else:
            dim = int(rng.integers(0, len(shape)))
            start, stop = sorted(int(x) for x in rng.integers(0, shape[dim] + 1, 2))
            part = Part(dim, start, stop)
        run = part_run(shape, dtype, part)
        try:
            plan = plan_slice(shape, dtype, part.index)
        except SafetensorError:
            assert run is None, (shape, part)
            continue
        one_run = len(plan.starts) == 1 and plan.nbytes > 0
        if dtype.bits % 8:
            assert run is None
            continue
        assert (run is not None) == one_run, (shape, part)
        if run is not None:
            taken += 1
            assert run == (plan.shape, int(plan.starts[0]), plan.nbytes), (shape, part)
    assert dtype.bits % 8 or taken > 500


@pytest.mark.parametrize("backend", ["pread", "mmap"])
@pytest.mark.parametrize("framework", ["np", "pt"])
def test_row_slices_by_the_short_path_equal_the_general_one(
    tmp_path: Path, backend: str, framework: str
) -> None:
    """``s[a:b]`` of a whole-byte tensor takes SafeSlice's short path (one read or copy, no
    plan) up to 64 KiB under mmap and 2 MiB by pread; it must give what the general path gives
    for the same rows (:func:`_general`), fresh memory each time, for every bound."""
    if framework == "pt":
        pytest.importorskip("torch")
    rng = np.random.default_rng(13)
    tensors = {
        "small": rng.standard_normal((12, 5)).astype(np.float32),
        "mid": rng.integers(-9, 9, (300, 100)).astype(np.int16),  # 60,000 bytes
        "large": rng.standard_normal((700, 1000)).astype(np.float32),  # 2.8 MB: general path
        "vector": np.arange(40, dtype=np.uint8),
        "cube": rng.standard_normal((3, 4, 5)).astype(np.float16),
    }
    path = tmp_path / "rows.safetensors"
    from pysafetensors.numpy import save_file

    save_file(tensors, path)
    bounds = [None, 0, 1, 2, -1, -3, 5, 299, 10**30, -(10**30)]
    with safe_open(path, framework, backend=backend) as f:
        for name, value in tensors.items():
            piece = f.get_slice(name)
            for start in bounds:
                for stop in bounds:
                    index = slice(start, stop)
                    got = _agrees_with_general(piece, index, piece[index], value[index])
                    if got.size:
                        got.reshape(-1)[0] = 0  # private memory: the next read is unchanged
            np.testing.assert_array_equal(np.asarray(piece[:]), value)


@pytest.mark.parametrize("slice_reads", ["coalesce", "exact"])
@pytest.mark.parametrize("backend", ["pread", "mmap"])
@pytest.mark.parametrize("framework", ["np", "pt"])
def test_small_tensor_boxes_by_the_short_path_equal_the_general_one(
    tmp_path: Path,
    backend: str,
    framework: str,
    slice_reads: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``s[a:b, c:d, ...]`` (plain slices) of a whole-byte tensor of up to 64 KiB takes
    SafeSlice's short path (the tensor's bytes, a numpy copy, no plan); it must give what the
    general path gives (:func:`_general`), in fresh
    memory, for random bounds and steps, clamped and empty selections included."""
    if framework == "pt":
        pytest.importorskip("torch")
    rng = np.random.default_rng(17)
    tensors = {
        "matrix": rng.standard_normal((12, 9)).astype(np.float32),
        "cube": rng.integers(-99, 99, (5, 6, 7)).astype(np.int16),
        "bytes": rng.integers(0, 255, (40, 3)).astype(np.uint8),
        "wide": rng.integers(0, 2**40, (64, 128)).astype(np.int64),  # 64 KiB exactly
        "larger": rng.standard_normal((64, 257)).astype(np.float32),  # by rows of 64 KiB
        "vector": np.arange(30, dtype=np.float64),
    }
    path = tmp_path / "boxes.safetensors"
    from pysafetensors.numpy import save_file

    save_file(tensors, path)
    from pysafetensors._reader import SafeSlice

    boxed: list[str] = []
    real = SafeSlice._box

    def spy(self: SafeSlice, index: tuple[slice, ...]) -> Any:
        got = real(self, index)
        if got is not None:  # else left to the general path
            boxed.append(self.name)
        return got

    monkeypatch.setattr(SafeSlice, "_box", spy)
    monkeypatch.setattr(SafeSlice, "name", property(lambda self: self._info.name), raising=False)
    bounds = [None, 0, 1, 2, 3, -1, -4, 8, 10**30, -(10**30)]
    steps = [None, None, 1, 2, 5]
    with safe_open(path, framework, backend=backend, slice_reads=slice_reads) as f:
        for name, value in tensors.items():
            piece = f.get_slice(name)
            for _ in range(150):
                count = int(rng.integers(1, value.ndim + 1))
                index = tuple(
                    slice(
                        bounds[rng.integers(len(bounds))],
                        bounds[rng.integers(len(bounds))],
                        steps[rng.integers(len(steps))],
                    )
                    for _ in range(count)
                )
                got = _agrees_with_general(piece, index, piece[index], value[index])
                assert got.flags.c_contiguous
                if got.size:
                    got.reshape(-1)[0] = 0  # private memory: the next read is unchanged
            np.testing.assert_array_equal(np.asarray(piece[:, ...]), value)
            np.testing.assert_array_equal(np.asarray(_general(piece, (slice(None),))), value)
            # What the short path leaves to the general one: its errors, in its words.
            with pytest.raises(SliceError):
                piece[(slice(None),) * (value.ndim + 1)]
            with pytest.raises(SliceError):
                piece[::-1, :]
    # Taken for every tensor of up to 64 KiB, and for the larger one's selections of rows of
    # up to 64 KiB in all; for pread only under "coalesce" (the tensor is read from the first
    # selected byte to the last, which "exact" promises not to do).
    expected = set() if (backend, slice_reads) == ("pread", "exact") else set(tensors)
    assert set(boxed) == expected


def test_small_tensor_box_of_a_truncated_file_names_the_tensor(tmp_path: Path) -> None:
    from pysafetensors.numpy import save_file

    path = tmp_path / "cut.safetensors"
    save_file({"a": np.arange(16, dtype=np.int64), "m": np.ones((8, 8), np.float32)}, path)
    for backend in ("pread", "mmap"):
        with safe_open(path, "np", backend=backend) as f:
            start = f.header.data_start + f.header.tensors["m"].begin
            size = os.path.getsize(path)
            os.truncate(path, start + 8)
            with pytest.raises(SafetensorError) as info:
                f.get_slice("m")[:, :4]
            assert info.value.kind == ("ShortRead" if backend == "pread" else "FileTruncated")
            assert info.value.tensor == "m" and "'m'" in str(info.value)
            # As the general path: the same error, and an empty selection reads nothing.
            with pytest.raises(SafetensorError) as general:
                _general(f.get_slice("m"), (slice(None), slice(None, 4)))
            assert (general.value.kind, general.value.offset, str(general.value)) == (
                info.value.kind,
                info.value.offset,
                str(info.value),
            )
            assert f.get_slice("m")[:, 2:2].shape == (8, 0)
            os.truncate(path, size)
            with open(path, "r+b") as out:  # the bytes back (truncation zeroed nothing before)
                out.seek(start)
                out.write(np.ones((8, 8), np.float32).tobytes())
            np.testing.assert_array_equal(f.get_slice("m")[:, :4], np.ones((8, 4), np.float32))


@pytest.mark.parametrize(
    "index", [([0, 40], slice(None, None, 0)), ([0, 40], slice(1.5, 2)), (slice(0, 1, 0), [0, 9])]
)
def test_a_bad_slice_beside_an_index_array_is_a_slice_error(
    big: tuple[Path, np.ndarray], index: Any
) -> None:
    # Measuring the box to read it in parts raised Python's own ValueError/TypeError.
    path, _ = big
    with safe_open(path, "np") as f, pytest.raises(SliceError):
        f.get_slice("x")[index]


@pytest.mark.parametrize("slice_reads", ["coalesce", "exact"])
@pytest.mark.parametrize("backend", ["pread", "mmap"])
@pytest.mark.parametrize("framework", ["np", "pt"])
def test_rows_by_integer_by_the_short_paths_equal_the_general_one(
    tmp_path: Path, backend: str, framework: str, slice_reads: str
) -> None:
    """``s[i]``, ``s[i, a:b, ...]`` and ``s[a:b, c:d]`` of a tensor of any size (rows of up
    to 64 KiB in all) take SafeSlice's short paths; they give what the general path gives
    (:func:`_general`), and leave its errors to it."""
    if framework == "pt":
        pytest.importorskip("torch")
    rng = np.random.default_rng(23)
    tensors = {
        "matrix": rng.standard_normal((300, 70)).astype(np.float32),  # 82 KiB
        "cube": rng.integers(-99, 99, (40, 30, 20)).astype(np.int16),
        "vector": np.arange(20_000, dtype=np.float64),
        "wide_rows": rng.integers(0, 255, (3, 70_000)).astype(np.uint8),  # rows over 64 KiB
        "small": np.arange(12, dtype=np.int32).reshape(3, 4),
    }
    path = tmp_path / "ints.safetensors"
    from pysafetensors.numpy import save_file

    save_file(tensors, path)
    with safe_open(path, framework, backend=backend, slice_reads=slice_reads) as f:
        for name, value in tensors.items():
            piece = f.get_slice(name)
            rows = value.shape[0]
            indices: list[Any] = [0, 1, rows - 1, -1, -rows]
            if value.ndim > 1:
                indices += [(2, slice(1, 9)), (-1, slice(None, None, 3)), (0,)]
                indices += [(slice(1, 3), slice(2, 5)), (slice(5, 1), slice(None))]
            if value.ndim > 2:
                indices += [(1, slice(None), slice(3, 4)), (slice(None, 4), 2)]
            for index in indices:
                got = _agrees_with_general(piece, index, piece[index], value[index])
                if got.size:
                    got.reshape(-1)[0] = 0  # private memory: the next read is unchanged
            for wrong in (rows, -rows - 1, (rows, slice(None))):
                with pytest.raises(SliceError) as short_error:
                    piece[wrong]
                with pytest.raises(SliceError) as general_error:
                    _general(piece, wrong)
                assert (
                    str(short_error.value).split(" with shape")[1:]
                    == str(general_error.value).split(" with shape")[1:]
                )


@pytest.mark.parametrize("slice_reads", ["coalesce", "exact"])
@pytest.mark.parametrize("backend", ["pread", "mmap"])
@pytest.mark.parametrize("framework", ["np", "pt"])
def test_ellipsis_and_later_integers_by_the_short_paths_equal_the_general_one(
    tmp_path: Path,
    backend: str,
    framework: str,
    slice_reads: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``[...]``, ``[()]``, a ``...`` among plain slices and ints, and ints after the first
    item take SafeSlice's short paths (the planned path cost ~8-23 us a call, the reference
    ~2 us); 0-d tensors' ``[...]`` and ``[()]`` too. They give what the general path gives, in
    fresh memory, and leave its errors to it, in its words."""
    if framework == "pt":
        pytest.importorskip("torch")

    rng = np.random.default_rng(29)
    tensors = {
        "scalar": np.array(2.5, np.float32),
        "scalar_i8": np.array(-3, np.int8),
        "vector": np.arange(40, dtype=np.int16),
        "matrix": rng.standard_normal((12, 9)).astype(np.float32),
        "cube": rng.integers(-99, 99, (5, 6, 7)).astype(np.int32),
        "large": rng.standard_normal((300, 70)).astype(np.float32),  # over 64 KiB
    }
    path = tmp_path / "ellipsis.safetensors"
    from pysafetensors.numpy import save_file

    save_file(tensors, path)
    general_calls: list[Any] = []
    real = reader_safe_open._read_slice

    def spy(self: Any, info: Any, index: Any, **kwargs: Any) -> Any:
        general_calls.append(index)
        return real(self, info, index, **kwargs)

    E = Ellipsis  # noqa: N806 - short, as in an index
    per_rank: dict[int, list[Any]] = {
        0: [E, (), (E,)],
        1: [E, (), (E,), (E, 3), (3, E), (-1, E), (E, slice(2, 9, 2)), (slice(1, 5), E)],
        2: [E, (), (E, 0), (E, -1), (0, E), (E, 2, 3), (slice(1, 4), 2), (2, E, 5)],
        3: [E, (E, 1), (1, E, 2), (slice(1, 3), E, 4), (E, 2, slice(1, 5)), (0, 1, 2), (1, 2)],
    }
    with safe_open(path, framework, backend=backend, slice_reads=slice_reads) as f:
        for name, value in tensors.items():
            piece = f.get_slice(name)
            for index in per_rank[value.ndim]:
                monkeypatch.setattr(reader_safe_open, "_read_slice", spy)
                general_calls.clear()
                got = piece[index]
                took_general = bool(general_calls)
                monkeypatch.undo()
                want = value[index]
                got = _agrees_with_general(piece, index, got, want)
                if got.size:
                    got.reshape(-1)[0] = 1  # private memory: the next read is unchanged
                    np.testing.assert_array_equal(np.asarray(piece[index]), want)
                # Small tensors take a short path for every one of these (by pread under
                # "exact", boxes, which read from the first selected byte to the last, do
                # not); the large one's too, where its rows are few enough.
                if name != "large" and (backend, slice_reads) != ("pread", "exact"):
                    assert not took_general, (name, index)
            # Errors stay the general path's, word for word.
            for wrong in [(E, E), (E, 1000)] + ([(0, 99)] if value.ndim > 1 else []):
                with pytest.raises(SliceError) as short_error:
                    piece[wrong]
                with pytest.raises(SliceError) as general_error:
                    _general(piece, wrong)
                assert str(short_error.value) == str(general_error.value)


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_short_paths_of_a_64_dimension_tensor_leave_it_to_the_general_path(
    tmp_path: Path, framework: str
) -> None:
    """The box path views the bytes with one axis more than the tensor: at numpy's 64
    dimensions that raised numpy's ValueError; such tensors take the general path."""
    if framework == "pt":
        pytest.importorskip("torch")
    header = json.dumps({"t": {"dtype": "F32", "shape": [1] * 64, "data_offsets": [0, 4]}})
    text = header.encode() + b" " * (-len(header) % 8)
    path = tmp_path / "deep.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + np.float32(1.5).tobytes())
    with safe_open(path, framework) as f:
        piece = f.get_slice("t")
        for index, ndim in [
            ((), 64),
            ((Ellipsis,), 64),
            ((Ellipsis, 0), 63),
            ((slice(None), 0), 63),
        ]:
            got = np.asarray(piece[index])
            assert got.ndim == ndim and got.reshape(-1).tolist() == [1.5], index
