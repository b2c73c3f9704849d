"""Every progress bar's total is the sum of what its command then reports: a bar announced
for bytes that are never read stops short of its end, and one that runs past its total says
nothing at all.

The bar itself (tqdm) only draws on a terminal, so the commands run with ``Ui.progress``
replaced by a recorder that keeps the total announced and the counts reported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from pysafetensors._cli import _common
from pysafetensors.numpy import save_file

from .conftest import Result, example_tensors, write_sharded


@pytest.fixture
def bars(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every bar the command opens: its description, total and reported counts."""
    opened: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def recorder(self: Any, total: int, desc: str) -> Iterator[Callable[[int], None]]:
        bar: dict[str, Any] = {"desc": desc, "total": total, "counts": []}
        opened.append(bar)
        yield bar["counts"].append

    monkeypatch.setattr(_common.Ui, "progress", recorder)
    return opened


def _check(result: Result, bars: list[dict[str, Any]], desc: str, expected: int) -> None:
    assert result.code in (0, 1), result.err
    (bar,) = [b for b in bars if b["desc"] == desc]
    assert sum(bar["counts"]) == bar["total"] == expected, bar


def _pair(tmp_path: Path) -> tuple[Path, Path, dict[str, np.ndarray]]:
    tensors = example_tensors()
    changed = dict(tensors)
    changed["model.embed.weight"] = tensors["model.embed.weight"] + 1
    # A reshaped tensor is reported without its values being read.
    changed["model.layers.0.norm.weight"] = np.ones((4, 8), np.float32)
    del changed["step"]
    changed["extra"] = np.zeros(3, np.int8)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(tensors, str(a))
    save_file(changed, str(b))
    return a, b, tensors


def test_diff_counts_the_pairs_it_compares(
    cli: Callable[..., Result], bars: list[dict[str, Any]], tmp_path: Path
) -> None:
    a, b, tensors = _pair(tmp_path)
    compared = [
        n for n in tensors if n not in ("step", "model.layers.0.norm.weight")
    ]  # in both, same shape
    expected = 2 * sum(tensors[n].nbytes for n in compared)
    _check(cli("diff", a, b), bars, "diff", expected)


def test_diff_with_a_filter_counts_the_filtered_pairs(
    cli: Callable[..., Result], bars: list[dict[str, Any]], tmp_path: Path
) -> None:
    a, b, tensors = _pair(tmp_path)
    result = cli("diff", a, b, "--filter", "model.embed.*")
    _check(result, bars, "diff", 2 * tensors["model.embed.weight"].nbytes)


def test_diff_without_values_counts_nothing(
    cli: Callable[..., Result], bars: list[dict[str, Any]], tmp_path: Path
) -> None:
    a, b, _ = _pair(tmp_path)
    _check(cli("diff", a, b, "--no-values"), bars, "diff", 0)


def test_stats_and_hash_count_the_tensors_read(
    cli: Callable[..., Result], bars: list[dict[str, Any]], example: Path
) -> None:
    data = sum(t.nbytes for t in example_tensors().values())
    _check(cli("hash", example), bars, "hash", data)
    _check(cli("stats", example), bars, "stats", data)
    embed = example_tensors()["model.embed.weight"].nbytes
    bars.clear()
    _check(cli("stats", example, "--filter", "model.embed.*"), bars, "stats", embed)


def test_validate_strict_counts_the_files_it_reads(
    cli: Callable[..., Result], bars: list[dict[str, Any]], example: Path, tmp_path: Path
) -> None:
    _check(cli("validate", "--strict", example), bars, "validate", example.stat().st_size)
    names = list(example_tensors())
    folder = write_sharded(tmp_path / "sharded", example_tensors(), [names[:2], names[2:]])
    bars.clear()
    in_shards = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    _check(cli("validate", "--strict", folder), bars, "validate", in_shards)


def test_cast_counts_the_tensors_it_converts(
    cli: Callable[..., Result], bars: list[dict[str, Any]], tmp_path: Path
) -> None:
    path = tmp_path / "m.safetensors"
    tensors = {
        "w": np.ones((16, 16), np.float32),
        "h": np.ones(8, ml_dtypes.bfloat16),
        "i": np.arange(5, dtype=np.int64),
    }
    save_file(tensors, str(path))
    result = cli("cast", path, tmp_path / "out.safetensors", "--to", "F16")
    _check(result, bars, "cast", sum(t.nbytes for t in tensors.values()))
