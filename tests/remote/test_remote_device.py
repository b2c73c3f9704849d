"""Remote files loaded to a CUDA device through the staging pipeline, on a stand-in device
(see ``tests/bench/test_cuda_staging.py``): the same tensors as a CPU load, each in a storage
of its own, fetched by ranged requests that read each byte once."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from bench.test_cuda_staging import owns_its_storage, stage_on_cuda  # noqa: E402
from pysafetensors import safe_open  # noqa: E402

from .rangeserver import RangeServer  # noqa: E402


def test_a_remote_file_loads_to_the_device_through_the_pipeline(
    server: RangeServer, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = server.url("model.safetensors")
    with safe_open(data_dir / "model.safetensors", "pt") as f:
        want = f.get_tensors()
        rows = f.get_slice("embed")[100:300]
        cols = f.get_slice("proj")[:, 16:80]
    made = stage_on_cuda(monkeypatch)
    server.reset()
    with safe_open(url, "pt") as f:
        got = f.get_tensors()
        got_rows = f.get_slice("embed")[100:300]
        got_cols = f.get_slice("proj")[:, 16:80]
    assert made, "the staging pipeline was not used"
    for name, t in want.items():
        assert torch.equal(got[name], t), name
        assert owns_its_storage(got[name]), name
    assert torch.equal(got_rows, rows) and torch.equal(got_cols, cols)
    size = (data_dir / "model.safetensors").stat().st_size
    fetched = sum(r.nbytes for r in server.log if r.path == "/model.safetensors")
    # Every byte of the file once for get_tensors, then the two slices' (a few rows more for
    # the column split's covering blocks): never the file twice.
    assert fetched < size + rows.numel() * 4 + 256 * 256 * 2 + (64 << 10)
