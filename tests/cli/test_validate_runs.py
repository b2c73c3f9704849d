"""``validate --strict`` checks runs of small tensors at once and reports what it reports
tensor by tensor.

A random file of float types (those the fast bit test knows and those it does not), BOOL
and integers, in runs of one dtype and alone, some of a few sub-chunks, with NaN, Inf and
bytes other than 0 and 1 here and there. The problems (each tensor's counts and first offset)
and the progress counts must be those of checking every tensor on its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import _validate
from pysafetensors._dtypes import DTYPES
from pysafetensors._validate import validate

from .conftest import raw_file
from .test_stats_batches import _tensor_bytes

_CHECKED = [d for d in DTYPES if d.is_float or d.code == "BOOL"]


def _random_file(rng: np.random.Generator, path: Path) -> None:
    header: dict[str, Any] = {}
    data = bytearray()
    i = 0
    while i < 400:
        pool = _CHECKED if rng.random() < 0.85 else DTYPES
        dtype = pool[int(rng.integers(0, len(pool)))]
        n = int(rng.integers(1, 300)) if rng.random() < 0.95 else 700_000  # a few sub-chunks
        n -= n % 4  # whole bytes of F4 and F6
        run = int(rng.integers(1, 30)) if rng.random() < 0.6 else 1
        for _ in range(run):
            raw = bytearray(_tensor_bytes(rng, dtype, n))
            if dtype.code == "BOOL" and raw and rng.random() < 0.3:
                raw[int(rng.integers(0, len(raw)))] = 7
            header[f"t{i:04d}"] = {
                "dtype": dtype.code,
                "shape": [n],
                "data_offsets": [len(data), len(data) + len(raw)],
            }
            data += raw
            i += 1
    # Whatever the draw: a run of BOOL with a bad byte in its third tensor, one of F32 with a
    # NaN and an Inf in its second.
    bools = [np.array([0, 1, 1, 0], np.uint8).tobytes()] * 5
    bools[2] = bytes([1, 0, 2, 1])
    floats = [np.ones(8, np.float32).tobytes()] * 4
    floats[1] = np.array([1, np.nan, 2, np.inf, 0, 0, 0, 0], np.float32).tobytes()
    for code, raws in (("BOOL", bools), ("F32", floats)):
        for raw in raws:
            header[f"t{i:04d}"] = {
                "dtype": code,
                "shape": [len(raw) // (1 if code == "BOOL" else 4)],
                "data_offsets": [len(data), len(data) + len(raw)],
            }
            data += raw
            i += 1
    path.write_bytes(raw_file(header, bytes(data)))


def _alone(checked: Any) -> Any:
    return ([e] for e in checked)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_runs_report_what_each_tensor_alone_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    path = tmp_path / "mixed.safetensors"
    _random_file(np.random.default_rng(seed), path)
    runs = [len(r) for r in _validate._adjacent_runs(_checked_entries(path))]
    assert max(runs) >= 10 and 1 in runs
    got: list[int] = []
    together = validate(path, strict=True, progress=got.append)
    monkeypatch.setattr(_validate, "_adjacent_runs", _alone)
    each: list[int] = []
    alone = validate(path, strict=True, progress=each.append)
    assert together == alone
    assert {p.code for p in alone} >= {"NonFinite", "BoolNotZeroOne"}
    assert sum(got) == sum(each) == path.stat().st_size


def _checked_entries(path: Path) -> list[Any]:
    """The entries the value checks read, as ``_check_values`` chooses them."""
    import pysafetensors

    with pysafetensors.safe_open(str(path), "np") as f:
        infos = list(f.header.tensors.values())
    entries = [_validate._Entry(i.name, i.dtype, i.shape, i.begin, i.end) for i in infos]
    return [e for e in entries if e.end > e.begin and (e.dtype.is_float or e.dtype.code == "BOOL")]
