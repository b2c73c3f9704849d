"""Plain tables (no terminal): columns padded to the widest cell as a terminal shows it."""

from __future__ import annotations

import argparse
import random

import pytest

from pysafetensors._cli._common import Ui, display_width

_CELLS = ["", "a", "F32", "1,024", "模型", "e\u0301x", "\U0001f600!", "layer.0.weight", "-0.5"]


def _expected(columns: list[str], rows: list[list[str]], right: set[str]) -> str:
    """The table as the per-cell definition gives it: each cell padded to its column's
    widest display width, right-aligned columns on the left, lines without trailing spaces."""
    widths = [max(display_width(c) for c in col) for col in zip(columns, *rows, strict=True)]
    lines = []
    for cells in [columns, *rows]:
        parts = []
        for col, cell, w in zip(columns, cells, widths, strict=True):
            pad = " " * (w - display_width(cell))
            parts.append(pad + cell if col in right else cell + pad)
        lines.append("  ".join(parts).rstrip())
    return "".join(line + "\n" for line in lines)


@pytest.mark.parametrize("seed", range(20))
def test_plain_table_pads_by_display_width(seed: int, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(seed)
    columns = [f"C{i}" for i in range(rng.randint(1, 5))]
    ascii_only = seed % 2 == 0
    pool = [c for c in _CELLS if c.isascii()] if ascii_only else _CELLS
    rows = [[rng.choice(pool) for _ in columns] for _ in range(rng.choice([0, 1, 3, 1500]))]
    right = {c for c in columns if rng.random() < 0.5}
    Ui(argparse.Namespace()).table(columns, rows, right=sorted(right))
    assert capsys.readouterr().out == _expected(columns, rows, right)


def test_a_row_of_another_length_is_refused() -> None:
    with pytest.raises(ValueError, match="number of cells"):
        Ui(argparse.Namespace()).table(["A", "B"], [["1", "2"], ["3"]])
