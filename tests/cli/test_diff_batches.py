"""``diff`` in batches of small tensors prints exactly what it prints one pair at a time.

Two random files of the same tensors in the same order, of every dtype: most pairs equal, some
with bytes changed (NaN, Inf, large and tiny differences), some cast to another dtype of the
same width or to F64, some empty, some of a few chunks, some only in one file or of another
shape. The batched output (the default) must equal the per-pair output (``BATCH_ELEMENTS =
0``) byte for byte, with tolerances and filters that break the runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors._adapter import numpy_dtype
from pysafetensors._cli import _chunk_work, _cmd_diff
from pysafetensors._cli._common import open_model
from pysafetensors._cli._paired_batches import PairBatch, batched_pairs
from pysafetensors._dtypes import DTYPES, DType

from .conftest import raw_file
from .test_stats_batches import SMALL_CHUNK, _tensor_bytes

#: Numeric dtypes numpy holds natively, whose values can be cast to F64 for B.
_CASTABLE = {"F16", "F32", "F64", "I8", "I16", "I32", "U8", "U16", "U32", "BF16"}


def _other_of_width(rng: np.random.Generator, dtype: DType) -> DType:
    """Another dtype of the same width (the same bytes read as other values)."""
    same = [d for d in DTYPES if d.bits == dtype.bits and d != dtype]
    return same[int(rng.integers(0, len(same)))] if same else dtype


def _changed(rng: np.random.Generator, raw: bytes) -> bytes:
    """``raw`` with a few bytes set at random (a flipped exponent: NaN, Inf, huge values)."""
    out = bytearray(raw)
    for at in rng.integers(0, len(out), max(1, len(out) // 20)):
        out[at] = int(rng.integers(0, 256))
    return bytes(out)


def _random_pair(rng: np.random.Generator, a_path: Path, b_path: Path) -> None:
    a_header: dict[str, Any] = {}
    b_header: dict[str, Any] = {}
    a_data, b_data = bytearray(), bytearray()
    for i in range(300):
        dtype = DTYPES[int(rng.integers(0, len(DTYPES)))]
        pick = rng.random()
        n = (
            int(rng.integers(1_500, 3_500))
            if pick < 0.06
            else 0
            if pick < 0.1
            else int(rng.integers(1, 200))
        )
        n -= n % 4  # whole bytes of F4 and F6
        shape = [n // 4, 4] if n and rng.random() < 0.5 else [n]
        raw = _tensor_bytes(rng, dtype, n)
        name = f"layer.{i // 60}.t{i:03}.{dtype.code.lower()}"
        a_header[name] = {
            "dtype": dtype.code,
            "shape": shape,
            "data_offsets": [len(a_data), len(a_data) + len(raw)],
        }
        a_data += raw
        b_dtype, b_shape, b_raw = dtype, shape, raw
        change = rng.random()
        if change < 0.15 and raw:
            b_raw = _changed(rng, raw)
        elif change < 0.22 and dtype.code in _CASTABLE:
            values = np.frombuffer(raw, numpy_dtype(dtype)).astype(np.float64)
            with np.errstate(invalid="ignore", over="ignore"):
                b_raw = (values * (1 + 1e-4)).tobytes()
            b_dtype = next(d for d in DTYPES if d.code == "F64")
        elif change < 0.3:
            b_dtype = _other_of_width(rng, dtype)
        elif change < 0.33:
            continue  # only in A
        elif change < 0.36 and n:
            b_shape = [n]  # another shape where A's is [n // 4, 4]
        b_header[name] = {
            "dtype": b_dtype.code,
            "shape": b_shape,
            "data_offsets": [len(b_data), len(b_data) + len(b_raw)],
        }
        b_data += b_raw
    a_path.write_bytes(raw_file(a_header, bytes(a_data)))
    b_path.write_bytes(raw_file(b_header, bytes(b_data)))


ARGS = [
    [],
    ["--json"],
    ["--atol", "1e-3"],
    ["--json", "--rtol", "0.01", "--atol", "1e-6"],
    ["-f", "layer.1.*", "-f", "layer.4.*"],
    ["--json", "--regex", r"t\d\d[02468]\."],  # every other tensor: no runs
]


@pytest.mark.parametrize(
    "chunk", [SMALL_CHUNK, _chunk_work.CHUNK_ELEMENTS], ids=["small", "default"]
)
@pytest.mark.parametrize("seed", [1, 2])
def test_batched_diff_is_the_per_pair_diff(
    cli: Callable[..., Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
    chunk: int,
) -> None:
    monkeypatch.setattr(_chunk_work, "CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(_chunk_work, "_usable_cores", lambda: 4)  # workers hand results back
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _random_pair(np.random.default_rng(seed), a, b)
    # The files have what the batches are for: long runs, and pairs left alone.
    with open_model(str(a), None) as ma, open_model(str(b), None) as mb:
        pairs = [
            (x, mb.tensors[name])
            for name, x in ma.tensors.items()
            if name in mb.tensors and x.shape == mb.tensors[name].shape
        ]
        units = list(batched_pairs(pairs, chunk))
    assert max(len(u.pairs) for u in units if isinstance(u, PairBatch)) >= 10
    assert chunk != SMALL_CHUNK or any(not isinstance(u, PairBatch) for u in units)
    for args in ARGS:
        monkeypatch.setattr(_cmd_diff, "BATCH_ELEMENTS", 0)
        alone = cli("diff", a, b, *args)
        monkeypatch.setattr(_cmd_diff, "BATCH_ELEMENTS", None)
        together = cli("diff", a, b, *args)
        assert alone.code == together.code == 1, (args, alone.err, together.err)
        assert together.out == alone.out, args
        assert together.err == alone.err, args
        if "--json" in args:
            doc = json.loads(together.out)
            statuses = {row["status"] for row in doc["tensors"]}
            assert {"identical", "changed"} <= statuses, args


def test_copies_compare_in_few_reads(
    cli: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two copies of a file of 2,000 small tensors: a read of each file per batch, not per
    tensor, and every tensor identical."""
    from pysafetensors._cli import _paired_batches

    rng = np.random.default_rng(3)
    header: dict[str, Any] = {}
    data = bytearray()
    for i in range(2_000):
        raw = rng.standard_normal(int(rng.integers(1, 300))).astype(np.float32).tobytes()
        header[f"t{i}"] = {
            "dtype": "F32",
            "shape": [len(raw) // 4],
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(raw_file(header, bytes(data)))
    b.write_bytes(a.read_bytes())
    batches: list[int] = []
    real = _paired_batches.read_pair_batch

    def counted(batch: PairBatch) -> Any:
        batches.append(len(batch.pairs))
        return real(batch)

    monkeypatch.setattr(_cmd_diff, "read_pair_batch", counted)
    doc = json.loads(cli("diff", a, b, "--json").out)
    assert doc["equal"] and doc["summary"]["identical"] == 2_000
    assert sum(batches) == 2_000
    # Batches of up to a chunk's elements a side: 2,000 tensors of ~150 elements, two.
    assert len(batches) <= -(-len(data) // 4 // _chunk_work.CHUNK_ELEMENTS) + 1
