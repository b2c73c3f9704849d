"""``stats --histogram`` over many tensors: memory bounded by what it must keep.

JSON output is written tensor by tensor as each is summarised (nothing kept per tensor); the
text output prints its table first, so it draws each tensor's histogram as the tensor is done
and keeps the text until then, in memory only up to a small spool and then in a temporary file
(kept as arrays, 16 bytes a bin, every histogram grew the heap with the model). Measured
with ``tracemalloc``, which numpy's allocations report to: an allocation bound, not a timing.
These small tensors are summarised in batches on the worker threads, each of which keeps its
scratch buffers (~2 MiB) for the command: allowed for in :data:`PER_WORKER`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from pysafetensors._cli import _chunk_work, main
from pysafetensors._cli._chunk_work import ChunkWorkers
from pysafetensors.numpy import save_file

TENSORS, BINS = 300, 1_000
#: Each worker thread's scratch (float64 values, masks) and its share of the batches in flight.
PER_WORKER = 3 * 2**20


def _workers_allowance() -> int:
    """Memory the worker threads may hold (none: one core, the calling thread works)."""
    threads = ChunkWorkers().threads
    return PER_WORKER * threads if threads > 1 else 0


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stats") / "many.safetensors"
    rng = np.random.default_rng(3)
    save_file({f"t{i}": rng.standard_normal(32).astype(np.float32) for i in range(TENSORS)}, path)
    return path


def _peak(args: list[str], out: str) -> int:
    with open(out, "w") as sink, contextlib.redirect_stdout(sink):
        tracemalloc.start()
        try:
            assert main(["-q", "stats", "--histogram", str(BINS), *args]) == 0
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()


def test_json_histograms_are_written_as_they_are_made(many: Path, tmp_path: Path) -> None:
    out = tmp_path / "stats.json"
    peak = _peak(["--json", str(many)], str(out))
    doc = json.loads(out.read_text())
    assert len(doc["tensors"]) == TENSORS
    first = doc["tensors"][0]
    assert len(first["histogram"]["counts"]) == BINS
    assert sum(first["histogram"]["counts"]) == 32
    # 8 MB measured (the encoder's batch of pieces, the headers) before workers summarised
    # small tensors, 10.6 MB with one worker, 13.8 MB with two; kept as Python lists until
    # printing, the histograms took 21 MB (and they would grow with the tensors).
    assert peak < 12 * 2**20 + _workers_allowance(), peak


def test_text_keeps_no_histogram_on_the_heap(
    many: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One worker, so that the bound tells: the workers' scratch would cover the difference.
    monkeypatch.setattr(_chunk_work, "_usable_cores", lambda: 1)
    out = tmp_path / "stats.txt"
    peak = _peak([str(many)], str(out))
    text = out.read_text()
    assert text.count("\nt299:\n") == 1
    # 4.0-4.5 MB measured (1 MiB of it the spool's memory part). Kept on the heap for the
    # table, the histograms took 300 x 1,000 bins x 16 bytes = 4.8 MB more as arrays (7.1 MB
    # measured), 13 MB more as Python lists.
    assert peak < 6 * 2**20, peak
    assert os.path.getsize(out) > TENSORS * BINS * 20
