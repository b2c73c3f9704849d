"""The library pieces behind the CLI: the lenient validator and edit_metadata."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np
import pytest

import pysafetensors
from pysafetensors._errors import HeaderError, SafetensorError
from pysafetensors._format import parse_header
from pysafetensors._sources import BufferSource
from pysafetensors._validate import validate_source
from pysafetensors.numpy import load_file, save, save_file

from .conftest import example_tensors, raw_file


def _strict_ok(data: bytes) -> bool:
    if len(data) < 8:
        return False
    n = struct.unpack("<Q", data[:8])[0]
    if 8 + n > len(data):
        return False
    try:
        parse_header(data[8 : 8 + n], len(data) - 8 - n)
    except HeaderError:
        return False
    return True


def test_validator_agrees_with_the_strict_parser() -> None:
    """No errors exactly when the strict reader accepts the file, over random corruptions."""
    base = save(
        {
            "a": np.arange(6, dtype=np.float32),
            "b": np.ones((2, 3), np.int16),
            "c": np.zeros(0, np.uint8),
        },
        metadata={"format": "pt"},
    )
    rng = random.Random(1234)
    n = struct.unpack("<Q", base[:8])[0]
    seen_bad = 0
    for _ in range(400):
        data = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            kind = rng.random()
            if kind < 0.6 and len(data) > 8 + n:  # flip a header byte to a JSON character
                data[rng.randrange(8, 8 + n)] = ord(rng.choice('0123456789[]{},:" -.eE\x00\\'))
            elif kind < 0.8:
                data = data[: rng.randrange(len(data))]
            else:
                data += bytes(rng.randint(1, 9))
        data = bytes(data)
        problems = validate_source(BufferSource(data))
        errors = [p for p in problems if p.severity == "error"]
        assert (not errors) == _strict_ok(data), (data, problems)
        seen_bad += bool(errors)
    assert seen_bad > 200


def test_validator_collects_many_problems() -> None:
    header = {
        "__metadata__": {"format": 1},
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},  # overlaps a
        "c": {"dtype": "F4", "shape": [3], "data_offsets": [12, 14]},  # 12 bits
        "d": {"dtype": "F32", "shape": "x", "data_offsets": [14, 18]},  # bad shape type
    }
    problems = validate_source(BufferSource(raw_file(header, bytes(20))))
    codes = [(p.code, p.tensor) for p in problems]
    assert ("InvalidOffset", "b") in codes
    assert ("MisalignedSlice", "c") in codes
    assert ("InvalidHeaderDeserialization", "d") in codes
    assert ("MetadataIncompleteBuffer", None) in codes
    assert any("__metadata__" in p.message for p in problems)
    assert all(p.offset is not None for p in problems if p.tensor in ("b", "c"))


def test_edit_metadata_exported_and_in_place(tmp_path: Path) -> None:
    assert "edit_metadata" in pysafetensors.__all__
    path = tmp_path / "m.safetensors"
    save_file(example_tensors(), str(path), metadata={"format": "pt", "long": "x" * 64})
    before = path.read_bytes()
    n = struct.unpack("<Q", before[:8])[0]
    assert pysafetensors.edit_metadata(path, set={"format": "np"}, delete=["long"]) is True
    after = path.read_bytes()
    assert (
        len(after) == len(before) and after[:8] == before[:8] and after[8 + n :] == before[8 + n :]
    )
    with pysafetensors.safe_open(path, "np") as f:
        assert f.metadata() == {"format": "np"}
    assert pysafetensors.edit_metadata(path, set={"k": "v" * 200}, reserve=100) is False
    # The reserve leaves room: the next, similar edit is in place.
    assert pysafetensors.edit_metadata(path, set={"k2": "w" * 60}) is True
    with pysafetensors.safe_open(path, "np") as f:
        assert f.metadata() == {"format": "np", "k": "v" * 200, "k2": "w" * 60}
    for name, value in example_tensors().items():
        np.testing.assert_array_equal(load_file(str(path))[name], value)
    assert pysafetensors.edit_metadata(path, set={"only": "this"}, replace=True) is True
    with pysafetensors.safe_open(path, "np") as f:
        assert f.metadata() == {"only": "this"}


def test_edit_metadata_errors(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(2, np.float32)}, str(path))
    with pytest.raises(SafetensorError, match="no key 'x'"):
        pysafetensors.edit_metadata(path, delete=["x"])
    with pytest.raises(TypeError):
        pysafetensors.edit_metadata(path, set={"a": 1})  # type: ignore[dict-item]
    bad = tmp_path / "bad.safetensors"
    content = raw_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4))
    bad.write_bytes(content)
    with pytest.raises(HeaderError):
        pysafetensors.edit_metadata(bad, set={"a": "b"})
    assert bad.read_bytes() == content  # a file that fails validation is never written


def test_edit_metadata_argument_handling(tmp_path: Path) -> None:
    from pysafetensors import SerializeError, edit_metadata, safe_open
    from pysafetensors.numpy import save_file

    path = tmp_path / "m.safetensors"
    save_file({"a": np.ones(2)}, path, metadata={"key": "v", "k": "single letter"})
    edit_metadata(path, delete="key")  # one key, not the letters k, e, y
    with safe_open(path, "np") as f:
        assert f.metadata() == {"k": "single letter"}
    before = path.read_bytes()
    with pytest.raises(SerializeError, match="lone surrogate"):
        edit_metadata(path, set={"bad": "\ud800"})
    assert path.read_bytes() == before
