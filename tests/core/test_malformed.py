"""Reading rules R1-R8 (spec §1.2-1.7, §8): every row of ``malformed.CASES`` through every entry
point, checked against the recorded verdict and, when installed, against the reference itself."""

from __future__ import annotations

import inspect
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import (
    HeaderDecodeError,
    HeaderSizeError,
    OffsetError,
    SafetensorError,
    TensorInfoError,
    deserialize,
    safe_open,
)

from .malformed import CASES, Case, kind_of_reference_message

HEADER_PREFIX = "Error while deserializing header: "
DESERIALIZE_PREFIX = "Error while deserializing: "

#: The error class each reference variant maps to.
CLASS_OF_KIND: dict[str, type[SafetensorError]] = {
    "HeaderTooSmall": HeaderSizeError,
    "HeaderTooLarge": HeaderSizeError,
    "InvalidHeaderLength": HeaderSizeError,
    "InvalidHeader": HeaderDecodeError,
    "InvalidHeaderDeserialization": HeaderDecodeError,
    "InvalidOffset": OffsetError,
    "MetadataIncompleteBuffer": OffsetError,
    "ValidationOverflow": TensorInfoError,
    "MisalignedSlice": TensorInfoError,
    "TensorInvalidInfo": TensorInfoError,
}

ids = [c.id for c in CASES]


def _check_error(exc: SafetensorError, case: Case, prefix: str) -> None:
    assert case.kind is not None
    assert type(exc) is CLASS_OF_KIND[case.kind], (type(exc), case.kind)
    assert exc.kind == case.kind
    message = str(exc)
    assert message.startswith(prefix), message
    assert case.text in message, (case.text, message)
    if case.tensor is not None:
        assert f"`{case.tensor}`" in message, message
        assert exc.tensor == case.tensor


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_deserialize(case: Case) -> None:
    if case.kind is None:
        deserialize(case.data)
        return
    with pytest.raises(SafetensorError) as info:
        deserialize(case.data)
    _check_error(info.value, case, DESERIALIZE_PREFIX)


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_safe_open(case: Case, backend: str, write_raw: Any) -> None:
    path = write_raw(case.data)
    if case.kind is None:
        with safe_open(path, "np", backend=backend) as f:
            try:
                f.get_tensors()
            except TensorInfoError as exc:
                # A valid header whose shape no array can have (the reference fails too, with
                # numpy's "Maximum allowed dimension exceeded").
                assert exc.kind == "ShapeTooLarge"
        return
    with pytest.raises(SafetensorError) as info:
        safe_open(path, "np", backend=backend)
    _check_error(info.value, case, HEADER_PREFIX)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_load_bytes(case: Case) -> None:
    """``numpy.load(bytes)`` goes through the same validation."""
    from pysafetensors.numpy import load

    if case.kind is None:
        try:
            load(case.data)
        except TensorInfoError as exc:
            # Shapes no array can have (the reference's numpy.load raises numpy's ValueError;
            # ours is a ValueError too).
            assert exc.kind in ("ShapeTooLarge", "TooManyDimensions") and isinstance(
                exc, ValueError
            )
        return
    with pytest.raises(SafetensorError) as info:
        load(case.data)
    _check_error(info.value, case, DESERIALIZE_PREFIX)


# ------------------------------------------------------------------ against the reference itself


@pytest.fixture(scope="module")
def reference() -> Any:
    return pytest.importorskip("safetensors")


def _reference_outcome(reference: Any, data: bytes) -> tuple[str | None, str, Any]:
    try:
        items = reference.deserialize(data)
    except reference.SafetensorError as exc:
        message = str(exc).removeprefix(DESERIALIZE_PREFIX)
        return kind_of_reference_message(message), message, None
    return None, "", {name: (v["dtype"], v["shape"], bytes(v["data"])) for name, v in items}


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_same_verdict_as_reference(case: Case, reference: Any) -> None:
    ref_kind, ref_message, ref_items = _reference_outcome(reference, case.data)
    # The table itself must still describe the reference.
    assert ref_kind == case.kind, ref_message
    assert case.text in ref_message
    try:
        ours = deserialize(case.data)
    except SafetensorError as exc:
        assert exc.kind == ref_kind, (str(exc), ref_message)
        return
    assert ref_kind is None
    assert {name: (v["dtype"], v["shape"], bytes(v["data"])) for name, v in ours} == ref_items


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_same_verdict_as_reference_safe_open(case: Case, reference: Any, write_raw: Any) -> None:
    path = write_raw(case.data)
    try:
        with reference.safe_open(str(path), "np") as f:
            ref: Any = (f.metadata(), f.offset_keys(), sorted(f.keys()))
    except reference.SafetensorError as exc:
        message = str(exc)
        assert message.startswith(HEADER_PREFIX)
        ref = kind_of_reference_message(message)
    try:
        with safe_open(path, "np") as f:
            ours: Any = (f.metadata(), f.offset_keys(), f.keys())
    except SafetensorError as exc:
        ours = exc.kind
    if isinstance(ref, tuple) and len(set(ref[1])) != len(ref[1]):  # pragma: no cover
        pytest.fail("duplicate names in offset_keys")
    if isinstance(ref, tuple) and isinstance(ours, tuple):
        # Zero-length tensors sharing an offset come in arbitrary order in the reference.
        assert ours[0] == ref[0] and ours[2] == ref[2]
        assert sorted(ours[1]) == sorted(ref[1])
    else:
        assert ours == ref


# -------------------------------------------------------------------------- rules not in a table


def _padded_empty(n: int) -> bytes:
    return struct.pack("<Q", n) + b"{}" + b" " * (n - 2)


def test_header_exactly_at_limit_is_accepted(tmp_path: Path) -> None:
    data = _padded_empty(100_000_000)
    assert deserialize(data) == []
    path = tmp_path / "big.safetensors"
    path.write_bytes(data)
    with safe_open(path, "np") as f:
        assert f.keys() == []
        assert f.header.data_start == 100_000_008


def test_header_one_past_limit_is_refused() -> None:
    data = struct.pack("<Q", 100_000_001) + b"{}"
    with pytest.raises(HeaderSizeError, match="header too large") as info:
        deserialize(data)
    assert info.value.kind == "HeaderTooLarge"


def test_max_header_size_override(tmp_path: Path) -> None:
    data = _padded_empty(64)
    path = tmp_path / "f.safetensors"
    path.write_bytes(data)
    with pytest.raises(HeaderSizeError) as info:
        safe_open(path, "np", max_header_size=63)
    assert info.value.kind == "HeaderTooLarge"
    assert str(info.value).startswith(HEADER_PREFIX + "header too large")
    with safe_open(path, "np", max_header_size=64) as f:
        assert f.keys() == []
    with pytest.raises(HeaderSizeError):
        deserialize(data, max_header_size=63)
    assert deserialize(data, max_header_size=64) == []


@pytest.mark.parametrize(
    ("limit", "error", "text"),
    [
        (None, TypeError, "must be an integer, not NoneType"),
        (1.5, TypeError, "must be an integer, not float"),
        (True, TypeError, "must be an integer, not True"),
        ("64", TypeError, "must be an integer, not str"),
        (-1, ValueError, "must be 0 or more, not -1"),
    ],
)
def test_a_wrong_max_header_size_is_named_before_any_read(
    tmp_path: Path, limit: object, error: type[Exception], text: str
) -> None:
    # None reached the comparison with N as Python's "'>' not supported"; 1.5 and True were
    # taken, and quoted back as "the limit" when a file was refused.
    path = tmp_path / "f.safetensors"
    path.write_bytes(_padded_empty(64))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(_padded_empty(64))
    for target in (path, folder):
        with pytest.raises(error, match=f"max_header_size {text}"):
            safe_open(target, "np", max_header_size=limit)  # type: ignore[arg-type]
    with pytest.raises(error, match=f"max_header_size {text}"):
        deserialize(_padded_empty(64), max_header_size=limit)  # type: ignore[arg-type]
    np = pytest.importorskip("numpy")
    with safe_open(path, "np", max_header_size=np.int64(64)) as f:  # numpy's integers are taken
        assert f.keys() == []


def test_header_over_default_limit_accepted_when_raised() -> None:
    data = _padded_empty(100_000_008)
    with pytest.raises(HeaderSizeError):
        deserialize(data)
    assert deserialize(data, max_header_size=100_000_008) == []


def test_duplicate_names_last_wins() -> None:
    header = (
        b'{"t":{"dtype":"I32","shape":[4],"data_offsets":[0,16]},'
        b'"t":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}'
    )
    data = struct.pack("<Q", len(header)) + header + np.arange(4, dtype="<f4").tobytes()
    [(name, info)] = deserialize(data)
    assert (name, info["dtype"], info["shape"]) == ("t", "F32", [2, 2])


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (b'{"__metadata__":null}', None),
        (b'{"__metadata__":{}}', {}),
        (b"{}", None),
        (b'{"__metadata__":{"a":"1","a":"2","b":""}}', {"a": "2", "b": ""}),
    ],
)
def test_metadata_null_empty_absent(header: bytes, expected: Any, write_raw: Any) -> None:
    path = write_raw(struct.pack("<Q", len(header)) + header)
    with safe_open(path, "np") as f:
        assert f.metadata() == expected


def test_error_offsets_and_tensor_names() -> None:
    """Our messages add what the reference's leave out: which tensor and where."""
    header = (
        b'{"a":{"dtype":"I32","shape":[4],"data_offsets":[0,16]},'
        b'"b":{"dtype":"I32","shape":[4],"data_offsets":[20,36]}}'
    )
    data = struct.pack("<Q", len(header)) + header + bytes(36)
    with pytest.raises(OffsetError) as info:
        deserialize(data)
    exc = info.value
    assert exc.tensor == "b"
    assert exc.offset == 8 + len(header) + 16
    assert "[20, 36]" in str(exc)
    assert "previous tensor ends at 16" in str(exc)


def test_parse_depth_beyond_python_recursion() -> None:
    """Nesting deeper than ``json`` can recurse is still a clean JSON error."""
    header = b'{"t":{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    with pytest.raises(HeaderDecodeError, match="recursion limit exceeded"):
        deserialize(struct.pack("<Q", len(header)) + header)


@pytest.mark.parametrize(("brackets", "reads"), [(125, True), (126, False)])
def test_nesting_deep_in_the_callers_stack_is_not_called_malformed(
    brackets: int, reads: bool
) -> None:
    """``json`` recurses once per level: under ~870 frames of the caller's, a header with 125
    brackets in a field (the most serde reads) was refused as malformed ("recursion limit
    exceeded"). It is Python's RecursionError there, as for any code recursing that deep, and
    read at an ordinary depth; one level more is the file's fault at any depth."""
    nested = b"[" * brackets + b"]" * brackets
    header = b'{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":' + nested + b"}}"
    blob = struct.pack("<Q", len(header)) + header + b"\0"
    room = sys.getrecursionlimit() - len(inspect.stack()) - 60

    def deep(n: int) -> Any:
        return deep(n - 1) if n else deserialize(blob)

    limit = sys.getrecursionlimit()
    if reads:
        with pytest.raises(RecursionError, match="the caller's stack is too deep"):
            deep(room)
        assert [name for name, _ in deserialize(blob)] == ["t"]
    else:
        for depth in (0, room):
            with pytest.raises(HeaderDecodeError, match="recursion limit exceeded"):
                deep(depth)
    assert sys.getrecursionlimit() == limit  # the process's, left alone


def test_huge_integer_literal() -> None:
    """A 5000-digit integer: serde's f64 overflows; Python's int() would refuse > 4300 digits."""
    header = b'{"t":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":' + b"9" * 5000 + b"}}"
    with pytest.raises(HeaderDecodeError, match="number out of range"):
        deserialize(struct.pack("<Q", len(header)) + header)


def test_format_module_is_pure() -> None:
    """The format layer parses bytes without a file: usable from any byte source."""
    from pysafetensors._format import parse_header, parse_header_length

    header = b'{"t":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
    n = parse_header_length(struct.pack("<Q", len(header)), 8 + len(header) + 2)
    parsed = parse_header(header, 2)
    assert n == len(header)
    assert parsed.data_size == 2
    assert list(parsed.tensors) == ["t"]


def test_differences_doc_counts_these_cases() -> None:
    """docs/differences.md gives the number of hand-built files; it had drifted (180 for 185)."""
    doc = Path(__file__).parents[2] / "docs" / "differences.md"
    assert f"{len(CASES)} hand-built files of" in doc.read_text(encoding="utf-8")
