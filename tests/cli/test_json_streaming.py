"""JSON output is written as it is encoded, with rows made as they are written."""

from __future__ import annotations

import io
import json
import random
from collections.abc import Iterator
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors._cli._common import LazyRows, print_json


def test_print_json_writes_what_json_dumps_would_with_rows_made_on_the_way() -> None:
    made: list[int] = []

    def rows() -> Iterator[dict[str, object]]:
        for i in range(70_000):  # past one batch of pieces
            made.append(i)
            yield {"name": f"t{i}\u00e9", "shape": [i, 2], "ok": i % 2 == 0}

    doc = {"schema": "x", "tensors": LazyRows(70_000, rows), "empty": LazyRows(0, iter), "n": None}
    assert made == []  # nothing is made before printing
    out = io.StringIO()
    print_json(doc, out)
    expected = {
        "schema": "x",
        "tensors": [
            {"name": f"t{i}\u00e9", "shape": [i, 2], "ok": i % 2 == 0} for i in range(70_000)
        ],
        "empty": [],
        "n": None,
    }
    assert out.getvalue() == json.dumps(expected, indent=2, ensure_ascii=True) + "\n"
    assert len(made) == 70_000  # each row made once, while written


def _random_value(rng: random.Random, depth: int, left: list[int]) -> Any:
    """A JSON-able value of every kind ``print_json`` may meet, nested ``depth`` deep at most,
    of about ``left[0]`` values in all (decreased as they are made)."""
    left[0] -= 1
    kind = rng.randrange(12 if depth and left[0] > 0 else 8)
    if kind == 0:
        return rng.choice(["", "a", 'q"\\/', "t\u00e9\u2028\x00\n", "\ud800x", "\U0001f600"])
    if kind == 1:
        return rng.choice([None, True, False])
    if kind == 2:
        return rng.choice([0, -1, 2**63, -(2**70), True + 1])
    if kind == 3:
        return rng.choice([0.0, -0.0, 1e-310, 1.5e300, 0.1, -2.5, 1e16])
    if kind == 4:
        return IntEnum("E", "A B")(2)  # an int subclass: json writes int.__repr__
    if kind == 5:
        return []
    if kind == 6:
        return {}
    if kind == 7:
        return ()
    n = min(rng.choice([1, 2, 5, 300]), max(left[0], 1))  # 300: past a container written whole
    if kind == 8:
        return [_random_value(rng, depth - 1, left) for _ in range(n)]
    if kind == 9:
        return tuple(_random_value(rng, depth - 1, left) for _ in range(min(n, 5)))
    if kind == 10:
        items = [_random_value(rng, depth - 1, left) for _ in range(n)]
        return LazyRows(n, lambda: iter(items))
    keys: list[Any] = ["k", "", "\u00e9", 1, -2.5, True, False, None, 10**20]
    return {
        (rng.choice(keys) if i < 3 else f"key{i}"): _random_value(rng, depth - 1, left)
        for i in range(n)
    }


def _plain(value: Any) -> Any:
    """``value`` with its LazyRows as lists (what json.dumps is given to compare)."""
    if isinstance(value, LazyRows):
        return [_plain(v) for v in value]
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("seed", range(40))
def test_print_json_is_json_dumps_character_for_character(seed: int) -> None:
    """Small containers are written whole, large ones and LazyRows in pieces: the text is
    json.dumps's for any mix of them, keys of every kind json takes included."""
    rng = random.Random(seed)
    doc = _random_value(rng, 4, [2000])
    if seed % 2:  # many values: large containers taken apart
        doc = [doc, *(_random_value(rng, 3, [20]) for _ in range(300))]
    out = io.StringIO()
    print_json(doc, out)
    assert out.getvalue() == json.dumps(_plain(doc), indent=2, ensure_ascii=True) + "\n"


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        ({"a": [1, float("nan")]}, ValueError),
        ([{"x": float("-inf")}] * 300, ValueError),
        ({"a": {(1, 2): 3}}, TypeError),
        ({"a": [object()]}, TypeError),
        ({"a": LazyRows(1, lambda: iter([{1.5: b"bytes"}]))}, TypeError),
    ],
)
def test_print_json_refuses_what_json_refuses(doc: Any, error: type[Exception]) -> None:
    with pytest.raises(error) as ours:
        print_json(doc, io.StringIO())
    with pytest.raises(error) as theirs:
        json.dumps(_plain(doc), indent=2, ensure_ascii=True, allow_nan=False)
    assert str(ours.value) == str(theirs.value)


def test_a_value_nested_too_deeply_is_a_clear_error(cli: Any, tmp_path: Path) -> None:
    """An index's metadata may hold any JSON: nested hundreds of levels deep, `inspect
    --json` ended in a RecursionError's traceback; it is an error that says what."""
    from pysafetensors import SafetensorError
    from pysafetensors.numpy import save_file

    deep: Any = "x"
    for _ in range(2_000):
        deep = [deep]
    with pytest.raises(SafetensorError, match="nested too deeply"):
        print_json({"a": deep}, io.StringIO())
    for _ in range(1_300):  # 700 deep: what json writes and reads, and too deep for print_json
        deep = deep[0]
    shard = "model-00001-of-00001.safetensors"
    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / shard))
    index = {"metadata": {"total_size": 8, "deep": deep}, "weight_map": {"a": shard}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    r = cli("inspect", tmp_path, "--json")
    assert r.code == 1 and "nested too deeply" in r.err and "Traceback" not in r.err, r.err
