"""JSON output is written as it is encoded, with rows made as they are written."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

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
