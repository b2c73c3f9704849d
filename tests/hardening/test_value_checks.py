"""``validate(check_values=True)``: NaN, Inf and BOOL bytes counted exactly.

Float chunks are first screened by their bits (every exponent bit set is NaN or Inf, for the
IEEE-like formats), reading into one reused buffer; a chunk that may hold one is counted by
the exact path. These tests hold both to a count made on the whole tensor with numpy and
ml_dtypes, for every float dtype, with the values anywhere (chunk edges included), in tensors
that span many chunks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import pysafetensors._validate as validate_mod
from pysafetensors._validate import validate
from pysafetensors.numpy import save_file

FLOATS: dict[str, Any] = {
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F32": np.float32,
    "F64": np.float64,
    "C64": np.complex64,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
}


def _expected(value: np.ndarray, data_offset: int) -> tuple[int, int, int | None]:
    """(NaN count, Inf count, file offset of the first) by numpy on the whole tensor (a complex
    value counts once, NaN or Inf where a part is, as numpy's isnan/isinf of it say)."""
    flat = value.reshape(-1)
    as_float = flat.astype(np.float64) if flat.dtype.kind == "V" or flat.itemsize == 1 else flat
    if flat.dtype == ml_dtypes.bfloat16:
        as_float = flat.astype(np.float32)
    nan = np.isnan(as_float)
    inf = np.isinf(as_float)
    bad = np.flatnonzero(nan | inf)
    first = data_offset + int(bad[0]) * flat.itemsize if bad.size else None
    return int(nan.sum()), int(inf.sum()), first


@pytest.mark.parametrize("sub_chunks", [False, True])
@pytest.mark.parametrize("code", list(FLOATS))
def test_value_checks_count_exactly_across_chunks(
    tmp_path: Path, code: str, sub_chunks: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validate_mod, "CHUNK_BYTES", 48)  # many chunks, none splitting one
    if sub_chunks:  # each chunk looked at in two halves
        monkeypatch.setattr(validate_mod, "_SUB_CHUNK_BYTES", 24)
    rng = np.random.default_rng(len(code))
    dtype = FLOATS[code]
    tensors: dict[str, np.ndarray] = {}
    for case in range(12):
        size = int(rng.integers(1, 400))
        value = rng.standard_normal(size).astype(np.float32)
        if code == "C64":
            value = (value + 1j * rng.standard_normal(size)).astype(np.complex64)
        value = value.astype(dtype)
        if case % 3:  # some tensors all finite, the others with NaN/Inf anywhere
            picks = rng.integers(0, size, int(rng.integers(1, 6)))
            flat = value.view(np.float32) if code == "C64" else value
            for i in picks:
                i = int(i) % flat.size
                flat[i] = rng.choice([np.nan, np.inf, -np.inf]) if code != "F8_E4M3" else np.nan
        tensors[f"t{case}"] = value
    path = tmp_path / "v.safetensors"
    save_file(tensors, path)
    from pysafetensors import safe_open

    with safe_open(path, "np") as f:
        starts = {n: f.header.data_start + i.begin for n, i in f.header.tensors.items()}
    found = {
        p.tensor: p
        for p in validate(str(path), strict=True, check_values=True)
        if p.code == "NonFinite"
    }
    for name, value in tensors.items():
        nan, inf, first = _expected(value, starts[name])
        if not nan and not inf:
            assert name not in found, (code, name)
            continue
        problem = found[name]
        m = re.search(
            r"holds (\d+) NaN and (\d+) Inf values \(first at file offset (\d+)\)", problem.message
        )
        assert m is not None, problem.message
        assert (int(m.group(1)), int(m.group(2)), int(m.group(3))) == (nan, inf, first), (
            code,
            name,
        )
        assert problem.offset == first


def test_bool_bytes_other_than_zero_and_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validate_mod, "CHUNK_BYTES", 24)
    flags = np.zeros(100, np.bool_)
    path = tmp_path / "b.safetensors"
    save_file({"b": flags}, path)
    raw = bytearray(path.read_bytes())
    start = len(raw) - 100
    raw[start + 30] = 2
    raw[start + 77] = 255
    path.write_bytes(bytes(raw))
    (problem,) = [
        p for p in validate(str(path), strict=True, check_values=True) if p.code == "BoolNotZeroOne"
    ]
    assert "2 bytes other than 0 and 1 (first at file offset " + str(start + 30) in problem.message


def test_the_bit_screen_passes_finite_chunks_and_flags_the_rest() -> None:
    for code, (kind, mask, first) in validate_mod._NONFINITE_BITS.items():
        dtype = FLOATS[code]
        finite = np.array([0.0, -1.5, 2.0, -0.0], np.float32).astype(dtype)
        scratch: list[np.ndarray] = []
        assert validate_mod._all_finite(code, finite.view(np.uint8), scratch), code
        for bad in (np.nan, np.inf, -np.inf):
            value = np.array([1.0, bad], np.float32).astype(dtype)
            assert not validate_mod._all_finite(code, value.view(np.uint8), scratch), (code, bad)
        assert (kind(mask) & kind(first)) == kind(first)
