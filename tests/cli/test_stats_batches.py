"""``stats`` in batches of small tensors prints exactly what it prints one tensor at a time.

A random file mixes tiny tensors (runs of one dtype and size, as a MoE's experts, and lone
ones), tensors of a few chunks, empty ones, of every dtype, with NaN, Inf, zeros of both
signs, one repeated value, values past the scaled-sum threshold. The batched output (the
default) must equal the per-tensor output (``BATCH_WORDS = 0``) byte for byte: the table, the
histograms, the JSON, with filters that break the runs of adjacent tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors._adapter import numpy_dtype
from pysafetensors._cli import _chunk_work, _cmd_stats
from pysafetensors._cli._common import open_model
from pysafetensors._cli._small_tensors import Batch, _blocks, batched
from pysafetensors._dtypes import DTYPES, DType

from .conftest import raw_file

#: Elements per chunk for the runs with small chunks: the "large" tensors span a few.
SMALL_CHUNK = 1_000


def _values(rng: np.random.Generator, n: int) -> np.ndarray:
    """float64 values of one of several kinds."""
    kind = int(rng.integers(0, 9))
    values = rng.standard_normal(n) * 10.0 ** int(rng.integers(-3, 4))
    if kind == 1 and n:
        values[rng.integers(0, n, max(1, n // 10))] = np.nan
    elif kind == 2 and n:
        values[rng.integers(0, n, max(1, n // 10))] = np.inf * rng.choice([-1.0, 1.0])
    elif kind == 3:
        values = np.abs(values)
        values[: max(1, n // 3)] = -0.0  # the minimum: a negative zero
    elif kind == 4:
        values = -np.abs(values)
        values[: max(1, n // 3)] = rng.choice([0.0, -0.0])
    elif kind == 5:
        values[:] = rng.choice([0.0, 2.5, -7.0, 1e20])  # one value
    elif kind == 6:
        values[:] = np.nan
    elif kind == 7:
        values *= 1e300  # past the scaled-sum threshold (F64; Inf in narrower types)
    return values


def _tensor_bytes(rng: np.random.Generator, dtype: DType, n: int) -> bytes:
    """``n`` elements of ``dtype``: random bits for the sub-byte and E8M0 formats, else
    values of a random kind (integers: random bits or small values with zeros)."""
    if dtype.bits < 8 or dtype.code == "F8_E8M0":
        return rng.integers(0, 256, n * dtype.bits // 8, dtype=np.uint8).tobytes()
    if dtype.code == "BOOL":
        return rng.integers(0, 2, n, dtype=np.uint8).tobytes()
    target = numpy_dtype(dtype)
    if target.kind in "iu":
        if rng.random() < 0.5:
            return rng.integers(0, 256, n * dtype.bits // 8, dtype=np.uint8).tobytes()
        return rng.integers(0, 5, n).astype(target).tobytes()
    values = _values(rng, n)
    with np.errstate(invalid="ignore", over="ignore"):
        if target.kind == "c":
            values = values + 1j * _values(rng, n)
        return values.astype(target).tobytes()


def _random_file(rng: np.random.Generator, path: Path) -> None:
    """Runs of tensors of one dtype and size, lone ones, empty ones, some of a few chunks."""
    header: dict[str, Any] = {}
    data = bytearray()
    i = 0
    while i < 250:
        dtype = DTYPES[int(rng.integers(0, len(DTYPES)))]
        pick = rng.random()
        if pick < 0.08:
            n = int(rng.integers(1_500, 3_500))  # a few small chunks; one default chunk
        elif pick < 0.12:
            n = 0
        else:
            n = int(rng.integers(1, 200))
        n -= n % 4  # whole bytes of F4 and F6
        run = int(rng.integers(1, 25)) if rng.random() < 0.5 and n < 1_000 else 1
        for _ in range(run):
            raw = _tensor_bytes(rng, dtype, n)
            name = f"layer.{i // 50}.t{i:03}.{dtype.code.lower()}"
            header[name] = {
                "dtype": dtype.code,
                "shape": [n // 4, 4] if n and rng.random() < 0.5 else [n],
                "data_offsets": [len(data), len(data) + len(raw)],
            }
            data += raw
            i += 1
    path.write_bytes(raw_file(header, bytes(data)))


ARGS = [
    [],
    ["--histogram", "7"],
    ["--json"],
    ["--json", "--histogram"],
    ["--json", "--histogram", "1"],
    ["--histogram", "3", "-f", "layer.1.*", "-f", "layer.5.*"],
    ["--json", "--histogram", "300", "--regex", r"t\d\d[02468]\."],  # every other tensor
    ["--json", "--histogram", "33000", "--regex", r"t0[0-2]\d\."],  # too many bins for a batch
]


@pytest.mark.parametrize(
    "chunk", [SMALL_CHUNK, _chunk_work.CHUNK_ELEMENTS], ids=["small", "default"]
)
@pytest.mark.parametrize("seed", [1, 2])
def test_batched_output_is_the_per_tensor_output(
    cli: Callable[..., Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
    chunk: int,
) -> None:
    monkeypatch.setattr(_chunk_work, "CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(_chunk_work, "_usable_cores", lambda: 4)  # workers hand results back
    path = tmp_path / "mixed.safetensors"
    _random_file(np.random.default_rng(seed), path)
    # The file has what the batches are for: runs of several tensors, rows of one dtype and
    # size in them, and tensors left to the per-tensor path.
    with open_model(str(path), None) as model:
        units = list(batched(list(model.tensors.values()), 7, chunk))
    runs = [u.refs for u in units if isinstance(u, Batch)]
    assert max(map(len, runs)) >= 5
    assert any(
        a.dtype == b.dtype and a.numel == b.numel
        for r in runs
        for a, b in zip(r[:-1], r[1:], strict=True)
    )
    assert chunk != SMALL_CHUNK or any(not isinstance(u, Batch) for u in units)
    for args in ARGS:
        monkeypatch.setattr(_cmd_stats, "BATCH_WORDS", 0)
        alone = cli("stats", path, *args)
        monkeypatch.setattr(_cmd_stats, "BATCH_WORDS", None)
        together = cli("stats", path, *args)
        assert alone.code == together.code == 0, (args, alone.err, together.err)
        assert together.out == alone.out, args
        assert together.err == alone.err, args
        if "--json" in args:
            rows = json.loads(together.out)["tensors"]
            assert rows and any(row["histogram"] for row in rows) == ("--histogram" in args)


def test_batched_stats_are_numpys(cli: Callable[..., Any], tmp_path: Path) -> None:
    # Both paths agreeing is not enough: the batched numbers must also be right.
    rng = np.random.default_rng(9)
    tensors = {
        f"e{i:02}": (rng.standard_normal(64) * (i + 1)).astype(np.float32) for i in range(40)
    }
    tensors["e07"][3] = np.nan
    tensors["e11"][:] = 0.5
    header: dict[str, Any] = {}
    data = bytearray()
    for name, array in tensors.items():
        header[name] = {"dtype": "F32", "shape": [64], "data_offsets": [len(data), len(data) + 256]}
        data += array.tobytes()
    path = tmp_path / "experts.safetensors"
    path.write_bytes(raw_file(header, bytes(data)))
    rows = {
        t["name"]: t for t in cli("stats", path, "--json", "--histogram", "5").json()["tensors"]
    }
    for name, array in tensors.items():
        values = array.astype(np.float64)
        finite = values[np.isfinite(values)]
        row = rows[name]
        assert (row["min"], row["max"], row["nan"]) == (
            finite.min(),
            finite.max(),
            64 - finite.size,
        )
        assert row["mean"] == pytest.approx(finite.mean(), rel=1e-12)
        assert row["std"] == pytest.approx(finite.std(), rel=1e-12)
        counts, edges = np.histogram(finite, bins=5)
        assert row["histogram"] == {"edges": edges.tolist(), "counts": counts.tolist()}


def test_alternating_sizes_are_summarised_together(
    cli: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A LoRA's A and B matrices alternate in a file (r x in, out x r): each was a block of its
    # own, every tensor paying the block's ~20 numpy calls. Grouped by dtype and size across
    # the batch, the output is still the per-tensor path's, byte for byte.
    rng = np.random.default_rng(3)
    header: dict[str, Any] = {}
    data = bytearray()
    for i in range(60):
        shape = [4, 32] if i % 2 == 0 else [16, 4]
        values = rng.standard_normal(shape).astype(np.float32)
        if i == 7:
            values[0, 0] = np.nan
        header[f"layer.{i // 2}.lora_{'AB'[i % 2]}.weight"] = {
            "dtype": "F32",
            "shape": shape,
            "data_offsets": [len(data), len(data) + values.nbytes],
        }
        data += values.tobytes()
    path = tmp_path / "lora.safetensors"
    path.write_bytes(raw_file(header, bytes(data)))
    with open_model(str(path), None) as model:
        refs = list(model.tensors.values())
        raw = np.frombuffer(bytes(data), np.uint8)
        groups = [members for members, _ in _blocks(refs, raw)]
    assert sorted(map(len, groups)) == [30, 30]
    for args in (["--json", "--histogram", "5"], ["--histogram", "3"]):
        monkeypatch.setattr(_cmd_stats, "BATCH_WORDS", 0)
        alone = cli("stats", path, *args)
        monkeypatch.setattr(_cmd_stats, "BATCH_WORDS", None)
        together = cli("stats", path, *args)
        assert alone.code == together.code == 0
        assert together.out == alone.out, args
