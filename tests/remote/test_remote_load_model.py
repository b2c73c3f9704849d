"""``torch.load_model`` from a URL: the parameters are read in place from the loopback range
server, all in one plan of requests, each byte fetched once, with no copy of the weights
besides the model's."""

from __future__ import annotations

from pathlib import Path

import pytest

from .rangeserver import RangeServer

torch = pytest.importorskip("torch")

import pysafetensors.torch as st_torch  # noqa: E402


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 256)
    )


def test_load_model_over_http_reads_each_byte_once(server: RangeServer, data_dir: Path) -> None:
    torch.manual_seed(0)
    saved = _model()
    path = data_dir / "load_model.safetensors"
    st_torch.save_model(saved, path)
    model = _model()
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    assert st_torch.load_model(model, server.url(path.name)) == (set(), [])
    for name, value in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers
    # The header and the data once each: nothing read twice, nothing past the file.
    size = path.stat().st_size
    assert size - 4096 < server.bytes_sent(path.name) <= size
    # The open's request, then all six tensors in one plan: one request for their 2 MiB.
    assert server.requests(path.name) == 2
