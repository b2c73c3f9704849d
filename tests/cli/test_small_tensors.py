"""``stats``' batches of small tensors: the row-wise functions give, for every row, what the
per-tensor ones give for that tensor alone, bit for bit; batches are runs of adjacent tensors of
one file within their cap."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pysafetensors._cli import _histogram
from pysafetensors._cli._common import open_model
from pysafetensors._cli._histogram import (
    bin_counts,
    bin_counts_rows,
    histogram_edges,
    histogram_edges_rows,
)
from pysafetensors._cli._small_tensors import Batch, batch_weight, batched
from pysafetensors._cli._value_stats import summarise, summarise_rows
from pysafetensors.numpy import save_file

F64_MAX = float(np.finfo(np.float64).max)


def _rows(rng: np.random.Generator, k: int, n: int) -> np.ndarray:
    """Rows of every kind: plain at many scales, with NaN, Inf, zeros of either sign (alone,
    at the minimum, at the maximum), past the scaled-sum threshold, one value."""
    rows = rng.standard_normal((k, n)) * 10.0 ** rng.integers(-300, 300, (k, 1))
    for i in range(k):
        kind = i % 12
        if kind == 1:
            rows[i, rng.integers(0, n)] = np.nan
        elif kind == 2:
            rows[i, rng.integers(0, n)] = np.inf * rng.choice([-1, 1])
        elif kind == 3:
            rows[i] = np.abs(rows[i])
            rows[i, rng.integers(0, n)] = -0.0  # the minimum, a negative zero
        elif kind == 4:
            rows[i] = -np.abs(rows[i])
            rows[i, : max(1, n // 2)] = 0.0  # the maximum, a positive zero
        elif kind == 5:
            rows[i] = rng.choice([0.0, -0.0], n)
        elif kind == 6:
            rows[i] = rng.uniform(-1, 1, n) * 1.7e308
        elif kind == 7:
            rows[i] = 2.5
        elif kind == 8:
            rows[i] = np.nan
        elif kind == 9:
            rows[i, 0] = 0.0  # a zero inside the range: no sign to look at
    return rows


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 16, 31, 128, 129, 255, 1000, 4097])
def test_summarise_rows_is_summarise_of_each_row(n: int) -> None:
    rng = np.random.default_rng(n)
    k = 48
    rows = _rows(rng, k, n)
    # repr: the digits and the sign of a zero (-0.0 == 0.0).
    want = [repr(summarise(row.copy())) for row in rows]
    assert [repr(p) for p in summarise_rows(rows.copy())] == want
    # Integer rows: exact extremes beside the float64 values.
    ints = rng.integers(-(2**63), 2**63 - 1, (k, n), dtype=np.int64, endpoint=True)
    ints[::5] = 0
    want = [repr(summarise(row.astype(np.float64), row)) for row in ints]
    assert [repr(p) for p in summarise_rows(ints.astype(np.float64), ints)] == want


def test_summarise_rows_of_empty_rows() -> None:
    parts = summarise_rows(np.empty((3, 0)))
    assert parts == [summarise(np.empty(0))] * 3


def _ranges(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    lo = rng.standard_normal(200) * 10.0 ** rng.integers(-320, 300, 200)
    hi = lo + np.abs(rng.standard_normal(200)) * 10.0 ** rng.integers(-320, 300, 200)
    special = [
        (3.0, 3.0),  # one value
        (1e20, 1e20),  # one value beyond numpy's half unit
        (F64_MAX, F64_MAX),
        (-F64_MAX, F64_MAX),  # a width that overflows
        (0.0, 5e-324),  # a zero step
        (-0.0, 1.0),
        (-0.0, -0.0),
        (1.0, 1.0 + 2**-52),  # repeated edges
    ]
    lo = np.concatenate([lo, [a for a, _ in special]])
    hi = np.concatenate([np.maximum(lo[:200], hi), [b for _, b in special]])
    return lo, hi


@pytest.mark.parametrize("bins", [1, 2, 3, 10, 1000])
def test_edges_rows_are_the_edges_of_each_range(bins: int) -> None:
    lo, hi = _ranges(np.random.default_rng(bins))
    got = histogram_edges_rows(lo, hi, bins)
    for i in range(lo.size):
        want = histogram_edges(float(lo[i]), float(hi[i]), bins)
        assert got[i].tobytes() == want.tobytes(), (lo[i], hi[i])


@pytest.mark.parametrize("bins", [1, 3, 10, 257])
@pytest.mark.parametrize("block", [65_536, 40])
def test_counts_rows_are_the_counts_of_each_row(
    bins: int, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_histogram, "_BLOCK", block)  # rows counted a few at a time
    rng = np.random.default_rng(bins)
    lo, hi = _ranges(rng)
    k, n = lo.size, 33
    # Values within each range, at its edges (the top one: the last bin), beside it, NaN, Inf.
    with np.errstate(over="ignore", invalid="ignore"):
        values = lo[:, None] + rng.uniform(0, 1, (k, n)) * (hi - lo)[:, None]
    values = np.where(np.isfinite(values), values, lo[:, None])
    values[:, 0], values[:, 1], values[:, 2] = lo, hi, hi
    values[::3, 3] = np.nan
    values[::4, 4] = np.inf
    values[::5, 5] = lo[::5] - 1.0
    edges = histogram_edges_rows(lo, hi, bins)
    edges[7] = np.linspace(0.0, 1.0, bins + 1)  # a row whose values are mostly outside
    got = bin_counts_rows(values, edges)
    for i in range(k):
        assert got[i].tolist() == bin_counts(values[i], edges[i]).tolist(), i
        finite = values[i][np.isfinite(values[i])]
        assert got[i].tolist() == np.histogram(finite, bins=edges[i])[0].tolist(), i


def _refs(tmp_path: Path, tensors: dict[str, np.ndarray]) -> list:
    path = tmp_path / "b.safetensors"
    save_file(tensors, str(path))
    with open_model(str(path), None) as model:
        return list(model.tensors.values())


def test_batches_are_runs_of_adjacent_small_tensors_within_the_cap(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    tensors = {f"t{i:03}": rng.standard_normal(int(rng.integers(0, 40))) for i in range(120)}
    tensors["t050"] = rng.standard_normal(5_000)  # larger than the cap
    refs = _refs(tmp_path, tensors)
    for bins in (None, 2):
        units = list(batched(refs, bins, 300))
        flat = [r for u in units for r in (u.refs if isinstance(u, Batch) else (u,))]
        assert [r.name for r in flat] == [r.name for r in refs]  # every tensor, in order
        for u in units:
            if isinstance(u, Batch):
                assert sum(batch_weight(r, bins) for r in u.refs) <= 300
                assert all(a.end == b.begin for a, b in zip(u.refs, u.refs[1:], strict=False))
                assert u.nbytes == sum(r.nbytes for r in u.refs)
            else:
                assert batch_weight(u, bins) > 300
        assert sum(isinstance(u, Batch) for u in units) >= 2  # the large tensor splits them
    assert all(not isinstance(u, Batch) for u in batched(refs, None, 0))


def test_batches_skip_over_tensors_left_out(tmp_path: Path) -> None:
    refs = _refs(tmp_path, {f"t{i}": np.ones(4) for i in range(6)})
    chosen = [r for r in refs if r.name != "t3"]  # a filter: t2 and t4 are not adjacent
    units = list(batched(chosen, None, 10_000))
    assert [[r.name for r in u.refs] for u in units if isinstance(u, Batch)] == [
        ["t0", "t1", "t2"],
        ["t4", "t5"],
    ]
