"""``cast`` of spans of small tensors writes exactly what it writes one tensor at a time.

Random files of every dtype in a random order (raw headers: not the writers' order, so the
output's order differs from the input's), with runs of small tensors of one dtype, lone and
empty ones, some of a few chunks, values that overflow, flush to zero, NaN and Inf. The output
with spans (the default) must equal the per-tensor output (``BATCH_ELEMENTS = 0``) byte for
byte, and so must what ``cast`` prints (the losses are counted per tensor), for several
``--to``, ``--from`` and filters, a file and a sharded model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors._cli import _chunk_work, _cmd_cast
from pysafetensors._dtypes import DTYPES

from .conftest import raw_file
from .test_stats_batches import SMALL_CHUNK, _tensor_bytes

_FLOATS = [d for d in DTYPES if d.code in ("F64", "F32", "F16", "BF16")]


def _random_header(rng: np.random.Generator, count: int, prefix: str) -> tuple[dict, bytes]:
    header: dict[str, Any] = {}
    data = bytearray()
    i = 0
    while i < count:
        # Mostly the types cast converts (four of some twenty).
        pool = _FLOATS if rng.random() < 0.6 else DTYPES
        dtype = pool[int(rng.integers(0, len(pool)))]
        pick = rng.random()
        n = (
            int(rng.integers(1_500, 3_500))
            if pick < 0.06
            else 0
            if pick < 0.1
            else int(rng.integers(1, 120))
        )
        n -= n % 4  # whole bytes of F4 and F6
        run = int(rng.integers(1, 20)) if rng.random() < 0.6 and n < 1_000 else 1
        # Runs in a random order of names (the output, by rank and then name, is another
        # order), each run's names in order (as a writer of the reference's order leaves them).
        key = int(rng.integers(0, 10**6))
        for j in range(run):
            raw = _tensor_bytes(rng, dtype, n)
            name = f"{prefix}.{key:06d}.{j:02d}.{i}.{dtype.code.lower()}"
            header[name] = {
                "dtype": dtype.code,
                "shape": [n],
                "data_offsets": [len(data), len(data) + len(raw)],
            }
            data += raw
            i += 1
    return header, bytes(data)


ARGS = [
    ["--to", "bf16"],
    ["--to", "f16"],  # F64/F32 values past 65504 overflow, tiny ones flush to zero
    ["--to", "f8_e4m3", "--from", "f32,f64,bf16,f16"],
    ["--to", "f64", "--from", "F16", "--from", "BF16,F8_E5M2"],
    ["--to", "f16", "--regex", r"\.[0-9]*[02468]\."],  # every other tensor: runs broken
]


@pytest.mark.parametrize(
    "chunk", [SMALL_CHUNK, _chunk_work.CHUNK_ELEMENTS], ids=["small", "default"]
)
@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_cast_in_spans_writes_the_per_tensor_output(
    cli: Callable[..., Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    chunk: int,
    sharded: bool,
) -> None:
    monkeypatch.setattr(_chunk_work, "CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(_chunk_work, "_usable_cores", lambda: 4)
    rng = np.random.default_rng(11 if sharded else 12)
    if sharded:
        source = tmp_path / "model"
        source.mkdir()
        weight_map = {}
        for s in (1, 2):
            shard = f"model-0000{s}-of-00002.safetensors"
            header, data = _random_header(rng, 120, f"s{s}")
            (source / shard).write_bytes(raw_file(header, data))
            weight_map.update(dict.fromkeys(header, shard))
        index = {"metadata": {}, "weight_map": weight_map}
        (source / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        source = tmp_path / "in.safetensors"
        source.write_bytes(raw_file(*_random_header(rng, 250, "t")))
    spans: list[int] = []
    real = _cmd_cast._spans

    def counted(*a: Any) -> Any:
        for unit in real(*a):
            if isinstance(unit, _cmd_cast._Span):
                spans.append(len(unit.members))
            yield unit

    monkeypatch.setattr(_cmd_cast, "_spans", counted)
    warned = False
    for n, args in enumerate(ARGS):
        outputs = []
        for cap in (0, None):
            monkeypatch.setattr(_cmd_cast, "BATCH_ELEMENTS", cap)
            out = tmp_path / f"out{n}-{cap}" / ("model" if sharded else "out.safetensors")
            out.parent.mkdir()
            r = cli("cast", source, out, *args)
            assert r.code == 0, (args, r.err)
            files = sorted(out.rglob("*")) if sharded else [out]
            contents = {p.name: p.read_bytes() for p in files if p.is_file()}
            here = f"out{n}-{cap}"
            outputs.append((contents, r.out.replace(here, "out"), r.err.replace(here, "out")))
        assert outputs[0] == outputs[1], args
        warned = warned or "became" in outputs[0][2]
    assert warned  # losses were counted (per tensor, the same either way)
    assert max(spans) >= 8  # long spans were read and cast at once
