"""``diff`` of 64-bit integers against floats: compared through float64, ``2**53 + 1`` and
``2.0**53`` were "values equal". An integer equals a float only where the float is that whole
number; every count and difference is checked against Python's exact arithmetic."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from pysafetensors.numpy import save_file


def _exact(ints: list[int], floats: list[float]) -> tuple[int, float]:
    """Differing count and max abs difference, exactly (NaN and Inf: infinite)."""
    differ, worst = 0, 0.0
    for i, f in zip(ints, floats, strict=True):
        if f != f or f in (float("inf"), float("-inf")):
            differ, worst = differ + 1, float("inf")
        elif Fraction(f) != i:
            differ += 1
            worst = max(worst, float(abs(Fraction(f) - i)))
    return differ, worst


@pytest.mark.parametrize("int_dtype", [np.int64, np.uint64])
@pytest.mark.parametrize("float_dtype", [np.float64, np.float32])
@pytest.mark.parametrize("ints_first", [True, False])
def test_wide_integers_against_floats_are_compared_exactly(
    cli, tmp_path: Path, int_dtype, float_dtype, ints_first: bool
) -> None:
    info = np.iinfo(int_dtype)
    ints = [2**53 + 1, 2**53, 5, 3, 7, info.max, info.min, 2**60 + 3, 0, 2**62]
    floats = [2.0**53, 2.0**53, 5.0, 3.5, float("nan"), float(2**64 if info.min == 0 else 2**63)]
    floats += [float(info.min), float(2**60), float("inf"), 2.0**62]
    floats = [float(float_dtype(f)) for f in floats]  # as the file holds them
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"t": np.array(ints, int_dtype)}, a if ints_first else b)
    save_file({"t": np.array(floats, float_dtype)}, b if ints_first else a)
    r = cli("diff", a, b, "--json")
    assert r.code == 1, r.err
    (entry,) = r.json()["tensors"]
    differ, worst = _exact(ints, floats)
    values = entry["values"]
    assert values["differing"] == differ and values["outside_tolerance"] == differ
    assert values["max_abs"] == (None if worst == float("inf") else worst)


def test_a_wide_integer_beside_its_float_is_no_difference(cli, tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"t": np.array([2**53, -(2**63), 2**62 + 2**40], np.int64)}, a)
    save_file({"t": np.array([2.0**53, -(2.0**63), 2.0**62 + 2.0**40], np.float64)}, b)
    (entry,) = cli("diff", a, b, "--json").json()["tensors"]
    assert entry["values"]["differing"] == 0 and entry["values"]["max_abs"] == 0.0
    save_file({"t": np.array([2**53 + 1, -(2**63), 2**62 + 2**40], np.int64)}, a)
    (entry,) = cli("diff", a, b, "--json").json()["tensors"]
    assert entry["values"]["differing"] == 1 and entry["values"]["max_abs"] == 1.0
    r = cli("diff", a, b, "--atol", "1")
    assert "1 values differ" in r.out and "0 outside" in r.out
