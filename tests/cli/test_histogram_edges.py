"""``stats --histogram``'s edges and counts against ``numpy.histogram``.

Where numpy gives a histogram of the finite values (``numpy.histogram(finite, bins)`` without a
warning or an error), the command's edges must be numpy's, bit for bit, and its counts numpy's.
Where numpy gives none (one value too large for numpy's half-unit widening, a width that
overflows float64, a range of a few units in the last place), the edges must still be finite,
ordered, span the values, and the counts must be numpy's for those edges. Across dtypes
(BF16 and FP8 through ml_dtypes), with values equal to the top edge, which numpy's closed last
bin holds.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from pysafetensors._cli._histogram import bin_counts, histogram_edges, histogram_range
from pysafetensors.numpy import save_file

F64_MAX = float(np.finfo(np.float64).max)
TINY = 5e-324  # the smallest subnormal


def _numpys(finite: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray] | None:
    """numpy's ``(counts, edges)``, or None where it gives no histogram."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            counts, edges = np.histogram(finite, bins=bins)
        except (ValueError, RuntimeWarning):
            return None
    return counts, edges


def _check(finite: np.ndarray, bins: int, edges: np.ndarray, counts: np.ndarray) -> None:
    """``edges``/``counts`` are numpy's where it gives any, else sound and numpy's counts for
    those edges."""
    numpys = _numpys(finite, bins)
    if numpys is not None:
        assert edges.tobytes() == numpys[1].tobytes()
        assert counts.tolist() == numpys[0].tolist()
        return
    assert edges.size == bins + 1 and np.isfinite(edges).all()
    assert (edges[1:] >= edges[:-1]).all()
    assert edges[0] <= finite.min() and finite.max() <= edges[-1]
    assert counts.tolist() == np.histogram(finite, bins=edges)[0].tolist()
    assert counts.sum() == finite.size


def _arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Tensors of several dtypes whose ranges are ordinary, degenerate or extreme."""
    bits16 = rng.integers(0, 1 << 16, 4_000, dtype=np.uint16)
    codes = np.arange(256, dtype=np.uint8)
    normal = rng.standard_normal(3_000)
    f16 = np.finfo(np.float16)
    bf16 = ml_dtypes.finfo(ml_dtypes.bfloat16)
    # Many values equal to the maximum: the top edge, counted in the last bin.
    topped = np.concatenate([normal, np.full(50, normal.max()), np.full(7, normal.min())])
    return {
        "f64": topped,
        "f32": topped.astype(np.float32),
        "f16": (topped * 1e4).astype(np.float16),  # some Inf past 65504
        "f16-bits": bits16.view(np.float16),  # every kind: NaN, Inf, subnormals, extremes
        "f16-extremes": np.array([f16.max, -f16.max, f16.smallest_subnormal], np.float16),
        "f16-subnormals": np.array([f16.smallest_subnormal, 2 * f16.smallest_subnormal, 0], "f2"),
        "bf16": topped.astype(ml_dtypes.bfloat16),
        "bf16-bits": bits16.view(ml_dtypes.bfloat16),
        "bf16-extremes": np.array([bf16.max, -bf16.max, 1.0], ml_dtypes.bfloat16),
        "bf16-max-only": np.full(5, bf16.max, ml_dtypes.bfloat16),
        "f8e4m3": codes.view(ml_dtypes.float8_e4m3fn),
        "f8e5m2": codes.view(ml_dtypes.float8_e5m2),
        "f8-normal": (normal * 10).astype(ml_dtypes.float8_e4m3fn),
        "i8": rng.integers(-128, 128, 500, dtype=np.int8),
        "u8-top": np.array([0, 255, 255, 255, 17], np.uint8),
        "i64-huge": np.array([-(2**63), 2**63 - 1, 0], np.int64),
        "one-value": np.full(9, 3.25),
        "one-huge": np.full(4, 1e20),  # numpy: [v, v] after its +-0.5, "Too many bins"
        "one-max": np.full(3, F64_MAX),
        "one-min": np.full(3, -F64_MAX),
        "one-subnormal": np.full(2, TINY),
        "signed-zeros": np.array([0.0, -0.0, 0.0]),
        "overflowing": np.array([-1.7e308, 1.7e308, 0.0, 1e300]),
        "full-range": np.array([-F64_MAX, F64_MAX]),
        "few-ulps": np.array([1.0, 1.0 + 2**-52, 1.0, 1.0 + 2**-51]),
        "subnormal-range": np.array([0.0, TINY, 3 * TINY]),
    }


def _finite(array: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # FP8 NaN codes
        values = array.astype(np.float64).ravel()
    return values[np.isfinite(values)]


@pytest.mark.parametrize("bins", [1, 2, 3, 7, 10, 64, 10_001])
def test_edges_and_counts_are_numpys(bins: int) -> None:
    for name, array in _arrays(np.random.default_rng(bins)).items():
        finite = _finite(array)
        edges = histogram_edges(float(finite.min()), float(finite.max()), bins)
        try:
            with np.errstate(invalid="ignore"):
                values = array.astype(np.float64)
            _check(finite, bins, edges, bin_counts(values, edges))
        except AssertionError as exc:
            raise AssertionError(f"{name}, {bins} bins") from exc


def test_the_command_reports_numpys_edges_and_counts(cli, tmp_path: Path) -> None:
    arrays = _arrays(np.random.default_rng(3))
    path = tmp_path / "ranges.safetensors"
    save_file(arrays, str(path))
    # 10,001 bins: numpy's count-and-range path for many bins, below it its search of edges.
    for bins in (1, 3, 10, 10_001):
        r = cli("stats", path, "--json", "--histogram", str(bins))
        assert r.code == 0, r.err
        for row in r.json()["tensors"]:
            histogram = row["histogram"]
            edges = np.array(histogram["edges"], np.float64)
            counts = np.array(histogram["counts"], np.int64)
            try:
                _check(_finite(arrays[row["name"]]), bins, edges, counts)
            except AssertionError as exc:
                raise AssertionError(f"{row['name']}, {bins} bins") from exc


def test_values_at_the_top_edge_are_in_the_last_bin(cli, tmp_path: Path) -> None:
    values = np.array([0.0, 1.0, 1.0, 1.0, 0.5], ml_dtypes.bfloat16)
    save_file({"x": values}, str(tmp_path / "t.safetensors"))
    (row,) = cli("stats", tmp_path / "t.safetensors", "--json", "--histogram", "2").json()[
        "tensors"
    ]
    assert row["histogram"] == {"edges": [0.0, 0.5, 1.0], "counts": [1, 4]}


def test_one_value_gets_numpys_unit_range_around_it() -> None:
    assert histogram_edges(3.0, 3.0, 2).tolist() == [2.5, 3.0, 3.5]
    assert histogram_edges(TINY, TINY, 3).tolist() == np.histogram([TINY], 3)[1].tolist()
    assert histogram_range(-0.0, -0.0, 5) == (-0.5, 0.5)


@pytest.mark.parametrize("value", [1e20, -1e20, 2.0**52, 2.0**53 + 2, 1.7e308])
@pytest.mark.parametrize("bins", [1, 4, 10])
def test_one_value_beyond_half_a_unit_gets_bins_of_two_ulps(value: float, bins: int) -> None:
    # numpy's v - 0.5 and v + 0.5 are v itself here: it refuses ("Too many bins").
    edges = histogram_edges(value, value, bins)
    assert np.isfinite(edges).all() and (edges[1:] > edges[:-1]).all()
    assert edges[0] == value - bins * math.ulp(value) and edges[-1] == value + bins * math.ulp(
        value
    )
    counts = bin_counts(np.full(3, value), edges)
    assert counts.sum() == 3 and counts[(bins - 1) // 2 if bins % 2 else bins // 2] == 3


@pytest.mark.parametrize("value", [F64_MAX, -F64_MAX])
def test_one_value_at_the_float64_limit_keeps_finite_edges(value: float) -> None:
    edges = histogram_edges(value, value, 4)
    assert np.isfinite(edges).all() and (edges[1:] > edges[:-1]).all()
    # The range ends at the value, on the side where the next float would be infinite.
    assert (edges[-1] if value > 0 else edges[0]) == value
    assert bin_counts(np.array([value]), edges).tolist() == (
        [0, 0, 0, 1] if value > 0 else [1, 0, 0, 0]
    )


def test_a_width_that_overflows_is_spaced_by_halves() -> None:
    edges = histogram_edges(-F64_MAX, F64_MAX, 4)
    assert edges.tolist() == (np.linspace(-F64_MAX / 2, F64_MAX / 2, 5) * 2).tolist()
    assert edges[0] == -F64_MAX and edges[-1] == F64_MAX and edges[2] == 0
    assert bin_counts(np.array([-F64_MAX, F64_MAX, 0.0]), edges).tolist() == [1, 0, 1, 1]


def test_a_range_of_a_few_ulps_keeps_numpys_repeated_edges() -> None:
    edges = histogram_edges(0.0, TINY, 10)
    assert edges.tolist() == np.linspace(0.0, TINY, 11).tolist()
    assert edges[0] == edges[1] == 0.0 and edges[-1] == TINY
    # The empty bins between equal edges take nothing; 0 goes to the last bin starting at 0.
    counts = bin_counts(np.array([0.0, TINY, TINY]), edges)
    assert counts.tolist() == np.histogram([0.0, TINY, TINY], bins=edges)[0].tolist()
    assert counts.sum() == 3 and counts[-1] == 2


@pytest.mark.parametrize(
    ("lo", "hi", "bins"),
    [(math.inf, -math.inf, 10), (math.nan, 1.0, 10), (0.0, math.inf, 10), (2.0, 1.0, 3), (0, 1, 0)],
)
def test_no_range_is_refused(lo: float, hi: float, bins: int) -> None:
    with pytest.raises(ValueError, match="histogram"):
        histogram_edges(lo, hi, bins)


def test_bin_counts_are_numpys_with_nan_inf_and_values_outside(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    values = rng.standard_normal(5_000)
    values[::97] = np.nan
    values[::89] = np.inf
    values[::83] = -np.inf
    for edges in (
        np.linspace(-1, 1, 8),  # values outside on both sides
        np.array([-1.0, -1.0, 0.0, 0.0, 0.5, 2.0, 2.0]),  # repeated edges, at the top too
        np.array([0.0, 1.0]),
    ):
        # numpy counts explicit edges over the finite values; ours skips the others itself.
        want = np.histogram(values[np.isfinite(values)], bins=edges)[0]
        assert bin_counts(values, edges).tolist() == want.tolist()


@pytest.mark.parametrize(
    "array",
    [np.full(4, np.nan, np.float32), np.array([np.inf, -np.inf]), np.zeros((0, 3), np.float16)],
    ids=["nan", "inf", "empty"],
)
def test_no_finite_values_no_histogram(cli, tmp_path: Path, array: np.ndarray) -> None:
    save_file({"x": array}, str(tmp_path / "n.safetensors"))
    r = cli("stats", tmp_path / "n.safetensors", "--json", "--histogram", "5")
    assert r.code == 0, r.err
    (row,) = r.json()["tensors"]
    assert row["histogram"] is None and row["min"] is None
    text = cli("stats", tmp_path / "n.safetensors", "--histogram", "5").out
    assert "x:" not in text  # no histogram printed under the table
